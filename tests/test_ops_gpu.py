"""The ops on GPU tensors (the native core) against higher-precision references.

Every numeric check uses the tolerance rule of ``helpers.assert_close_rule``:
the op's output may differ from the fp32 reference (fp64 for fp32 inputs) by at
most twice what plain PyTorch in the op's own dtype differs by, plus atol.
Inputs are fresh random values drawn from the ``gen`` fixture, whose seed is in
every failure message.  Outputs are NaN-poisoned buffers wherever the test owns
the output, so an element the op fails to write shows up.

Runs only where a GPU with the native core is present (see conftest.py).
"""

from __future__ import annotations

import itertools
import threading
import warnings

import pytest
import torch
from helpers import (
    assert_close_rule,
    assert_within_output_rounding,
    gelu_fp64,
    linear_formula,
    poisoned,
    randn,
    ref_dtype,
    same_dtype_torch,
    whole_range_inputs,
)

import fusedenc
import fusedenc.testing
from fusedenc.common.activations import ACTIVATIONS

pytestmark = pytest.mark.gpu

DEVICE = "cuda"

FP16 = pytest.param(torch.float16, id="fp16")
BF16 = pytest.param(torch.bfloat16, id="bf16")
FP32 = pytest.param(torch.float32, id="fp32")
HALF = [FP16, BF16]
ALL_DTYPES = [FP16, BF16, FP32]

#: The fp32 subset of the every-activation test: native epilogues (none, relu)
#: and fusedenc's kernel (gelu, swish), checked against fp64 with a tight atol.
#: No fp32 test uses gelu_tanh: it runs in the library's GELU epilogue, whose
#: fp32 accuracy (it may use a fast tanh) is not part of what is tested here.
FP32_ACTIVATIONS = ("none", "relu", "gelu", "swish")

#: M values no other test uses, so a call under force_epilogue_fallback() plans
#: a fresh GEMM (and warns) even when the whole module runs in one process.
_FRESH_M = itertools.count(start=1001, step=2)


def _rand(shape, dtype, gen, scale=1.0):
    return randn(shape, dtype, device=DEVICE, gen=gen, scale=scale)


def _operands(m_shape, k, n, dtype, gen, bias=True):
    """x [*m_shape, K], weight [N, K] scaled by 1/sqrt(K) (outputs stay O(1)), bias [N] or None."""
    x = _rand(tuple(m_shape) + (k,), dtype, gen)
    w = _rand((n, k), dtype, gen, scale=k**-0.5)
    b = _rand((n,), dtype, gen) if bias else None
    return x, w, b


def _check(out, x, w, b=None, activation="none", residual=None, beta=1.0, alpha=1.0, *, what):
    """Assert the tolerance rule for ``out`` = fusedenc.linear(x, w, b, ...)."""
    dtype = x.dtype
    ref = linear_formula(x, w, b, activation, residual, beta, alpha, dtype=ref_dtype(dtype))
    same = same_dtype_torch(x, w, b, activation, residual, beta, alpha)
    assert_close_rule(out, ref, same, dtype, what=what)


def _cache_calls() -> int:
    info = fusedenc.plan_cache_info()
    return info["hits"] + info["misses"]


