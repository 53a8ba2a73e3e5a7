"""CPU smoke test of the benchmarks: bench/nps.py and bench/ops.py run end to end on tiny shapes.

Each script runs as a subprocess (as a user would run it), into a temporary
directory; the test reads the JSON it wrote and checks the fields the README
and the issue promise, and that the correctness check passed.  On a machine
with a GPU the same commands run there (on the tiny presets), which is fine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from bench_helpers import run_bench, run_bench_on_gpu

from fusedenc.tune.presets import select_runs

# Each runs a benchmark in a subprocess (seconds each): in the exhaustive run.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
#: The start of bench/nps.py's CPU_NOTE, written out: the test checks what a user reads.
CPU_NOTE = "CPU run: the fusedenc rows time the PyTorch reference ops (fusedenc has no native core on the CPU)"
ENV_FIELDS = ("device_name", "driver", "torch", "cuda", "hip", "cudnn", "blaslt", "fusedenc_backend", "date_utc",
              "host_cpu", "load_average_1min")


def _run(script: str, args: list[str], tmp_path, tag: str | None = "smoke") -> dict:
    """Run a benchmark; ``tag=None``: without --tag, so the file is named from preset, dtype and device."""
    # --device cpu: the same CPU run on a GPU machine too (gpu_check.sh runs the CPU tests there).
    proc = run_bench(script, ["--device", "cpu", "--out-dir", str(tmp_path), "--no-progress",
                              *(["--tag", tag] if tag else []), *args], timeout=240)  # fmt: skip
    prefix = os.path.splitext(script)[0]
    [path] = tmp_path.glob(f"{prefix}_{tag}.json" if tag else f"{prefix}_tiny_float32_*.json")
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    assert path.with_suffix(".txt").read_text(encoding="utf-8").strip()
    result["_stdout"] = proc.stdout
    return result


def _has_encoder() -> bool:
    try:
        return importlib.util.find_spec("fusedenc.encoder.blocks") is not None
    except ImportError:
        return False


def test_nps_tiny(tmp_path):
    r = _run("nps.py", ["--preset", "tiny,tiny-bert", "--batch-sizes", "1,4", "--reps", "20"], tmp_path)
    assert r["schema"] == "fusedenc.bench.nps/1"
    for field in ENV_FIELDS:
        assert field in r["env"], field
    assert r["ceilings"]["gemm"]["tflops"] > 0
    assert r["check_passed"] is True and r["errors"] == []
    assert [run["name"] for run in r["runs"]] == ["tiny", "tiny-bert"]

    expected = {"unfused", "torch", "torch-fastpath"} | ({"fusedenc"} if _has_encoder() else set())
    for run in r["runs"]:
        impls = run["impls"]
        assert expected <= set(impls), f"{run['name']}: ran {sorted(impls)}"
        for name in expected:
            e = impls[name]
            for b in ("1", "4"):
                pt = e["points"][b]
                assert pt["ms"] > 0 and pt["per_s"] > 0 and pt["reps"] >= 20, (run["name"], name, pt)
        for name in ("unfused", "torch", "fusedenc"):
            if name in impls:
                c = impls[name]["check"]
                assert c["passed"] is True and c["max_abs_err"] <= c["bound"], (run["name"], name, c)
        assert impls["torch"]["points"]["4"]["x_torch"] == pytest.approx(1.0)
        for b in ("1", "4"):
            lines = run["reference_lines"][b]
            assert lines["gemm_floor"]["ms"] > 0 and lines["roofline_ms"] > 0
        if "torch-compile" not in impls:  # CPU: skipped by default, and the output says so
            assert "torch-compile" in run["skipped"] and "fusedenc-graph" in run["skipped"]
        if not _has_encoder():
            assert "fusedenc" in run["skipped"]

    tiny, bert = r["runs"]
    # tiny has the Lc0 form (swish, alpha != 1): the fast path cannot serve it; a stand-in is timed, not judged.
    fp = tiny["impls"]["torch-fastpath"]
    assert fp["label"] == "torch-fastpath (gelu stand-in)" and fp["check"]["passed"] is None
    assert fp["info"]["serves_preset"] is False and fp["info"]["on_fast_path"] is True
    assert fp["points"]["4"]["x_torch"] is None  # excluded from the ratios
    # tiny-bert (gelu, alpha 1): the real fast path, checked.
    fp = bert["impls"]["torch-fastpath"]
    assert fp["label"] == "torch-fastpath" and fp["check"]["passed"] is True and fp["info"]["on_fast_path"] is True
    assert "CHECK FAILED" not in r["_stdout"]
    # The rate column says what it counts: tiny's batch elements are positions, tiny-bert's sequences.
    table = (tmp_path / "nps_smoke.txt").read_text(encoding="utf-8")
    headers = [line.split()[2] for line in table.splitlines() if line.startswith("   batch  implementation")]
    assert headers == ["positions/s", "sequences/s"], table
    assert "positions/s by batch size" in table and "sequences/s by batch size" in table, table
    # On the CPU the fusedenc rows time the PyTorch reference ops: said once, above the first table.
    if _has_encoder():
        out = r["_stdout"]
        assert out.count(CPU_NOTE) == 1 and out.index(CPU_NOTE) < out.index("== tiny:"), out[:3000]
        assert any(note.startswith(CPU_NOTE) for note in r["notes"]), r["notes"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "nps_smoke.png").stat().st_size > 0


def test_rate_unit_names_what_a_preset_times():
    """Throughput is batch elements per second: positions for the Lc0 bodies (t82, bt4), sequences for BERT's."""
    runs = select_runs(["t82", "bt4", "bert-base"], None, on_gpu=True)
    assert {r.name: r.rate_unit for r in runs} == {
        "t82": "positions/s", "bt4": "positions/s", "bert-base-s128": "sequences/s", "bert-base-s512": "sequences/s"}


