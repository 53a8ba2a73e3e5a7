"""Padding-free batches: the real tokens of a padded batch packed into one ``[T, D]`` row buffer.

A batch of sentences padded to its longest is mostly padding on real text (the Python
docs' sentences at batch 128: about 70%), and every GEMM, LayerNorm and activation of a
padded encoder computes those rows.  ``Packing`` says where the real tokens are: one
gather (``pack``) makes the ``[T_real, D]`` rows every op of the stack then runs on, the
attention sees the sequences through ``cu_seqlens`` offsets
(``fusedenc.attention.varlen``), and one scatter (``unpack``) restores the padded shape,
padding positions zero.  ``mean_pool`` pools sentence embeddings straight from the
packed rows, for callers that never need the padded shape.

Masks need not be prefix masks: a sequence's real tokens are packed in position order
wherever they sit (left padding, holes), which is what attention over those keys computes
(attention itself does not see positions; they are already in the embeddings).

The layout follows flash-attention's ``bert_padding.py`` (``unpad_input``/``pad_input``).
Building a ``Packing`` reads the mask on the host once (one sync: one device-to-host copy
of the mask; ``packing_from_host`` takes a mask already read): the row count and the
longest sequence size the buffers and the attention grid.  The host work is numpy on the
mask, and the indices and offsets go to the device in one copy (views of one buffer).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from ..attention.varlen import VarlenPlan, check_offsets

__all__ = [
    "Packing",
    "PaddedRows",
    "check_packed_rows",
    "cu_seqlens_from_lengths",
    "masked_mean_pool",
    "masked_pool",
    "mean_pool",
    "pack",
    "packing_from_host",
    "packing_from_lengths",
    "padded_rows",
    "packing_from_mask",
    "real_tokens_first",
    "unpack",
]


class Packing:
    """Where the real tokens of a ``[B, S]`` padded batch sit among the packed rows.

    ``lengths``: real tokens per sequence (host ints); ``total``: their sum T;
    ``max_seqlen``: the longest; ``indices``: int64 ``[T]`` on the device, the flat
    position ``b * S + s`` of each packed row, sequence by sequence, in position order;
    ``cu_seqlens``: int32 ``[B + 1]`` on the device (from a mask: both views of one
    buffer, contiguous); ``prefix``: every sequence's real tokens
    come first (right padding); ``first_real``: every sequence's position 0 is a real token.
    """

    __slots__ = ("batch", "seq", "lengths", "total", "max_seqlen", "indices", "cu_seqlens", "prefix", "first_real",
                 "_seq_ids")  # fmt: skip

    def __init__(self, batch, seq, lengths, indices, cu_seqlens, prefix, first_real):
        self.batch, self.seq = batch, seq
        self.lengths = tuple(lengths)
        self.total = sum(self.lengths)
        self.max_seqlen = max(self.lengths, default=0)
        self.indices, self.cu_seqlens = indices, cu_seqlens
        self.prefix, self.first_real = prefix, first_real
        self._seq_ids = None

    @property
    def has_padding(self) -> bool:
        return self.total < self.batch * self.seq

    def attention(self, backend: Optional[str] = None) -> VarlenPlan:
        """The attention plan of these sequences (what ``EncoderStack.forward_packed`` runs)."""
        return VarlenPlan(self.cu_seqlens, self.max_seqlen, backend)

    def seq_ids(self) -> torch.Tensor:
        """int64 ``[T]``: the sequence of each packed row (made once, on the device)."""
        if self._seq_ids is None:
            self._seq_ids = torch.div(self.indices, max(self.seq, 1), rounding_mode="floor")
        return self._seq_ids

    def __repr__(self) -> str:
        return (f"Packing(batch={self.batch}, seq={self.seq}, total={self.total}, max_seqlen={self.max_seqlen}, "
                f"prefix={self.prefix})")  # fmt: skip


_CPU = torch.device("cpu")


def _device_of(device, default: torch.device) -> torch.device:
    return default if device is None else torch.device(device)


def cu_seqlens_from_lengths(lengths: Sequence[int], device=None) -> torch.Tensor:
    """int32 ``[N + 1]``: 0 and the running sums of ``lengths``."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def packing_from_mask(key_padding_mask: torch.Tensor, *, device=None) -> Packing:
    """The packing of a bool ``[B, S]`` mask, True = padding (``nn.TransformerEncoder``'s
    ``src_key_padding_mask``; a Hugging Face ``attention_mask`` is its negation).  Any
    pattern is accepted: left padding, holes, and sequences that are all padding (length 0:
    no rows, zeros after ``unpack``).  One host sync (the mask is read on the host)."""
    if not isinstance(key_padding_mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(key_padding_mask).__name__}")
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = padding), got {key_padding_mask.dtype}")
    if key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be [B, S], got shape {tuple(key_padding_mask.shape)}")
    device = _device_of(device, key_padding_mask.device)
    return packing_from_host(key_padding_mask.cpu().numpy(), device=device)  # the one sync: one D2H copy


