"""fusedenc.attention.triton_short on CPU through Triton's interpreter: the short-sequence kernel
against the fp32/fp64 formula, with bias (per batch, broadcast, float32, strided), padding
masks, fully masked rows, NaN, every launch-config path and the [B*S, H*Dh] row layout.

TRITON_INTERPRET=1 must be set before the kernel is defined, and it must not leak into
other test modules: the cases run in one child process (this file run as a script), and
each test here reports one case's result.  Skipped when triton is not installed.

Not covered here: bfloat16 (the interpreter of triton 3.9 multiplies bfloat16 dot
operands as their raw uint16 bit patterns) and anything about GPU code generation;
tests/test_triton_attention_gpu.py covers those on a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest
import torch
from interpreter_helpers import interpreter_suite, report_cases

if __name__ != "__main__" and importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

DTYPES = {"float16": torch.float16, "float32": torch.float32}

#: Each case: batch, seq, heads, head dim, dtype, bias, mask, extra.
#: bias: none | batch | broadcast | batch_f32 | broadcast_f32 | strided (a transposed view)
#: mask: none | random (trailing padding, each sequence keeps a key) | padded (and sequence 1 all padding)
#: extra: none | config=<block_m>,<warps>,<heads per program> | separate (q, k, v not one packed
#: buffer) | neg_inf_rows | nan_q | nan_k | nan_v | nan_bias | nan_padded_key | scale
CASES = [
    (1, 1, 1, 16, "float16", "none", "none", "none"),
    (3, 1, 4, 32, "float16", "batch", "padded", "none"),
    (2, 7, 3, 16, "float16", "broadcast", "random", "none"),  # H=3: the table's 4 heads per program become 1
    (3, 7, 2, 64, "float32", "batch_f32", "none", "none"),
    (2, 7, 2, 32, "float16", "strided", "padded", "none"),
    (2, 7, 2, 32, "float16", "none", "none", "separate"),
    (2, 7, 2, 32, "float16", "batch", "none", "neg_inf_rows"),
    (2, 7, 2, 16, "float32", "broadcast_f32", "random", "scale"),
    (2, 64, 4, 32, "float16", "broadcast_f32", "padded", "none"),  # Lc0 form
    (2, 64, 4, 32, "float16", "none", "none", "config=16,4,2"),  # 4 query blocks, 2 heads per program
    (1, 64, 4, 64, "float16", "batch", "random", "config=64,4,4"),
    (1, 128, 2, 64, "float16", "batch", "random", "none"),
    (2, 128, 4, 16, "float32", "none", "padded", "config=32,4,4"),
    (2, 7, 2, 32, "float16", "batch", "random", "nan_q"),
    (2, 7, 2, 32, "float16", "none", "random", "nan_k"),
    (2, 7, 2, 32, "float16", "none", "none", "nan_v"),
    (2, 7, 2, 32, "float16", "batch", "none", "nan_bias"),
    (2, 7, 2, 32, "float16", "none", "random", "nan_padded_key"),
]


def case_id(case) -> str:
    b, s, h, d, dtype, bias, mask, extra = case
    return f"B{b}-S{s}-H{h}-Dh{d}-{dtype}-bias_{bias}-mask_{mask}-{extra}"


# ------------------------------------------------------------ pytest side ----


results, test_case_under_interpreter = interpreter_suite(__file__, CASES, case_id)


# ------------------------------------------------------------ child side ----


def make_inputs(case, gen):
    b, s, h, d, dtype_name, bias_kind, mask_kind, extra = case
    dtype = DTYPES[dtype_name]

    def rnd(*shape, dt=dtype):
        return torch.randn(shape, generator=gen).to(dt)

    if extra == "separate":  # three tensors with three different stride patterns
        q = rnd(b, h, s, d).transpose(1, 2)
        k = rnd(b, s, h, d)
        v = rnd(b, s, 2 * h, d)[:, :, ::2]
    else:  # views of one packed [B, S, 3, H, Dh] buffer, what fused_qkv returns
        q, k, v = rnd(b, s, 3, h, d).unbind(2)
    bias = None
    if bias_kind != "none":
        bias_dtype = torch.float32 if bias_kind.endswith("_f32") else dtype
        bias = rnd(1 if bias_kind.startswith("broadcast") else b, h, s, s, dt=bias_dtype)
        if bias_kind == "broadcast":  # [B, H, S, S] with batch stride 0 (broadcast_f32 stays [1, H, S, S])
            bias = bias.expand(b, h, s, s)
        if bias_kind == "strided":
            bias = bias.transpose(-1, -2)
    mask = None
    if mask_kind != "none":
        lengths = torch.randint(1, s + 1, (b,), generator=gen)
        mask = torch.arange(s)[None, :] >= lengths[:, None]
        if mask_kind == "padded" and b > 1:
            mask[1] = True
    if extra == "neg_inf_rows":  # whole rows of -inf bias: those query rows must be zeros
        bias[0, 1, ::2] = float("-inf")
    nan = float("nan")
    if extra == "nan_q":
        q[0, 3, 1, 5] = nan
    elif extra == "nan_k":
        k[1, 0, 0, 2] = nan  # key 0 is never padding: all of sequence 1, head 0 turns NaN
    elif extra == "nan_v":
        v[0, 2, 1, 7] = nan
    elif extra == "nan_bias":
        bias[1, 0, 4, 6] = nan
    elif extra == "nan_padded_key":  # masked out before the softmax: no NaN anywhere
        mask[0, -1] = True
        k[0, -1, 1, 3] = nan
    return q, k, v, bias, mask


def run_case(case, gen, short_attention, LaunchConfig, assert_close_rule, attention_formula):
    b, s, h, d, dtype_name, bias_kind, mask_kind, extra = case
    dtype = DTYPES[dtype_name]
    q, k, v, bias, mask = make_inputs(case, gen)
    scale = 0.3 if extra == "scale" else 1.0 / math.sqrt(d)
    config = LaunchConfig(*map(int, extra.split("=")[1].split(","))) if extra.startswith("config=") else None

    empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # every output element the kernel fails to write shows as NaN
        return empty(*args, **kwargs).fill_(float("nan"))

    torch.empty = poisoned_empty
    try:
        out = short_attention(q, k, v, bias, mask, scale, config=config)
    finally:
        torch.empty = empty

    assert out.shape == (b * s, h * d) and out.dtype == dtype, f"shape {tuple(out.shape)}, dtype {out.dtype}"
    assert out.stride() == (h * d, 1), f"not dense [B*S, H*Dh] rows: strides {out.stride()}"
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    ref = attention_formula(q, k, v, bias, mask, dtype=ref_dtype, scale=scale)
    same = attention_formula(q, k, v, bias, mask, dtype=dtype, scale=scale)
    assert_close_rule(out, ref, same, dtype, "vs formula")
    rows = out.view(b, s, h, d)
    if mask_kind == "padded" and b > 1:
        assert torch.equal(rows[1], torch.zeros_like(rows[1])), "an all-padding sequence is not zeros"
    if extra == "neg_inf_rows":
        dead = rows[0, ::2, 1]
        assert torch.equal(dead, torch.zeros_like(dead)), "rows of -inf bias are not zeros"
    if extra.startswith("nan_"):
        expect_nan = extra != "nan_padded_key"
        assert bool(out.isnan().any()) == expect_nan, f"NaN in output: {bool(out.isnan().any())}"


def main(seed: int) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from helpers import assert_close_rule, attention_formula

    from fusedenc.attention.triton_short import LaunchConfig, short_attention

    return report_cases(seed, CASES, case_id, lambda case, gen: run_case(
        case, gen, short_attention, LaunchConfig, assert_close_rule, attention_formula))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
