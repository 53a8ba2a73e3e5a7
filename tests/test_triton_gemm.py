"""fusedenc.core.triton_gemm on CPU through Triton's interpreter: ``act(x @ W^T + b)`` in one kernel
against the fp32/fp64 formula for every activation, with and without bias, at M in {1, 7, 33};
poisoned outputs, strided rows (column slices of wider buffers), explicit tile configs (several
row and column blocks, grouped order with a short last group, K not a multiple of the K block),
pre-activations far from zero (mish's softplus threshold, saturation), NaN propagation, and the
argument checks.

TRITON_INTERPRET=1 must be set before the kernel is defined, and it must not leak into
other test modules: the cases run in one child process (this file run as a script), and
each test here reports one case's result.  Skipped when triton is not installed.

Not covered here: bfloat16 (the interpreter of triton 3.9 multiplies bfloat16 dot
operands as their raw uint16 bit patterns) and anything about GPU code generation
(tile configs, pipelining, the GPU's exp/erf/division); tests/test_triton_gemm_gpu.py
covers those on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from interpreter_helpers import assert_case_passed, report_cases, run_cases_in_interpreter

if __name__ != "__main__" and importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from fusedenc.common.activations import ACTIVATIONS  # noqa: E402

DTYPES = {"float16": torch.float16, "float32": torch.float32}

#: (N, K) pairs the main sweep cycles through: multiples of 16 up to 64.
_NK = [(16, 16), (32, 48), (64, 64), (48, 32), (64, 16), (16, 64)]


def _cases():
    """Each case: M, N, K, dtype, activation, bias (bool), extra.

    extra: none | out (a poisoned out= buffer) | strided (x, W and out column slices of
    wider buffers) | batched (x [2, M, K]) | wide (pre-activations spanning about +-45) |
    nan_x | nan_w | nan_bias | config=<block_m>,<block_n>,<block_k>,<group_m>,<warps>,<stages>
    """
    cases = []
    i = 0
    for m in (1, 7, 33):
        for act in ACTIVATIONS:
            for bias in (True, False):
                for dtype in DTYPES:
                    n, k = _NK[i % len(_NK)]
                    cases.append((m, n, k, dtype, act, bias, "none"))
                    i += 1
    for act in ACTIVATIONS:
        cases.append((33, 64, 32, "float32", act, True, "wide"))
        cases.append((7, 48, 64, "float16", act, True, "wide"))
        cases.append((7, 32, 48, "float16", act, True, "nan_x"))
        cases.append((7, 32, 48, "float16", act, False, "nan_w"))
        cases.append((7, 32, 48, "float16", act, True, "nan_bias"))
    cases += [
        (33, 64, 48, "float16", "swish", True, "out"),
        (7, 48, 32, "float32", "mish", False, "out"),
        (33, 48, 32, "float16", "mish", True, "strided"),
        (7, 64, 64, "float32", "gelu", True, "strided"),
        (1, 32, 16, "float16", "relu2", True, "strided"),
        (7, 32, 32, "float16", "selu", True, "batched"),
        # 3 row blocks, 4 column blocks, groups of 2 row blocks (the last group has 1); K 48 = 1.5 K blocks
        (33, 64, 48, "float16", "mish", True, "config=16,16,32,2,4,2"),
        (33, 64, 48, "float32", "gelu", False, "config=16,16,32,2,4,2"),
        # N 48 = 1.5 column blocks (wrapped loads, masked store); 4 K blocks
        (33, 48, 64, "float16", "swish", True, "config=32,32,16,8,4,3"),
        (7, 48, 64, "float32", "sigmoid", True, "config=16,32,16,1,4,3"),
    ]
    return cases


CASES = _cases()


def case_id(case) -> str:
    m, n, k, dtype, act, bias, extra = case
    return f"M{m}-N{n}-K{k}-{dtype}-{act}-{'bias' if bias else 'nobias'}-{extra}"


# ------------------------------------------------------------ pytest side ----


@pytest.fixture(scope="module")
def results():
    """Run every case once in a child process with the interpreter on; {case id: error or None}."""
    return run_cases_in_interpreter(__file__)


@pytest.mark.parametrize("case", CASES + ["argument_checks"], ids=lambda c: c if isinstance(c, str) else case_id(c))
@pytest.mark.sweep
def test_case_under_interpreter(case, results):
    assert_case_passed(results, case if isinstance(case, str) else case_id(case))


def test_import_fusedenc_does_not_import_triton():
    code = "import sys, fusedenc; assert 'triton' not in sys.modules, 'import fusedenc imported triton'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_cpu_tensors_without_interpreter_rejected():
    """Without the interpreter a CPU tensor is a clear ValueError, not a crash inside Triton."""
    code = (
        "import torch\n"
        "from fusedenc.core.triton_gemm import linear_act\n"
        "x, w = torch.randn(4, 16), torch.randn(32, 16)\n"
        "try:\n"
        "    linear_act(x, w)\n"
        "except ValueError as e:\n"
        "    assert 'GPU' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ValueError')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


# ------------------------------------------------------------ child side ----


def make_inputs(case, gen):
    m, n, k, dtype_name, act, has_bias, extra = case
    dtype = DTYPES[dtype_name]
    scale = 15.0 if extra == "wide" else 1.0

    def rnd(*shape, s=1.0):
        return (torch.randn(shape, generator=gen) * s).to(dtype)

    if extra == "strided":  # column slices of wider buffers: row strides K + 16, K + 24
        x = rnd(m, k + 16)[:, :k]
        w = rnd(n, k + 24, s=k**-0.5)[:, 8 : 8 + k]
    elif extra == "batched":
        x = rnd(2, m, k)
        w = rnd(n, k, s=k**-0.5)
    else:
        x = rnd(m, k, s=scale)
        w = rnd(n, k, s=k**-0.5)
    b = rnd(n, s=0.5) if has_bias else None
    nan = float("nan")
    if extra == "nan_x":
        x[min(3, m - 1), k // 2] = nan  # that whole output row turns NaN
    elif extra == "nan_w":
        w[5, 1] = nan  # output column 5 turns NaN
    elif extra == "nan_bias":
        b[9] = nan
    return x, w, b


def run_case(case, gen, linear_act, GemmConfig, assert_close_rule, linear_formula, same_dtype_torch, ref_dtype):
    m, n, k, dtype_name, act, has_bias, extra = case
    dtype = DTYPES[dtype_name]
    x, w, b = make_inputs(case, gen)
    config = None
    if extra.startswith("config="):
        config = GemmConfig(*map(int, extra.split("=")[1].split(",")))
    out_shape = tuple(x.shape[:-1]) + (n,)

    out = None
    if extra == "out":
        out = torch.full(out_shape, float("nan"), dtype=dtype)
    elif extra == "strided":
        wide = torch.full((m, n + 32), float("nan"), dtype=dtype)
        out = wide[:, 8 : 8 + n]

    empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # every output element the kernel fails to write shows as NaN
        return empty(*args, **kwargs).fill_(float("nan"))

    torch.empty = poisoned_empty
    try:
        got = linear_act(x, w, b, act, out=out, config=config)
    finally:
        torch.empty = empty

    assert got.shape == out_shape and got.dtype == dtype, f"shape {tuple(got.shape)}, dtype {got.dtype}"
    if out is not None:
        assert got is out, "out= given but another tensor returned"
    if extra == "strided":
        assert torch.isnan(wide[:, :8]).all() and torch.isnan(wide[:, 8 + n :]).all(), "wrote outside out's columns"
    ref = linear_formula(x, w, b, act, dtype=ref_dtype(dtype))
    same = same_dtype_torch(x, w, b, act)
    assert_close_rule(got, ref.to(ref_dtype(dtype)), same, dtype, "vs formula")
    if extra == "nan_x":
        assert bool(got[min(3, m - 1)].isnan().all()), "a NaN in x did not turn its output row NaN"
    if extra in ("nan_w", "nan_bias"):
        col = 5 if extra == "nan_w" else 9
        assert bool(got[:, col].isnan().all()), f"a NaN in {extra[4:]} did not turn output column {col} NaN"


def check_arguments(linear_act):
    """The argument rules of fusedenc.linear, and the empty batch."""
    x, w, b = torch.randn(4, 32), torch.randn(16, 32), torch.randn(16)
    bad = {
        "K mismatch": lambda: linear_act(torch.randn(4, 16), w),
        "bias shape": lambda: linear_act(x, w, torch.randn(32)),
        "K not aligned": lambda: linear_act(torch.randn(4, 6), torch.randn(16, 6)),
        "transposed weight": lambda: linear_act(x, torch.randn(32, 16).t()),
        "out shape": lambda: linear_act(x, w, b, out=torch.empty(4, 32)),
        "unknown activation": lambda: linear_act(x, w, b, "softmax"),
    }
    buf = torch.randn(4, 32)
    bad["out overlaps x"] = lambda: linear_act(buf, torch.randn(32, 32), out=buf)
    for what, call in bad.items():
        try:
            call()
        except ValueError:
            continue
        raise AssertionError(f"{what}: no ValueError")
    try:
        linear_act(x, w.half())
    except TypeError:
        pass
    else:
        raise AssertionError("dtype mismatch: no TypeError")
    empty = linear_act(torch.randn(0, 32), w, b, "mish")
    assert empty.shape == (0, 16), empty.shape


def main(seed: int) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from helpers import assert_close_rule, linear_formula, ref_dtype, same_dtype_torch

    from fusedenc.core.triton_gemm import GemmConfig, linear_act

    def run(case, gen):
        if case == "argument_checks":
            check_arguments(linear_act)
        else:
            run_case(case, gen, linear_act, GemmConfig, assert_close_rule, linear_formula, same_dtype_torch, ref_dtype)

    return report_cases(seed, CASES + ["argument_checks"], lambda c: c if isinstance(c, str) else case_id(c), run)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