def packing_from_host(padding: np.ndarray, *, device=None) -> Packing:
    """``packing_from_mask`` of a mask already on the host: a numpy bool ``[B, S]`` array,
    True = padding (not kept: read only).  No sync; one host-to-device copy, to ``device``
    (the CPU by default): the indices and the offsets share one buffer."""
    if not isinstance(padding, np.ndarray) or padding.dtype != np.bool_ or padding.ndim != 2:
        got = f"{padding.dtype} {padding.shape}" if isinstance(padding, np.ndarray) else type(padding).__name__
        raise TypeError(f"padding must be a numpy bool [B, S] array (True = padding), got {got}")
    real = ~padding  # a new contiguous array
    b, s = real.shape
    flat = real.ravel().nonzero()[0]  # b * S + s of each real token, in order
    total = flat.shape[0]
    # int64 [T] indices, then int32 [B + 1] offsets in the int64 words after them: one copy.
    buf = np.empty(total + (b + 2) // 2, dtype=np.int64)
    buf[:total] = flat
    cu = buf[total:].view(np.int32)[: b + 1]
    cu[:] = flat.searchsorted(np.arange(0, (b + 1) * s, s)) if s > 0 else 0
    offsets = cu.tolist()
    lengths = [hi - lo for lo, hi in zip(offsets, offsets[1:])]
    prefix = real_tokens_first(real)
    first_real = bool(real[:, 0].all()) if s > 0 else b == 0
    both = torch.from_numpy(buf).to(_device_of(device, _CPU))
    indices = both[:total]
    cu_seqlens = both.view(torch.int32)[2 * total : 2 * total + b + 1]
    return Packing(b, s, lengths, indices, cu_seqlens, bool(prefix), first_real)


def real_tokens_first(real: np.ndarray) -> bool:
    """Whether every row of numpy bool ``real`` ``[B, S]`` (True = a real token) has its real
    tokens first (right padding, or none): no real token follows a padding position."""
    return real.shape[1] < 2 or not (real[:, 1:] > real[:, :-1]).any()


class PaddedRows(NamedTuple):
    """Where each of ``tokens`` packed rows comes from in a padded ``[N, S]`` batch whose
    sequences are each row's first ``cu[i + 1] - cu[i]`` entries (``padded_rows``)."""

    flat: torch.Tensor  # int64 [tokens]: the row's index in the flattened [N * S] batch
    position: torch.Tensor  # int32 [tokens]: its index in its sequence
    start: torch.Tensor  # int32 [tokens]: its sequence's first packed row
    target: torch.Tensor  # int64 [tokens]: flat for a real row, N * S (one past) for a slack row


def padded_rows(cu: torch.Tensor, tokens: int, batch: int, seq: int) -> PaddedRows:
    """The packing of a padded batch computed on its device from the int32 offsets ``cu``
    ``[N + 1]`` (no host sync): row ``r`` belongs to the last sequence starting at or before
    it.  Rows past ``cu[N]`` (a graph bucket's slack) get clamped indices (the last sequence,
    its last column): they read an entry of the last row (a valid id: the feeds see to it)
    and scatter to ``target`` N * S."""
    index = torch.arange(tokens, dtype=torch.int32, device=cu.device)
    sequence = (torch.searchsorted(cu, index, right=True) - 1).clamp_(0, batch - 1)
    start = cu[sequence]
    position = (index - start).clamp_(min=0)
    flat = (sequence * seq + position.clamp(max=seq - 1)).long()
    return PaddedRows(flat, position, start, torch.where(index < cu[-1], flat, batch * seq))


def packing_from_lengths(lengths: Union[Sequence[int], torch.Tensor], seq_len: int, *, device=None) -> Packing:
    """The packing of right-padded sequences of these ``lengths`` in a ``[B, seq_len]`` batch
    (each ``0 <= length <= seq_len``; ``ValueError`` naming the first that is not)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(f"lengths must be a 1-D integer tensor, got {lengths.dtype} {tuple(lengths.shape)}")
        lengths = lengths.tolist()
    lengths = list(lengths)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"lengths[{i}] must be an int, got {n!r}")
        if not 0 <= n <= seq_len:
            raise ValueError(f"lengths[{i}]={n} is outside [0, seq_len={seq_len}] (the padded length of the batch)")
    device = torch.device("cpu") if device is None else torch.device(device)
    index = [b * seq_len + s for b, n in enumerate(lengths) for s in range(n)]
    indices = torch.tensor(index, dtype=torch.int64, device=device)
    first_real = all(n > 0 for n in lengths)
    return Packing(len(lengths), seq_len, lengths, indices, cu_seqlens_from_lengths(lengths, device), True, first_real)


def _check_padded(x: torch.Tensor, packing: Packing, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(packing, Packing):
        raise TypeError(f"packing must be a fusedenc.varlen.Packing, got {type(packing).__name__}")
    if x.dim() != 3 or tuple(x.shape[:2]) != (packing.batch, packing.seq):
        raise ValueError(f"{name} must be [B, S, D] = [{packing.batch}, {packing.seq}, D], got {tuple(x.shape)}")
    if x.device != packing.indices.device:
        raise ValueError(f"{name} is on {x.device} but the packing on {packing.indices.device}")


def pack(x: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The real tokens of padded ``x`` ``[B, S, D]`` as contiguous ``[T, D]`` rows (one gather)."""
    _check_padded(x, packing, "x")
    return x.reshape(-1, x.shape[-1]).index_select(0, packing.indices)


def unpack(rows: torch.Tensor, packing: Packing, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed ``rows`` ``[T, D]`` back in the padded ``[B, S, D]`` shape, padding positions
    zero (one scatter; ``out``: a buffer to write, whose padding positions are zeroed)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[0] != packing.total:
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"rows must be [T, D] with T = {packing.total} (the packing's tokens), got {shape}")
    d = rows.shape[1]
    if out is None:
        out = rows.new_zeros((packing.batch, packing.seq, d))
    else:
        _check_padded(out, packing, "out")
        out.zero_()
    out.view(-1, d).index_copy_(0, packing.indices, rows)
    return out


def mean_pool(rows: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Float32 ``[B, D]``: each sequence's mean over its packed rows (sentence-transformers'
    mean pooling, without the padded shape); a sequence of no tokens gives zeros."""
    if rows.dim() != 2 or rows.shape[0] != packing.total:
        raise ValueError(f"rows must be [T, D] with T = {packing.total}, got {tuple(rows.shape)}")
    acc = torch.zeros((packing.batch, rows.shape[1]), dtype=torch.float32, device=rows.device)
    acc.index_add_(0, packing.seq_ids(), rows.float())
    counts = torch.tensor(packing.lengths, dtype=torch.float32).clamp(min=1e-9).to(rows.device)
    return acc / counts[:, None]


def masked_mean_pool(hidden: torch.Tensor, mask: Optional[torch.Tensor],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, D]`` in ``dtype``: each sequence's mean of padded ``hidden`` ``[B, S, D]`` over the
    positions ``mask`` ``[B, S]`` keeps (HF's, 1 = real token; None: every position), as
    sentence-transformers pools (its 1e-9 clamp: a sequence of no tokens gives zeros).
    ``mean_pool`` is the same mean from packed rows."""
    keep = (torch.ones(hidden.shape[:2], device=hidden.device) if mask is None else mask.to(hidden.device))
    keep = keep.unsqueeze(-1).to(dtype)
    return (hidden.to(dtype) * keep).sum(1) / keep.sum(1).clamp(min=1e-9)


def masked_pool(hidden: torch.Tensor, mask: Optional[torch.Tensor], mode: str) -> torch.Tensor:
    """``[B, D]`` float32: padded ``hidden`` ``[B, S, D]`` pooled over the positions ``mask``
    keeps (HF's, 1 = real token; None: every position) as sentence-transformers' ``Pooling``
    modes do: ``mean`` (``masked_mean_pool``), ``cls`` (the first position), ``max`` (the
    element-wise max over real tokens; a sequence of none gives -inf), ``mean_sqrt_len_tokens``
    (their sum over the square root of their count).  ``ValueError`` for another mode."""
    if mode == "mean":
        return masked_mean_pool(hidden, mask)
    if mode == "cls":
        return hidden[:, 0].float()
    keep = torch.ones(hidden.shape[:2], device=hidden.device) if mask is None else mask.to(hidden.device)
    keep = keep.unsqueeze(-1).float()
    if mode == "max":
        return hidden.float().masked_fill(keep == 0, float("-inf")).amax(1)
    if mode == "mean_sqrt_len_tokens":
        return (hidden.float() * keep).sum(1) / keep.sum(1).clamp(min=1e-9).sqrt()
    raise ValueError(f"pooling mode {mode!r}: one of mean, cls, max, mean_sqrt_len_tokens")


def check_packed_rows(rows: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: Optional[int]) -> int:
    """Checks packed ``rows`` and their int32 ``cu_seqlens`` on the host (one sync); returns
    ``max_seqlen`` (the longest sequence when None was given).  ``ValueError`` naming the fault."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        got = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [N + 1], got {got}")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens needs at least two entries (one sequence)")
    if cu_seqlens.device != rows.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the rows on {rows.device}")
    cu = cu_seqlens.tolist()
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    if max_seqlen is None:
        max_seqlen = max(longest, 0)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise ValueError(f"max_seqlen must be an int or None, got {max_seqlen!r}")
    check_offsets(cu, rows.shape[0], max_seqlen)
    if cu[-1] != rows.shape[0]:
        raise ValueError(f"cu_seqlens[-1]={cu[-1]} must equal the number of rows, {rows.shape[0]}")
    return max_seqlen
