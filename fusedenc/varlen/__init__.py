"""Padding-free batches: packing (cu_seqlens), pack / unpack, pooling (packing.py), and the
packed-row calls of blocks and stacks, ``forward_packed`` / ``forward_unpadded`` (calls.py)."""

from .packing import (
    Packing,
    PaddedRows,
    check_packed_rows,
    cu_seqlens_from_lengths,
    masked_mean_pool,
    mean_pool,
    pack,
    packing_from_host,
    packing_from_lengths,
    packing_from_mask,
    padded_rows,
    real_tokens_first,
    unpack,
)

__all__ = [
    "Packing",
    "PaddedRows",
    "check_packed_rows",
    "cu_seqlens_from_lengths",
    "masked_mean_pool",
    "mean_pool",
    "pack",
    "packing_from_host",
    "packing_from_lengths",
    "padded_rows",
    "packing_from_mask",
    "real_tokens_first",
    "unpack",
]
