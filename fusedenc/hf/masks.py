"""Hugging Face's attention masks as fusedenc's attention takes them: the forms the BERT-family
layers receive (none, an additive bias, a boolean mask, per-key or per-query-and-key,
broadcast or materialized) turned into an attention bias or a key padding mask
(``convert_mask``), and the cache the layers of one encoder share so that one call's mask
is converted (and read on the host) once, not once a layer (``MaskCache``)."""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import numpy as np
import torch

from . import varlen as hf_varlen

__all__ = ["SUPPORTED_ATTN_IMPLEMENTATIONS", "MaskCache", "convert_mask"]

#: The attention implementations whose masks the adapter understands (checked and
#: tested).  The patched layers run fusedenc's attention whichever is selected;
#: the choice only decides the mask format HF hands them.
SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def _bias_from(mask: torch.Tensor, heads: int, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """An additive ``[B or 1, H, S, S]`` bias (a broadcast view) from a 4-D mask."""
    if mask.dtype == torch.bool:  # True = attend (the torch SDPA convention)
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    elif mask.dtype not in (dtype, torch.float32):  # the two bias dtypes fusedenc.attention takes
        mask = mask.to(dtype)
    return mask.expand(mask.shape[0], heads, seq, seq)


def convert_mask(
    mask: Optional[torch.Tensor], batch: int, seq: int, heads: int, dtype: torch.dtype, *, inspect_values: bool = True
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """HF's layer attention mask -> fusedenc's ``(attn_bias, key_padding_mask)``.

    Accepted forms (what transformers 4.4x-5.x hand a BertLayer):

    * ``None``: no masking.
    * ``[B, S]`` (flash-attention style): 1/True = token, 0/False = padding.
    * bool ``[B or 1, 1 or H, 1 or S, S]``: True = attend (5.x "sdpa").
    * float ``[B or 1, 1 or H, 1 or S, S]``: added to the scores, ``finfo.min``
      at padding (4.x "eager" ``[B, 1, 1, S]``, 4.x "sdpa" and 5.x "eager"
      ``[B, 1, S, S]``).

    A mask that is one value per (sequence, key), the same for every head and
    query, becomes ``key_padding_mask`` (the fast path: no ``[B, H, S, S]``
    tensor).  Broadcast dimensions show that from the strides; HF's
    ``[B, 1, S, S]`` masks are materialized, so their values are checked, one
    host sync per mask (the layers of one forward share the result, see
    ``MaskCache``).  A float mask qualifies if it holds only 0 and
    ``finfo.min``/-inf and no sequence is all padding (HF averages over every
    key there; key padding would give zeros).  Anything else becomes an
    additive ``attn_bias``, as is ``inspect_values=False`` (no sync: under
    ``torch.compile`` or CUDA-graph capture) for masks the strides cannot vouch for.
    """
    if mask is None:
        return None, None
    per_key = _per_key(mask, batch, seq, heads, inspect_values)
    if per_key is not None and per_key.holds():  # one sync where the form does not vouch
        return None, per_key.padding(batch, seq)
    return _bias_from(mask, heads, seq, dtype), None


class _PerKey(NamedTuple):
    """Whether a mask is one value per (sequence, key) (``convert_mask``), and which: made
    without a sync, read on the host in one copy (``read``, one sync).  ``plane``: bool
    ``[B or 1, S]`` on the mask's device, a bool mask's first row (first head, first query;
    ``token``: True = token, a view) or where a float mask's is ``finfo.min``/-inf (True =
    padding).  ``zero``: where a float mask's first row is 0 (its values must all be 0 or the
    minimum, no sequence all padding).  ``same``: 0-d bool, every head's and query's row
    equals the first (None: the strides show it).  With neither, the form vouches for ``plane``."""

    plane: torch.Tensor
    token: bool
    zero: Optional[torch.Tensor] = None
    same: Optional[torch.Tensor] = None

    @property
    def vouched(self) -> bool:
        return self.zero is None and self.same is None

    def holds(self) -> bool:
        """Whether the mask is a key padding mask (one sync, unless the form vouches)."""
        if self.zero is None:
            return self.same is None or bool(self.same)
        return self.padding_on_host(self.read()) is not None

    def read(self) -> np.ndarray:
        """``plane``, then ``zero`` and ``same`` (one column) side by side: one copy to the host."""
        if self.vouched:
            return self.plane.cpu().numpy()
        parts = [p for p in (self.plane, self.zero) if p is not None]
        if self.same is not None:
            parts.append(self.same.expand(self.plane.shape[0], 1))
        return torch.cat(parts, dim=1).cpu().numpy()

    def padding_on_host(self, host: np.ndarray) -> Optional[np.ndarray]:
        """From what ``read`` gave: the key padding ``[B or 1, S]`` (True = padding), or None
        where the values show an additive bias."""
        seq = self.plane.shape[1]
        if self.same is not None and not host[0, -1]:
            return None
        pad = ~host[:, :seq] if self.token else host[:, :seq]
        if self.zero is not None and (not (host[:, seq : 2 * seq] | pad).all() or pad.all(axis=-1).any()):
            return None
        return pad

    def padding(self, batch: int, seq: int) -> torch.Tensor:
        """The key padding mask bool ``[B, S]`` on the device (contiguous)."""
        pad = ~self.plane if self.token else self.plane
        if pad.shape[0] != batch or not pad.is_contiguous():
            pad = pad.expand(batch, seq).contiguous()
        return pad


def _per_key(mask, batch: int, seq: int, heads: int, inspect_values: bool) -> Optional[_PerKey]:
    """``convert_mask``'s checks of ``mask`` (raising as documented there), then its
    ``_PerKey``, or None where it is an additive bias for sure (a mask only its values could
    vouch for, with ``inspect_values=False``).  No sync."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attention_mask of type {type(mask).__name__} is not supported (flex_attention's BlockMask?); "
            f"use attn_implementation in {SUPPORTED_ATTN_IMPLEMENTATIONS}"
        )
    shape = mask.shape
    if len(shape) == 2:
        if shape[0] != batch or shape[1] != seq:
            raise ValueError(f"a 2-D attention_mask must be [B, S] = ({batch}, {seq}), got {tuple(shape)}")
        return _PerKey(mask == 0, False)
    if len(shape) != 4 or any(n != 1 and n != full for n, full in zip(shape, (batch, heads, seq, seq))):
        raise ValueError(
            f"attention_mask must broadcast to [B, H, S, S] = ({batch}, {heads}, {seq}, {seq}) with a full "
            f"key dim, got shape {tuple(shape)}"
        )
    if shape[3] != seq:
        raise ValueError(f"attention_mask must have one entry per key (last dim {seq}), got {tuple(shape)}")
    is_bool = mask.dtype == torch.bool
    if not is_bool and not mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool or floating point, got {mask.dtype}")

    first = mask[:, :1, :1]  # [B or 1, 1, 1, S]: the first head's first query
    row = first.view(shape[0], seq)
    broadcast = (shape[1] == 1 or mask.stride(1) == 0) and (shape[2] == 1 or mask.stride(2) == 0)
    if broadcast and is_bool:
        return _PerKey(row, True)
    if not inspect_values:
        return None
    same = None if broadcast else (mask == first).all()
    if is_bool:
        return _PerKey(row, True, None, same)
    return _PerKey(row <= torch.finfo(mask.dtype).min, False, row == 0, same)


class MaskCache:
    """One ``convert_mask`` result, shared by the layers of one encoder.

    Every layer of a forward gets the same mask object; converting it once saves
    the later layers its kernels and the value check's host sync.  The first
    layer always converts (unless the padding-free encoder read the mask this
    forward: ``read``); the others reuse the result while the mask is the
    same object (held by weak reference, so the cache keeps nothing alive) at the
    same in-place version (inference tensors have no version counter: for them,
    the first layer's conversion is what picks up a buffer refilled in place).
    """

    def __init__(self):
        self._last = None  # (weakref to mask, key, (bias, key padding) or the key padding on the host)

    def __deepcopy__(self, memo):  # a copied model starts with its own, empty cache
        return MaskCache()

    def __call__(self, mask, x: torch.Tensor, heads: int, refresh: bool):
        if mask is None:
            return None, None
        batch, seq = x.shape[0], x.shape[1]
        if not isinstance(mask, torch.Tensor) or torch.compiler.is_compiling():
            return convert_mask(mask, batch, seq, heads, x.dtype, inspect_values=False)
        key = _mask_key(mask, x, heads)
        last = self._last
        if not refresh and last is not None and last[0]() is mask and last[1] == key:
            result = last[2]
            if isinstance(result, np.ndarray):  # the encoder read a key padding mask: made on the device now
                result = (None, torch.from_numpy(np.ascontiguousarray(result)).to(x.device))
                self._last = (last[0], key, result)
            return result
        result = convert_mask(mask, batch, seq, heads, x.dtype, inspect_values=hf_varlen.may_sync(x))
        self._last = (weakref.ref(mask), key, result)
        return result

    def read(self, mask: torch.Tensor, x: torch.Tensor, heads: int) -> Optional[np.ndarray]:
        """The padding-free encoder's one read of its forward's mask (one sync; the caller
        checked that it may sync): the key padding mask on the host, numpy bool ``[B, S]``
        (True = padding; read only), or None where the mask is an additive bias.  Keeps the
        conversion, as a layer's call with ``refresh`` would, for a padded forward's layers.
        Refuses what ``convert_mask`` refuses."""
        batch, seq = x.shape[0], x.shape[1]
        per_key = _per_key(mask, batch, seq, heads, True)
        pad = None if per_key is None else per_key.padding_on_host(per_key.read())  # the sync
        if pad is not None and pad.shape[0] != batch:  # one row for every sequence
            pad = np.broadcast_to(pad, (batch, seq))
        # A padded forward's first layer makes its key padding from the host copy: no view of the mask kept.
        key = _mask_key(mask, x, heads)
        self._last = (weakref.ref(mask), key, pad if pad is not None else (_bias_from(mask, heads, seq, x.dtype), None))
        return pad


def _mask_key(mask: torch.Tensor, x: torch.Tensor, heads: int) -> tuple:
    """What a cached conversion of ``mask`` depends on besides the mask object itself."""
    return (-1 if mask.is_inference() else mask._version, x.shape[0], x.shape[1], heads, x.dtype)
