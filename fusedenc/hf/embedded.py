"""A patched BERT or RoBERTa model's plain call from token ids: embeddings and every layer in one graph.

At small batches of real sentences (32-128 of ~25 tokens) a padding-free BERT call is
bound by the host, not the GPU: HF's model forward (its decorators, the embeddings
module's Python and launches, the mask hand-off, the encoder's checks) costs about as much
as the GPU work of a MiniLM-sized model.  ``install(model)`` gives a patched ``BertModel``
(the class of BERT, MiniLM, e5, bge, ... checkpoints), ``RobertaModel`` or ``XLMRobertaModel``
(multilingual e5, bge-m3, ...) a shorter path for the call such services make,
``model(input_ids, attention_mask[, token_type_ids])``:

1. the mask is read once on the host (a sync; a mask already on the CPU costs none): numpy
   checks that every sequence is a prefix of its row and finds the offsets; a batch without
   padding, or a call without a mask (HF: every token real), runs its rows as they are,
   with the encoder's dense attention;
2. one automatic CUDA graph (``fusedenc.graphs.auto`` with ``graph_feeds.PaddedIdsFeed``:
   bucketed by token count, sequence count, longest sequence and padded length) takes the
   padded ids, token types and offsets (one native call of copies; ``sentence_embeddings``
   with the tokenizer's host tensors: ``HostIdsFeed``, one copy from pinned memory), and runs everything
   else: it packs the real tokens' ids, runs HF's three embedding lookups, their sum and
   LayerNorm in HF's order (one Triton kernel for BERT's), then every layer's block on
   the packed rows, and scatters the last layer's rows back to ``[B, S, D]`` (zeros at
   padding, as the encoder's padding-free path).  Positions are found in the graph: BERT's
   is the token's index in its sequence (HF's ``position_ids`` buffer, for a prefix mask);
   RoBERTa's counts the sequence's tokens that are not ``padding_idx`` up to it, from
   ``padding_idx + 1`` (``padding_idx`` for such a token), as HF's
   ``create_position_ids_from_input_ids`` does on the padded row;
3. HF's pooler runs in the graph too (the first token's dense layer and tanh), unless it is
   not HF's own class or a hook is on it or its parts: then eagerly on the result.  Its
   three launches cost more host time than its GPU work (~0.1 ms a call on an H200 host).

Everything between the mask's read and the graph's launch is host work the GPU waits for
(at 32 sentences a MiniLM call's GPU work is ~0.35 ms), hence no host-side gather or
index tensors.

The output is HF's ``BaseModelOutputWithPoolingAndCrossAttentions``.  Everything else
takes HF's forward (and from there the encoder's padding-free or padded path): positional
arguments beyond ``input_ids``, any other argument that is not None / False
(``position_ids``, ``inputs_embeds``, ``head_mask``, ``output_hidden_states``, a cache, ...),
``return_dict=False`` or a config that returns tuples or collects outputs; masks with
left padding, holes or an all-padding sequence; sequences longer than the
position embeddings; ``torch.compile`` tracing or a caller's graph capture; a hook on the
model, its embeddings or their modules (or a global one); layers the encoder would run one
by one (``hf_varlen``); a subclass of those model classes or of their embeddings.  On a CPU
the same path runs eagerly (no graph).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
from torch import nn

from .. import core
from ..attention.varlen import BACKEND_ENV, triton_unusable_on
from ..common.torch_modules import without_autograd
from ..graphs import auto as auto_graphs
from ..graphs.feeds import HostIdsFeed, PaddedIdsFeed
from ..varlen import packing as varlen
from . import classes as patched_classes
from . import varlen as hf_varlen

__all__ = ["POOLING_MODES", "EmbeddedModel", "install"]

#: The model classes given the short path: (module, model class) -> (embeddings class, whether
#: positions follow the ids as RoBERTa's, from padding_idx + 1).
_MODELS = {
    ("transformers.models.bert.modeling_bert", "BertModel"): ("BertEmbeddings", False),
    ("transformers.models.roberta.modeling_roberta", "RobertaModel"): ("RobertaEmbeddings", True),
    ("transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaModel"): ("XLMRobertaEmbeddings", True),
}
#: Keyword arguments the short path accepts when None or False (what a task head passes on).
_NEUTRAL = frozenset((
    "position_ids", "head_mask", "inputs_embeds", "encoder_hidden_states", "encoder_attention_mask",
    "past_key_values", "use_cache", "output_attentions", "output_hidden_states", "cache_position",
))  # fmt: skip
_EMBEDDING_PARTS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "dropout")
_output_class = None  # transformers' BaseModelOutputWithPoolingAndCrossAttentions, once imported


class EmbeddedModel(nn.Module):
    """Mixed into a patched model's class (``install``): the short path of its plain call."""

    _fusedenc_hf_class: type  # the HF model class it was made from (patched_classes)

    def forward(self, *args, **kwargs):
        out = without_autograd(self._fusedenc_embedded_call, args, kwargs)  # fusedenc's path: inference only
        return super().forward(*args, **kwargs) if out is None else out

    def _apply(self, fn, *args, **kwargs):
        # Graphs keep the weights they captured alive: drop them with the old weights, where a
        # tensor was replaced (sentence-transformers' encode() calls .to(device) every time).
        before = auto_graphs.storage_key(self)
        result = super()._apply(fn, *args, **kwargs)
        if auto_graphs.storage_key(self) != before:
            auto_graphs.cache_of(self).clear()
        return result

    def _fusedenc_embedded_call(self, args, kwargs):
        """The short path's output, or None where HF's forward must run (module docstring)."""
        if len(args) > 1:
            return None
        ids = args[0] if args else kwargs.get("input_ids")
        mask, types = kwargs.get("attention_mask"), kwargs.get("token_type_ids")
        for name, value in kwargs.items():
            if name in ("input_ids", "attention_mask", "token_type_ids"):
                continue
            if name == "return_dict" and value in (None, True):
                continue
            if name not in _NEUTRAL or (value is not None and value is not False):
                return None
        ready = self._fusedenc_ready(ids, mask, types)
        if ready is None:
            return None
        pooler = self._fusedenc_graph_pooler()
        tail = _Scattered(pooler)
        return self._fusedenc_graph_call(ready, ids, types, tail, ("hidden", pooler is None))

    def _fusedenc_pooled_call(self, ids, mask, types, normalize: bool, mode: str = "mean") -> Optional[torch.Tensor]:
        """``sentence_embeddings``' result (pooled as ``mode``: one of ``POOLING_MODES``)
        through the short path's graph, or None where it does not apply (then HF's forward
        and torch's pooling).  The ids may still be on the host (the tokenizer's tensors): the
        graph's feed copies them over itself."""
        tail = _Pooled(mode, normalize)
        ready = self._fusedenc_ready(ids, mask, types, from_host=True)
        if ready is None:
            return None
        return self._fusedenc_graph_call(ready, ids, types, tail, ("pooled", mode, normalize))

    def _fusedenc_ready(self, ids, mask, types, from_host: bool = False):
        """``(stack, native, real, on_host)`` where the short path takes this call (``real``:
        the mask's bool array on the host, None without a mask; ``on_host``: the ids and token
        types are on the host, for a model on a GPU, which ``from_host`` allows), else None
        (module docstring)."""
        if self.training:
            return None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not (mask is None or isinstance(mask, torch.Tensor)):
            return None
        if (mask is not None and mask.shape != ids.shape) or (types is not None and (
                not isinstance(types, torch.Tensor) or types.shape != ids.shape)):  # fmt: skip
            return None
        if ids.dtype not in (torch.int64, torch.int32) or (types is not None and types.dtype != ids.dtype):
            return None
        emb, encoder = self.embeddings, self.encoder
        if ids.numel() == 0 or not self._fusedenc_plain():
            return None
        if ids.shape[1] + self._fusedenc_first_position() > emb.position_embeddings.num_embeddings:
            return None  # more positions than embeddings: HF's forward raises
        device = emb.word_embeddings.weight.device
        on_host = from_host and device.type == "cuda" and ids.device.type == "cpu"
        where = torch.device("cpu") if on_host else device
        if ids.device != where or (types is not None and types.device != where):
            return None
        if not hf_varlen.may_sync(emb.word_embeddings.weight):  # compiling, or a capture on the device
            return None
        stack = encoder._fusedenc_as_stack()
        if stack is None:
            return None
        native = core.active_on(device) and not auto_graphs.observing(stack)  # FP8 calibration: eager
        # The one read of the mask (a sync where it is on the GPU): HF's convention, 0 = padding.
        real = None if mask is None else mask.detach().cpu().numpy() != 0
        if real is not None and not real.all() and (not real[:, 0].all() or not varlen.real_tokens_first(real)):
            return None  # left padding, an all-padding sequence or holes: HF's forward
        return stack, native, real, on_host

    def _fusedenc_graph_call(self, ready, ids, types, tail, key):
        """The graph (or, without one, eager) call of the short path: ``tail`` turns the last
        layer's rows into the result; ``key`` says which tail, for the graph cache."""
        stack, native, real, on_host = ready
        device = self.embeddings.word_embeddings.weight.device
        if real is None or real.all():
            if on_host:  # rare (no padding at all): the dense path's feed takes device inputs
                ids, types = ids.to(device), None if types is None else types.to(device)
            # No mask (HF: every token real) or none of it padding: the batch as it is, with
            # the encoder's dense attention (at equal lengths faster than the varlen kernel).
            result = auto_graphs.call(self, self._fusedenc_dense_rows(stack, tail), (ids, types),
                                      key=("embedded dense", key), rows_per_item=ids.shape[1], native=native)  # fmt: skip
            return tail.done(self, result)
        lengths = real.sum(1)
        offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        # The forced varlen backend and the fused embeddings' switch are read when a graph is
        # captured: a graph per setting.
        settings = (os.environ.get(BACKEND_ENV), os.environ.get(FUSED_EMBEDDINGS_ENV))
        result = auto_graphs.call(
            self, self._fusedenc_embedded_rows(stack, tail), (ids, types, offsets, int(offsets[-1]), int(lengths.max())),
            key=("embedded", settings, key), native=native,
            feed=HostIdsFeed.on(device) if on_host else PaddedIdsFeed.of)  # fmt: skip
        return tail.done(self, result)

    def _fusedenc_finish(self, result):
        """HF's output from a graph function's ``result``: the last hidden state ``[B, S, D]``
        (HF's pooler, if any, then runs eagerly) or ``{"hidden", "pooled"}``."""
        if isinstance(result, dict):
            return _output(result["hidden"], result["pooled"])
        pooled = self.pooler(result) if self.pooler is not None else None
        return _output(result, pooled)

    def _fusedenc_graph_pooler(self) -> Optional[nn.Module]:
        """HF's pooler where it can run inside the graph function (HF's own class, no hook on
        it or its parts); None: there is none, or it runs eagerly after."""
        pooler = self._modules.get("pooler")
        if pooler is None or type(pooler).__module__ != self._fusedenc_hf_class.__module__:
            return None
        return None if any(hf_varlen.forward_hooked(m) for m in pooler.modules()) else pooler

    def _fusedenc_plain(self) -> bool:
        """Whether nothing would see or change the embeddings' call, and HF returns its
        ModelOutput without collecting anything."""
        is_decoder, hidden_states, attentions, return_dict = _config_flags(self.config)
        if is_decoder or hidden_states or attentions or return_dict is False:
            return False
        if hf_varlen.global_forward_hooks() or hf_varlen.collected_outputs() or hf_varlen.forward_hooked(self):
            return False
        emb = self.embeddings
        cls = self._fusedenc_hf_class
        if (type(emb).__module__, type(emb).__name__) != (cls.__module__, _model_kind(cls)[0]):
            return False
        hooked = hf_varlen.forward_hooked
        if emb.training or hooked(emb) or getattr(emb, "position_embedding_type", "absolute") != "absolute":
            return False
        parts = emb._modules  # not getattr: nn.Module's __getattr__ costs ~1 us a part, every call
        return not any(hooked(parts[name]) for name in _EMBEDDING_PARTS)

    def _fusedenc_first_position(self) -> int:
        """The position of a sequence's first token: 0 (BERT), ``padding_idx + 1`` (RoBERTa)."""
        return self.embeddings.padding_idx + 1 if _model_kind(self._fusedenc_hf_class)[1] else 0

    def _fusedenc_embedded_rows(self, stack, tail: "_Tail"):
        """The graph's function: padded ids (and token types) ``[B, S]`` whose real tokens are
        each row's first ``offsets[i + 1] - offsets[i]``, the offsets (int32 ``[B + 1]``,
        ending at T), T and the longest sequence, to ``tail.packed``'s result from the last
        layer's packed rows.  The real tokens are packed in the graph: T rows for every op."""
        emb = self.embeddings
        from_ids = self._fusedenc_first_position() > 0
        last = emb.position_embeddings.num_embeddings - 1

        def rows(ids, types, offsets, tokens: int, max_seqlen: int) -> torch.Tensor:
            if ids.device != emb.word_embeddings.weight.device:  # host ids, run eagerly
                device = emb.word_embeddings.weight.device
                ids, types = ids.to(device), None if types is None else types.to(device)
            batch, seq = ids.shape
            cu = torch.as_tensor(offsets, device=ids.device)  # a graph's static offsets; copied when eager
            fused = None if from_ids else _fused_embeddings(emb, ids)
            if fused is not None:  # one kernel for the packing, lookups, sums and LayerNorm
                x, target = fused.packed_embeddings(
                    ids, types, cu, tokens, emb.word_embeddings.weight, emb.position_embeddings.weight,
                    emb.token_type_embeddings.weight, emb.LayerNorm.weight, emb.LayerNorm.bias, emb.LayerNorm.eps)  # fmt: skip
            else:
                where = varlen.padded_rows(cu, tokens, batch, seq)
                token_ids = ids.reshape(-1)[where.flat]
                token_types = types.reshape(-1)[where.flat] if types is not None else torch.zeros_like(token_ids)
                if from_ids:  # RoBERTa: padding_idx + the count of non-padding ids so far in the sequence
                    real = token_ids.ne(emb.padding_idx).int()
                    counted = torch.cumsum(real, 0)
                    before = torch.where(where.start > 0, counted[(where.start - 1).clamp_(min=0)], 0)
                    positions = ((counted - before) * real + emb.padding_idx).clamp_(0, last)
                else:
                    positions = where.position.clamp(max=last)
                x, target = _embedded(emb, token_ids, token_types, positions), where.target
            return tail.packed(stack._packed_rows(x, cu, max_seqlen), target, cu, batch, seq)

        return rows

    def _fusedenc_dense_rows(self, stack, tail: "_Tail"):
        """The graph's function for batches without padding: ids (and token types) ``[B, S]``
        to ``tail.dense``'s result from the last layer's ``[B, S, D]`` (positions: BERT's
        index, RoBERTa's count)."""
        emb = self.embeddings
        from_ids = self._fusedenc_first_position() > 0

        def rows(ids: torch.Tensor, types: Optional[torch.Tensor]) -> torch.Tensor:
            b, s = ids.shape
            if from_ids:  # HF's create_position_ids_from_input_ids
                real = ids.ne(emb.padding_idx).int()
                positions = torch.cumsum(real, 1) * real + emb.padding_idx
            else:
                positions = torch.arange(s, device=ids.device).expand(b, s)
            x = _embedded(emb, ids, torch.zeros_like(ids) if types is None else types, positions)
            return tail.dense(stack._eager_rows(x.reshape(b * s, -1), b, s, None, None).view(b, s, -1))

        return rows


