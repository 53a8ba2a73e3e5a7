"""GEMM algorithm choice by measurement on the GPU: heuristic candidates, their
accuracy, a choice steering which candidate a plan runs, and ``tune gemm`` end
to end.  Tolerance rule as everywhere (helpers.assert_close_rule): a candidate
may differ from the fp32 reference by at most twice what candidate 0 (the
heuristic's own pick) differs by, plus atol.

Runs only where a GPU with the native core is present (see conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import assert_close_rule, linear_formula, poisoned, randn, same_dtype_torch

import fusedenc
import fusedenc.encoder.blocks as encoder_module
from fusedenc import core
from fusedenc.common.device import device_arch
from fusedenc.core import gemm_routes, gemm_tuning
from fusedenc.tune.presets import PRESETS, GemmProblem, block_gemms

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)
DTYPE = torch.float16
COUNT = 8


@pytest.fixture(autouse=True)
def _no_choices(monkeypatch):
    """Every test starts and ends with no choice installed (a tuning file may exist on the machine)."""
    monkeypatch.setattr(gemm_tuning, "_warned", set())
    core.clear_gemm_choices()
    gemm_routes.install({})
    yield
    core.clear_gemm_choices()
    gemm_routes.install({})


def _operands(problem: GemmProblem, gen):
    x = randn((problem.m, problem.k), DTYPE, DEVICE, gen)
    w = randn((problem.n, problem.k), DTYPE, DEVICE, gen, scale=problem.k**-0.5)
    b = randn((problem.n,), DTYPE, DEVICE, gen) if problem.bias else None
    r = randn((problem.m, problem.n), DTYPE, DEVICE, gen) if problem.residual else None
    return x, w, b, r


def _gemm(problem, x, w, b, r, out) -> dict:
    """``core.gemm``'s keyword arguments for these tensors (what fusedenc.linear passes), on the current stream."""
    stream = torch.cuda.current_stream(DEVICE).cuda_stream
    return dict(
        a=x, lda=problem.k, w=w, ldw=problem.k, out=out, ldo=problem.n, m=problem.m, n=problem.n, k=problem.k,
        bias=b, residual=r, ldr=problem.n, activation=problem.activation, alpha=problem.alpha, stream=stream,
        workspace=core.workspace(DEVICE, stream),
    )  # fmt: skip


T82 = block_gemms(PRESETS["t82"], 16)
T82_IDS = [p.name for p in T82]


@pytest.mark.parametrize("problem", T82, ids=T82_IDS)
def test_t82_problems_have_candidates_and_leave_the_plan_cache_alone(problem, gen):
    x, w, b, r = _operands(problem, gen)
    out = torch.empty((problem.m, problem.n), dtype=DTYPE, device=DEVICE)
    before = fusedenc.plan_cache_info()
    found = core.gemm_candidates(count=COUNT, **_gemm(problem, x, w, b, r, out))
    core.gemm_with_candidate(count=COUNT, index=0, **_gemm(problem, x, w, b, r, out))
    torch.cuda.synchronize()
    assert fusedenc.plan_cache_info() == before  # candidates live apart from the plan cache
    assert 1 <= len(found["candidates"]) <= COUNT
    assert all(c["algo"] for c in found["candidates"])
    assert len({c["algo"] for c in found["candidates"]}) == len(found["candidates"]), found  # no duplicates
    key = found["key"]
    assert (key["m"], key["n"], key["k"], key["lda"], key["ldw"], key["ldd"]) == (
        problem.m, problem.n, problem.k, problem.k, problem.k, problem.n
    )  # fmt: skip
    assert key["align_a"] == key["align_w"] == key["align_d"] == 16
    assert key["workspace_bytes"] == core.WORKSPACE_BYTES
    with pytest.raises(ValueError, match="out of range"):
        core.gemm_with_candidate(count=COUNT, index=len(found["candidates"]), **_gemm(problem, x, w, b, r, out))
    with pytest.raises(ValueError, match="candidate count"):
        core.gemm_candidates(count=0, **_gemm(problem, x, w, b, r, out))


