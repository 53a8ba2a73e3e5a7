"""What the GPU tests of the benchmarks share: running one and reading its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench_on_gpu(script: str, args: list[str], tmp_path, timeout: int = 1200) -> dict:
    """``bench/<script> ARGS --out-dir tmp_path --tag gpu`` from the repository root; fails the
    test with the run's output if it exits non-zero, else returns its JSON file."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", script), *args, "--out-dir", str(tmp_path), "--tag", "gpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    prefix = os.path.splitext(script)[0]
    with open(os.path.join(tmp_path, f"{prefix}_gpu.json"), encoding="utf-8") as f:
        return json.load(f)
