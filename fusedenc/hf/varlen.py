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
encoder (``fusedenc.graphs.auto``).  The first such call of each kind of keyword arguments
(their None-ness, flags' values, types) runs HF's loop with each layer handing that result
on, and records HF's output type where the loop did nothing else (the stack's rows came out
as the last hidden state, a 1-tuple or a ModelOutput whose other fields are None); later
calls of that kind make that output directly, without the loop.  Calls with positional
arguments, with an argument a patched layer refuses (``output_attentions``, ``head_mask``,
a KV cache, ...; the layers raise) or while transformers' output capture collects always
run the loop.  The layers run one by one instead where a layer call could be seen or
changed from outside: a forward hook or pre-hook on a layer (transformers 5's
output-capturing hooks only while they collect), a ``forward`` set on a layer instance, a
global module forward hook, a layer in training mode (it raises), a new stack's block in
training mode.  ``stack_of(encoder)`` is the cached
stack (its ``auto_graphs.stats()``).

Host work: the mask is read once (a sync: its key padding, and where needed the values
that show it is one, in one copy; ``hf._MaskCache.read``), and every decision that shapes,
flags and hooks make comes before that read; between it and the stack's launch there is
numpy work on the mask, one host-to-device copy of the indices and offsets
(``varlen.packing_from_host``) and the gather.