class _Tail:
    """What the short path's graph makes of the last layer's rows: ``packed(rows [T', D],
    target [T'], cu, B, S)`` (``target``: each packed row's index in ``[B * S]``, ``B * S``
    for slack rows) and ``dense(hidden [B, S, D])`` (no padding); ``done(model, result)``
    is the call's return value from the graph's output (after ``PaddedIdsFeed.take``)."""


class _Scattered(_Tail):
    """HF's output: the rows scattered back to ``[B, S, D]`` (zeros at padding), and HF's
    pooler on them in the graph when given (``_fusedenc_graph_pooler``), else after it."""

    def __init__(self, pooler: Optional[nn.Module]):
        self.pooler = pooler

    def packed(self, rows, target, cu, batch: int, seq: int):
        out = rows.new_zeros(batch * seq + 1, rows.shape[1])  # padding positions zero, as the encoder's unpack
        out.index_copy_(0, target, rows)  # slack rows: to the row dropped here
        return self.dense(out[:-1].view(batch, seq, rows.shape[1]))

    def dense(self, hidden):
        return hidden if self.pooler is None else {"hidden": hidden, "pooled": self.pooler(hidden)}

    def done(self, model, result):
        return model._fusedenc_finish(result)


#: The pooling modes (sentence-transformers' names) the short path's graph computes.
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len_tokens")


