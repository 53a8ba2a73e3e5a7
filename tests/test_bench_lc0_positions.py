"""CPU smoke test of bench/lc0_positions.py: every row runs end to end on the tiny net.

The numbers of a CPU run mean nothing; the test checks that the script runs as a user runs
it, that each row it promises is there with a positive rate, and the files it writes."""

from __future__ import annotations

import json

import pytest

from bench_helpers import run_bench

# Each runs a benchmark in a subprocess (seconds each): in the exhaustive run.
pytestmark = pytest.mark.slow


def test_lc0_positions_tiny_cpu(tmp_path):
    run_bench("lc0_positions.py", ["--device", "cpu", "--synthetic", "tiny", "--batch-sizes", "4,16",
                                   "--positions", "64", "--epd-positions", "48", "--out-dir", str(tmp_path),
                                   "--tag", "smoke"], timeout=600)  # fmt: skip
    result = json.loads((tmp_path / "lc0_positions_smoke.json").read_text(encoding="utf-8"))
    assert result["schema"] == "fusedenc.bench.lc0_positions/1"
    assert result["environment"]["torch"] and "git_commit" in result["environment"]
    rows = {(r["row"], r["batch"]) for r in result["rows"]}
    assert rows == {(name, b) for name in ("eager", "evaluator", "evaluator, minibatches", "cli") for b in (4, 16)}
    for r in result["rows"]:
        assert r["nps"] > 0, r
        if r["row"].startswith("evaluator"):
            assert r["positions"] == 64 and r["mean_batch"] <= r["batch"], r
        if r["row"] == "cli":
            assert r["positions"] == 48, r
    assert "x graph" in (tmp_path / "lc0_positions_smoke.txt").read_text(encoding="utf-8")
