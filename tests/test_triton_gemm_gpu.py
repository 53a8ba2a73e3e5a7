"""fusedenc.core.triton_gemm on a GPU: ``act(x @ W^T + b)`` in one Triton kernel against the fp32
formula by the tests' rule, float16 and bfloat16, at the FFN1 shapes of the bench presets
(t82, bt4, bert-base) and M in {1, 7, 4097, 16384} (every config-table bucket that matters:
the small-M tiles and the large-M tile, with row tails); every activation; pre-activations far
from zero; NaN propagation through the GPU's exp/erf/division; poisoned and strided outputs,
strided inputs, a 3-D input; every candidate tile config of ``sweep`` (they must compile on
this GPU and agree); float32 (full-precision products); CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rule, linear_formula, poisoned, same_dtype_torch

from fusedenc.common.activations import ACTIVATIONS

pytest.importorskip("triton")
tg = pytest.importorskip("fusedenc.core.triton_gemm")

pytestmark = pytest.mark.gpu

DEV = "cuda"
HALF = [torch.float16, torch.bfloat16]
#: FFN1 (N, K) and the activation of each bench preset.
SHAPES = {"t82": (2304, 768, "swish"), "bt4": (1536, 1024, "mish"), "bert": (3072, 768, "gelu")}
MS = [1, 7, 4097, 16384]


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(DEV, dtype)


def _operands(m, n, k, dtype, gen, x_scale=1.0, bias=True):
    x = _rand((m, k), dtype, gen, x_scale)
    w = _rand((n, k), dtype, gen, k**-0.5)  # outputs O(x_scale)
    b = _rand((n,), dtype, gen, 0.5) if bias else None
    return x, w, b


def _check(out, x, w, b, act, what):
    ref = linear_formula(x, w, b, act, dtype=torch.float32)
    same = same_dtype_torch(x, w, b, act)
    assert_close_rule(out, ref, same, out.dtype, what)


def _cases():
    """Every activation at t82 with M 7 and 4097 (the small- and large-M tiles, both with row
    tails); the preset's own activation and none everywhere else (fewer kernels to compile)."""
    for name, (n, k, own) in SHAPES.items():
        for m in MS:
            acts = ACTIVATIONS if (name == "t82" and m in (7, 4097)) else ("none", own)
            for act in acts:
                yield pytest.param(n, k, m, act, id=f"{name}-M{m}-{act}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("n, k, m, act", list(_cases()))
@pytest.mark.sweep
def test_ffn1_shapes_match_formula(n, k, m, act, dtype, gen):
    x, w, b = _operands(m, n, k, dtype, gen)
    out = tg.linear_act(x, w, b, act)
    torch.cuda.synchronize()
    assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
    _check(out, x, w, b, act, f"M{m} N{n} K{k} {act} {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_wide_preactivations(act, dtype, gen):
    """Pre-activations of about +-45: mish past its softplus threshold, exp overflowing in the
    branch not taken (swish, sigmoid, gelu_tanh, selu), saturated tanh/sigmoid; no NaN may appear."""
    x, w, b = _operands(4097, 2304, 768, dtype, gen, x_scale=15.0)
    out = tg.linear_act(x, w, b, act)
    assert not bool(out.isnan().any()), f"{act}: NaN from finite inputs (seed={gen.seed_value})"
    _check(out, x, w, b, act, f"wide {act} {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_nan_propagates(act, gen):
    """NaN in a row of x, a row of W or an element of b turns exactly that output row/column NaN
    (relu as a comparison, the clamps as where: the GPU's min/max would drop NaN)."""
    m, n, k = 300, 2304, 768
    x, w, b = _operands(m, n, k, torch.float16, gen)
    x[17, 5] = float("nan")
    w[40, 3] = float("nan")
    b[1000] = float("nan")
    out = tg.linear_act(x, w, b, act)
    nan = out.isnan()
    expect = torch.zeros_like(nan)
    expect[17, :] = True
    expect[:, 40] = True
    expect[:, 1000] = True
    assert torch.equal(nan, expect), f"{act}: NaN at {int(nan.sum())} places, expected {int(expect.sum())}"
    _check(out, x, w, b, act, f"nan {act}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("act", ["none", "mish", "gelu"])
def test_no_bias_into_poisoned_out(act, dtype, gen):
    x, w, _ = _operands(4097, 2304, 768, dtype, gen, bias=False)
    out = poisoned((4097, 2304), dtype, DEV)
    got = tg.linear_act(x, w, None, act, out=out)
    assert got is out
    _check(out, x, w, None, act, f"no bias {act} {dtype} seed={gen.seed_value}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("m", [7, 4097])
def test_strided_rows(m, dtype, gen):
    """x, W and out as column slices of wider buffers (row strides K + 64, K + 8, N + 72)."""
    n, k = 2304, 768
    x = _rand((m, k + 64), dtype, gen)[:, 32 : 32 + k]
    w = _rand((n, k + 8), dtype, gen, k**-0.5)[:, :k]
    b = _rand((n,), dtype, gen, 0.5)
    wide = poisoned((m, n + 72), dtype, DEV)
    out = wide[:, 64 : 64 + n]
    tg.linear_act(x, w, b, "swish", out=out)
    assert bool(wide[:, :64].isnan().all()) and bool(wide[:, 64 + n :].isnan().all()), "wrote outside out"
    _check(out, x, w, b, "swish", f"strided M{m} {dtype} seed={gen.seed_value}")


def test_batched_input(gen):
    x = _rand((4, 64, 768), torch.float16, gen)
    w = _rand((2304, 768), torch.float16, gen, 768**-0.5)
    b = _rand((2304,), torch.float16, gen, 0.5)
    out = tg.linear_act(x, w, b, "mish")
    assert out.shape == (4, 64, 2304)
    _check(out, x, w, b, "mish", f"batched seed={gen.seed_value}")


_CONFIGS = sorted(set(tg.CANDIDATES) | {tg._default_config(bk) for bk in (16, 32, 64, 512, 8192)})


@pytest.mark.parametrize("config", _CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_every_candidate_config(config, gen):
    """Each config sweep() tries and each table default compiles on this GPU and is right,
    at a row and column tail (M 4097, N 2304) and at bt4's K."""
    for n, k in ((2304, 768), (1536, 1024)):
        x, w, b = _operands(4097, n, k, torch.float16, gen)
        out = tg.linear_act(x, w, b, "mish", out=poisoned((4097, n), torch.float16, DEV), config=config)
        _check(out, x, w, b, "mish", f"config {config} N{n} K{k} seed={gen.seed_value}")


@pytest.mark.parametrize("act", ["none", "swish", "gelu", "mish"])
def test_float32_full_precision(act, gen):
    x, w, b = _operands(300, 512, 256, torch.float32, gen)
    out = tg.linear_act(x, w, b, act)
    ref = linear_formula(x.double(), w.double(), b.double(), act)
    _check_f32 = same_dtype_torch(x, w, b, act)
    assert_close_rule(out, ref, _check_f32, torch.float32, f"float32 {act} seed={gen.seed_value}")


@pytest.mark.parametrize("act", ["swish", "mish", "gelu"])
def test_cuda_graph_capture_and_replay(act, gen):
    """A captured call replays on new input values, rewrites a poisoned output and matches an
    eager call bit for bit."""
    m, n, k = 4097, 2304, 768
    dtype = torch.float16
    x, w, b = _operands(m, n, k, dtype, gen)
    out = poisoned((m, n), dtype, DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tg.linear_act(x, w, b, act, out=out)  # warm-up: compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tg.linear_act(x, w, b, act, out=out)
    for replay in range(2):
        x.copy_(_rand((m, k), dtype, gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        what = f"graph replay {replay} {act} seed={gen.seed_value}"
        _check(out, x, w, b, act, what)
        eager = tg.linear_act(x, w, b, act, out=poisoned((m, n), dtype, DEV))
        assert torch.equal(out, eager), f"{what}: replay differs from an eager call"


def test_launch_config_table():
    """Buckets and fitting: tiles never exceed the problem (beyond tl.dot's 16), fp32 halves the K tile."""
    assert tg.m_bucket(1) == 16 and tg.m_bucket(33) == 64 and tg.m_bucket(4097) == 8192 and tg.m_bucket(10**6) == 8192
    small = tg.launch_config(tg.m_bucket(7), 2304, 768, torch.float16)
    assert small.block_m == 16
    big = tg.launch_config(tg.m_bucket(16384), 2304, 768, torch.float16)
    assert (big.block_m, big.block_n, big.block_k) == (128, 128, 64)
    assert tg.launch_config(8192, 2304, 768, torch.float32).block_k == 32