The padded path (every layer on ``[B, S, D]`` with a key padding mask) runs instead when
the packed one would not reproduce HF: a layer that is not this encoder's own (an HF layer
put back, a patched layer copied from another model: packed rows with no mask would make
it attend across the sequences); no mask or no padding; a sequence whose position 0
is padding (left padding: the pooler would read a zero), or that is all padding (HF
averages over every key there); a mask that is not a key padding mask; hidden states of
every layer requested (``output_hidden_states``: they must keep HF's shape); and while
``torch.compile`` traces or a CUDA graph is captured (packing reads the mask on the host).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..encoder.blocks import EncoderBlock, EncoderStack
from ..graphs import auto as auto_graphs
from ..varlen import packing as varlen
from . import classes as patched_classes

__all__ = ["PaddingFree", "PaddingFreeEncoder", "collected_outputs", "forward_hooked", "global_forward_hooks", "install",
           "stack_of"]  # fmt: skip

#: Automatic graphs a patched encoder's stack keeps (token count x sequence-count x longest-sequence buckets).
PACKED_MAX_GRAPHS = 32


def may_sync(x: torch.Tensor) -> bool:
    """Whether reading ``x`` on the host is allowed now: not while ``torch.compile`` traces or a
    CUDA graph is captured on the current stream."""
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


_CAPTURE_MODULE = "transformers.utils.output_capturing"
_capture_module = None  # transformers.utils.output_capturing once looked up; False where there is none


def collected_outputs() -> Optional[dict]:
    """What transformers 5's output capture collects now (``output_hidden_states``,
    ``output_attentions``: hooks on the layers record their outputs), or None.
    transformers keeps this in a context variable of ``transformers.utils.output_capturing``."""
    global _capture_module
    module = _capture_module
    if module is None:
        try:
            from transformers.utils import output_capturing as module
        except ImportError:
            module = False
        _capture_module = module
    collector = getattr(module, "_active_collector", None) if module else None
    active = collector.get() if collector is not None else None
    return active if isinstance(active, dict) else None


def _collecting_hidden_states() -> bool:
    """Whether transformers 5's output capture is collecting every layer's hidden states now
    (they must then be padded).  Versions without it pass the flag to the encoder instead
    (checked by the caller)."""
    active = collected_outputs()
    return active is not None and "hidden_states" in active


class PaddingFree:
    """What one patched encoder and its layers share: the packing of the forward in flight.

    ``converted``: the encoder converted this forward's mask already (the first layer of
    a padded forward need not convert it again).  ``result``: the packed rows ``[1, T, D]``
    after every layer, when the encoder ran their blocks as one stack (each layer hands
    them on).  ``deferred``: the model's own mask building and its arguments, where it
    handed the 2-D mask through (``pass_masks_through``): a padded forward builds HF's mask."""

    __slots__ = ("packing", "converted", "result", "deferred")

    def __init__(self):
        self.packing: Optional[varlen.Packing] = None
        self.converted = False
        self.result: Optional[torch.Tensor] = None
        self.deferred: Optional[tuple] = None

    def packed(self, hidden_states: torch.Tensor, attention_mask) -> Optional[varlen.Packing]:
        """The packing a layer call runs on (its hidden states are the packed rows), else None."""
        p = self.packing
        if p is None or attention_mask is not None or hidden_states.dim() != 3:
            return None
        return p if tuple(hidden_states.shape[:2]) == (1, p.total) else None


class PaddingFreeEncoder(nn.Module):
    """Mixed into a patched encoder's class (``install``): its forward packs, runs, unpacks."""

    _fusedenc_padding_free: PaddingFree
    name_prefix = "PaddingFree"  # patched_classes: "PaddingFree" + the HF encoder class's name

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        state = self._fusedenc_padding_free
        try:
            if self._fusedenc_may_pack(hidden_states, attention_mask, args, kwargs):
                # Every host-only decision comes before the mask is read: that read is a sync, and
                # from it to the stack's launch the GPU has nothing to do.
                stack = self._fusedenc_as_stack()
                key = self._fusedenc_call_key(kwargs) if stack is not None and not args else None
                made = self.__dict__.get("_fusedenc_outputs", {}).get(key) if key is not None else None
                packing = self._fusedenc_packing(hidden_states, attention_mask)  # the sync
                if packing is not None:
                    rows = varlen.pack(hidden_states, packing)
                    if made is not None:  # HF's layer loop would only hand the stack's rows on: skipped
                        return _made(made, varlen.unpack(stack.forward_packed(rows, packing), packing))
                    return self._fusedenc_run_packed(rows, packing, stack, key, args, kwargs)
            deferred = state.deferred
            if deferred is not None and deferred[0] is attention_mask:  # the padded path: HF's own mask
                attention_mask = deferred[1](**deferred[2])[0]
                state.converted = False
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            state.packing, state.converted, state.result, state.deferred = None, False, None, None

    def _fusedenc_run_packed(self, rows, packing, stack, key, args, kwargs):
        """HF's forward (its layer loop) on the packed rows ``[1, T, D]``: each layer runs its
        block, or hands on the stack's result; records HF's output type for ``key``."""
        state = self._fusedenc_padding_free
        state.packing = packing
        if stack is not None:  # every block in one call (one graph on a GPU); the layers hand its rows on
            state.result = stack.forward_packed(rows, packing)[None]
        out = super().forward(rows[None], None, *args, **kwargs)
        last = _last_hidden_state(out)
        if key is not None and last is state.result:
            made = _output_maker(out)
            if made is not None:
                outputs = self.__dict__.setdefault("_fusedenc_outputs", {})
                if len(outputs) >= _MAX_OUTPUT_KINDS:
                    outputs.clear()
                outputs[key] = made
        return _with_last_hidden_state(out, varlen.unpack(last[0], packing))

    def _fusedenc_as_stack(self) -> Optional[EncoderStack]:
        """The layers' blocks as one stack, where calling the layers one by one would do
        nothing else (module docstring); None: they run one by one."""
        state = self._fusedenc_padding_free
        layers = list(self._modules["layer"])  # not self.layer: nn.Module's __getattr__ costs ~2 us a call
        blocks = tuple(layer._modules.get("block") for layer in layers)
        stack = self.__dict__.get("_fusedenc_stack")
        # The blocks the stack was made of, kept as a tuple: comparing it (identity first, in C)
        # costs a fraction of walking the stack's ModuleList, on every call.
        if stack is not None and self.__dict__.get("_fusedenc_stack_blocks") != blocks:  # layers or blocks replaced
            self._fusedenc_drop_stack()
            stack = None
        hooked = False
        for layer, block in zip(layers, blocks):
            # A layer in training mode refuses the call (HFEncoderLayer): the layers run, and raise.
            mine = _own(layer, state) and isinstance(block, EncoderBlock)
            if not mine or layer.training:
                return None
            hooked = hooked or forward_hooked(layer)
        if global_forward_hooks() or (hooked and any(_watched(layer) for layer in layers)):
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
            self.__dict__["_fusedenc_stack_blocks"] = blocks
        return stack

    def _fusedenc_drop_stack(self) -> None:
        stack = self.__dict__.pop("_fusedenc_stack", None)
        self.__dict__.pop("_fusedenc_stack_blocks", None)
        if stack is not None:
            stack.auto_graphs.clear()  # its graphs hold the weights they captured

    def _apply(self, fn, *args, **kwargs):
        # .to() / .half() reach the blocks through the layers, not through the cached stack
        # (no submodule): drop it, and with it graphs that keep the old weights alive, where
        # they replaced a tensor (auto_graphs.storage_key: a .to() to where it is keeps both).
        before = auto_graphs.storage_key(self)
        result = super()._apply(fn, *args, **kwargs)
        if auto_graphs.storage_key(self) != before:
            self._fusedenc_drop_stack()
        return result

    def _fusedenc_may_pack(self, hidden_states, attention_mask, args, kwargs) -> bool:
        """Whether the packed path may run, as far as shapes and flags tell (no sync)."""
        if attention_mask is None or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            return False
        if self.training or not may_sync(hidden_states) or hidden_states.shape[0] * hidden_states.shape[1] == 0:
            return False
        # A call a patched layer refuses takes the padded path, where the first layer raises
        # before any block runs (the packed path would run the stack first).
        if self._fusedenc_refused(kwargs) or self._fusedenc_wants_hidden_states(args, kwargs):
            return False
        # Packed rows [1, T, D] with no mask mean something only to this encoder's own layers
        # (they read the packing from its state): a layer that is not one of them (an HF layer
        # put back, a patched layer copied from elsewhere) would attend across sequences.
        state = self._fusedenc_padding_free
        return all(_own(layer, state) for layer in self._modules["layer"])

    def _fusedenc_packing(self, hidden_states, attention_mask) -> Optional[varlen.Packing]:
        """This forward's packing, or None where the padded path must run (module docstring):
        the one read of the mask (a sync), which also converts it for a padded forward."""
        first = self.layer[0]
        masks = getattr(first, "_masks", None)
        if masks is None:
            return None
        padding = masks.read(attention_mask, hidden_states, first.num_heads)
        self._fusedenc_padding_free.converted = True  # the first layer of a padded forward reuses it
        # No padding, or a sequence whose position 0 is padding (left padding, all padding).
        if padding is None or not padding.any() or padding[:, 0].any():
            return None
        return varlen.packing_from_host(padding, device=hidden_states.device)

    def _fusedenc_call_key(self, kwargs) -> Optional[tuple]:
        """The kind of this call (what could change HF's output type: each keyword argument's
        None-ness, a flag's value, a type; the config's ``return_dict``), or None where HF's
        loop must run: something transformers' output capture collects (a call with an
        argument a patched layer refuses never packs: ``_fusedenc_may_pack``)."""
        config = self.config
        if getattr(config, "output_attentions", False) or collected_outputs():
            return None
        return (getattr(config, "return_dict", None), *((name, _kind(v)) for name, v in kwargs.items()))

    @staticmethod
    def _fusedenc_refused(kwargs) -> bool:
        """Whether the call passes an argument a patched layer refuses (``HFEncoderLayer._refuse``)."""
        if any(v is not None and v is not False for v in (kwargs.get(name) for name in _FLAGS_REFUSED)):
            return True
        return any(v is not None and not (type(v) in (list, tuple) and all(x is None for x in v))
                   for v in (kwargs.get(name) for name in _ARGS_REFUSED))  # fmt: skip

    def _fusedenc_wants_hidden_states(self, args, kwargs) -> bool:
        if kwargs.get("output_hidden_states") or getattr(self.config, "output_hidden_states", False):
            return True
        # transformers 4.x: output_hidden_states is a positional parameter of the encoder.
        if args:
            names = _positional_names(type(self))
            if "output_hidden_states" in names:
                i = names.index("output_hidden_states") - 2  # after hidden_states, attention_mask
                if 0 <= i < len(args) and args[i]:
                    return True
        return _collecting_hidden_states()


#: Keyword arguments whose true value a patched layer refuses, and those it refuses unless
#: None (transformers 4.x passes head_mask on as a list of None per layer).
_FLAGS_REFUSED = ("output_attentions", "is_causal")
_ARGS_REFUSED = ("head_mask", "past_key_value", "past_key_values", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                 "max_length_k", "seq_idx")  # fmt: skip

#: Kinds of encoder call whose output type a padding-free encoder keeps (``_fusedenc_call_key``).
_MAX_OUTPUT_KINDS = 32


def _kind(value):
    """What of an argument could change HF's encoder output type: None-ness, a scalar's
    value, which items of a list are None, else the type."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (list, tuple):
        return type(value), tuple(x is None for x in value)
    return type(value)


def _output_maker(out):
    """How to make ``out`` again from a new last hidden state: ``tuple`` for a 1-tuple (4.x,
    ``return_dict=False``), the ModelOutput class where every other field is None; else None."""
    if type(out) is tuple:
        return tuple if len(out) == 1 else None
    keys = getattr(out, "keys", None)
    if not callable(keys) or list(keys()) != ["last_hidden_state"]:
        return None
    cls = type(out)
    try:
        again = cls(last_hidden_state=out.last_hidden_state)
    except Exception:  # noqa: BLE001 - a class not made this way: keep HF's loop
        return None
    same = list(again.keys()) == ["last_hidden_state"] and again.last_hidden_state is out.last_hidden_state
    return cls if same else None


def _made(maker, last_hidden_state: torch.Tensor):
    return (last_hidden_state,) if maker is tuple else maker(last_hidden_state=last_hidden_state)


def stack_of(encoder: nn.Module) -> Optional[EncoderStack]:
    """The ``EncoderStack`` a padding-free encoder runs its layers' blocks as (made by its
    first forward that could use one), or None."""
    return encoder.__dict__.get("_fusedenc_stack")


def _own(layer: nn.Module, state: PaddingFree) -> bool:
    """Whether ``layer`` was patched by the encoder whose shared state is ``state`` (it reads
    the packing of a forward from there)."""
    return layer.__dict__.get("_padding_free") is state


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
    collecting = bool(collected_outputs())
    return any(collecting or getattr(h, "__module__", None) != _CAPTURE_MODULE for h in hooks)


def forward_hooked(module: nn.Module) -> bool:
    """Whether ``module``'s call could be seen or changed from outside: a forward hook or
    pre-hook on it, or a ``forward`` set on the instance."""
    return bool("forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks)


def global_forward_hooks() -> bool:
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


def install(encoder: nn.Module) -> None:
    """Give a patched HF encoder (every layer already an ``HFEncoderLayer``) the padding-free
    forward: its class becomes a subclass that also derives from ``PaddingFreeEncoder``, and
    it and its layers share one ``PaddingFree``.  Installed once; later calls do nothing."""
    if isinstance(encoder, PaddingFreeEncoder):
        return
    state = PaddingFree()
    patched_classes.mix_in(encoder, PaddingFreeEncoder)
    encoder._fusedenc_padding_free = state
    for layer in encoder.layer:
        layer._padding_free = state


def pass_masks_through(model: nn.Module) -> None:
    """In ``model``, every transformers 5 encoder model (BERT, RoBERTa, XLM-R, ELECTRA, ...:
    a module with ``_create_attention_masks`` whose ``encoder`` is padding-free, not a
    decoder) hands the caller's 2-D attention mask to its encoder as it is, instead of
    building the 4-D mask that only the padded path's layers would read: that building is
    ~0.35 ms of host work a call and a host sync of its own (``padding_mask.all()``), before
    the encoder's one read of the mask.  The patched layers read a 2-D mask as HF would
    (``hf.convert_mask``: 0 = padding); HF's path stays for decoders, cross-attention and any
    other mask form.  Installed once per module (an instance attribute)."""
    for module in model.modules():
        encoder = module.__dict__.get("_modules", {}).get("encoder")
        create = getattr(module, "_create_attention_masks", None)
        config = getattr(module, "config", None)
        if (not isinstance(encoder, PaddingFreeEncoder) or create is None or config is None
                or getattr(config, "is_decoder", False) or "_create_attention_masks" in module.__dict__):
            continue
        module._create_attention_masks = _MaskPassThrough(module, encoder._fusedenc_padding_free)


class _MaskPassThrough:
    """``_create_attention_masks`` handing a plain 2-D padding mask through, with HF's own
    mask building and its arguments left in ``state.deferred`` for a padded forward (see
    above).  An object, not a closure, so a patched model pickles whole."""

    def __init__(self, module: nn.Module, state: PaddingFree):
        self.module, self.state = module, state

    def __call__(self, *args, **kwargs):
        module = self.module
        create = type(module)._create_attention_masks.__get__(module)  # HF's, under this instance attribute
        mask = kwargs.get("attention_mask")
        embedding = kwargs.get("embedding_output")
        if (not args and isinstance(mask, torch.Tensor) and mask.dim() == 2 and isinstance(embedding, torch.Tensor)
                and kwargs.get("encoder_attention_mask") is None and kwargs.get("encoder_hidden_states") is None
                and kwargs.get("past_key_values") is None and mask.shape == embedding.shape[:2]):
            mask = mask.to(embedding.device)
            self.state.deferred = (mask, create, kwargs)
            return mask, None
        return create(*args, **kwargs)