def test_nps_fp8_tiny(tmp_path):
    """``--dtype fp8`` on the CPU: a float16 model, the FP8 rows beside the fp16 ones;
    fusedenc-fp8 runs the package's reference math and passes the FP8 rule (its relative
    error within slack x emulated FP8's); the rows that need a GPU are skipped with reasons."""
    if not _has_encoder():
        pytest.skip("fusedenc.encoder.blocks is not importable")
    r = _run("nps.py", ["--preset", "tiny", "--dtype", "fp8", "--batch-sizes", "2", "--reps", "20"], tmp_path)
    assert r["check_passed"] is True and r["errors"] == [], r["errors"]
    assert "check_fp8" in r["methodology"]
    (run,) = r["runs"]
    assert run["config"]["dtype"] == "float16"
    f8 = run["check"]["fp8"]
    assert 1e-3 < f8["emulated_rel_err"] < 0.1 and f8["slack"] == 1.5, f8
    impls, skipped = run["impls"], run["skipped"]
    assert {"unfused", "torch", "fusedenc", "fusedenc-fp8"} <= set(impls), sorted(impls)
    for name in ("torch-fp8-compile", "fusedenc-fp8-graph", "fusedenc-fp8-fast", "fusedenc-fp8-static",
                 "fusedenc-fp8-static-ln"):
        assert skipped.get(name), (name, skipped)  # not run on CPU, and the table says why
    ran = ["fusedenc-fp8"]
    if "torch-fp8" in impls:  # this torch takes row-wise scales in torch._scaled_mm on the CPU
        ran.append("torch-fp8")
    else:
        assert "_scaled_mm" in skipped["torch-fp8"], skipped
    # The FP8 rows' ratio is against the fastest fp16 fusedenc row that ran (bench/nps.py's FUSEDENC_FP16).
    fusedenc_ms = min(impls[n]["points"]["2"]["ms"] for n in ("fusedenc", "fusedenc-eager", "fusedenc-compile", "fusedenc-graph")
                      if n in impls and "2" in impls[n].get("points", {}))  # fmt: skip
    for name in ran:
        e = impls[name]
        c = e["check"]
        assert e["precision"] == "fp8" and c["passed"] is True, (name, c)
        assert c["rel_err"] <= c["bound"] == pytest.approx(1.5 * f8["emulated_rel_err"] + f8["floor"]), (name, c)
        assert 0.5 < c["x_emulated"] < 1.5, (name, c)  # FP8's error, not fp16's: the GEMMs really ran in FP8
        pt = e["points"]["2"]
        assert pt["ms"] > 0 and pt["x_fusedenc_fp16"] == pytest.approx(fusedenc_ms / pt["ms"]), (name, pt)
    for name in ("torch", "fusedenc"):  # the fp16 rows keep the fp16 rule
        c = impls[name]["check"]
        assert c["passed"] is True and "rel_err" not in c and c["max_abs_err"] <= c["bound"], (name, c)
        assert "x_fusedenc_fp16" not in impls[name]["points"]["2"]
    text = (tmp_path / "nps_smoke.txt").read_text(encoding="utf-8")
    assert "x fusedenc16" in text and "fusedenc-fp8-graph" in text and "CHECK FAILED" not in r["_stdout"]


