"""Every launch configuration of fusedenc's own GPU kernels, once each, against CPU references.

Why this file exists: compute-sanitizer's racecheck (the shared-memory hazard
checker) instruments every kernel of the process, the vendor libraries' too,
and cannot leave any out (its kernel filters crash it, see tools/sanitize.sh).
The regular GPU tests compute their references with large cuBLAS/cuBLASLt
GEMMs on the GPU, so a racecheck run of them spends hours in vendor kernels.
This file launches each shipped configuration of our kernels on small shapes
and computes every reference on the CPU, so that

    bash tools/sanitize.sh --tools racecheck tests/test_kernel_sweep_gpu.py

covers our kernels in minutes.  It checks results (the docs/ARCHITECTURE.md tolerance
rule, poisoned outputs) but is no API test: the per-op test files cover the
API, argument checks, NaN handling, graphs and compile.

How: inputs are drawn on the CPU from the seeded ``gen`` fixture and copied to
the GPU; references (fp32, fp64 for fp32) and the plain-PyTorch ``same``
result of the rule are computed from the CPU copies; outputs are NaN-poisoned
on the CPU and copied over, so no GPU kernel runs but ours, except:

* ``short_attention`` allocates its output itself: ``torch.empty`` is patched
  to NaN-fill it (one PyTorch fill kernel, no vendor library);
* the bias/activation kernel only runs after a cuBLASLt GEMM
  (``fusedenc.linear``), kept at 64 x 96 x 64.

The kernels and what is swept:

1. ``fusedenc.attention.triton_short`` (``_short_attention_kernel``): every entry of
   ``_CONFIGS`` (key block x head dim) through the table lookup, in float16
   with bias + key padding mask (one sequence all padding) and in bfloat16
   with neither; heads per program reduced (H = 3, 6); float32 inputs and a
   float32 bias.
2. ``fusedenc.core.triton_gemm`` (``_linear_act_kernel``): every config of the
   table, its per-bucket defaults and what ``tune gemm`` tries
   (``tuning_candidates``), as given, at M = 70 and a K that runs the
   pipeline past its stages; every activation once through the table's
   small-M config; no bias, K not a multiple of the K block, float32.
3. ``csrc/kernels/layer_norm.cu`` (``layer_norm_kernel<T, kChunks>``) through
   ``fusedenc.ops.norm.layer_norm``: for float16, bfloat16 and float32, row widths
   that give every (threads per row, chunks per thread) shape that
   ``choose_config`` picks -- groups smaller than a warp, one warp, several
   warps with shared-memory reductions (two rows per block and one), up to the
   largest D -- each with residual + x_bias + sum_out, with none of them, and
   with sum_out written in place over residual.
4. ``csrc/kernels/bias_activation.cu`` (``bias_activation_kernel<T, act,
   bias?>``) through ``fusedenc.linear`` under
   ``fusedenc.testing.force_epilogue_fallback()``, so that every activation,
   the library-fused ones included, runs the plain GEMM and then our kernel.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from attention_helpers import packed_inputs
from helpers import assert_close_rule, attention_formula, linear_formula, poisoned, randn, ref_dtype, same_dtype_torch
from layer_norm_helpers import ln_formula, ln_same_dtype

import fusedenc
import fusedenc.testing
from fusedenc.common import checks
from fusedenc.common.activations import ACTIVATIONS, apply_activation
from fusedenc.ops.gemm import split_qkv
from fusedenc.ops.norm import layer_norm

try:  # the Triton sections need the triton package; the native kernels' sections do not
    import fusedenc.attention.triton_short as tri
    import fusedenc.core.triton_gemm as tg
except ImportError:
    tri = tg = None

pytestmark = [pytest.mark.gpu]

DEV = "cuda"
FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
_NAMES = {FP16: "fp16", BF16: "bf16", FP32: "fp32"}
#: Extra columns right of every strided output: they must still be NaN after the call.
_MARGIN = 16

needs_triton = pytest.mark.skipif(tri is None, reason="triton is not installed")


# ------------------------------------------------------------ helpers ----


def _gpu(t):
    """A GPU copy of a CPU tensor (a plain copy: no kernel), never an alias of it; None stays None."""
    return None if t is None else t.to(DEV, copy=True)


def _poisoned_gpu(shape, dtype) -> torch.Tensor:
    """A NaN-filled GPU buffer, filled on the CPU and copied (no fill kernel on the GPU)."""
    return poisoned(shape, dtype, "cpu").to(DEV)


def _check_strided_out(canvas, cols, what) -> torch.Tensor:
    """The ``[:, :cols]`` part of a GPU canvas, on the CPU, after checking that the margin is untouched."""
    host = canvas.cpu()
    assert bool(host[:, cols:].isnan().all()), f"{what}: wrote right of the output's last column"
    return host[:, :cols]


def _gemm_operands(m, n, k, dtype, gen, with_bias=True):
    """CPU x [M, K], w [N, K] scaled by 1/sqrt(K) (outputs stay O(1)) and b [N] or None."""
    x = randn((m, k), dtype, gen=gen)
    w = randn((n, k), dtype, gen=gen, scale=k**-0.5)
    b = randn((n,), dtype, gen=gen, scale=0.5) if with_bias else None
    return x, w, b


def _check_linear(out, x, w, b, activation, what):
    """``out`` (CPU) against ``act(x @ w.T + b)`` from the CPU operands, by the tolerance rule."""
    dtype = x.dtype
    ref = linear_formula(x, w, b, activation, dtype=ref_dtype(dtype))
    same = same_dtype_torch(x, w, b, activation)
    assert_close_rule(out, ref, same, dtype, what)


# ------------------------------------------------- 1. Triton attention ----

#: One sequence length per key block of the table (16, 32, 64, 128): 20 and 100 leave row tails.
_SEQ_FOR_KEY_BLOCK = {16: 16, 32: 20, 64: 64, 128: 100}
#: Each table entry runs twice, so that it sees both 16-bit dtypes and both variants (not every pair).
_ATTENTION_RUNS = ((FP16, "bias+mask"), (BF16, "none"))


def _run_attention(b, s, h, d, dtype, variant, gen, what):
    """short_attention with the table's config on packed GPU views, against the CPU formula.

    variant: a ``packed_inputs`` variant ("none", "bias+mask", "bias_float32"); the masked
    ones make sequence 1 all padding, whose rows must come out as exact zeros.
    """
    qkv, q, k, v, bias, mask = packed_inputs(b, s, h, d, dtype, gen, variant, device="cpu")
    gq, gk, gv = split_qkv(_gpu(qkv), h)  # strided views of one packed GPU buffer, like fused_qkv's
    scale = d**-0.5
    with pytest.MonkeyPatch.context() as mp:  # the op allocates its output: make it NaN
        empty = torch.empty
        mp.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
        out = tri.short_attention(gq, gk, gv, _gpu(bias), _gpu(mask), scale)
    host = out.cpu()
    what = f"{what} B={b} S={s} H={h} Dh={d} {_NAMES[dtype]} {variant} seed={gen.seed_value}"
    assert host.shape == (b * s, h * d) and host.dtype == dtype, f"{what}: {tuple(host.shape)} {host.dtype}"
    ref = attention_formula(q, k, v, bias, mask, dtype=ref_dtype(dtype), scale=scale)
    same = attention_formula(q, k, v, bias, mask, dtype=dtype, scale=scale)
    assert_close_rule(host, ref, same, dtype, what)
    if mask is not None:
        padded = host.view(b, s, -1)[1]
        assert torch.equal(padded, torch.zeros_like(padded)), f"{what}: the all-padding sequence is not zeros"


def _attention_table_cases():
    if tri is None:
        return []
    cases = []
    for (key_block, head_dim), cfg in sorted(tri._CONFIGS.items()):
        shape = f"keys{key_block}-dh{head_dim}-bm{cfg.block_m}-w{cfg.num_warps}-hpp{cfg.heads_per_program}"
        for dtype, variant in _ATTENTION_RUNS:
            cases.append(pytest.param(key_block, head_dim, dtype, variant, id=f"{shape}-{_NAMES[dtype]}-{variant}"))
    return cases


@needs_triton
@pytest.mark.parametrize("key_block, head_dim, dtype, variant", _attention_table_cases())
@pytest.mark.sweep
def test_attention_table_entry(key_block, head_dim, dtype, variant, gen):
    """Each table entry as the lookup gives it: H = 4 is a multiple of every heads-per-program value."""
    seq, heads = _SEQ_FOR_KEY_BLOCK[key_block], 4
    assert tri.key_block(seq) == key_block
    assert tri.launch_config(seq, heads, head_dim) == tri._CONFIGS[(key_block, head_dim)]
    _run_attention(2, seq, heads, head_dim, dtype, variant, gen, what="table entry")


#: (S, Dh, H) where H is not a multiple of the entry's heads per program: 4 -> 1, 4 -> 2, 2 -> 1.
_REDUCED_HEADS = [(16, 32, 3), (20, 16, 6), (64, 32, 3)]


@needs_triton
@pytest.mark.parametrize("seq, head_dim, heads", _REDUCED_HEADS, ids=[f"S{s}-dh{d}-H{h}" for s, d, h in _REDUCED_HEADS])
def test_attention_heads_per_program_reduced(seq, head_dim, heads, gen):
    table = tri._CONFIGS[(tri.key_block(seq), head_dim)]
    used = tri.launch_config(seq, heads, head_dim).heads_per_program
    assert used < table.heads_per_program and heads % used == 0, (table, used)
    _run_attention(2, seq, heads, head_dim, FP16, "bias+mask", gen, what=f"heads per program {used}")


#: float32 q, k, v (full-precision products) once per key block, S = 128 filling its block;
#: a float32 bias with float16 q, k, v (the Lc0 form).
_ATTENTION_FLOAT32 = [
    pytest.param(16, 32, FP32, "bias+mask", id="S16-dh32-fp32"),
    pytest.param(20, 16, FP32, "bias+mask", id="S20-dh16-fp32"),
    pytest.param(64, 32, FP32, "bias+mask", id="S64-dh32-fp32"),
    pytest.param(128, 16, FP32, "bias+mask", id="S128-dh16-fp32"),
    pytest.param(64, 32, FP16, "bias_float32", id="S64-dh32-fp16-fp32_bias"),
]


@needs_triton
@pytest.mark.parametrize("seq, head_dim, dtype, variant", _ATTENTION_FLOAT32)
def test_attention_float32(seq, head_dim, dtype, variant, gen):
    _run_attention(2, seq, 4, head_dim, dtype, variant, gen, what="float32")


# ---------------------------------------------------- 2. Triton FFN1 GEMM ----


def _run_linear_act(m, n, k, dtype, activation, with_bias, gen, config=None):
    """linear_act into a strided, poisoned GPU output (table config unless ``config``), against the CPU."""
    x, w, b = _gemm_operands(m, n, k, dtype, gen, with_bias)
    canvas = _poisoned_gpu((m, n + _MARGIN), dtype)
    tg.linear_act(_gpu(x), _gpu(w), _gpu(b), activation, out=canvas[:, :n], config=config)
    what = f"M{m} N{n} K{k} {_NAMES[dtype]} {activation} bias={with_bias} config={config} seed={gen.seed_value}"
    _check_linear(_check_strided_out(canvas, n, what), x, w, b, activation, what)


def _gemm_configs():
    """The table's configs, the bucket defaults and every config ``tune gemm`` tries, unfitted
    (N = K = 4096 shrink nothing; block_m follows the M bucket as it does in tuning)."""
    if tg is None:
        return []
    configs = set(tg._CONFIGS.values())
    for m in (1, 17, 33, 300, 4097):  # M buckets 16, 32, 64, 512 and the large-M one
        configs.update(tg.tuning_candidates(m, 4096, 4096, FP16))
    return sorted(configs)


def _config_id(c) -> str:
    return f"bm{c.block_m}-bn{c.block_n}-bk{c.block_k}-gm{c.group_m}-w{c.num_warps}-st{c.num_stages}"


@needs_triton
@pytest.mark.parametrize("config", _gemm_configs(), ids=_config_id)
def test_triton_gemm_config(config, gen):
    """Each config as given: M = 70 (a row tail in every row block size), N = 2 column blocks
    and a tail, K = stages + 1 K blocks (the pipeline wraps around its buffers)."""
    n = 2 * config.block_n + 16
    k = config.block_k * (config.num_stages + 1)
    _run_linear_act(70, n, k, FP16, "swish", True, gen, config=config)


@needs_triton
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_triton_gemm_activation(activation, gen):
    """Every activation epilogue once, with the table's config for M = 7 (bfloat16: the config sweep runs float16)."""
    _run_linear_act(7, 96, 64, BF16, activation, True, gen)


