"""BERT's embeddings of the real tokens of a padded batch, in one Triton kernel.

The short path of a patched ``BertModel`` (``fusedenc.hf.embedded``) packs the real tokens
inside its CUDA graph.  In torch that is ~15 small kernels before the first layer: the
packed row's sequence (``searchsorted`` on the offsets) and position, two gathers (ids and
token types), three embedding lookups, two sums, the LayerNorm, and the index the last
layer's rows are scattered back with.  At 32 sentences of ~25 tokens each kernel is a few
microseconds of launch latency on the GPU, ~40 us together on an H200.  This kernel does all
of it in one pass, one program per block of packed rows:

* the row's sequence is the last ``i`` with ``cu[i] <= row`` (a binary search over the
  ``[N + 1]`` offsets), clamped to ``N - 1``; its position ``row - cu[i]``;
* the id and token type are read from the padded ``[N, S]`` ids at that position (clamped
  to ``S - 1``; rows past ``cu[N]``, a graph bucket's slack, read the last sequence's row:
  the feeds keep every entry a valid id, zeros outside the call's corner);
* ``LayerNorm((word[id] + type[type]) + pos[position])`` in HF's order: the two sums rounded
  to the model's dtype, the LayerNorm's statistics in fp32 (torch's ``layer_norm``);
* the scatter index ``seq * S + position`` of each real row (``N * S`` for slack rows: the
  dropped row of ``hf_embedded``'s scatter).

BERT's positions only (the index in the sequence); RoBERTa's, which count the non-pad ids
before a token, stay in torch.  Importing this module imports Triton: ``hf_embedded`` asks
``unusable`` first.  ``TRITON_INTERPRET=1`` before the import runs it on CPU tensors
(slowly: the tests do that).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..varlen.packing import padded_rows

__all__ = ["packed_embeddings", "reference_packed_embeddings"]

#: Packed rows per program: the grid is ~T / 4 programs, each holding 4 rows of D in registers.
ROWS_PER_PROGRAM = 4


# The integers that change from batch to batch are not specialized on (Triton would compile a
# kernel for each value that is 1 or divisible by 16, and each compile takes ~0.5 s the first
# time a machine runs it): none of them sets a vector width, they only bound and index.
@triton.jit(do_not_specialize=["n_rows", "n_seq", "seq_len", "ids_stride"])
def _packed_embeddings_kernel(
    ids_ptr, types_ptr, cu_ptr, word_ptr, pos_ptr, type_ptr, gamma_ptr, beta_ptr, out_ptr, target_ptr,
    n_rows, n_seq, seq_len, last_position, eps,
    ids_stride, word_stride, pos_stride, type_stride, out_stride,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    HAS_TYPES: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n_rows
    # The last i in [0, n_seq] with cu[i] <= row: cu[0] = 0 <= row, so lo starts valid; hi is
    # one past the range.  SEARCH_STEPS halvings of n_seq + 1 candidates leave one.
    lo = tl.zeros([BLOCK_R], dtype=tl.int32)
    hi = tl.zeros([BLOCK_R], dtype=tl.int32) + (n_seq + 1)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        found = tl.load(cu_ptr + mid, mask=in_range, other=0) <= rows
        move = hi - lo > 1
        lo = tl.where(move & found, mid, lo)
        hi = tl.where(move & ~found, mid, hi)
    seq = tl.minimum(lo, n_seq - 1)
    start = tl.load(cu_ptr + seq, mask=in_range, other=0)
    position = tl.maximum(rows - start, 0)
    column = tl.minimum(position, seq_len - 1)
    flat = seq.to(tl.int64) * ids_stride + column
    token = tl.load(ids_ptr + flat, mask=in_range, other=0).to(tl.int64)
    if HAS_TYPES:
        kind = tl.load(types_ptr + flat, mask=in_range, other=0).to(tl.int64)
    else:
        kind = tl.zeros([BLOCK_R], dtype=tl.int64)
    end = tl.load(cu_ptr + n_seq)
    dropped = tl.zeros([BLOCK_R], dtype=tl.int64) + n_seq * seq_len  # the scatter's spare row
    scatter = tl.where(rows < end, seq.to(tl.int64) * seq_len + column, dropped)
    tl.store(target_ptr + rows, scatter, mask=in_range)

    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    ok = in_range[:, None] & col_ok[None, :]
    pos = tl.minimum(position, last_position).to(tl.int64)
    w = tl.load(word_ptr + token[:, None] * word_stride + cols[None, :], mask=ok, other=0.0)
    t = tl.load(type_ptr + kind[:, None] * type_stride + cols[None, :], mask=ok, other=0.0)
    p = tl.load(pos_ptr + pos[:, None] * pos_stride + cols[None, :], mask=ok, other=0.0)
    # HF's order and roundings: (words + token types) + positions, each sum in the model's dtype.
    x = ((w + t).to(w.dtype) + p).to(w.dtype).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    centered = tl.where(ok, x - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * gamma[None, :] + beta[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], y.to(w.dtype), mask=ok)


def packed_embeddings(
    ids: torch.Tensor,
    types: Optional[torch.Tensor],
    cu: torch.Tensor,
    tokens: int,
    word: torch.Tensor,
    position: torch.Tensor,
    token_type: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [tokens, D], scatter index int64 [tokens])`` of the padded ids ``[N, S]``
    (token types alike, or None: type 0) whose real tokens are each row's first
    ``cu[i + 1] - cu[i]`` (int32 offsets ``[N + 1]``); ``tokens`` rows (a bucket, at least
    ``cu[N]``).  Embedding tables ``[*, D]`` with a unit last stride, one dtype.  No host
    sync; the caller checks shapes (``hf_embedded``)."""
    n, s = ids.shape
    d = word.shape[1]
    out = torch.empty((tokens, d), dtype=word.dtype, device=word.device)
    target = torch.empty(tokens, dtype=torch.int64, device=word.device)
    if tokens == 0:
        return out, target
    ids = ids.contiguous()
    types = None if types is None else types.contiguous()
    grid = (triton.cdiv(tokens, ROWS_PER_PROGRAM),)
    _packed_embeddings_kernel[grid](
        ids, ids if types is None else types, cu, word, position, token_type, gamma, beta, out, target,
        tokens, n, s, position.shape[0] - 1, float(eps),
        ids.stride(0), word.stride(0), position.stride(0), token_type.stride(0), out.stride(0),
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_R=ROWS_PER_PROGRAM, SEARCH_STEPS=_steps(n),
        HAS_TYPES=types is not None, num_warps=_warps(d),
    )  # fmt: skip
    return out, target