def test_ops_tiny(tmp_path):
    r = _run("ops.py", ["--preset", "tiny", "--tokens", "256", "--reps", "20"], tmp_path)
    assert r["schema"] == "fusedenc.bench.ops/1"
    for field in ENV_FIELDS:
        assert field in r["env"], field
    assert r["ceilings"]["gemm"]["tflops"] > 0 and r["ceilings"]["copy"]["gbs"] > 0
    assert r["check_passed"] is True and r["errors"] == []
    (run,) = r["runs"]
    assert set(run["ops"]) == {"qkv", "ffn1", "out_proj", "ffn2", "attention", "layernorm"}
    for name, op in run["ops"].items():
        assert len(op["cases"]) >= 2, name
        for case in op["cases"]:
            assert case["check"]["passed"] is True, (name, case)
            assert case["us"] > 0 and case["gbs"] > 0 and case["pct_copy_bw"] > 0, (name, case)
            if op["flops"]:
                assert case["tflops"] > 0 and case["pct_gemm_rate"] > 0, (name, case)


def test_ops_another_activation(tmp_path):
    """``--activation``: the preset's shapes with FFN1's activation replaced, checked against the
    reference of that activation; an unknown one refused before anything runs."""
    r = _run("ops.py", ["--preset", "tiny-bert", "--tokens", "64", "--reps", "20", "--ops", "ffn1",
                        "--activation", "gelu_tanh"], tmp_path)  # fmt: skip
    (run,) = r["runs"]
    assert run["name"] == "tiny-bert-gelu_tanh" and r["check_passed"] is True
    assert all("gelu_tanh" in c["case"] for c in run["ops"]["ffn1"]["cases"][:3]), run["ops"]["ffn1"]["cases"]
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ops.py"), "--activation", "gelu_fast"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "unknown --activation gelu_fast" in bad.stderr, bad.stderr


@pytest.mark.parametrize("script", ["nps.py", "ops.py"])
def test_default_file_name_names_preset_dtype_and_device(script, tmp_path):
    """Without --tag (as tools/gpu_perf.sh runs them) the result files are named from the run."""
    extra = ["--batch-sizes", "1"] if script == "nps.py" else ["--tokens", "64"]
    r = _run(script, ["--preset", "tiny", "--reps", "20", *extra], tmp_path, tag=None)
    assert r["check_passed"] is True


