"""patch_hf's padding-free path: a patched encoder computes only the real tokens of a padded batch.

``patch_hf`` makes each patched ``*Encoder`` module (``BertEncoder``, ...) an instance of a
subclass that also derives from ``PaddingFreeEncoder``.  Its ``forward``, when HF hands it
an attention mask with padding, packs the real tokens of ``hidden_states`` ``[B, S, D]``
into ``[1, T_real, D]`` rows (one gather), runs the encoder's own forward on them with no
mask (so the layer loop, and whatever the installed transformers version returns, stay
HF's), each patched layer running its block on the packed rows with the sequences'
offsets (``EncoderBlock.forward_packed``), and scatters the last hidden state back to
``[B, S, D]`` (one scatter).  Padding positions of that output are **zero**; HF computes
values there (each padding token attends to its sequence's real tokens) that nothing
downstream should read: the mean pooling of sentence-transformers masks them, and the
pooler reads position 0, which the packed path requires to be a real token.

The padded path (every layer on ``[B, S, D]`` with a key padding mask) runs instead when
the packed one would not reproduce HF: no mask or no padding; a sequence whose position 0
is padding (left padding: the pooler would read a zero), or that is all padding (HF
averages over every key there); a mask that is not a key padding mask; hidden states of
every layer requested (``output_hidden_states``: they must keep HF's shape); and while
``torch.compile`` traces or a CUDA graph is captured (packing reads the mask on the host).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import varlen

__all__ = ["PaddingFree", "PaddingFreeEncoder", "install"]


def _may_sync(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _collecting_hidden_states() -> bool:
    """Whether transformers 5's output capture is collecting every layer's hidden states
    now (its ``output_hidden_states``: hooks on the layers record their outputs, which
    must then be padded).  transformers keeps this in a context variable of
    ``transformers.utils.output_capturing``; versions without it pass the flag to the
    encoder instead (checked by the caller)."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    collector = getattr(output_capturing, "_active_collector", None)
    active = collector.get() if collector is not None else None
    return isinstance(active, dict) and "hidden_states" in active


class PaddingFree:
    """What one patched encoder and its layers share: the packing of the forward in flight.

    ``converted``: the encoder converted this forward's mask already (the first layer of
    a padded forward need not convert it again)."""

    __slots__ = ("packing", "converted")

    def __init__(self):
        self.packing: Optional[varlen.Packing] = None
        self.converted = False

    def packed(self, hidden_states: torch.Tensor, attention_mask) -> Optional[varlen.Packing]:
        """The packing a layer call runs on (its hidden states are the packed rows), else None."""
        p = self.packing
        if p is None or attention_mask is not None or hidden_states.dim() != 3:
            return None
        return p if tuple(hidden_states.shape[:2]) == (1, p.total) else None


class PaddingFreeEncoder(nn.Module):
    """Mixed into a patched encoder's class (``install``): its forward packs, runs, unpacks."""

    _fusedenc_padding_free: PaddingFree

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        state = self._fusedenc_padding_free
        packing = self._fusedenc_packing(hidden_states, attention_mask, args, kwargs)
        if packing is None:
            try:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            finally:
                state.converted = False
        rows = varlen.pack(hidden_states, packing)[None]
        state.packing = packing
        try:
            out = super().forward(rows, None, *args, **kwargs)
        finally:
            state.packing, state.converted = None, False
        return _with_last_hidden_state(out, varlen.unpack(_last_hidden_state(out)[0], packing))

    def _fusedenc_packing(self, hidden_states, attention_mask, args, kwargs) -> Optional[varlen.Packing]:
        """This forward's packing, or None where the padded path must run (module docstring)."""
        if attention_mask is None or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            return None
        if torch.compiler.is_compiling() or self.training:
            return None
        first = self.layer[0]
        batch, seq = hidden_states.shape[0], hidden_states.shape[1]
        # The one conversion of this forward's mask (the first layer reuses it on the padded path).
        _, key_padding_mask = first._masks(attention_mask, hidden_states, first.num_heads, True)
        self._fusedenc_padding_free.converted = True
        if key_padding_mask is None or not _may_sync(hidden_states) or batch * seq == 0:
            return None
        if self._fusedenc_wants_hidden_states(args, kwargs):
            return None
        packing = varlen.packing_from_mask(key_padding_mask, device=hidden_states.device)
        if not packing.has_padding or not packing.first_real:
            return None
        return packing

    def _fusedenc_wants_hidden_states(self, args, kwargs) -> bool:
        if kwargs.get("output_hidden_states") or getattr(self.config, "output_hidden_states", False):
            return True
        # transformers 4.x: output_hidden_states is a positional parameter of the encoder.
        names = _positional_names(type(self))
        if "output_hidden_states" in names:
            i = names.index("output_hidden_states") - 2  # after hidden_states, attention_mask
            if 0 <= i < len(args) and args[i]:
                return True
        return _collecting_hidden_states()


_NAMES: dict[type, tuple[str, ...]] = {}


def _positional_names(cls: type) -> tuple[str, ...]:
    """The positional parameter names of the HF encoder's forward (without self)."""
    names = _NAMES.get(cls)
    if names is None:
        import inspect

        hf_forward = next(c.forward for c in cls.__mro__[1:] if c is not PaddingFreeEncoder and "forward" in vars(c))
        params = list(inspect.signature(hf_forward).parameters.values())[1:]
        names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        _NAMES[cls] = names
    return names


def _last_hidden_state(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _with_last_hidden_state(out, value: torch.Tensor):
    """HF's encoder output (a ModelOutput, or a tuple in 4.x with return_dict=False) with its
    last hidden state replaced."""
    if hasattr(out, "last_hidden_state"):
        out.last_hidden_state = value  # ModelOutput keeps its item and attribute in step
        return out
    return (value,) + tuple(out[1:])


_CLASSES: dict[type, type] = {}


def install(encoder: nn.Module) -> None:
    """Give a patched HF encoder (every layer already an ``HFEncoderLayer``) the padding-free
    forward: its class becomes a subclass that also derives from ``PaddingFreeEncoder``, and
    it and its layers share one ``PaddingFree``.  Installed once; later calls do nothing."""
    if isinstance(encoder, PaddingFreeEncoder):
        return
    cls = type(encoder)
    fused = _CLASSES.get(cls)
    if fused is None:
        fused = type(f"PaddingFree{cls.__name__}", (PaddingFreeEncoder, cls), {"__module__": __name__})
        _CLASSES[cls] = fused
    state = PaddingFree()
    encoder.__class__ = fused
    encoder._fusedenc_padding_free = state
    for layer in encoder.layer:
        layer._padding_free = state