@pytest.mark.parametrize("problem", T82, ids=T82_IDS)
def test_every_candidate_is_within_the_rule(problem, gen):
    x, w, b, r = _operands(problem, gen)
    ref = linear_formula(x, w, b, problem.activation, r, alpha=problem.alpha, dtype=torch.float32)
    out = poisoned((problem.m, problem.n), DTYPE, DEVICE)
    found = core.gemm_candidates(count=COUNT, **_gemm(problem, x, w, b, r, out))
    core.gemm_with_candidate(count=COUNT, index=0, **_gemm(problem, x, w, b, r, out))
    cand0 = out.clone()
    assert_close_rule(cand0, ref, same_dtype_torch(x, w, b, problem.activation, r, alpha=problem.alpha), DTYPE,
                      f"{problem.name} candidate 0 (seed {gen.seed_value})")  # fmt: skip
    # Candidate 0 is the algorithm cuBLASLt's default plan runs (the sm90 epilogue GEMM,
    # which takes large swish problems on an H100, is not among the candidates).
    default = poisoned((problem.m, problem.n), DTYPE, DEVICE)
    with core.sm90_gemm_disabled():
        core.gemm(**_gemm(problem, x, w, b, r, default))
    assert torch.equal(default, cand0), f"{problem.name}: candidate 0 differs from the default plan"
    for i in range(1, len(found["candidates"])):
        out.fill_(float("nan"))
        core.gemm_with_candidate(count=COUNT, index=i, **_gemm(problem, x, w, b, r, out))
        assert_close_rule(out, ref, cand0, DTYPE,
                          f"{problem.name} candidate {i} [{found['candidates'][i]['algo']}] (seed {gen.seed_value})")  # fmt: skip


def _problem_with_choices(gen):
    """A t82 problem with at least two candidates, its operands and candidates (skip if none has two)."""
    for problem in T82:
        x, w, b, r = _operands(problem, gen)
        out = torch.empty((problem.m, problem.n), dtype=DTYPE, device=DEVICE)
        found = core.gemm_candidates(count=COUNT, **_gemm(problem, x, w, b, r, out))
        if len(found["candidates"]) >= 2:
            return problem, (x, w, b, r), found
    pytest.skip("the heuristic offers one candidate for every t82 problem at batch 16")


def test_a_choice_changes_which_candidate_runs(gen):
    native = core.native_module()
    problem, (x, w, b, r), found = _problem_with_choices(gen)
    pick = len(found["candidates"]) - 1
    algo = found["candidates"][pick]["algo"]
    expected = poisoned((problem.m, problem.n), DTYPE, DEVICE)
    core.gemm_with_candidate(count=COUNT, index=pick, **_gemm(problem, x, w, b, r, expected))

    native.set_gemm_choice(**found["key"], index=pick, candidates=COUNT, algo=algo)
    assert fusedenc.plan_cache_info()["size"] == 0  # setting a choice re-plans everything
    [choice] = fusedenc.gemm_choices()
    assert choice["status"] == "not used yet" and choice["plans"] == 0
    assert choice["key"]["activation"] == problem.activation and choice["key"]["dtype"] == "float16"

    misses = fusedenc.plan_cache_info()["misses"]
    out = fusedenc.linear(x, w, b, problem.activation, r, alpha=problem.alpha)
    fusedenc.linear(x, w, b, problem.activation, r, alpha=problem.alpha)  # a cache hit: no new plan
    torch.cuda.synchronize()
    info = fusedenc.plan_cache_info()
    assert info["misses"] == misses + 1 and info["size"] == 1
    [choice] = fusedenc.gemm_choices()
    assert choice["status"] == f"in use: candidate {pick} [{algo}]", choice
    assert choice["plans"] == 1
    assert torch.equal(out, expected), "the op did not run the chosen candidate"
    ref = linear_formula(x, w, b, problem.activation, r, alpha=problem.alpha, dtype=torch.float32)
    assert_close_rule(out, ref, same_dtype_torch(x, w, b, problem.activation, r, alpha=problem.alpha), DTYPE,
                      f"{problem.name} with candidate {pick} chosen (seed {gen.seed_value})")  # fmt: skip

    # Clearing the choices returns to the heuristic's pick.
    core.clear_gemm_choices()
    assert fusedenc.gemm_choices() == []
    default = fusedenc.linear(x, w, b, problem.activation, r, alpha=problem.alpha)
    cand0 = poisoned((problem.m, problem.n), DTYPE, DEVICE)
    core.gemm_with_candidate(count=COUNT, index=0, **_gemm(problem, x, w, b, r, cand0))
    assert torch.equal(default, cand0)