def _dtype_name(dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


# ----------------------------------------------------------- activations ----

_ACTIVATION_CASES = [
    pytest.param(dtype, act, id=f"{_dtype_name(dtype)}-{act}")
    for dtype in (torch.float16, torch.bfloat16)
    for act in ACTIVATIONS
] + [pytest.param(torch.float32, act, id=f"fp32-{act}") for act in FP32_ACTIVATIONS]


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype, activation", _ACTIVATION_CASES)
@pytest.mark.sweep
def test_linear_every_activation(dtype, activation, with_bias, gen):
    """Each activation, with and without bias, writes every element of out within the rule."""
    m, k, n = 333, 256, 768
    x, w, b = _operands((m,), k, n, dtype, gen, bias=with_bias)
    out = poisoned((m, n), dtype, DEVICE)
    got = fusedenc.linear(x, w, b, activation, out=out)
    assert got is out
    _check(out, x, w, b, activation, what=f"{activation} {dtype} bias={with_bias} seed={gen.seed_value}")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "swish"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_linear_allocates_output(dtype, activation, gen):
    """Without out=, linear returns a new contiguous [..., N] tensor on x's device and dtype."""
    x, w, b = _operands((2, 45), 128, 256, dtype, gen)
    out = fusedenc.linear(x, w, b, activation)
    assert out.shape == (2, 45, 256)
    assert out.dtype == dtype and out.device == x.device and out.is_contiguous()
    _check(out, x, w, b, activation, what=f"allocating {activation} {dtype} seed={gen.seed_value}")


# ---------------------------------------------------------------- shapes ----

# (leading dims of x, K, N, activation, bias).  Every M in {1, 7, 4097} meets
# every N in {8, 24, 768, 2304}, every K in {8, 64, 768} and x of 1, 2 and 3
# leading dims; activations alternate between native epilogues and the kernel.
_SHAPE_CASES = [
    ((1,), 8, 8, "gelu_tanh", True),
    ((1, 1), 64, 24, "mish", False),
    ((1, 1, 1), 768, 768, "none", True),
    ((1,), 64, 2304, "relu", False),
    ((1, 7), 768, 8, "relu", True),
    ((7,), 8, 24, "gelu_tanh", False),
    ((7, 1, 1), 64, 768, "mish", True),
    ((1, 1, 7), 768, 2304, "none", False),
    ((17, 241), 64, 8, "mish", True),
    ((4097,), 768, 24, "none", False),
    ((17, 1, 241), 8, 768, "relu", True),
    ((4097,), 768, 2304, "gelu_tanh", True),
    ((1, 17, 241), 768, 2304, "mish", False),
]


def _shape_params():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for lead, k, n, act, bias in _SHAPE_CASES:
            if dtype == torch.float32 and act == "gelu_tanh":
                continue  # see FP32_ACTIVATIONS
            case_id = f"{_dtype_name(dtype)}-x{'x'.join(map(str, lead))}xK{k}-N{n}-{act}-{'bias' if bias else 'nobias'}"
            yield pytest.param(dtype, lead, k, n, act, bias, id=case_id)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, lead, k, n, activation, with_bias", list(_shape_params()))
def test_linear_shapes(dtype, lead, k, n, activation, with_bias, gen):
    """M of 1, 7 and 4097 over 1 to 3 leading dims, with small and large N and K."""
    x, w, b = _operands(lead, k, n, dtype, gen, bias=with_bias)
    out = poisoned(lead + (n,), dtype, DEVICE)
    fusedenc.linear(x, w, b, activation, out=out)
    _check(out, x, w, b, activation, what=f"x{tuple(x.shape)} N={n} {activation} {dtype} seed={gen.seed_value}")


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [0.37, -1.5])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu_tanh", "mish"])
@pytest.mark.parametrize("dtype", HALF)
def test_alpha_scales_before_bias_and_activation(dtype, activation, alpha, gen):
    """act(alpha * x @ W^T + b): alpha scales the product only, before bias and activation."""
    x, w, b = _operands((129,), 256, 384, dtype, gen)
    out = poisoned((129, 384), dtype, DEVICE)
    fusedenc.linear(x, w, b, activation, alpha=alpha, out=out)
    _check(out, x, w, b, activation, alpha=alpha, what=f"alpha={alpha} {activation} {dtype} seed={gen.seed_value}")