_GEMM_OTHER = [
    # K = 72 < the fitted K block (128): the masked-K main loop; no bias
    pytest.param(7, 96, 72, FP16, "mish", False, id="M7-K72-uneven_k-nobias-fp16"),
    # float32: the fitted configs (K block <= 32, <= 3 stages) of buckets 16 and 128
    pytest.param(7, 96, 64, FP32, "gelu", True, id="M7-fp32"),
    pytest.param(70, 96, 64, FP32, "gelu", True, id="M70-fp32"),
]


@needs_triton
@pytest.mark.parametrize("m, n, k, dtype, activation, with_bias", _GEMM_OTHER)
def test_triton_gemm_other_paths(m, n, k, dtype, activation, with_bias, gen):
    _run_linear_act(m, n, k, dtype, activation, with_bias, gen)


# ------------------------------------------------------ 3. LayerNorm ----

#: Row widths in 16-byte vectors: groups of 1 and 4 threads (a partial group), one warp with 1-4
#: chunks, 64 threads (two rows per block, shared-memory reduction), then 128 ... 1024 threads.
#: D must be a multiple of 16 bytes, so no row width with a partial vector exists.
_LN_VECS = (1, 3, 32, 33, 96, 128, 129, 256, 512, 1024, 2048, 4096)
_LN_ROWS = 5  # not a multiple of the rows per block of any small-row config: a partial block


