"""The padding-free entry points of ``EncoderBlock`` and ``EncoderStack`` (a mixin of both).

``forward_packed(rows, cu_seqlens)`` runs on packed rows (no padding in, none out);
``forward_unpadded(x, key_padding_mask | lengths)`` packs a padded batch, runs, and unpacks
(padding positions zero).  Both hand the module's own data path (``_eager_rows``) a
``VarlenPlan`` where a padded call passes its key padding mask: every path of a block and a
stack (plain, LayerNorm-folded, FP8) then runs on the packed rows unchanged, and only the
attention differs (``fusedenc.attention.varlen``).

Both are plain calls with automatic CUDA graphs on a GPU (``fusedenc.graphs.auto``, the
module's own cache, ``module.auto_graphs``): a packed call is keyed by the buckets of its
token count, sequence count and ``max_seqlen`` (``graph_feeds.PackedFeed``), whose static
``cu_seqlens`` ends in empty sequences.  Neither varlen attention backend reads the offsets
on the host (``flash_varlen`` sizes its grid by ``max_seqlen``, ``padded`` its layout), so
both replay.  ``varlen_graph_runner`` is the explicit runner (views of static buffers, no
copy out; ``fusedenc.graphs.varlen``).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from .. import core
from ..attention import VarlenPlan
from ..attention.varlen import BACKEND_ENV
from ..common.torch_modules import inference_only, runs_eagerly_when_compiled
from ..graphs import auto as auto_graphs
from ..graphs.feeds import PackedFeed
from ..graphs.varlen import VarlenGraphRunner
from . import packing as varlen

__all__ = ["PaddingFreeCalls"]


def _native_active(device: torch.device) -> bool:
    """Whether the native core runs on ``device``: where automatic graphs apply (a test seam)."""
    return core.active_on(device)


def _first_block(module):
    blocks = getattr(module, "blocks", None)
    return module if blocks is None else blocks[0]


class PaddingFreeCalls:
    """Mixed into EncoderBlock and EncoderStack (which provide ``_eager_rows`` and ``batch_first``)."""

    def _packed_input(self, rows) -> torch.Tensor:
        """Packed rows checked against the parameters: ``[T, D]`` in their dtype, on their device."""
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
        p = _first_block(self).qkv_weight
        if rows.dim() != 2 or rows.shape[1] != p.shape[1]:
            raise ValueError(f"packed rows must be [T, {p.shape[1]}], got shape {tuple(rows.shape)}")
        if rows.dtype != p.dtype or rows.device != p.device:
            raise TypeError(f"rows are {rows.dtype} on {rows.device}; the parameters {p.dtype} on {p.device}")
        return rows.contiguous()

    def _prepared_varlen(self, x2, plan: VarlenPlan, executor):
        """A block's ``_prepared`` for packed rows.  The operands are validated as a padded call
        of one row (the GEMMs and LayerNorms see the same dense ``[T, D]`` rows either way, and
        that signature stays cached whatever T is); the offsets were checked when the plan
        was made.  Returns (executor, the plan with its backend chosen), None without rows."""
        if not x2.is_contiguous():
            raise ValueError("packed rows must be a contiguous [T, D] tensor")
        prepared = self._prepared(x2[:1], 1, 1, None, None, executor)
        if prepared is None:
            return None
        return prepared[0], plan.choose(x2.dtype, self.head_dim, x2.device)

    @runs_eagerly_when_compiled  # reads the offsets on the host: runs eagerly inside a compiled caller
    @inference_only
    def forward_packed(self, rows: torch.Tensor, cu_seqlens, max_seqlen: Optional[int] = None) -> torch.Tensor:
        """The module on packed rows, no padding: ``rows`` ``[T, D]`` with sequence i at rows
        ``cu_seqlens[i]:cu_seqlens[i + 1]`` (int32 ``[N + 1]`` on the rows' device, ending at T;
        checked on the host, one sync) or a ``fusedenc.varlen.packing.Packing`` (checked when made);
        ``max_seqlen``: the longest sequence, or a bound on it (found when None).  Returns a
        new ``[T, D]`` tensor.  On a GPU, repeated calls replay CUDA graphs (module docstring)."""
        rows = self._packed_input(rows)
        if isinstance(cu_seqlens, varlen.Packing):
            if rows.shape[0] != cu_seqlens.total:
                raise ValueError(f"rows has {rows.shape[0]} rows but the packing {cu_seqlens.total} tokens")
            return self._packed_call(rows, cu_seqlens.cu_seqlens, cu_seqlens.max_seqlen)
        return self._packed_call(rows, cu_seqlens, varlen.check_packed_rows(rows, cu_seqlens, max_seqlen))

    def _packed_call(self, rows: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """Checked packed rows through the module's automatic graphs, else eagerly."""
        # The forced varlen backend is read when a graph is captured: a graph per setting.
        key = ("packed", os.environ.get(BACKEND_ENV))
        native = _native_active(rows.device) and not auto_graphs.observing(self)  # FP8 calibration: eager
        return auto_graphs.call(self, self._packed_rows, (rows, cu_seqlens, max_seqlen), key=key, native=native,
                                feed=PackedFeed.of)  # fmt: skip

    def _packed_rows(self, rows: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """The module's data path on packed rows: eagerly on the call's own, or captured on a
        bucket's static rows and offsets with the bucket's ``max_seqlen`` (a bound)."""
        return self._eager_rows(rows, 1, rows.shape[0], None, VarlenPlan(cu_seqlens, max_seqlen))

    @runs_eagerly_when_compiled
    @inference_only
    def forward_unpadded(self, x: torch.Tensor, key_padding_mask=None, *, lengths=None) -> torch.Tensor:
        """``forward(x, key_padding_mask=...)`` computed on the real tokens only: one gather,
        the module on the ``[T_real, D]`` rows, one scatter.  ``x`` padded ``[B, S, D]``
        (``[S, B, D]`` when not batch_first); ``key_padding_mask`` bool ``[B, S]`` (True =
        padding, any pattern) or ``lengths`` (right padding, each at most S).  Padding
        positions of the result are zero (``forward`` computes values there)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"x must be a padded [B, S, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        if (key_padding_mask is None) == (lengths is None):
            raise ValueError("pass exactly one of key_padding_mask and lengths")
        xb = x if self.batch_first else x.transpose(0, 1)
        batch, seq = xb.shape[0], xb.shape[1]
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != (batch, seq):
                got = getattr(key_padding_mask, "shape", type(key_padding_mask).__name__)
                raise ValueError(f"key_padding_mask must be bool [B, S] = [{batch}, {seq}], got {got}")
            packing = varlen.packing_from_mask(key_padding_mask, device=x.device)
        else:
            packing = varlen.packing_from_lengths(lengths, seq, device=x.device)
        rows = self._packed_input(varlen.pack(xb, packing))
        out = varlen.unpack(self._packed_call(rows, packing.cu_seqlens, packing.max_seqlen), packing)
        return out if self.batch_first else out.transpose(0, 1)

    def varlen_graph_runner(
        self, token_buckets: Optional[Sequence[int]] = None, *, max_sequences: int, max_seqlen: int
    ) -> VarlenGraphRunner:
        """A CUDA-graph runner over packed rows (stacks): one graph per token-count bucket, for
        up to ``max_sequences`` sequences of up to ``max_seqlen`` tokens (``fusedenc.VarlenGraphRunner``)."""
        return VarlenGraphRunner(self, token_buckets, max_sequences=max_sequences, max_seqlen=max_seqlen)