def test_a_choice_that_no_longer_fits_falls_back_to_candidate_0_and_says_why(gen):
    native = core.native_module()
    problem, (x, w, b, r), found = _problem_with_choices(gen)
    cand0 = poisoned((problem.m, problem.n), DTYPE, DEVICE)
    core.gemm_with_candidate(count=COUNT, index=0, **_gemm(problem, x, w, b, r, cand0))

    native.set_gemm_choice(**found["key"], index=1, candidates=COUNT, algo="not the measured algorithm")
    out = fusedenc.linear(x, w, b, problem.activation, r, alpha=problem.alpha)
    [choice] = fusedenc.gemm_choices()
    assert choice["status"].startswith("ignored: candidate 1 is now"), choice
    assert torch.equal(out, cand0)

    n = len(found["candidates"])
    big = core.max_gemm_candidates()
    if n < COUNT:  # the heuristic had fewer than COUNT: an index past them is out of range
        native.set_gemm_choice(**found["key"], index=COUNT - 1, candidates=COUNT, algo="")
        out = fusedenc.linear(x, w, b, problem.activation, r, alpha=problem.alpha)
        [choice] = fusedenc.gemm_choices()
        assert choice["status"].startswith(f"ignored: candidate {COUNT - 1} of {COUNT}"), choice
        assert torch.equal(out, cand0)
    with pytest.raises(ValueError):
        native.set_gemm_choice(**found["key"], index=big, candidates=big, algo="")


def test_tune_gemm_writes_a_file_that_loads_without_warnings(tmp_path):
    out = tmp_path / "gemm.json"
    env = dict(os.environ, FUSEDENC_CONFIG_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-m", "fusedenc.tune", "gemm", "--preset", "t82", "--batch-sizes", "16",
         "--candidates", "4", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "winner" in r.stdout and "ERROR" not in r.stdout, r.stdout[-4000:]
    obj = json.loads(out.read_text())
    assert obj["schema"] == gemm_tuning.GEMM_TUNING_SCHEMA
    assert obj["measured_with"] == gemm_tuning.device_metadata(core.library_info(), torch.cuda.current_device())
    assert len(obj["choices"]) == 4  # qkv, out_proj, ffn1, ffn2: four distinct problems
    assert all(0 <= c["index"] < c["candidates"] == 4 for c in obj["choices"])
    assert all(m["candidate_0_is_default"] for m in obj["measurements"]), obj["measurements"]
    # The Triton FFN1 kernel was timed exactly where cuBLASLt has no epilogue for the activation (swish).
    timed = {m["used_by"][0].split()[-1]: m["triton"] for m in obj["measurements"]}
    if gemm_routes.triton_available():
        assert timed["ffn1"] and all(c["ok"] and c["us"] > 0 for c in timed["ffn1"]["configs"]), timed["ffn1"]
        assert "T0" in r.stdout
    assert timed["qkv"] is None and timed["out_proj"] is None and timed["ffn2"] is None
    routed = [c for c in obj["choices"] if c.get("kernel") == "triton"]
    assert all(c["key"]["activation"] == "swish" and len(c["triton_config"]) == 6 for c in routed), routed

    with warnings.catch_warnings():
        warnings.simplefilter("error", gemm_tuning.GemmTuningWarning)
        report = core.load_gemm_tuning(devices=[torch.cuda.current_device()], path=str(out))
    # Where the Hopper epilogue GEMM serves FFN1 it was timed as the default to beat.
    sm90 = {m["used_by"][0].split()[-1]: m["sm90"] for m in obj["measurements"]}
    assert sm90["qkv"] is None and sm90["out_proj"] is None and sm90["ffn2"] is None, sm90
    a, w, b, o = (torch.empty(shape, dtype=DTYPE, device=DEVICE) for shape in ((1024, 768), (2304, 768), 2304, (1024, 2304)))
    if core.sm90_gemm_applies(a, w, b, o, "swish")[0]:
        assert sm90["ffn1"] is not None and sm90["ffn1"]["ok"] and sm90["ffn1"]["us"] > 0, sm90
    else:
        assert sm90["ffn1"] is None, sm90
    wins = [c for c in obj["choices"] if gemm_tuning.library_choice_applies(c) and c not in routed]
    assert report[0]["status"] == "installed" and report[0]["choices"] == len(wins), report
    assert report[0]["triton_routes"] == len(routed) and len(gemm_routes.routes()) == len(routed)
    assert len(fusedenc.gemm_choices()) == len(wins)

    # The installed choices serve the block's GEMMs (post-LN t82 at batch 16), within the rule.
    block = fusedenc.EncoderBlock(768, 24, 2304, activation="swish", residual_alpha=30**-0.25)
    block = block.to(device=DEVICE, dtype=DTYPE).eval()
    gen = torch.Generator().manual_seed(1)
    x = randn((16, 64, 768), DTYPE, DEVICE, gen)
    with torch.no_grad():
        y = block(x)
    assert torch.isfinite(y).all()
    for c in fusedenc.gemm_choices():
        assert c["status"].startswith("in use"), c


def test_a_file_from_another_device_is_ignored_with_one_warning(tmp_path):
    index = torch.cuda.current_device()
    meta = dict(gemm_tuning.device_metadata(core.library_info(), index), device_name="Some Other GPU")
    key = {f: v for f, v in zip(gemm_tuning.GEMM_KEY_FIELDS, (
        1024, 2304, 768, 768, 768, 0, 2304, "float16", "swish", True, False, 16, 16, 16, 16, core.WORKSPACE_BYTES,
    ))}  # fmt: skip
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({
        "schema": gemm_tuning.GEMM_TUNING_SCHEMA, "arch": device_arch(torch.device("cuda", index)), "measured_with": meta,
        "choices": [{"key": key, "index": 1, "candidates": 4, "algo": ""}],
    }))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = core.load_gemm_tuning(devices=[index], path=str(path))
        core.load_gemm_tuning(devices=[index], path=str(path))
    ours = [w for w in caught if issubclass(w.category, gemm_tuning.GemmTuningWarning)]
    assert len(ours) == 1 and "device_name" in str(ours[0].message) and str(path) in str(ours[0].message)
    assert report[0]["status"].startswith("ignored") and fusedenc.gemm_choices() == []


