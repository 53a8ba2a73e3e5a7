"""The triton_short attention backend on a GPU: through fusedenc.attention against the fp32
formula and sdpa_math (float16, bfloat16, float32; bias and mask variants; fully masked rows;
NaN), every launch-config path, CUDA-graph capture and replay, torch.compile, no-copy output,
opcheck, and how the backend is chosen (only when forced or by a measured table)."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import COPY_OPS, packed_inputs, record_kernel_outputs, replays_match_eager
from helpers import assert_close_rule, attention_formula

import fusedenc.attention as A
import fusedenc.attention.tables as attention_tables
from fusedenc.attention import attention, explain
from fusedenc.common import table_files

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_attention_tables")]

DEV = "cuda"
NAME = "triton_short"
DTYPES = [torch.float16, torch.bfloat16]
#: Key blocks 16 (S 1, 16), 32 (S 20), 64 and 128 (S 100 and 128 too): every row of the config table.
SEQS = [1, 16, 20, 64, 100, 128]
HEAD_DIMS = [32, 64, 128]
VARIANTS = [
    "none", "bias", "bias_broadcast", "bias_expanded", "bias_float32", "bias_strided", "mask", "bias+mask",
]  # fmt: skip
#: Every variant at head dim 32 (Lc0's); the others run the two that matter most.
SHORT_VARIANTS = ["none", "bias+mask"]


@pytest.fixture(autouse=True)
def _needs_backend():
    if not A.BACKENDS[NAME].available():
        pytest.fail(f"{NAME} is not available on this GPU machine (triton installed, GPU visible)")


def _shape(s):
    return (3, 4) if s <= 64 else (2, 4)


def check(out, q, k, v, bias, mask, dtype, what, scale=None):
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    b, s, h, d = q.shape
    assert out.shape == (b * s, h * d) and out.dtype == dtype and out.is_contiguous(), what
    ref = attention_formula(q, k, v, bias, mask, dtype=ref_dtype, scale=scale)
    same = attention_formula(q, k, v, bias, mask, dtype=dtype, scale=scale)
    assert_close_rule(out, ref, same, dtype, what + " (vs formula)")


# ------------------------------------------------------------ accuracy ----


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_formula_and_math(dtype, seq, head_dim, gen):
    b, h = _shape(seq)
    for variant in VARIANTS if head_dim == 32 else SHORT_VARIANTS:
        what = f"{dtype} S={seq} Dh={head_dim} {variant} seed={gen.seed_value}"
        qkv, q, k, v, bias, mask = packed_inputs(b, seq, h, head_dim, dtype, gen, variant)
        out = attention(q, k, v, bias, mask, backend=NAME)
        torch.cuda.synchronize()
        check(out, q, k, v, bias, mask, dtype, what)
        math_out = attention(q, k, v, bias, mask, backend="sdpa_math")
        ref = attention_formula(q, k, v, bias, mask, dtype=torch.float32)
        assert_close_rule(out, ref, math_out, dtype, what + " (vs sdpa_math)")
        if mask is not None:
            rows = out.view(b, seq, -1)[1]
            assert torch.equal(rows, torch.zeros_like(rows)), what + ": all-padding rows are not zeros"


@pytest.mark.parametrize("seq", [7, 64, 128])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_float32_and_head_dim_16(seq, head_dim, gen):
    """float32 uses full-precision products (no TF32): held to float32's tolerance."""
    for dtype in (torch.float32, torch.float16):
        what = f"{dtype} S={seq} Dh={head_dim} seed={gen.seed_value}"
        qkv, q, k, v, bias, mask = packed_inputs(2, seq, 4, head_dim, dtype, gen, "bias+mask")
        check(attention(q, k, v, bias, mask, scale=0.3, backend=NAME), q, k, v, bias, mask, dtype, what, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_neg_inf_bias_are_zeros(dtype, gen):
    qkv, q, k, v, bias, mask = packed_inputs(2, 64, 4, 32, dtype, gen, "bias")
    bias[0, 1, ::3] = float("-inf")
    out = attention(q, k, v, bias, backend=NAME)
    check(out, q, k, v, bias, None, dtype, f"-inf rows seed={gen.seed_value}")
    dead = out.view(2, 64, 4, 32)[0, ::3, 1]
    assert torch.equal(dead, torch.zeros_like(dead))


@pytest.mark.parametrize("where", ["q", "k", "v", "bias", "padded_key"])
def test_nan_propagates_like_the_formula(where, gen):
    """The GPU's max reduction ignores NaN (the interpreter's does not): NaN must still come out."""
    b, s, h, d = 2, 64, 4, 32
    qkv, q, k, v, bias, mask = packed_inputs(b, s, h, d, torch.float16, gen, "bias+mask")
    mask[0] = False
    mask[0, -1] = True
    nan = float("nan")
    if where == "q":
        q[0, 3, 1, 5] = nan
    elif where == "k":
        k[0, 0, 2, 1] = nan
    elif where == "v":
        v[0, 5, 0, 7] = nan
    elif where == "bias":
        bias[0, 3, 10, 20] = nan
    else:  # a NaN key that the mask removes: no NaN anywhere
        k[0, -1, 1, 3] = nan
    out = attention(q, k, v, bias, mask, backend=NAME)
    check(out, q, k, v, bias, mask, torch.float16, f"NaN in {where} seed={gen.seed_value}")
    assert bool(out.isnan().any()) == (where != "padded_key")


@pytest.mark.parametrize(
    "seq, head_dim, config",
    [
        (64, 32, (16, 1, 1)), (64, 32, (32, 2, 2)), (64, 32, (64, 4, 4)), (64, 32, (64, 8, 1)),
        (64, 32, (64, 2, 8)), (128, 128, (32, 4, 1)), (128, 128, (128, 8, 1)), (128, 64, (64, 4, 2)),
        (100, 64, (32, 2, 4)),
    ],
)  # fmt: skip
def test_alternative_launch_configs(seq, head_dim, config, gen):
    """Configs the table does not use today but a tuning run may: each must be right too."""
    from fusedenc.attention.triton_short import LaunchConfig, short_attention

    qkv, q, k, v, bias, mask = packed_inputs(2, seq, 8, head_dim, torch.float16, gen, "bias+mask")
    out = short_attention(q, k, v, bias, mask, head_dim**-0.5, config=LaunchConfig(*config))
    check(out, q, k, v, bias, mask, torch.float16, f"config {config} seed={gen.seed_value}")


# ------------------------------------------------------------ no copy ----


#: What merging a mask into a bias would cost: none of it may run.
_MASK_OPS = {"aten::where", "aten::masked_fill", "aten::masked_fill_", "aten::fill_", "aten::add", "aten::expand"}


@pytest.mark.parametrize("variant", ["none", "bias_float32"])
def test_output_is_the_kernel_output_without_copy(variant, gen, monkeypatch):
    backend = A.BACKENDS[NAME]
    kernel_outputs = record_kernel_outputs(backend, monkeypatch)
    A.clear_cache()
    qkv, q, k, v, bias, mask = packed_inputs(4, 64, 4, 64, torch.float16, gen, variant)
    attention(q, k, v, bias, mask, backend=NAME)  # plan and compile
    kernel_outputs.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = attention(q, k, v, bias, mask, backend=NAME)
    assert len(kernel_outputs) == 1
    kout = kernel_outputs[0]
    assert out.untyped_storage().data_ptr() == kout.untyped_storage().data_ptr(), "output was copied"
    assert out.data_ptr() == kout.data_ptr() and out.stride() == (256, 1)
    ops = {e.key for e in prof.key_averages()}
    assert not ops & COPY_OPS, f"copy ops in the call: {ops & COPY_OPS}"
    assert not ops & _MASK_OPS, f"bias/mask preparation ops in the call: {ops & _MASK_OPS}"


# ------------------------------------------------------------ graphs, compile, opcheck ----


@pytest.mark.parametrize("variant", ["none", "bias+mask", "bias_float32"])
def test_cuda_graph_capture_and_replay(variant, gen):
    for out, q, k, v, bias, mask in replays_match_eager(3, 64, 4, 32, variant, gen, backend=NAME):
        check(out, q, k, v, bias, mask, torch.float16, f"replay {variant} seed={gen.seed_value}")


def test_opcheck(gen):
    qkv, q, k, v, bias, mask = packed_inputs(2, 20, 2, 32, torch.float16, gen, "bias")
    mask = torch.zeros((2, 20), dtype=torch.bool, device=DEV)
    mask[0, 15:] = True
    torch.library.opcheck(torch.ops.fusedenc.attention.default, (q, k, v, bias, mask, None, NAME))
    torch.library.opcheck(torch.ops.fusedenc.attention.default, (q, k, v, None, None, 0.5, NAME))


# ------------------------------------------------------------ choice ----


def test_chosen_only_by_a_table_rule_or_when_forced(gen, monkeypatch, tmp_path):
    """Not in the fallback order: only a table rule that names it (the shipped sm90
    table does where it measured faster) or forcing picks it."""
    qkv, q, k, v, bias, mask = packed_inputs(2, 64, 4, 32, torch.float16, gen, "bias+mask")
    assert NAME not in A.FALLBACK_ORDER
    ex = explain(q, k, v, bias, mask)
    if ex.backend == NAME:
        chosen = next(c for c in ex.candidates if c.available and c.supported)
        assert chosen.name == NAME and chosen.source in ("user table", "shipped table"), str(ex)
        rule = ex.user_rule if chosen.source == "user table" else ex.shipped_rule
        assert NAME in rule["backends"], str(ex)

    monkeypatch.setenv(table_files.CONFIG_DIR_ENV, str(tmp_path))  # no user table
    monkeypatch.setattr(attention_tables, "load_shipped", lambda arch: None)  # and no shipped one
    A.clear_cache()
    assert explain(q, k, v, bias, mask).backend != NAME

    monkeypatch.setenv(A.BACKEND_ENV, NAME)
    A.clear_cache()
    ex = explain(q, k, v, bias, mask)
    assert ex.backend == NAME and A.BACKEND_ENV in ex.reason
    check(attention(q, k, v, bias, mask), q, k, v, bias, mask, torch.float16, f"forced seed={gen.seed_value}")


@pytest.mark.parametrize(
    "seq, head_dim, reason",
    [(129, 32, "at most 128"), (64, 48, "head dim"), (64, 256, "head dim"), (64, 8, "head dim")],
)
def test_refuses_what_it_cannot_serve(seq, head_dim, reason, gen):
    qkv, q, k, v, bias, mask = packed_inputs(1, seq, 2, head_dim, torch.float16, gen)
    ok, why = A.BACKENDS[NAME].supports(A.describe_call(q, k, v, None, None))
    assert not ok and reason in why
    with pytest.raises(ValueError, match=NAME):
        attention(q, k, v, backend=NAME)


def test_refuses_unaligned_views(gen):
    qkv = torch.randn((2, 16, 3 * 64 + 1), generator=gen).to(DEV, torch.float16)
    q, k, v = qkv[..., 1:].view(2, 16, 3, 2, 32).unbind(2)  # odd element offsets: not 16-byte aligned
    ok, why = A.BACKENDS[NAME].supports(A.describe_call(q, k, v, None, None))
    assert not ok and "aligned" in why