# -------------------------------------------------------------- residual ----


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [1.0, 0.37])
@pytest.mark.parametrize("beta", [1.0, -0.5, 2.0])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_residual_into_separate_output(dtype, with_bias, beta, alpha, gen):
    """alpha * x @ W^T + b + beta * residual into a separate out (C != D); residual is untouched."""
    x, w, b = _operands((3, 50), 256, 512, dtype, gen, bias=with_bias)
    r = _rand((3, 50, 512), dtype, gen)
    r_before = r.clone()
    out = poisoned((3, 50, 512), dtype, DEVICE)
    got = fusedenc.linear(x, w, b, residual=r, beta=beta, alpha=alpha, out=out)
    assert got is out
    assert torch.equal(r, r_before), "the residual was modified"
    what = f"residual beta={beta} alpha={alpha} bias={with_bias} {dtype} seed={gen.seed_value}"
    _check(out, x, w, b, residual=r, beta=beta, alpha=alpha, what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [1.0, -0.5])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_residual_in_place(dtype, beta, gen):
    """out=residual: the residual is read and overwritten in the same call, and returned."""
    x, w, b = _operands((200,), 128, 256, dtype, gen)
    r = _rand((200, 256), dtype, gen)
    r_before = r.clone()
    got = fusedenc.linear(x, w, b, residual=r, beta=beta, out=r)
    assert got is r
    _check(r, x, w, b, residual=r_before, beta=beta, what=f"in place beta={beta} {dtype} seed={gen.seed_value}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["relu", "mish", "residual"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_strided_operands(dtype, case, gen):
    """Row strides wider than the rows: x, weight and residual are column slices, out is a
    column slice of a poisoned buffer whose other columns must stay NaN."""
    m, k, n, pad = 37, 64, 48, 16  # pad: a multiple of 16 bytes for every dtype
    x = _rand((m, k + 3 * pad), dtype, gen)[:, pad : pad + k]
    w = _rand((n, k + pad), dtype, gen, scale=k**-0.5)[:, :k]
    b = _rand((n,), dtype, gen)
    residual = _rand((m, n + pad), dtype, gen)[:, pad:] if case == "residual" else None
    activation = "none" if case == "residual" else case
    beta = 0.5 if case == "residual" else 1.0
    assert x.stride(0) == k + 3 * pad and w.stride(0) == k + pad

    canvas = poisoned((m, n + 2 * pad), dtype, DEVICE)
    out = canvas[:, pad : pad + n]
    got = fusedenc.linear(x, w, b, activation, residual, beta, out=out)
    assert got is out
    _check(out, x, w, b, activation, residual, beta, what=f"strided {case} {dtype} seed={gen.seed_value}")
    assert torch.isnan(canvas[:, :pad]).all(), "columns left of the out slice were written"
    assert torch.isnan(canvas[:, pad + n :]).all(), "columns right of the out slice were written"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)], ids=["0xK", "2x0xK"])
def test_empty_batch(shape, gen):
    """An empty batch returns an empty [..., N] result (allocated or given), launching nothing."""
    dtype, n = torch.float16, 32
    x = torch.empty(shape, dtype=dtype, device=DEVICE)
    w = _rand((n, shape[-1]), dtype, gen)
    b = _rand((n,), dtype, gen)
    out_shape = shape[:-1] + (n,)
    calls = _cache_calls()

    got = fusedenc.linear(x, w, b, "gelu")
    assert got.shape == out_shape and got.dtype == dtype and got.device == x.device

    out = torch.empty(out_shape, dtype=dtype, device=DEVICE)
    assert fusedenc.linear(x, w, b, "gelu", out=out) is out

    r = torch.empty(out_shape, dtype=dtype, device=DEVICE)
    assert fusedenc.linear(x, w, b, residual=r, beta=0.5).shape == out_shape

    torch.cuda.synchronize()  # surfaces any asynchronous launch error
    assert _cache_calls() == calls, "an empty batch reached the GEMM"


# -------------------------------------------------------------- fallback ----

