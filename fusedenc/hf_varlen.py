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

One stack, one graph: where HF's layer loop would do nothing but call each patched layer
on the packed rows, the encoder runs all the layers' blocks as one ``EncoderStack`` (the
same block objects, no weight copies; cached on the encoder, rebuilt when the layers
change) through ``forward_packed``, which on a GPU replays one CUDA graph for the whole
encoder (``fusedenc.auto_graphs``); HF's loop then runs with each layer handing that
result on, so HF's output structure is kept.  The layers run one by one instead where a
layer call could be seen or changed from outside: a forward hook or pre-hook on a layer
(transformers 5's output-capturing hooks only while they collect), a ``forward`` set on a
layer instance, a global module forward hook, a layer not patched by this encoder, a block
in training mode.  ``stack_of(encoder)`` is the cached stack (its ``auto_graphs.stats()``).

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
from .encoder import EncoderBlock, EncoderStack

__all__ = ["PaddingFree", "PaddingFreeEncoder", "install", "stack_of"]

#: Automatic graphs a patched encoder's stack keeps (token count x sequence-count x longest-sequence buckets).
PACKED_MAX_GRAPHS = 32


def _may_sync(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


_CAPTURE_MODULE = "transformers.utils.output_capturing"


def _collected() -> Optional[dict]:
    """What transformers 5's output capture collects now (``output_hidden_states``,
    ``output_attentions``: hooks on the layers record their outputs), or None.
    transformers keeps this in a context variable of ``transformers.utils.output_capturing``."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    collector = getattr(output_capturing, "_active_collector", None)
    active = collector.get() if collector is not None else None
    return active if isinstance(active, dict) else None


def _collecting_hidden_states() -> bool:
    """Whether transformers 5's output capture is collecting every layer's hidden states now
    (they must then be padded).  Versions without it pass the flag to the encoder instead
    (checked by the caller)."""
    active = _collected()
    return active is not None and "hidden_states" in active


class PaddingFree:
    """What one patched encoder and its layers share: the packing of the forward in flight.

    ``converted``: the encoder converted this forward's mask already (the first layer of
    a padded forward need not convert it again).  ``result``: the packed rows ``[1, T, D]``
    after every layer, when the encoder ran their blocks as one stack (each layer hands
    them on)."""

    __slots__ = ("packing", "converted", "result")

    def __init__(self):
        self.packing: Optional[varlen.Packing] = None
        self.converted = False
        self.result: Optional[torch.Tensor] = None

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
            stack = self._fusedenc_as_stack()
            if stack is not None:  # every block in one call (one graph on a GPU); the layers hand its rows on
                state.result = stack.forward_packed(rows[0], packing)[None]
            out = super().forward(rows, None, *args, **kwargs)
        finally:
            state.packing, state.converted, state.result = None, False, None
        return _with_last_hidden_state(out, varlen.unpack(_last_hidden_state(out)[0], packing))

    def _fusedenc_as_stack(self) -> Optional[EncoderStack]:
        """The layers' blocks as one stack, where calling the layers one by one would do
        nothing else (module docstring); None: they run one by one."""
        state = self._fusedenc_padding_free
        layers = list(self.layer)
        blocks = [getattr(layer, "block", None) for layer in layers]
        stack = self.__dict__.get("_fusedenc_stack")
        if stack is not None and not _same(stack.blocks, blocks):  # layers or blocks replaced
            self._fusedenc_drop_stack()
            stack = None
        if not all(isinstance(b, EncoderBlock) and getattr(layer, "_padding_free", None) is state
                   for layer, b in zip(layers, blocks)):  # fmt: skip
            return None
        if any(_watched(layer) for layer in layers) or _global_forward_hooks():
            return None
        if stack is None:
            if any(b.training for b in blocks):  # EncoderStack() puts its blocks in eval mode: leave them be
                return None
            stack = EncoderStack(blocks)
            # Padded batches of real text give a new token count nearly every call: at batch 32
            # about seven token buckets and two longest-sequence buckets are in use at once,
            # more than the default LRU of 8 holds (evicted keys back off and run eagerly).  The
            # graphs share one memory pool; each holds only its static rows in and out.
            stack.auto_graphs.max_graphs = PACKED_MAX_GRAPHS
            # In __dict__, not a submodule: no second path to the blocks in state_dict() or modules().
            self.__dict__["_fusedenc_stack"] = stack
        return stack

    def _fusedenc_drop_stack(self) -> None:
        stack = self.__dict__.pop("_fusedenc_stack", None)
        if stack is not None:
            stack.auto_graphs.clear()  # its graphs hold the weights they captured

    def _apply(self, fn, *args, **kwargs):
        # .to() / .half() reach the blocks through the layers, not through the cached stack
        # (no submodule): drop it, and with it graphs that keep the old weights alive.
        self._fusedenc_drop_stack()
        return super()._apply(fn, *args, **kwargs)

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


def stack_of(encoder: nn.Module) -> Optional[EncoderStack]:
    """The ``EncoderStack`` a padding-free encoder runs its layers' blocks as (made by its
    first forward that could use one), or None."""
    return encoder.__dict__.get("_fusedenc_stack")


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _watched(layer: nn.Module) -> bool:
    """Whether something besides the layer's own forward would see or change a call of it:
    a forward hook or pre-hook (transformers 5's output-capturing hooks only while they
    collect something), or a ``forward`` set on the instance (a wrapper, as some
    transformers 4.x versions install while they record outputs)."""
    if "forward" in layer.__dict__:
        return True
    hooks = [*layer._forward_pre_hooks.values(), *layer._forward_hooks.values()]
    if not hooks:
        return False
    collecting = bool(_collected())
    return any(collecting or getattr(h, "__module__", None) != _CAPTURE_MODULE for h in hooks)


def _global_forward_hooks() -> bool:
    """Whether a global module forward hook or pre-hook is registered (it sees every layer call)."""
    m = torch.nn.modules.module
    return bool(getattr(m, "_global_forward_hooks", None) or getattr(m, "_global_forward_pre_hooks", None))


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