def test_nps_puts_an_lc0_net_beside_the_presets(tmp_path):
    """``bench/nps.py --net NET.pb.gz``: the whole net (planes in, heads out) checked against
    the fp32 reference, then timed, in the same table and JSON as the presets."""
    net = os.path.join(ROOT, "tests", "data", "lc0", "lc0_linear16_mish_smolgen.pb.gz")
    r = _run("nps.py", ["--preset", "tiny", "--batch-sizes", "4", "--reps", "20", "--impl", "torch,fusedenc",
                        "--net", net], tmp_path)  # fmt: skip
    assert r["check_passed"] is True and r["errors"] == []
    [rec] = r["nets"]
    assert rec["net"] == net and rec["description"]["layers"] == 2
    assert {c for c, v in rec["check"].items() if v["ok"]} == {"torch", "fusedenc"}
    rows = {(row["batch"], row["impl"]) for row in rec["rows"]}
    assert rows == {(4, "torch"), (4, "fusedenc")}
    assert all(row["nps"] > 0 for row in rec["rows"])
    assert "lc0_linear16_mish_smolgen.pb.gz" in (tmp_path / "nps_smoke.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("script", ["lc0.py", "nps.py"])
def test_a_damaged_net_file_is_one_line_and_status_2(script, tmp_path):
    """``bench/lc0.py --net`` (and ``bench/nps.py --net``) on a truncated file: ``python -m
    fusedenc.lc0``'s one-line "cannot read" message and status 2, no traceback."""
    with open(os.path.join(ROOT, "tests", "data", "lc0", "lc0_linear16_mish_smolgen.pb.gz"), "rb") as f:
        data = f.read()
    damaged = tmp_path / "damaged.pb.gz"
    damaged.write_bytes(data[: len(data) // 2])  # an interrupted download
    args = ["--net", str(damaged), "--out-dir", str(tmp_path), "--reps", "20", "--batch-sizes", "1"]
    if script == "nps.py":  # the smallest preset run first: the net comes after the presets
        args += ["--device", "cpu", "--preset", "tiny", "--impl", "torch", "--no-plot", "--no-progress"]
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"bench/{script}: cannot read {damaged}: truncated gzip: the compressed data ends before its end marker "
        "(an incomplete download?)"], proc.stderr  # fmt: skip


def test_a_missing_net_file_is_one_line_and_status_2(tmp_path):
    missing = tmp_path / "missing.pb.gz"
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "lc0.py"), "--net", str(missing), "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr == f"bench/lc0.py: cannot read {missing}: No such file or directory\n"


@pytest.mark.gpu
def test_lc0_rows_are_checked_and_timed_on_the_gpu(tmp_path):
    """``bench/lc0.py`` on the GPU: torch, torch.compile and fusedenc each pass the reference
    check before they are timed, and the CUDA-graph row is timed beside them."""
    rec = run_bench_on_gpu("lc0.py", ["--synthetic", "tiny", "--batch-sizes", "8", "--reps", "20"],
                           tmp_path)["results"][0]
    for name in ("torch", "torch-compile", "fusedenc"):
        c = rec["check"][name]
        assert c["ok"] and c["err"] <= c["bound"], (name, c)
    timed = {row["impl"]: row["nps"] for row in rec["rows"] if row["batch"] == 8}
    assert set(timed) >= {"torch", "torch-compile", "fusedenc", "fusedenc-graph"}, timed
    assert all(nps > 0 for nps in timed.values()), timed


def test_lc0_backendbench_row_is_parsed_and_failures_are_reported(tmp_path, monkeypatch):
    """bench/lc0.py --lc0 reads lc0's CSV row for the batch asked; a run without that row raises with lc0's output."""
    monkeypatch.syspath_prepend(BENCH)
    import lc0 as lc0_bench  # bench/lc0.py

    fake = tmp_path / "lc0"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "Compiled with CUTLASS enabled" >&2\n'
        'echo "size, mean nps, mean ms,   sdev,     cv, max nps,  median, min nps, first max, first mean"\n'
        'echo " 256,    21000,  12.19,  0.1000, 0.0082,   21900,   21498,   20100,   13.0000,     13.5000"\n'
    )
    fake.chmod(0o755)
    r = lc0_bench.lc0_backendbench(str(fake), "net.pb.gz", 256, "cuda-fp16", 10)
    assert r == {"nps": 21498.0, "mean_nps": 21000.0, "cutlass": True}
    with pytest.raises(RuntimeError, match="without a batch-64 row"):
        lc0_bench.lc0_backendbench(str(fake), "net.pb.gz", 64, "cuda-fp16", 10)


def test_lc0_fp8_check_guards_and_reports_the_gate_metrics(monkeypatch):
    """bench/lc0.py --fp8's check: passes a few percent of error, fails garbage and NaN, and its
    gate metrics are against the fp16 outputs."""
    monkeypatch.syspath_prepend(BENCH)
    import lc0 as lc0_bench  # bench/lc0.py

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ref = {"policy": torch.randn(64, 1858, generator=g), "wdl": torch.softmax(torch.randn(64, 3, generator=g), -1)}
    fp16 = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in ref.items()}
    near = {k: v * (1 + 0.03 * torch.randn(v.shape, generator=g)) for k, v in ref.items()}
    c = lc0_bench._fp8_check(near, fp16, ref, lc0_bench.FP8_REL_BOUND)
    assert c["ok"] and 0.02 < c["rel_err"] < 0.04, c
    assert c["policy_top1_vs_fp16"] == (near["policy"].argmax(-1) == fp16["policy"].argmax(-1)).float().mean().item()
    assert c["wdl_max_diff_vs_fp16"] == (near["wdl"].double() - fp16["wdl"].double()).abs().max().item()
    garbage = {k: torch.randn(v.shape, generator=g) for k, v in ref.items()}
    assert not lc0_bench._fp8_check(garbage, fp16, ref, lc0_bench.FP8_REL_BOUND)["ok"]
    nan = {k: v.clone() for k, v in near.items()}
    nan["wdl"][3, 1] = float("nan")
    assert not lc0_bench._fp8_check(nan, fp16, ref, lc0_bench.FP8_REL_BOUND)["ok"]


