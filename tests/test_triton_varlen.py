"""fusedenc.attention.triton_short's kernel on packed variable-length sequences
(``short_varlen_attention``, the ``triton_short`` varlen backend) on CPU through Triton's
interpreter: against the per-sequence formula in float64/float32, with empty sequences,
a ``max_seqlen`` bound above the longest sequence (a graph bucket's), several query blocks
per sequence, heads that do not divide the table's heads per program, q/k/v as separate
tensors with their own strides, NaN, and slack rows past the last offset left unwritten.

As tests/test_triton_attention.py: TRITON_INTERPRET=1 is set in a child process (this file
run as a script) that reports one JSON line per case.  Not covered here: bfloat16 and GPU
code generation (tests/test_varlen_gpu.py runs the backend on a GPU).
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
SLACK = 3  # rows past the last offset: a graph bucket's, never written

#: Each case: sequence lengths, max_seqlen bound (0: the longest), heads, head dim, dtype, extra.
#: extra: none | config=<block_m>,<warps>,<heads per program> | separate | nan_q | nan_k
CASES = [
    ((5, 1, 7), 0, 2, 16, "float16", "none"),
    ((16, 0, 3, 9), 0, 4, 32, "float16", "none"),  # an empty sequence
    ((5, 3), 40, 2, 32, "float16", "none"),  # the bound of a bucket, above every sequence
    ((33, 64, 2), 0, 2, 64, "float32", "none"),
    ((33, 64, 2), 0, 2, 32, "float16", "config=16,4,2"),  # four query blocks a sequence, two heads a program
    ((128, 5), 0, 2, 32, "float16", "none"),  # the longest served
    ((20, 3, 11), 0, 3, 16, "float16", "none"),  # H = 3: the table's heads per program become 1
    ((7, 7), 0, 2, 32, "float16", "separate"),
    ((9, 4), 0, 2, 16, "float16", "nan_q"),
    ((9, 4), 0, 2, 16, "float16", "nan_k"),
    ((), 8, 2, 16, "float16", "none"),  # no sequence: nothing written
]


def case_id(case) -> str:
    lengths, bound, h, d, dtype, extra = case
    return f"L{'-'.join(map(str, lengths)) or 'none'}-max{bound}-H{h}-Dh{d}-{dtype}-{extra}"


# ------------------------------------------------------------ pytest side ----


results, test_case_under_interpreter = interpreter_suite(__file__, CASES, case_id)


# ------------------------------------------------------------ child side ----


def run_case(case, gen, short_varlen_attention, LaunchConfig, assert_close_rule, reference):
    lengths, bound, h, d, dtype_name, extra = case
    dtype = DTYPES[dtype_name]
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    max_seqlen = bound or max(lengths)
    rows = t + SLACK
    if extra == "separate":  # three tensors with three different stride patterns
        q = torch.randn(h, rows, d, generator=gen).to(dtype).transpose(0, 1)
        k = torch.randn(rows, h, d, generator=gen).to(dtype)
        v = torch.randn(rows, 2 * h, d, generator=gen).to(dtype)[:, ::2]
    else:  # views of one [T, 3, H, Dh] QKV buffer, what the fused QKV GEMM gives
        q, k, v = torch.randn(rows, 3, h, d, generator=gen).to(dtype).unbind(1)
    if extra == "nan_q":
        q[2, 1, 3] = float("nan")  # row 2 of sequence 0, head 1
    if extra == "nan_k":
        k[lengths[0], 0, 5] = float("nan")  # the first key of sequence 1: all of its head 0
    scale = 1.0 / math.sqrt(d)
    config = LaunchConfig(*map(int, extra.split("=")[1].split(","))) if extra.startswith("config=") else None

    empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # every element the kernel does not write shows as NaN
        return empty(*args, **kwargs).fill_(float("nan"))

    torch.empty = poisoned_empty
    try:
        out = short_varlen_attention(q, k, v, cu, max_seqlen, scale, config=config)
    finally:
        torch.empty = empty

    assert out.shape == (rows, h * d) and out.dtype == dtype, f"shape {tuple(out.shape)}, dtype {out.dtype}"
    assert out.stride() == (h * d, 1), f"not dense [T, H*Dh] rows: strides {out.stride()}"
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    ref = reference(q.to(ref_dtype), k.to(ref_dtype), v.to(ref_dtype), cu, scale)
    same = reference(q, k, v, cu, scale).to(dtype)  # float32 math on the rounded inputs, rounded: dtype's error
    assert_close_rule(out[:t], ref[:t], same[:t], dtype, "vs formula")
    assert bool(out[t:].isnan().all()), "a slack row past the last offset was written"
    if extra == "nan_q":
        got = out[:t].view(t, h, d).isnan()
        assert bool(got[2, 1].all()) and int(got.sum()) == d, "NaN in one query reaches only its own row"
    if extra == "nan_k":
        got = out[:t].view(t, h, d).isnan()
        seq1 = slice(lengths[0], lengths[0] + lengths[1])
        assert bool(got[seq1, 0].all()) and int(got.sum()) == lengths[1] * d, "NaN key: its sequence's head only"


def reference(q, k, v, cu, scale):
    """fusedenc's oracle (float32 math), or the same loop in float64 for float64 inputs."""
    from fusedenc.attention import reference_varlen_attention

    if q.dtype != torch.float64:
        return reference_varlen_attention(q, k, v, cu, scale)
    t, h, d = q.shape
    out = torch.zeros((t, h, d), dtype=torch.float64)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
            out[a:b] = (torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1) @ vs).transpose(0, 1)
    return out.view(t, h * d)


def main(seed: int) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from helpers import assert_close_rule

    from fusedenc.attention.triton_short import LaunchConfig, short_varlen_attention

    return report_cases(seed, CASES, case_id, lambda case, gen: run_case(
        case, gen, short_varlen_attention, LaunchConfig, assert_close_rule, reference))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
