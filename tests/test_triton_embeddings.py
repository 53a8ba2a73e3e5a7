"""fusedenc.hf.triton_embeddings' kernel (BERT's embeddings of a padded batch's real tokens,
packed) on CPU through Triton's interpreter: rows against the float32 formula by the
tolerance rule and the scatter index exactly, with empty sequences, a sequence as long as
its row, a token bucket with slack rows past the last offset, unused offsets at the end (a
graph's statics), no token types, widths that are not powers of two, and positions past
the table (clamped, as the torch path does).

As tests/test_triton_varlen.py: TRITON_INTERPRET=1 is set in a child process (this file run
as a script) that reports one JSON line per case.  Not covered here: bfloat16 and GPU code
generation (tests/test_varlen_gpu.py runs the short path on a GPU).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from interpreter_helpers import interpreter_suite, report_cases

if __name__ != "__main__" and importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

DTYPES = {"float16": torch.float16, "float32": torch.float32}
VOCAB, POSITIONS = 50, 40

#: Each case: sequence lengths, padded row length S, extra sequences (offsets ending at T),
#: extra token rows (a bucket's slack), width D, dtype, token types given.
CASES = [
    ((5, 1, 7), 8, 0, 0, 32, "float16", True),
    ((16, 0, 3, 9), 16, 0, 3, 48, "float16", True),  # an empty sequence; slack rows
    ((5, 3), 8, 3, 5, 32, "float16", False),  # unused offsets (a graph's statics), no types
    ((33, 2), 40, 0, 2, 40, "float32", True),  # a row as long as its sequence, D not a power of two
    ((30, 39, 1), 48, 1, 4, 24, "float16", True),  # positions up to 38 of a 40-row table
    ((45, 3), 48, 0, 0, 16, "float32", True),  # positions past the table: clamped to its last row
    ((1,), 8, 0, 0, 16, "float16", False),  # one sequence of one token
    ((3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0, 2, 8, 8, 4),
     12, 2, 3, 16, "float16", True),  # 39 sequences (an empty one, 2 unused): a deeper search
]


def case_id(case) -> str:
    lengths, s, extra_seq, slack, d, dtype, types = case
    return f"L{'-'.join(map(str, lengths))}-S{s}-n+{extra_seq}-t+{slack}-D{d}-{dtype}-{'types' if types else 'notypes'}"


# ------------------------------------------------------------ pytest side ----


results, test_case_under_interpreter = interpreter_suite(__file__, CASES, case_id)


def test_search_steps_are_one_value_up_to_2047_sequences_and_always_enough():
    """One compiled kernel serves every batch size a graph bucket takes (up to 2,047
    sequences); past that the halvings still reach a single candidate."""
    from fusedenc.hf import triton_embeddings

    steps = {triton_embeddings._steps(n) for n in range(1, 2048)}
    assert steps == {triton_embeddings.SEARCH_STEPS}, steps
    for n in (1, 2, 3, 1023, 1024, 2047, 2048, 4095, 4096, 100_000):
        assert 2 ** triton_embeddings._steps(n) >= n + 1, n  # n + 1 candidates halve down to one


# ------------------------------------------------------------ child side ----


def run_case(case, gen, module, assert_close_rule):
    lengths, s, extra_seq, slack, d, dtype_name, with_types = case
    dtype = DTYPES[dtype_name]
    n = len(lengths) + extra_seq
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), *[t] * extra_seq], dtype=torch.int32)
    ids = torch.randint(0, VOCAB, (n, s), generator=gen)
    types = torch.randint(0, 2, (n, s), generator=gen) if with_types else None
    word = torch.randn(VOCAB, d, generator=gen)
    position = torch.randn(POSITIONS, d, generator=gen)
    token_type = torch.randn(2, d, generator=gen)
    gamma, beta = 1 + 0.1 * torch.randn(d, generator=gen), 0.1 * torch.randn(d, generator=gen)
    tables = [x.to(dtype) for x in (word, position, token_type, gamma, beta)]
    tokens = t + slack

    empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # every element the kernel does not write shows as NaN / -1
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-1)

    torch.empty = poisoned_empty
    try:
        rows, target = module.packed_embeddings(ids, types, cu, tokens, *tables, 1e-12)
    finally:
        torch.empty = empty

    assert rows.shape == (tokens, d) and rows.dtype == dtype, f"rows {tuple(rows.shape)} {rows.dtype}"
    ref_rows, ref_target = module.reference_packed_embeddings(
        ids, types, cu, tokens, *[x.float() for x in tables], 1e-12)  # fmt: skip
    same_rows, _ = module.reference_packed_embeddings(ids, types, cu, tokens, *tables, 1e-12)
    assert torch.equal(target, ref_target), f"scatter index {target.tolist()} != {ref_target.tolist()}"
    assert bool((target[t:] == n * s).all()), "a slack row is scattered somewhere"
    real = target[:t]
    assert len(set(real.tolist())) == t and bool((real < n * s).all()), "real rows: one padded position each"
    assert bool(torch.isfinite(rows).all()), "every row written, slack rows too (they flow through the layers)"
    # The padded position each real row came from holds the id it was embedded from.
    sequence = real // s
    assert torch.equal(ids.reshape(-1)[real], ids[sequence, real % s])
    assert_close_rule(rows, ref_rows, same_rows.to(dtype), dtype, "vs formula")


def main(seed: int) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from helpers import assert_close_rule

    from fusedenc.hf import triton_embeddings

    return report_cases(seed, CASES, case_id, lambda case, gen: run_case(case, gen, triton_embeddings,
                                                                         assert_close_rule))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