def _ln_launch(vecs: int) -> tuple[int, int]:
    """(threads per row, vectors per thread) that ``choose_config`` in layer_norm.cu picks."""
    shift = 0
    while (1 << shift) < vecs and (1 << shift) < 32:
        shift += 1
    while -(-vecs // (1 << shift)) > 4:
        shift += 1
    return 1 << shift, -(-vecs // (1 << shift))


def _ln_cases():
    cases = []
    for dtype in (FP16, BF16, FP32):
        per_vec = checks.align_elems(dtype)
        for vecs in _LN_VECS:
            d = vecs * per_vec
            if d > checks.LAYER_NORM_MAX_DIM:
                continue
            threads, chunks = _ln_launch(vecs)
            cases.append(pytest.param(dtype, d, id=f"{_NAMES[dtype]}-D{d}-threads_per_row{threads}-chunks{chunks}"))
    return cases


#: residual, x_bias, weight + bias, sum_out ("in_place": over residual), alpha
_LN_OPTIONS = {
    "full": dict(residual=True, x_bias=True, affine=True, sum_out="new", alpha=0.6),
    "plain": dict(residual=False, x_bias=False, affine=True, sum_out=None, alpha=1.0),
    "in_place": dict(residual=True, x_bias=False, affine=False, sum_out="in_place", alpha=1.3),
}


def _run_layer_norm(t, d, dtype, option, gen):
    o = _LN_OPTIONS[option]
    x = randn((t, d), dtype, gen=gen)
    residual = randn((t, d), dtype, gen=gen) if o["residual"] else None
    x_bias = randn((d,), dtype, gen=gen, scale=0.5) if o["x_bias"] else None
    weight = randn((d,), dtype, gen=gen) if o["affine"] else None
    bias = randn((d,), dtype, gen=gen) if o["affine"] else None
    g_residual = _gpu(residual)
    out = _poisoned_gpu((t, d), dtype)
    sum_out = {None: None, "new": _poisoned_gpu((t, d), dtype), "in_place": g_residual}[o["sum_out"]]
    layer_norm(
        _gpu(x), _gpu(weight), _gpu(bias), 1e-5,
        residual=g_residual, alpha=o["alpha"], x_bias=_gpu(x_bias), out=out, sum_out=sum_out,
    )  # fmt: skip
    what = f"layer_norm T={t} D={d} {_NAMES[dtype]} {option} seed={gen.seed_value}"
    args = (x, weight, bias, 1e-5, residual, o["alpha"], x_bias)
    ref, ref_h = ln_formula(*args, dtype=ref_dtype(dtype))
    same, same_h = ln_same_dtype(*args)
    assert_close_rule(out.cpu(), ref, same, dtype, what)
    if sum_out is not None:
        assert_close_rule(sum_out.cpu(), ref_h, same_h, dtype, f"{what} sum_out")


@pytest.mark.parametrize("dtype, d", _ln_cases())
@pytest.mark.sweep
def test_layer_norm_row_width(dtype, d, gen):
    for option in _LN_OPTIONS:
        _run_layer_norm(_LN_ROWS, d, dtype, option, gen)


# ------------------------------------------- 4. bias + activation kernel ----


def _bias_activation_cases():
    """Each (dtype, activation, bias?) instantiation that can launch: float16 and bfloat16 with and
    without bias, float32 with bias. ("none" without bias has nothing to apply: no launch.)"""
    cases = []
    for dtype in (FP16, BF16, FP32):
        for activation in ACTIVATIONS:
            for with_bias in (True, False):
                if (activation == "none" or dtype == FP32) and not with_bias:
                    continue
                tag = "bias" if with_bias else "nobias"
                cases.append(pytest.param(dtype, activation, with_bias, id=f"{_NAMES[dtype]}-{activation}-{tag}"))
    return cases


@pytest.mark.parametrize("dtype, activation, with_bias", _bias_activation_cases())
@pytest.mark.sweep
def test_bias_activation_kernel(dtype, activation, with_bias, gen):
    """The kernel runs only after a library GEMM (64 x 96 x 64 here).  With the fused epilogues
    refused, every case is the DEFAULT epilogue + our kernel.  The output is a column slice of a
    wider buffer, so no tuned Triton route (dense rows only) can take the call instead."""
    m, n, k = 64, 96, 64
    x, w, b = _gemm_operands(m, n, k, dtype, gen, with_bias)
    canvas = _poisoned_gpu((m, n + _MARGIN), dtype)
    with fusedenc.testing.force_epilogue_fallback(), warnings.catch_warnings():
        warnings.simplefilter("ignore", fusedenc.FallbackWarning)  # the forced fallback warns on each new plan
        fusedenc.linear(_gpu(x), _gpu(w), _gpu(b), activation, out=canvas[:, :n])
    what = f"bias_activation {_NAMES[dtype]} {activation} bias={with_bias} seed={gen.seed_value}"
    out = _check_strided_out(canvas, n, what)
    ref = linear_formula(x, w, b, activation, dtype=ref_dtype(dtype))
    # The same math in torch: the plain GEMM's output is rounded to the dtype before the bias and
    # the activation see it (two roundings of the pre-activation, which relu2's square doubles).
    plain = torch.nn.functional.linear(x, w)
    same = apply_activation(plain + b if with_bias else plain, activation)
    assert_close_rule(out, ref, same, dtype, what)