#: Halvings of the offsets' binary search up to 2,047 sequences a call: one value, so one compiled
#: kernel for every batch size the graphs' buckets take (steps past the one that leaves a single
#: candidate change nothing, and cost a load of the same few cache lines).
SEARCH_STEPS = 11


def _steps(sequences: int) -> int:
    """Halvings that take ``sequences + 1`` candidates down to one: ``SEARCH_STEPS`` for every
    count up to 2,047, more only past it."""
    return max(SEARCH_STEPS, sequences.bit_length())


def _warps(d: int) -> int:
    return 4 if d <= 512 else 8


def reference_packed_embeddings(ids, types, cu, tokens, word, position, token_type, gamma, beta, eps):
    """``packed_embeddings`` in torch, as ``hf_embedded``'s torch path computes it (the same
    packing, ``varlen.padded_rows``; the same sums and LayerNorm): the tests' oracle."""
    n, s = ids.shape
    where = padded_rows(cu, tokens, n, s)
    token = ids.reshape(-1)[where.flat]
    kind = types.reshape(-1)[where.flat] if types is not None else torch.zeros_like(token)
    x = (word[token] + token_type[kind]) + position[where.position.clamp(max=position.shape[0] - 1).long()]
    return torch.nn.functional.layer_norm(x, (word.shape[1],), gamma, beta, eps), where.target
