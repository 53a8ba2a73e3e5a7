"""bench/nps.py --dtype fp8 on the GPU (issue 21): every FP8 row (the torchao-style
torch._scaled_mm peer, eager and compiled, and fusedenc's FP8 mode eager, in CUDA graphs
and with fast accumulation) is built, passes the FP8 rule and is timed, with the ratios the
issue asks for.  Tiny shapes: this checks that the rows run and are right, not their speed."""

from __future__ import annotations

import pytest
import torch
from bench_helpers import run_bench_on_gpu
from fp8_helpers import require_fp8_gpu

pytestmark = pytest.mark.gpu

FP8_ROWS = ("torch-fp8", "torch-fp8-compile", "torch-fp8-compile:reduce-overhead", "fusedenc-fp8",
            "fusedenc-fp8-graph", "fusedenc-fp8-fast", "fusedenc-fp8-static", "fusedenc-fp8-static-ln")  # fmt: skip


def _require_fp8():
    require_fp8_gpu()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm with row-wise scales needs compute capability 8.9+")


def test_nps_fp8_rows_run_and_pass_on_the_gpu(tmp_path):
    _require_fp8()
    r = run_bench_on_gpu("nps.py", ["--preset", "tiny", "--dtype", "fp8", "--batch-sizes", "4", "--no-plot",
                                    "--device", "cuda", "--compile-modes", "reduce-overhead", "--no-progress"],
                         tmp_path)  # fmt: skip
    assert r["check_passed"] is True and r["errors"] == [], r["errors"]
    (run,) = r["runs"]
    impls, skipped = run["impls"], run["skipped"]
    assert not [n for n in skipped if "fp8" in n], skipped  # by default every FP8 row that runs here: all of them
    e_fp8 = run["check"]["fp8"]["emulated_rel_err"]
    assert 1e-3 < e_fp8 < 0.1, e_fp8
    for name in FP8_ROWS:
        assert name in impls, (name, sorted(impls))
        e = impls[name]
        c = e.get("check", {})
        assert "error" not in e and c.get("passed") is True, (name, e.get("error"), c)
        assert c["rel_err"] <= c["bound"] and 0.5 < c["x_emulated"] < 1.5, (name, c)  # FP8's error, really FP8
        pt = e["points"]["4"]
        assert "error" not in pt and pt["ms"] > 0, (name, pt)
        assert pt["x_fusedenc_fp16"] > 0 and pt["x_torch_fp8"] > 0, (name, pt)
    lines = run["reference_lines"]["4"]
    assert lines["best_fusedenc_fp16"]["impl"] in ("fusedenc", "fusedenc-compile", "fusedenc-graph"), lines
    assert lines["best_torch_fp8"]["impl"].startswith("torch-fp8"), lines
    # The fast accumulation row really asked for it (the graph runner over a fast_accum stack).
    assert impls["fusedenc-fp8-fast"]["info"]["fast_accum"] is True


def test_lc0_fp8_row_runs_and_is_checked_on_the_gpu(tmp_path):
    """bench/lc0.py --fp8: the whole net's FP8 row passes its guard, is timed, and reports the
    gate metrics against the fp16 net."""
    require_fp8_gpu()
    rec = run_bench_on_gpu("lc0.py", ["--synthetic", "tiny", "--batch-sizes", "8", "--fp8", "--reps", "20"],
                           tmp_path)["results"][0]
    c = rec["check"]["fusedenc-fp8-static"]
    assert c["ok"] and 0 < c["rel_err"] <= c["bound"], c  # FP8 is never exact
    assert 0.0 <= c["policy_top1_vs_fp16"] <= 1.0 and c["wdl_max_diff_vs_fp16"] >= 0.0
    assert [r["batch"] for r in rec["rows"] if r["impl"] == "fusedenc-fp8-static"] == [8]
