"""fusedenc.fp8.triton_e4m3: static-scale e4m3 codes in one pass, bit for bit the torch form of
``fusedenc.fp8.rowwise.e4m3_columns`` (upcast, times the column scale, clamp to +-448, convert).

The CPU cases run in Triton's interpreter in a child process (TRITON_INTERPRET must not leak
into other modules; tests/interpreter_helpers.py) with a float32 output: the kernel's
indexing, masks, scaling and saturation (NaN kept) against the torch form before its
conversion; the interpreter's own e4m3 rounding is wrong at binade carries (124.4 -> 64), so
the conversion is the GPU test's: the compiled kernel and ``fp8.e4m3_columns``' dispatch to
it against the torch form, as bytes.  Inputs are fresh random values with saturating
magnitudes, NaN, +-inf and zeros mixed in; outputs are compared as raw bytes."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from interpreter_helpers import run_cases_in_interpreter

if __name__ != "__main__" and importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

#: rows, cols, dtype, row stride padding (0: dense)
CASES = [(1, 1, "float16", 0), (37, 300, "float16", 0), (16, 128, "bfloat16", 8), (5, 129, "float32", 3),
         (0, 64, "float16", 0), (300, 17, "float16", 0)]  # fmt: skip
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def case_id(case) -> str:
    return "M{}-N{}-{}-pad{}".format(*case)


def make_inputs(case, gen: torch.Generator, device="cpu"):
    rows, cols, dtype, pad = case
    base = torch.randn(rows, cols + pad, generator=gen) * 300  # many values past 448 after scaling
    flat = base.view(-1)
    if flat.numel() >= 8:
        idx = torch.randperm(flat.numel(), generator=gen)[:8]
        flat[idx] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-9, -1e-9, 448.0])
    x = base.to(DTYPES[dtype])[:, :cols].to(device)  # a row stride past the row when pad > 0
    scale = (torch.rand(cols, generator=gen) * 4 + 0.05).to(device)
    scale[:: max(1, cols // 3)] = 1.0
    return x, scale


def torch_form(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


def check(case, seed: int, device="cpu") -> None:
    """The kernel against the torch form: codes as bytes on a GPU; in the interpreter (CPU)
    the saturated float32 products before the conversion, NaN where NaN."""
    from fusedenc.fp8 import triton_e4m3

    gen = torch.Generator().manual_seed(seed)
    x, scale = make_inputs(case, gen, device)
    if device == "cpu":
        got = triton_e4m3.launch(x, scale, torch.full(x.shape, 7.0, dtype=torch.float32))  # poisoned
        want = (x.float() * scale).clamp_(-448.0, 448.0)
        assert torch.equal(got.isnan(), want.isnan()), "NaN positions differ"
        diff = ((got != want) & ~want.isnan()).nonzero()
    else:
        got = triton_e4m3.e4m3_columns(x, scale)
        want = torch_form(x, scale)
        assert got.dtype == torch.float8_e4m3fn and got.shape == want.shape and got.is_contiguous()
        diff = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} values differ, first at {diff[0].tolist()}"


if __name__ == "__main__":  # the child process: TRITON_INTERPRET=1 is set
    seed = int(sys.argv[1])
    for i, case in enumerate(CASES):
        try:
            check(case, seed + i)
            err = None
        except Exception as e:  # reported per case to the parent
            err = f"{type(e).__name__}: {e}"
        print(json.dumps({"case": case_id(case), "error": err}), flush=True)
    sys.exit(0)

_RESULTS: dict = {}


def _results():
    if not _RESULTS:
        _RESULTS["seed"], _RESULTS["found"], _RESULTS["stderr"] = run_cases_in_interpreter(__file__)
    return _RESULTS


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_the_torch_form_in_the_interpreter(case):
    r = _results()
    cid = case_id(case)
    assert cid in r["found"], f"case {cid} did not report (seed {r['seed']}):\n{r['stderr']}"
    assert r["found"][cid] is None, f"{cid} (seed {r['seed']}): {r['found'][cid]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_and_the_dispatch_match_the_torch_form_on_the_gpu(case):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from fusedenc.fp8 import rowwise as fp8

    seed = int.from_bytes(__import__("os").urandom(4), "little")
    check(case, seed, "cuda")
    x, scale = make_inputs(case, torch.Generator().manual_seed(seed + 1), "cuda")
    assert fp8._fused_columns(x, scale, fp8.format_for(x.device)) == (x.numel() == 0 or x.stride(1) == 1)
    got = fp8.e4m3_columns(x, scale)
    assert torch.equal(got.view(torch.uint8), torch_form(x, scale).view(torch.uint8)), f"seed {seed}"