# (activation, bias, residual, the library epilogue that is requested and refused)
_FALLBACK_CASES = [
    pytest.param("relu", True, False, "RELU_BIAS", id="relu-bias"),
    pytest.param("relu", False, False, "RELU", id="relu-nobias"),
    pytest.param("gelu_tanh", True, False, "GELU_BIAS", id="gelu_tanh-bias"),
    pytest.param("mish", True, False, "BIAS", id="mish-bias"),  # kernel adds bias and activation
    pytest.param("none", True, True, "BIAS", id="residual-bias"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("activation, with_bias, with_residual, requested", _FALLBACK_CASES)
@pytest.mark.parametrize("dtype", HALF)
def test_forced_epilogue_fallback(dtype, activation, with_bias, with_residual, requested, gen):
    """With the fused epilogue refused, the plain GEMM + bias/activation kernel is still within
    the rule; the first call of the shape warns once and records an event naming the epilogue."""
    m, k, n = next(_FRESH_M), 128, 256
    x, w, b = _operands((m,), k, n, dtype, gen, bias=with_bias)
    r = _rand((m, n), dtype, gen) if with_residual else None
    beta = -0.5 if with_residual else 1.0
    events_before = len(fusedenc.fallback_events())

    with fusedenc.testing.force_epilogue_fallback():
        with pytest.warns(fusedenc.FallbackWarning, match=f"fusedenc: {requested} epilogue"):
            first = fusedenc.linear(x, w, b, activation, r, beta, out=poisoned((m, n), dtype, DEVICE))
        with warnings.catch_warnings():  # the cached fallback plan does not warn again
            warnings.simplefilter("error", fusedenc.FallbackWarning)
            second = fusedenc.linear(x, w, b, activation, r, beta, out=poisoned((m, n), dtype, DEVICE))

    events = fusedenc.fallback_events()
    assert len(events) == events_before + 1, events[events_before:]
    event = events[-1]
    assert event["requested"] == requested, event
    assert f"m={m} n={n} k={k}" in event["problem"], event
    assert "forced" in event["reason"], event

    what = f"fallback {activation} bias={with_bias} residual={with_residual} {dtype} seed={gen.seed_value}"
    _check(first, x, w, b, activation, r, beta, what=what)
    assert torch.equal(first, second), "the cached fallback plan gave a different result"

    # Outside the context the same shape plans normally: no fallback, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusedenc.FallbackWarning)
        normal = fusedenc.linear(x, w, b, activation, r, beta, out=poisoned((m, n), dtype, DEVICE))
    assert len(fusedenc.fallback_events()) == events_before + 1
    _check(normal, x, w, b, activation, r, beta, what=f"after leaving the context: {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", HALF)
def test_gelu_pass_accurate_over_the_whole_range(dtype, act, gen):
    """The bias + activation pass's GELUs in 16 bits (activations.cuh's forms, which the Hopper
    GELU units share) at every representable input in [-40, 40]: through an identity weight the
    GEMM's output is exactly the input, and each output of the pass is within half an ulp plus
    1e-5 relative of the fp64 GELU, the negative tail included (torch's 1 + erf form loses it)."""
    x, w = whole_range_inputs(dtype, gen, DEVICE)
    out = poisoned((x.shape[0], w.shape[0]), dtype, DEVICE)
    with fusedenc.testing.sm90_gelu_epilogue(False), fusedenc.testing.force_epilogue_fallback(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", fusedenc.FallbackWarning)  # the forced fallback warns once a shape
        fusedenc.linear(x, w, None, act, out=out)
    assert_within_output_rounding(out, x, gelu_fp64(x.double(), act), dtype, f"the {act} pass")


# ------------------------------------------------------------------- QKV ----


@pytest.mark.gpu
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", HALF)
def test_fused_qkv_matches_separate_projections(dtype, with_bias, gen):
    """q, k, v equal x @ Wq^T + bq etc., as [B, S, H, Dh] views of one packed buffer."""
    bsz, seq, d, heads = 2, 77, 768, 12
    dh = d // heads
    x = _rand((bsz, seq, d), dtype, gen)
    ws = [_rand((d, d), dtype, gen, scale=d**-0.5) for _ in range(3)]
    bs = [_rand((d,), dtype, gen) for _ in range(3)] if with_bias else [None] * 3
    w_qkv, b_qkv = fusedenc.pack_qkv(*ws, *bs)
    assert (b_qkv is None) == (not with_bias)

    q, k, v = fusedenc.fused_qkv(x, w_qkv, b_qkv, heads)

    for got, w, b, name in zip((q, k, v), ws, bs, "qkv"):
        assert got.shape == (bsz, seq, heads, dh), name
        assert got.stride() == (seq * 3 * d, 3 * d, dh, 1), name
        ref = linear_formula(x, w, b, dtype=ref_dtype(dtype)).view(bsz, seq, heads, dh)
        same = same_dtype_torch(x, w, b).view(bsz, seq, heads, dh)
        assert_close_rule(got, ref, same, dtype, what=f"{name} bias={with_bias} {dtype} seed={gen.seed_value}")
    storage = q.untyped_storage().data_ptr()
    assert k.untyped_storage().data_ptr() == storage and v.untyped_storage().data_ptr() == storage
    assert k.data_ptr() == q.data_ptr() + d * q.element_size()
    assert v.data_ptr() == q.data_ptr() + 2 * d * q.element_size()


# ------------------------------------------------------------ CUDA graph ----


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gelu_tanh", "mish", "residual"])
@pytest.mark.parametrize("dtype", HALF)
def test_cuda_graph_replay_reads_new_inputs(dtype, case, gen):
    """A captured linear (native epilogue, kernel activation, residual) replays on new input
    values, rewrites a poisoned output, and matches an eager call bit for bit."""
    m, k, n = 96, 256, 512
    residual = case == "residual"
    activation = "none" if residual else case
    beta = -0.5 if residual else 1.0
    x, w, b = _operands((m,), k, n, dtype, gen)
    r = _rand((m, n), dtype, gen) if residual else None
    # The residual case lets the op allocate its output inside the capture (the
    # graph's pool); the others write into a static output the test owns.
    static_out = None if residual else poisoned((m, n), dtype, DEVICE)

    def step():
        return fusedenc.linear(x, w, b, activation, r, beta, out=static_out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: plans the GEMM outside the capture
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    if static_out is not None:
        assert graph_out is static_out

    for replay in range(2):
        x.copy_(_rand((m, k), dtype, gen))
        if residual:
            r.copy_(_rand((m, n), dtype, gen))
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        what = f"graph replay {replay} {case} {dtype} seed={gen.seed_value}"
        _check(graph_out, x, w, b, activation, r, beta, what=what)
        eager = fusedenc.linear(x, w, b, activation, r, beta, out=poisoned((m, n), dtype, DEVICE))
        assert torch.equal(graph_out, eager), f"{what}: replay differs from an eager call"


# --------------------------------------------------------- torch.compile ----


@pytest.mark.gpu
def test_compile_fullgraph_matches_eager(gen):
    """fused_qkv and linear (activation and residual) trace with fullgraph=True, and the
    compiled block agrees with eager fusedenc and with the reference."""
    torch._dynamo.reset()
    dtype = torch.float16
    bsz, seq, d, heads, hidden = 2, 24, 256, 4, 512
    x = _rand((bsz, seq, d), dtype, gen)
    w_qkv, b_qkv = fusedenc.pack_qkv(
        *[_rand((d, d), dtype, gen, scale=d**-0.5) for _ in range(3)],
        *[_rand((d,), dtype, gen) for _ in range(3)],
    )
    w1, b1 = _rand((hidden, d), dtype, gen, scale=d**-0.5), _rand((hidden,), dtype, gen)
    w2, b2 = _rand((d, hidden), dtype, gen, scale=hidden**-0.5), _rand((d,), dtype, gen)

    def block(t):
        q, k, v = fusedenc.fused_qkv(t, w_qkv, b_qkv, heads)
        h = fusedenc.linear(t, w1, b1, "gelu_tanh")
        y = fusedenc.linear(h, w2, b2, residual=t, beta=0.5)
        return q, k, v, h, y

    compiled = torch.compile(block, fullgraph=True)
    got = compiled(x)
    want = block(x)
    torch.cuda.synchronize()

    fp32 = ref_dtype(dtype)
    split = (bsz, seq, 3, heads, d // heads)
    qkv_ref = linear_formula(x, w_qkv, b_qkv, dtype=fp32).view(split)
    qkv_same = same_dtype_torch(x, w_qkv, b_qkv).view(split)
    # (name, compiled, eager, reference, torch in fp16).  y's reference takes the
    # compiled h as its input, so a difference in h is not charged to y.
    outputs = [(name, got[i], want[i], qkv_ref[:, :, i], qkv_same[:, :, i]) for i, name in enumerate("qkv")]
    outputs.append(("h", got[3], want[3], linear_formula(x, w1, b1, "gelu_tanh", dtype=fp32),
                    same_dtype_torch(x, w1, b1, "gelu_tanh")))  # fmt: skip
    outputs.append(("y", got[4], want[4], linear_formula(got[3], w2, b2, residual=x, beta=0.5, dtype=fp32),
                    same_dtype_torch(got[3], w2, b2, residual=x, beta=0.5)))  # fmt: skip
    for name, compiled_out, eager_out, ref, same in outputs:
        what = f"compiled {name} seed={gen.seed_value}"
        assert compiled_out.shape == eager_out.shape, what
        assert compiled_out.stride() == eager_out.stride(), what
        assert_close_rule(compiled_out, ref, same, dtype, what=what)
        # With the eager output as the oracle: compiled and eager differ by no more than the rule allows.
        assert_close_rule(compiled_out, eager_out, same, dtype, what=f"{what} vs eager")


# ----------------------------------------------------------- concurrency ----


def _run_in_threads(target, count):
    """Run target(i, stream) in ``count`` threads, each on its own stream; re-raise their errors."""
    errors = []
    barrier = threading.Barrier(count, timeout=120)
    streams = [torch.cuda.Stream() for _ in range(count)]

    def body(i):
        try:
            barrier.wait()
            with torch.cuda.stream(streams[i]):
                target(i, streams[i])
            streams[i].synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,), name=f"fusedenc-{i}") for i in range(count)]
    torch.cuda.synchronize()  # inputs made on the default stream are ready for every stream
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    torch.cuda.synchronize()
    if errors:
        raise errors[0]


@pytest.mark.gpu
def test_threads_on_separate_streams_match_serial(gen):
    """Two threads on their own streams, calling linear with different shapes, dtypes and
    activations 50 times each at once, get bit for bit what the same calls give serially."""
    iters = 50
    jobs = [
        dict(dtype=torch.float16, m=512, k=768, n=768, activation="gelu_tanh"),
        dict(dtype=torch.bfloat16, m=200, k=256, n=2304, activation="mish"),
    ]
    for job in jobs:
        job["w"] = _rand((job["n"], job["k"]), job["dtype"], gen, scale=job["k"] ** -0.5)
        job["b"] = _rand((job["n"],), job["dtype"], gen)
        job["xs"] = [_rand((job["m"], job["k"]), job["dtype"], gen) for _ in range(iters)]
        job["expected"] = [fusedenc.linear(x, job["w"], job["b"], job["activation"]) for x in job["xs"]]
        job["got"] = []
        _check(job["expected"][0], job["xs"][0], job["w"], job["b"], job["activation"],
               what=f"serial {job['activation']} seed={gen.seed_value}")  # fmt: skip

    def work(i, _stream):
        job = jobs[i]
        for x in job["xs"]:
            job["got"].append(fusedenc.linear(x, job["w"], job["b"], job["activation"]))

    _run_in_threads(work, len(jobs))

    for job in jobs:
        assert len(job["got"]) == iters
        for it, (got, want) in enumerate(zip(job["got"], job["expected"])):
            assert torch.equal(got, want), (
                f"{job['activation']} iteration {it}: threaded result differs from serial "
                f"(max diff {(got.float() - want.float()).abs().max().item():.3g}, seed={gen.seed_value})"
            )


@pytest.mark.gpu
def test_threads_planning_one_new_shape_at_once(gen):
    """Threads that miss the plan cache together on one new shape end with one cached plan,
    and all of them compute the same, correct result."""
    count = 4
    m, k, n = next(_FRESH_M), 128, 256
    dtype = torch.float16
    x, w, b = _operands((m,), k, n, dtype, gen)
    results = [None] * count
    fusedenc.clear_plan_cache()
    before = fusedenc.plan_cache_info()
    assert before["size"] == 0

    def work(i, _stream):
        results[i] = fusedenc.linear(x, w, b, "gelu_tanh")

    _run_in_threads(work, count)

    after = fusedenc.plan_cache_info()
    assert after["size"] == 1, after
    assert (after["hits"] + after["misses"]) - (before["hits"] + before["misses"]) == count, (before, after)
    _check(results[0], x, w, b, "gelu_tanh", what=f"planned in threads seed={gen.seed_value}")
    for i in range(1, count):
        assert torch.equal(results[i], results[0]), f"thread {i} differs from thread 0"


# ------------------------------------------------------------ plan cache ----


@pytest.mark.gpu
def test_plan_cache_hits_misses_and_eviction(gen):
    """A repeated shape is a hit, a new one a miss; a limit of 2 evicts the least recently
    used plans, and an evicted shape is planned again and still correct."""
    dtype, k, n = torch.float16, 64, 128
    w = _rand((n, k), dtype, gen, scale=k**-0.5)
    b = _rand((n,), dtype, gen)

    def call(m):
        x = _rand((m, k), dtype, gen)
        out = fusedenc.linear(x, w, b, "relu", out=poisoned((m, n), dtype, DEVICE))
        _check(out, x, w, b, "relu", what=f"plan cache m={m} seed={gen.seed_value}")

    saved_limit = fusedenc.plan_cache_info()["limit"]
    try:
        fusedenc.set_plan_cache_limit(1024)
        fusedenc.clear_plan_cache()
        i0 = fusedenc.plan_cache_info()
        assert i0["size"] == 0, i0

        call(11)
        i1 = fusedenc.plan_cache_info()
        assert (i1["size"], i1["misses"], i1["hits"]) == (1, i0["misses"] + 1, i0["hits"]), i1

        call(11)  # same shape: a hit, no new plan
        i2 = fusedenc.plan_cache_info()
        assert (i2["size"], i2["misses"], i2["hits"]) == (1, i1["misses"], i1["hits"] + 1), i2

        call(12)  # new shape: a miss, one more plan
        i3 = fusedenc.plan_cache_info()
        assert (i3["size"], i3["misses"], i3["hits"]) == (2, i2["misses"] + 1, i2["hits"]), i3

        fusedenc.set_plan_cache_limit(2)
        fusedenc.clear_plan_cache()
        e0 = fusedenc.plan_cache_info()
        assert e0["limit"] == 2 and e0["size"] == 0, e0
        for m in (21, 22, 23, 24):
            call(m)
        e1 = fusedenc.plan_cache_info()
        assert e1["size"] == 2, e1
        assert e1["misses"] == e0["misses"] + 4 and e1["evictions"] == e0["evictions"] + 2, (e0, e1)

        call(21)  # evicted (least recently used): planned again, still correct
        e2 = fusedenc.plan_cache_info()
        assert e2["size"] == 2 and e2["misses"] == e1["misses"] + 1, e2
        assert e2["evictions"] == e1["evictions"] + 1, e2
    finally:
        fusedenc.set_plan_cache_limit(saved_limit)
    assert fusedenc.plan_cache_info()["limit"] == saved_limit


# --------------------------------------------------------------- opcheck ----


def _opcheck_args(dtype, gen, residual):
    x, w, b = _operands((6,), 16, 24, dtype, gen)
    if residual:
        return (x, w, b, "none", _rand((6, 24), dtype, gen), 1.0, 0.5)
    return (x, w, b, "gelu", None, 0.5, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["bias-activation", "residual"])
@pytest.mark.parametrize("dtype", HALF)
def test_opcheck_linear_cuda(dtype, residual, gen):
    """torch.ops.fusedenc.linear passes opcheck (schema, fake, aot dispatch) on CUDA tensors."""
    torch.library.opcheck(torch.ops.fusedenc.linear.default, _opcheck_args(dtype, gen, residual))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF)
def test_opcheck_linear_out_cuda(dtype, gen):
    """torch.ops.fusedenc.linear_out (mutating out) passes opcheck on CUDA tensors."""
    out = poisoned((6, 24), dtype, DEVICE)
    torch.library.opcheck(torch.ops.fusedenc.linear_out.default, (out,) + _opcheck_args(dtype, gen, False))


# ------------------------------------------------------------ bad device ----


@pytest.mark.gpu
@pytest.mark.parametrize(
    "on_cpu, named",
    [("weight", "weight"), ("bias", "bias"), ("residual", "residual"), ("out", "out"), ("x", "weight")],
    ids=["weight", "bias", "residual", "out", "x"],
)
def test_operand_on_another_device_is_rejected_before_launch(on_cpu, named, gen):
    """One operand on the CPU while the others are on CUDA raises ValueError naming the
    operand compared with x, before any GEMM is planned or written."""
    dtype, m, k, n = torch.float16, 8, 32, 16
    x, w, b = _operands((m,), k, n, dtype, gen)
    r = _rand((m, n), dtype, gen) if on_cpu == "residual" else None
    out = poisoned((m, n), dtype, DEVICE)
    args = dict(x=x, weight=w, bias=b, residual=r, out=out)
    args[on_cpu] = args[on_cpu].cpu()
    calls = _cache_calls()

    with pytest.raises(ValueError, match=rf"^{named}\b"):
        fusedenc.linear(args["x"], args["weight"], args["bias"], "none", args["residual"], out=args["out"])

    torch.cuda.synchronize()
    assert _cache_calls() == calls, "the GEMM was reached"
    assert torch.isnan(args["out"]).all(), "out was written"