def _triton_route_file(tmp_path, problem, x, w, b, config) -> str:
    """A tuning file routing ``problem`` (with these operands' key) to the Triton kernel."""
    out = torch.empty((problem.m, problem.n), dtype=DTYPE, device=DEVICE)
    found = core.gemm_candidates(count=COUNT, **_gemm(problem, x, w, b, None, out))
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({
        "schema": gemm_tuning.GEMM_TUNING_SCHEMA, "arch": device_arch(DEVICE),
        "measured_with": gemm_tuning.device_metadata(core.library_info(), DEVICE.index),
        "choices": [{"key": gemm_tuning.key_from_core(found["key"]), "index": 0, "candidates": COUNT, "algo": "",
                     "kernel": "triton", "triton_config": list(config)}],
    }))  # fmt: skip
    return str(path)


def test_a_triton_route_serves_linear_and_the_block_identically(tmp_path, gen, monkeypatch):
    """A file's Triton choice routes exactly its problem, in fusedenc.linear and in both block paths."""
    pytest.importorskip("triton")
    from fusedenc.core import triton_gemm

    problem = next(p for p in T82 if p.name == "ffn1")  # t82 batch 16: m 1024, n 2304, k 768, swish + bias
    x, w, b, _ = _operands(problem, gen)
    config = gemm_routes.GemmConfig(64, 128, 64, 8, 4, 4)  # not the table's default: the file's config is used
    path = _triton_route_file(tmp_path, problem, x, w, b, config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gemm_tuning.GemmTuningWarning)
        report = core.load_gemm_tuning(devices=[DEVICE.index], path=path)
    assert report[0]["triton_routes"] == 1 and report[0]["choices"] == 0, report
    launches = []
    real_launch = triton_gemm.launch

    def spy(*args):
        launches.append(args[-1])
        return real_launch(*args)

    monkeypatch.setattr(triton_gemm, "launch", spy)

    what = f"t82 ffn1 via the Triton route (seed {gen.seed_value})"
    ref = linear_formula(x, w, b, "swish", dtype=torch.float32)
    out = poisoned((problem.m, problem.n), DTYPE, DEVICE)
    fusedenc.linear(x, w, b, "swish", out=out)
    assert launches == [config]
    assert_close_rule(out, ref, same_dtype_torch(x, w, b, "swish"), DTYPE, what)
    assert torch.equal(fusedenc.linear(x, w, b, "silu"), out)  # an alias of swish: the same route
    assert len(launches) == 2

    # Not the routed problem: another M, alpha != 1, no bias, another activation -> the library.
    fusedenc.linear(x[: problem.m // 2], w, b, "swish")
    fusedenc.linear(x, w, b, "swish", alpha=0.5)
    fusedenc.linear(x, w, None, "swish")
    fusedenc.linear(x, w, b, "mish")
    assert len(launches) == 2

    # The post-LN t82 block at batch 16 issues this problem once per forward, on both paths.
    block = fusedenc.EncoderBlock(768, 24, 2304, activation="swish", residual_alpha=30**-0.25)
    block = block.to(device=DEVICE, dtype=DTYPE).eval()
    block.ffn1_weight.data.copy_(w)
    block.ffn1_bias.data.copy_(b)
    xin = randn((16, 64, 768), DTYPE, DEVICE, gen)
    launches.clear()
    with torch.no_grad():
        native = block(xin)
    assert launches == [config]
    monkeypatch.setattr(encoder_module, "_native_active", lambda device: False)
    with torch.no_grad():
        via_ops = block(xin)
    assert launches == [config, config]
    assert torch.equal(native, via_ops)