def test_fp8_accuracy_tiny(tmp_path):
    """bench/fp8_accuracy.py: every configuration's row, and fp8 measurably worse than fp16."""
    out = tmp_path / "fp8.txt"
    run_bench("fp8_accuracy.py", ["--presets", "tiny", "--batch", "2", "--out", str(out)], timeout=240)
    rows = {}  # configuration -> final relative error, percent
    for line in out.read_text().splitlines():
        if line.startswith("   ") and "%" in line:  # "   <label, 24 wide> <cosine> <rel err>% <worst> ..."
            cosine, rel = line[28:].split()[:2]
            assert 0.5 < float(cosine) <= 1.0, line
            rows[line[3:27].strip()] = float(rel.rstrip("%"))
    assert {"fp16", "fp8", "fp8, FFN2 fp16", "fp8 1x128 blocks", "fp8, outliers"} <= set(rows), rows
    assert 0 < rows["fp16"] < rows["fp8"] < 50, rows


def test_fp8_accuracy_hf_bert_gate(monkeypatch):
    """bench/fp8_accuracy.py --hf-bert: a bert-base BertModel patched, in fp16 and FP8 (the
    modules' mode; CPU: the reference math), pooled output against fp32: fp16 close, every
    FP8 configuration measurably worse but sane."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(BENCH)
    import fp8_accuracy  # bench/fp8_accuracy.py

    lines = fp8_accuracy.run_hf_bert(2, 0, torch.device("cpu"), seq=32)
    rows = {line[3:27].strip(): [float(v.rstrip("%")) for v in line[28:].split()] for line in lines[2:]}
    assert set(rows) == {"fp16", "fp8", "fp8, FFN2 fp16", "fp8, static FFN2 input"}, rows
    assert rows["fp16"][0] > 0.9999 and rows["fp16"][1] < 0.5, rows
    for name in ("fp8", "fp8, FFN2 fp16", "fp8, static FFN2 input"):
        pooled_cos, pooled_rel = rows[name][:2]
        assert 0.9 < pooled_cos < rows["fp16"][0] and rows["fp16"][1] < pooled_rel < 30, (name, rows)


def test_nps_kernels_needs_a_gpu_and_prints_each_points_profile(tmp_path):
    """``--kernels``: refused on a CPU before anything runs; on a GPU each point's profile (the
    record ``common.kernel_profile`` makes) prints under its row: the kernels of a call, their
    summed time against the call's, the longest kernels by name."""
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "nps.py"), "--kernels", "--device", "cpu",
                          "--preset", "tiny", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "--kernels needs a GPU" in bad.stderr, bad.stderr
    assert not list(tmp_path.iterdir()), "a refused run wrote files"
    r = _run("nps.py", ["--preset", "tiny", "--batch-sizes", "2", "--reps", "20", "--impl", "torch"], tmp_path)
    (rec,) = r["runs"]
    rec["impls"]["torch"]["points"]["2"]["kernels"] = {
        "kernels_per_batch": 61.0, "copies_per_batch": 2.0, "kernel_us_per_batch": 231.0, "pass_us_per_batch": 915.0,
        "busy_fraction": 231.0 / 915.0, "top_kernels": [{"kernel": "sm90_norm_gelu_f16", "per_batch": 6.0, "us_per_batch": 88.5},
                                                        {"kernel": "flash_fwd", "per_batch": 6.0, "us_per_batch": 40.25}]}  # fmt: skip
    sys.path.insert(0, BENCH)
    try:
        import nps_report
    finally:
        sys.path.remove(BENCH)
    text = "\n".join(nps_report.report_lines(rec, select_runs(["tiny"], None, False)[0], on_gpu=False))
    assert "61 kernels + 2 copies a batch, 231 us of kernels in 915 us (25% busy)" in text, text
    assert "88.5 us,    6 calls: sm90_norm_gelu_f16" in text and text.index("sm90_norm") < text.index("flash_fwd")
