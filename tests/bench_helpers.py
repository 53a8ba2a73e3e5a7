"""What the tests of the benchmarks share: running one, and on the GPU reading its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(script: str, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """``bench/<script> ARGS`` from the repository root; fails the test with the command and
    its output if it exits non-zero."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    output = f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{output}"
    return proc


def run_bench_on_gpu(script: str, args: list[str], tmp_path, timeout: int = 1200) -> dict:
    """``bench/<script> ARGS --out-dir tmp_path --tag gpu`` (``run_bench``); returns its JSON file."""
    run_bench(script, [*args, "--out-dir", str(tmp_path), "--tag", "gpu"], timeout)
    prefix = os.path.splitext(script)[0]
    with open(os.path.join(tmp_path, f"{prefix}_gpu.json"), encoding="utf-8") as f:
        return json.load(f)