class _Pooled(_Tail):
    """``sentence_embeddings``: float32 ``[B, D]`` pooled in the graph (no ``[B, S, D]`` is
    written), L2-normalized when asked.  Modes as sentence-transformers' ``Pooling``: the mean
    over each sequence's real tokens, the first token's row (``cls``), the element-wise max over
    the real tokens, or their sum over the square root of their count (``mean_sqrt_len_tokens``);
    fp32 sums where sentence-transformers sums in the model's dtype."""

    def __init__(self, mode: str, normalize: bool):
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling mode {mode!r}: the graph pools {', '.join(POOLING_MODES)}")
        self.mode, self.normalize = mode, normalize

    def packed(self, rows, target, cu, batch: int, seq: int):
        if self.mode == "cls":
            # A bucket's spare sequences start at T, which may be the last static row + 1: clamped
            # (their rows are dropped by the feed's take).
            first = cu[:-1].long().clamp_(max=rows.shape[0] - 1)
            return self._finish(rows.index_select(0, first).float())
        which = torch.div(target, seq, rounding_mode="floor")  # each packed row's sequence; slack rows: B
        if self.mode == "max":
            pooled = rows.new_full((batch + 1, rows.shape[1]), float("-inf"), dtype=torch.float32)
            index = which[:, None].expand(-1, rows.shape[1])
            pooled.scatter_reduce_(0, index, rows.float(), "amax")
            return self._finish(pooled[:-1])
        sums = rows.new_zeros((batch + 1, rows.shape[1]), dtype=torch.float32)
        sums.index_add_(0, which, rows.float())
        counts = (cu[1:] - cu[:-1]).clamp(min=1).float()  # empty sequences (a bucket's spare ones): zeros
        scale = counts if self.mode == "mean" else counts.sqrt()
        return self._finish(sums[:-1] / scale[:, None])

    def dense(self, hidden):
        hidden = hidden.float()
        if self.mode == "cls":
            pooled = hidden[:, 0]
        elif self.mode == "max":
            pooled = hidden.amax(1)
        elif self.mode == "mean":
            pooled = hidden.mean(1)
        else:
            pooled = hidden.sum(1) / hidden.shape[1] ** 0.5
        return self._finish(pooled)

    def _finish(self, pooled):
        return torch.nn.functional.normalize(pooled, dim=1) if self.normalize else pooled

    def done(self, model, result):
        return result


