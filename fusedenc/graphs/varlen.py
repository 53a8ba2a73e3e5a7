"""CUDA graphs of a stack's padding-free forward, one per token-count bucket (``VarlenGraphRunner``).

A padded graph runner buckets the batch size; packed rows have no batch size, only a
token count T that changes with every batch of real sentences.  So the graphs are keyed
by T: a call with T rows replays the graph of the smallest bucket ``>= T``.  What else
varies is data in static buffers: the rows, and ``cu_seqlens`` (capacity ``max_sequences``;
unused entries repeat T, i.e. empty sequences).  The attention kernel's grid is sized by
``max_seqlen`` at capture, a fixed upper bound: CTAs past a sequence's end exit at once.
Rows between T and the bucket belong to no sequence; every op but attention is row-wise,
so they never touch the real rows.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from ..attention.varlen import check_offsets
from .runner import BucketedGraphs

__all__ = ["VarlenGraphRunner", "default_token_buckets"]


def default_token_buckets(max_tokens: int, smallest: int = 64, step: float = 2 ** 0.25, multiple: int = 64) -> tuple[int, ...]:
    """Buckets from ``smallest`` to ``max_tokens``, each about ``step`` times the last, rounded
    up to a multiple of ``multiple`` rows: at most ~19% of a replay is slack (about 9% on
    average) for about four graphs per doubling."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    out, t = [], float(smallest)
    while True:
        b = int(math.ceil(t / multiple) * multiple)
        if b >= max_tokens:
            out.append(int(math.ceil(max_tokens / multiple) * multiple))
            break
        if not out or b > out[-1]:
            out.append(b)
        t *= step
    return tuple(sorted(set(out)))


class VarlenGraphRunner(BucketedGraphs):
    """Replays one CUDA graph of ``stack.forward_packed`` per token-count bucket.

    ``runner(rows, cu_seqlens)``: ``rows`` ``[T, D]`` in the stack's dtype on its GPU,
    ``cu_seqlens`` the offsets of its N <= ``max_sequences`` sequences (a list of ints, or
    an int32 tensor: on the CPU it costs no sync), none longer than ``max_seqlen``.
    Returns ``[T, D]``: a view into the bucket's static output, valid until the next call
    (``.clone()`` to keep it).  T beyond the largest bucket or more sequences than
    ``max_sequences`` run eagerly (a new tensor).  Graphs are captured on first use of a
    bucket (``capture_all()`` does it up front) and share one memory pool.  Not
    thread-safe: one runner per thread.

    The machinery is ``BucketedGraphs``' with token counts for batch sizes (its
    ``batch_sizes`` are ``token_buckets``); a bucket's static inputs are ``(rows,
    cu_seqlens)``, the latter of ``max_sequences + 1`` entries whatever the bucket.
    """

    def __init__(self, stack: nn.Module, token_buckets: Optional[Sequence[int]] = None, *, max_sequences: int,
                 max_seqlen: int):  # fmt: skip
        blocks = getattr(stack, "blocks", None) if isinstance(stack, nn.Module) else None
        if not blocks or not hasattr(stack, "forward_packed"):
            raise TypeError(f"stack must be an EncoderStack, got {type(stack).__name__}")
        p = blocks[0].qkv_weight
        if p.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the stack on a GPU; its parameters are on {p.device}")
        for name, value in (("max_sequences", max_sequences), ("max_seqlen", max_seqlen)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        buckets = default_token_buckets(max_sequences * max_seqlen) if token_buckets is None else token_buckets

        def run(rows: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
            # The data path on packed rows, not forward_packed: the offsets are data here, never
            # read on the host, and this runner holds the graphs itself.
            return stack._packed_rows(rows, cu, max_seqlen)

        super().__init__(run, buckets, p.device, name="token_buckets")
        self.stack = stack
        self.max_sequences, self.max_seqlen = max_sequences, max_seqlen
        self.dtype, self._d = p.dtype, blocks[0].d_model

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """The buckets' token counts, ascending."""
        return self.batch_sizes

    def _static_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.zeros((bucket, self._d), dtype=self.dtype, device=self.device)
        cu = torch.zeros(self.max_sequences + 1, dtype=torch.int32, device=self.device)
        return rows, cu

    def _offsets(self, rows: torch.Tensor, cu_seqlens: Union[Sequence[int], torch.Tensor]) -> list[int]:
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        if rows.dim() != 2 or rows.shape[1] != self._d:
            raise ValueError(f"rows must be [T, {self._d}], got {tuple(rows.shape)}")
        if rows.dtype != self.dtype or rows.device != self.device:
            raise TypeError(f"rows are {rows.dtype} on {rows.device}; the runner takes {self.dtype} on {self.device}")
        if isinstance(cu_seqlens, torch.Tensor):
            if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                                 f"{tuple(cu_seqlens.shape)}")  # fmt: skip
            cu = cu_seqlens.tolist()
        else:
            cu = [int(c) for c in cu_seqlens]
        if len(cu) < 2:
            raise ValueError("cu_seqlens needs at least two entries (one sequence)")
        check_offsets(cu, rows.shape[0], self.max_seqlen)
        if cu[-1] != rows.shape[0]:
            raise ValueError(f"cu_seqlens[-1]={cu[-1]} must equal the number of rows, {rows.shape[0]}")
        return cu

    def __call__(self, rows: torch.Tensor, cu_seqlens: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
        cu = self._offsets(rows, cu_seqlens)
        t = rows.shape[0]
        if t == 0:
            return rows.new_empty((0, self._d))
        if t > self.token_buckets[-1] or len(cu) - 1 > self.max_sequences:
            device_cu = torch.tensor(cu, dtype=torch.int32).to(self.device)
            return self.stack.forward_packed(rows, device_cu, self.max_seqlen)
        # Not BucketedGraphs._dispatch: cu_seqlens is no batch-first input (one size for every bucket).
        g = self._graph(t)
        static_rows, static_cu = g.inputs
        full = cu + [t] * (self.max_sequences + 1 - len(cu))  # unused entries: empty sequences
        static_cu.copy_(torch.tensor(full, dtype=torch.int32), non_blocking=False)
        static_rows[:t].copy_(rows)
        g.graph.replay()
        return g.out[:t]