_FLAG_NAMES = frozenset(("is_decoder", "output_hidden_states", "output_attentions", "return_dict"))


def _config_flags(config) -> tuple:
    """The config's ``is_decoder``, ``output_hidden_states``, ``output_attentions`` and
    ``return_dict``, read on every call.  ``PretrainedConfig.__getattribute__`` looks each
    name up in ``attribute_map`` first (~3 us an attribute in Python); where none of these
    names is an alias, the plain lookup gives the same values (properties included)."""
    try:
        aliases = object.__getattribute__(config, "attribute_map")
    except AttributeError:
        aliases = {}
    get = getattr if aliases and not aliases.keys().isdisjoint(_FLAG_NAMES) else _plain_getattr
    return (get(config, "is_decoder", False), get(config, "output_hidden_states", False),
            get(config, "output_attentions", False), get(config, "return_dict", True))  # fmt: skip


def _plain_getattr(obj, name: str, default):
    try:
        return object.__getattribute__(obj, name)
    except AttributeError:
        return default


def _embedded(emb: nn.Module, ids: torch.Tensor, types: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's embeddings in HF's order: (words + token types) + positions, then the LayerNorm
    (its dropout: eval)."""
    x = emb.word_embeddings(ids) + emb.token_type_embeddings(types)
    return emb.LayerNorm(x + emb.position_embeddings(positions))


#: The packed embeddings in one Triton kernel (``fusedenc.hf.triton_embeddings``) instead of ~15
#: torch ops in the short path's graph: on by default (a MiniLM graph at 32 sentences ~100 us
#: shorter on an H200); ``FUSEDENC_FUSED_EMBEDDINGS=0`` keeps the torch ops (an A/B switch).
FUSED_EMBEDDINGS_ENV = "FUSEDENC_FUSED_EMBEDDINGS"


def _fused_embeddings(emb: nn.Module, ids: torch.Tensor):
    """``fusedenc.hf.triton_embeddings`` where its kernel computes what HF's BERT embeddings
    module would here, else None: not switched off, a CUDA (sm80+) or ROCm device, Triton, plain
    lookups (no ``max_norm``: it renormalizes the table in place), an affine LayerNorm over
    the last dimension, one floating dtype for every table."""
    if os.environ.get(FUSED_EMBEDDINGS_ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if triton_unusable_on(ids.device) is not None:
        return None
    parts = emb._modules
    tables = [parts[name] for name in ("word_embeddings", "position_embeddings", "token_type_embeddings")]
    norm = parts["LayerNorm"]
    if any(not isinstance(t, nn.Embedding) or t.max_norm is not None for t in tables) or type(norm) is not nn.LayerNorm:
        return None
    if norm.weight is None or norm.bias is None or len(norm.normalized_shape) != 1:
        return None
    weights = [t.weight for t in tables] + [norm.weight, norm.bias]
    dtype = weights[0].dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or any(
            w.dtype != dtype or w.stride(-1) != 1 for w in weights):  # fmt: skip
        return None
    from . import triton_embeddings  # imports Triton

    return triton_embeddings


def _model_kind(cls: type) -> Optional[tuple[str, bool]]:
    """``_MODELS``' entry for HF model class ``cls`` (None: not given the short path)."""
    return _MODELS.get((cls.__module__, cls.__name__))


def _output(hidden: torch.Tensor, pooled: Optional[torch.Tensor]):
    global _output_class
    if _output_class is None:
        from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

        _output_class = BaseModelOutputWithPoolingAndCrossAttentions
    return _output_class(last_hidden_state=hidden, pooler_output=pooled)


def install(model: nn.Module) -> None:
    """Give every HF ``BertModel``, ``RobertaModel`` and ``XLMRobertaModel`` in ``model`` whose
    encoder is padding-free the short path (its class becomes a subclass that also derives
    from ``EmbeddedModel``); others, and models already given it, are left alone."""
    for module in model.modules():
        cls = type(module)
        if (isinstance(module, EmbeddedModel) or _model_kind(cls) is None
                or not isinstance(module.__dict__["_modules"].get("encoder"), hf_varlen.PaddingFreeEncoder)):
            continue  # fmt: skip
        patched_classes.mix_in(module, EmbeddedModel)  # HF's class name kept
        # A new token count nearly every call: as many graphs as the encoder's own stack keeps.
        auto_graphs.cache_of(module).max_graphs = hf_varlen.PACKED_MAX_GRAPHS

