"""Sentence embeddings: ``fusedenc.sentence_embeddings`` of Hugging Face base models and of
sentence-transformers models, and what ``patch_hf`` adds to a ``SentenceTransformer`` so that
its own ``encode()`` runs on fusedenc.

A ``SentenceTransformer`` is a sequence of modules: a ``Transformer`` holding an HF model, a
``Pooling`` and optionally a ``Normalize``.  ``patch_hf`` patches the HF model (so every
batch is one CUDA graph from the padded ids, padding-free) and gives the wrapper a subclass
(``SentenceModel``).  For plain text in and sentence embeddings out, with a pooling the graph
computes (mean, CLS, max or mean-sqrt-length, then the ``Normalize`` module's L2
normalization if there is one), its ``encode()`` runs the corpus loop (``_encode_texts``:
tokenized on threads, token-budget batches, only ``[B, D]`` leaving the graph); where
sentence-transformers lacks the ``_inference`` step that replaces, or the call has prompts or
other options, its own loop runs and the forward still pools in the graph.  Every other call
(weighted-mean, last-token or combined pooling modes, token embeddings, prompts excluded from
pooling, other modalities) runs sentence-transformers' own modules on the patched model.
sentence-transformers is never imported here: a model is recognized by its classes' names and
modules.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from torch import nn

from ..varlen import packing as varlen
from . import classes as patched_classes
from .embedded import POOLING_MODES, EmbeddedModel
from .st_tokens import chunk_tokenizer
from .token_batches import TOKENIZE_CHUNK, padded_batch, stream_batches, tokenized_chunks

__all__ = ["SentenceModel", "SentenceParts", "patch", "sentence_embeddings", "sentence_parts"]

#: Keys a sentence-transformers ``tokenize()`` / ``preprocess()`` returns besides HF's inputs:
#: bookkeeping the model's call does not take.
_ST_KEYS = frozenset({"modality", "prompt_length"})
_HF_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def sentence_embeddings(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                        token_type_ids: Optional[torch.Tensor] = None, *, normalize: Optional[bool] = None,
                        pooling: Optional[str] = None, **features: Any) -> torch.Tensor:
    """Float32 ``[B, D]`` sentence embeddings.

    ``model`` is an HF base model (``BertModel``, ``RobertaModel``, ``XLMRobertaModel``, ...)
    or a sentence-transformers ``SentenceTransformer``, patched or not.  For an HF model: each
    sequence's last hidden states pooled as ``pooling`` says (sentence-transformers' modes:
    ``"mean"`` over its real tokens, the default; ``"cls"``, the first token; ``"max"``;
    ``"mean_sqrt_len_tokens"``), L2-normalized unless ``normalize=False``.  For a
    ``SentenceTransformer`` (``pooling`` not given: its modules decide): what
    its own modules compute (its pooling mode, its ``Normalize`` module if it has one;
    ``normalize=True`` normalizes a model without one), from what its ``tokenize()`` returns
    (``sentence_embeddings(st, **st.tokenize(texts))``; the ``modality`` and ``prompt_length``
    keys are taken too).

    The tensors may be on the model's device or on the host, as the tokenizer returns them;
    the result is on the model's device.  On a patched BERT, RoBERTa or XLM-R model (or a
    ``SentenceTransformer`` holding one, with mean pooling) the pooling runs inside the
    model's CUDA graph, so a call launches once and yields ``[B, D]``; host tensors are the
    faster hand-over there (one copy from pinned memory).  Elsewhere the model's own call,
    then the pooling.  A sequence with no real token gets zeros (mean pooling)."""
    if pooling is not None and pooling not in POOLING_MODES:
        raise ValueError(f"sentence_embeddings: pooling={pooling!r}: one of {', '.join(POOLING_MODES)}")
    parts = sentence_parts(model)
    if parts is not None:
        if pooling is not None:
            raise ValueError(f"sentence_embeddings: pooling={pooling!r} for a {type(model).__name__}: its own Pooling "
                             f"module pools (pass pooling only with a Hugging Face model)")  # fmt: skip
        return _sentence_model_embeddings(model, parts, input_ids, attention_mask, token_type_ids, normalize, features)
    if features:
        raise TypeError(f"sentence_embeddings: unexpected arguments {sorted(features)} for a {type(model).__name__}: "
                        f"an HF model takes input_ids, attention_mask and token_type_ids (a SentenceTransformer "
                        f"also takes the rest of what its tokenize() returns)")  # fmt: skip
    if normalize is None:
        normalize = True
    return _base_model_embeddings(model, input_ids, attention_mask, token_type_ids, normalize=normalize,
                                  pooling=pooling or "mean")  # fmt: skip


def _check_inputs(input_ids, attention_mask, token_type_ids, normalize) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TypeError(f"sentence_embeddings: input_ids must be a 2-D integer tensor [B, S], got {got}")
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != input_ids.shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"sentence_embeddings: {name} must be a tensor of input_ids' shape "
                             f"{tuple(input_ids.shape)}, got {got}")  # fmt: skip
    if normalize is not None and not isinstance(normalize, bool):
        raise TypeError(f"sentence_embeddings: normalize must be True, False or None, got {normalize!r}")


def _base_model_embeddings(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                           token_type_ids: Optional[torch.Tensor] = None, *, normalize: bool = True,
                           pooling: str = "mean") -> torch.Tensor:  # fmt: skip
    """Float32 ``[B, D]`` sentence embeddings of a BERT-family encoder: each sequence's last
    hidden states pooled as sentence-transformers' ``pooling`` mode does (default the mean over
    its real tokens), L2-normalized unless ``normalize=False`` (its ``Normalize`` module).

    ``model`` is an HF base model (``BertModel``, ``RobertaModel``, ``XLMRobertaModel``, ...),
    patched or not; ``attention_mask`` HF's (1 = real token; None: every token real).  The
    tensors may be on the model's device or on the host, as the tokenizer returns them; the
    result is on the model's device.  On a model ``patch_hf`` gave the short path
    (``fusedenc.hf.embedded``), the pooling runs inside its CUDA graph, so a call launches once and
    yields ``[B, D]``: at small batches most of what the host would spend on ``[B, S, D]`` and
    a handful of pooling ops.  Host tensors are the faster hand-over there: the mask is read
    where it is, and the ids, token types and offsets go over in one copy from pinned memory
    (``graph_feeds.HostIdsFeed``) instead of the caller's copies and a read back.  Otherwise
    (other models, masks the short path leaves to HF, a CPU) the model's own call, then the
    same pooling in torch.  A sequence with no real token gets zeros (mean pooling)."""
    _check_inputs(input_ids, attention_mask, token_type_ids, normalize)
    _check_host_ids_in_range(model, input_ids, token_type_ids)
    with torch.no_grad():
        if isinstance(model, EmbeddedModel):
            out = model._fusedenc_pooled_call(input_ids, attention_mask, token_type_ids, normalize, pooling)
            if out is not None:
                return out
        param = next(model.parameters(), None)
        if param is not None:  # the tokenizer's host tensors to the model's device
            input_ids, attention_mask, token_type_ids = (
                None if t is None else t.to(param.device) for t in (input_ids, attention_mask, token_type_ids))  # fmt: skip
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        hidden = model(**kwargs)[0]  # last_hidden_state, from a ModelOutput or a tuple
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
            got = f"{tuple(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise TypeError(f"sentence_embeddings needs a base model whose first output is the last hidden state "
                            f"[B, S, D] (BertModel, RobertaModel, ...; a task head's is not): {type(model).__name__} "
                            f"returned {got} first for input_ids {tuple(input_ids.shape)}")  # fmt: skip
        pooled = varlen.masked_pool(hidden, attention_mask, pooling)
        return torch.nn.functional.normalize(pooled, dim=1) if normalize else pooled


def _check_host_ids_in_range(model: nn.Module, ids: torch.Tensor, types: Optional[torch.Tensor]) -> None:
    """Refuse ids (and token types) outside the model's embedding tables before anything runs,
    where they are on the host (the tokenizer's tensors: a few microseconds of numpy).  On the
    GPU an out-of-range id is a device-side assert in HF's lookups (the CUDA context is lost)
    and an unchecked read in the short path's one-kernel embeddings; a tokenizer of another
    model is the usual cause.  Tensors already on the GPU are not checked (it would cost a
    sync)."""
    embeddings = getattr(model, "embeddings", None)
    parts = embeddings._modules if isinstance(embeddings, nn.Module) else {}
    words = parts.get("word_embeddings")
    if words is None and hasattr(model, "get_input_embeddings"):
        words = model.get_input_embeddings()
    for name, t, table, what in (("input_ids", ids, words, "vocabulary"),
                                 ("token_type_ids", types, parts.get("token_type_embeddings"), "token types")):  # fmt: skip
        if t is None or t.device.type != "cpu" or t.numel() == 0 or not isinstance(table, nn.Embedding):
            continue
        values = t.numpy()
        size = table.num_embeddings
        # One reduction: read as unsigned, a negative id is larger than any table.
        if int(values.view(np.dtype(f"u{values.itemsize}")).max()) >= size:
            low = int(values.min())
            bad = low if low < 0 else int(values.max())
            raise IndexError(f"sentence_embeddings: {name} holds {bad}, outside the model's {what} of {size} "
                             f"(0 to {size - 1}): a tokenizer of another model?")  # fmt: skip


# ---- sentence-transformers ------------------------------------------------------------------


class SentenceParts(NamedTuple):
    """What fusedenc reads of a ``SentenceTransformer``."""

    hf_model: nn.Module  # the HF model inside its Transformer module
    pooling: tuple[str, ...]  # the Pooling module's modes ("mean", "cls", "max", ...); () without one
    include_prompt: bool  # whether pooling covers prompt tokens (Pooling.include_prompt)
    normalize: bool  # a Normalize module after the pooling
    standard: bool  # exactly Transformer, Pooling, optionally Normalize: the layout fusedenc can pool


def _is_sentence_transformer(model: Any) -> bool:
    return any(c.__name__ == "SentenceTransformer" and c.__module__.startswith("sentence_transformers")
               for c in type(model).__mro__)  # fmt: skip


def _pooling_modes(pooling: nn.Module) -> tuple[str, ...]:
    mode = getattr(pooling, "pooling_mode", None)  # sentence-transformers >= 6: a name or a tuple of them
    if isinstance(mode, str):
        return (mode,)
    if isinstance(mode, (tuple, list)):
        return tuple(mode)
    if hasattr(pooling, "get_pooling_mode_str"):  # earlier releases: one flag a mode
        return tuple(pooling.get_pooling_mode_str().split("+"))
    return ("unknown",)


def sentence_parts(model: Any) -> Optional[SentenceParts]:
    """The parts of a sentence-transformers ``SentenceTransformer`` (None for anything else);
    ``TypeError`` for one whose first module holds no Hugging Face model."""
    if not _is_sentence_transformer(model):
        return None
    modules = list(model._modules.values())
    first = modules[0] if modules else None
    hf_model = getattr(first, "auto_model", None) or getattr(first, "model", None)
    if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(f"{type(model).__name__}'s first module ({type(first).__name__}) holds no Hugging Face "
                        f"model: fusedenc runs sentence-transformers models built on a BERT-family Transformer")  # fmt: skip
    rest = [type(m).__name__ for m in modules[1:]]
    pooling = modules[1] if rest[:1] == ["Pooling"] else None
    normalize = rest[1:2] == ["Normalize"] or (pooling is None and rest[:1] == ["Normalize"])
    standard = pooling is not None and rest[1:] in ([], ["Normalize"])
    return SentenceParts(hf_model, _pooling_modes(pooling) if pooling is not None else (),
                         bool(getattr(pooling, "include_prompt", True)), normalize, standard)  # fmt: skip


def _graph_pooling(parts: SentenceParts, features: dict) -> bool:
    """Whether the patched model's graph can pool this call: one of its pooling modes (mean,
    CLS, max, mean over the square root of the length) over every real token (prompt
    included), text, nothing but HF's inputs, a model given the short path."""
    return (parts.standard and len(parts.pooling) == 1 and parts.pooling[0] in POOLING_MODES
            and isinstance(parts.hf_model, EmbeddedModel)
            and features.get("modality", "text") == "text"
            and (parts.include_prompt or not features.get("prompt_length"))
            and set(features) <= _ST_KEYS | set(_HF_KEYS))  # fmt: skip


def _sentence_model_embeddings(model, parts: SentenceParts, input_ids, attention_mask, token_type_ids,
                               normalize: Optional[bool], features: dict) -> torch.Tensor:  # fmt: skip
    _check_inputs(input_ids, attention_mask, token_type_ids, normalize)
    unknown = set(features) - _ST_KEYS
    if unknown:
        raise TypeError(f"sentence_embeddings: unexpected arguments {sorted(unknown)}: pass what the model's "
                        f"tokenize() returns (input_ids, attention_mask, token_type_ids, modality, prompt_length)")  # fmt: skip
    if normalize is False and parts.normalize:
        raise ValueError(f"sentence_embeddings: normalize=False, but {type(model).__name__} ends in a Normalize "
                         f"module: its embeddings are normalized (pass normalize=None for the model's own)")  # fmt: skip
    hf_inputs = {k: v for k, v in zip(_HF_KEYS, (input_ids, attention_mask, token_type_ids)) if v is not None}
    _check_host_ids_in_range(parts.hf_model, input_ids, token_type_ids)
    with torch.no_grad():
        if _graph_pooling(parts, {**hf_inputs, **features}):
            out = parts.hf_model._fusedenc_pooled_call(input_ids, attention_mask, token_type_ids,
                                                       parts.normalize or bool(normalize), parts.pooling[0])  # fmt: skip
            if out is not None:
                return out
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        call = {k: v.to(device) for k, v in hf_inputs.items()}
        was_training = model.training
        model.eval()  # as encode() does
        try:
            pooled = model({**call, **features})["sentence_embedding"].float()
        finally:
            model.train(was_training)
        return nn.functional.normalize(pooled, dim=1) if normalize and not parts.normalize else pooled


#: Set by ``SentenceModel.encode`` while only the sentence embedding is asked for.
_POOLED_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("fusedenc_pooled_only", default=False)


class SentenceModel:
    """The subclass ``patch_hf`` gives a ``SentenceTransformer`` (``patched_classes``): its
    ``encode()`` and forward pool inside the patched model's graph where they can, and are
    sentence-transformers' own everywhere else."""

    name_prefix = "Fusedenc"  # patched_classes: "Fusedenc" + "SentenceTransformer"

    def encode(self, *args: Any, **kwargs: Any):
        if not _has_inference_step(self):  # sentence-transformers < 6.1: no step to replace
            done = self._fusedenc_plain_encode(args, kwargs)
            if done is not _NOT_PLAIN:
                return done
        output_value = kwargs.get("output_value", "sentence_embedding")
        if args and len(args) > 1:  # output_value given by position: read it off the signature
            bound = inspect.signature(super().encode).bind_partial(*args, **kwargs)
            output_value = bound.arguments.get("output_value", output_value)
        token = _POOLED_ONLY.set(output_value == "sentence_embedding")
        try:
            return super().encode(*args, **kwargs)
        finally:
            _POOLED_ONLY.reset(token)

    def _fusedenc_plain_encode(self, args: tuple, kwargs: dict) -> Any:
        """``encode()`` of plain text to sentence embeddings through ``_encode_texts``, for
        sentence-transformers releases whose ``encode()`` has no ``_inference`` step; its
        return conventions (6.0's: a tensor, a float array, bfloat16 as float32, or a list of
        rows; a single text's row alone).  ``_NOT_PLAIN`` for any other call."""
        signature = inspect.signature(super().encode)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return _NOT_PLAIN  # sentence-transformers' own encode() raises the right error
        first = next(iter(signature.parameters))
        texts = bound.arguments.get(first)
        options = {"batch_size": 32, "show_progress_bar": None, "output_value": "sentence_embedding",
                   "convert_to_numpy": True, "convert_to_tensor": False, "normalize_embeddings": False,
                   "precision": "float32"}  # fmt: skip
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if name == first or (kind is inspect.Parameter.VAR_KEYWORD and not value):
                continue
            if name in options:
                options[name] = value
            elif value is not None:  # prompts, a device, truncate_dim, a pool, model kwargs, ...
                return _NOT_PLAIN
        single = isinstance(texts, str)
        texts = [texts] if single else texts
        parts = sentence_parts(self)
        if (options["output_value"] != "sentence_embedding" or options["precision"] not in (None, "float32")
                or not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts)
                or not isinstance(options["batch_size"], int) or options["batch_size"] <= 0
                or getattr(self, "default_prompt_name", None) or getattr(self, "truncate_dim", None) is not None
                or not _graph_pooling(parts, {}) or not _pads_right(self)):  # fmt: skip
            return _NOT_PLAIN
        out = _encode_texts(self, parts, list(texts), options["batch_size"], options["normalize_embeddings"])
        if options["convert_to_tensor"]:
            result = out
        elif options["convert_to_numpy"]:
            out = out.cpu()
            result = (out.float() if out.dtype == torch.bfloat16 else out).numpy()
        else:
            result = list(out)
        return result[0] if single else result

    def _inference(self, inputs: list, *, prompt: Optional[str] = None, batch_size: int = 32,
                   output_value: Optional[str] = "sentence_embedding", save_to_cpu: bool = True,
                   normalize_embeddings: bool = False, truncate_dim: Optional[int] = None,
                   device: Any = None, **kwargs: Any):  # fmt: skip
        """sentence-transformers' (>= 6.1) per-call inference loop: here, for plain text in,
        sentence embeddings out, fusedenc's corpus loop (``_encode_texts``) instead of
        sentence-transformers' batch by batch one; everything else is its own."""
        parts = sentence_parts(self)
        if (output_value != "sentence_embedding" or prompt or truncate_dim is not None or device is not None
                or set(kwargs) - {"show_progress_bar"} or not inputs or not _graph_pooling(parts, {})
                or not all(isinstance(t, str) for t in inputs) or not _pads_right(self)):  # fmt: skip
            return super()._inference(inputs, prompt=prompt, batch_size=batch_size, output_value=output_value,
                                      save_to_cpu=save_to_cpu, normalize_embeddings=normalize_embeddings,
                                      truncate_dim=truncate_dim, device=device, **kwargs)  # fmt: skip
        resolve = getattr(self, "_resolve_inference_device", None)
        if resolve is not None:
            resolve(None)  # sentence-transformers' own placement step
        out = _encode_texts(self, parts, inputs, batch_size, normalize_embeddings)
        return out.cpu() if save_to_cpu else out

    def forward(self, input: Mapping, **kwargs: Any):  # noqa: A002 - sentence-transformers' name
        # The features are a dict or a BatchEncoding (a mapping that is not a dict)
        if _POOLED_ONLY.get() and not kwargs and isinstance(input, Mapping):
            parts = sentence_parts(self)
            if _graph_pooling(parts, input):
                ids = input["input_ids"]
                pooled = parts.hf_model._fusedenc_pooled_call(ids, input.get("attention_mask"), input.get("token_type_ids"),
                                                              parts.normalize, parts.pooling[0])  # fmt: skip
                if pooled is not None:  # in the model's dtype, as sentence-transformers' pooling gives
                    dtype = next(parts.hf_model.parameters()).dtype
                    return {**input, "sentence_embedding": pooled.to(dtype)}
        return super().forward(input, **kwargs)


_NOT_PLAIN = object()  # SentenceModel._fusedenc_plain_encode: not a call it takes


def _has_inference_step(model: Any) -> bool:
    """Whether sentence-transformers' ``encode()`` hands its loop to ``_inference`` (6.1 and
    later), which ``SentenceModel`` replaces; earlier releases loop inside ``encode()``."""
    return any("_inference" in vars(c) for c in type(model).__mro__ if c is not SentenceModel)


def _pads_right(model: Any) -> bool:
    """A tokenizer that pads on the right: with left padding HF's BERT numbers positions from the
    padding, and sentence-transformers' own loop gives that (the short path refuses it)."""
    return getattr(getattr(model, "tokenizer", None), "padding_side", "right") == "right"


@torch.inference_mode()  # as sentence-transformers' own loop
def _encode_texts(model: nn.Module, parts: SentenceParts, texts: list, batch_size: int,
                  normalize: bool) -> torch.Tensor:  # fmt: skip
    """A patched ``SentenceTransformer``'s embeddings of ``texts`` (``[N, D]`` in the model's
    dtype, on its device, in input order; L2-normalized at the end when ``normalize``, as
    ``encode(normalize_embeddings=True)``; the model in eval mode, as ``encode()`` puts it),
    computed as the corpus command does rather than as
    ``encode()``'s loop: sentence-transformers' loop tokenizes each batch on the thread that
    feeds the GPU, which on an H200 host bounds it to ~8k sentences/s whatever the model.  Here:

    * the texts are ordered as sentence-transformers orders them (longest text first) and
      tokenized in chunks on threads, while the chunks done so far run on the GPU: by the
      fast tokenizer where a sample of the call shows it gives the ids the model's own
      ``preprocess`` gives (its lower-casing, stripping and truncation), else by
      ``preprocess`` (``st_tokens``);
    * the texts are sorted by token count and cut by a budget of ``batch_size x
      max_seq_length`` padded tokens across chunks (``stream_batches``), so no batch holds
      more than the same ``encode(batch_size=...)`` could (the memory bound the caller chose)
      and a batch of short sentences holds many;
    * each batch goes over as host tensors to the patched model's graph, which pools there.
    """
    model.eval()
    hf_model = parts.hf_model
    param = next(hf_model.parameters())
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None) or 0
    max_length = int(getattr(model, "max_seq_length", None) or 512)
    budget = max(1, batch_size) * max_length
    done, placed = [], []
    tokenized = tokenized_chunks(texts, chunk_tokenizer(model, texts), TOKENIZE_CHUNK)
    for rows, ids, types, _ in stream_batches(((r, *t) for r, t in tokenized), budget):
        batch, mask = padded_batch(ids, pad)
        call = {"input_ids": torch.from_numpy(batch), "attention_mask": torch.from_numpy(mask)}
        if types is not None:
            call["token_type_ids"] = torch.from_numpy(padded_batch(types, 0)[0])
        pooled = hf_model._fusedenc_pooled_call(call["input_ids"], call["attention_mask"],
                                                call.get("token_type_ids"), parts.normalize, parts.pooling[0])  # fmt: skip
        if pooled is None:  # the short path declined (a hook added, ...): sentence-transformers' forward
            pooled = nn.Module.__call__(model, {k: v.to(param.device) for k, v in call.items()})
            pooled = pooled["sentence_embedding"]
        done.append(pooled.to(param.dtype))
        placed.append(rows)
    inverse = np.empty(len(texts), dtype=np.int64)
    inverse[np.concatenate(placed)] = np.arange(len(texts))
    out = torch.cat(done)
    out = out[torch.from_numpy(inverse).to(out.device)]
    return nn.functional.normalize(out, p=2, dim=1) if normalize else out


def patch(model: nn.Module, patch_hf: Any, *, inplace: bool, padding_free: bool) -> nn.Module:
    """``patch_hf`` of a ``SentenceTransformer`` (``patch_hf`` passes itself: it imports this
    module): its HF model patched, the wrapper in eval mode and given ``SentenceModel`` (its
    class name becomes "Fusedenc" + its own), once."""
    if not inplace:
        model = copy.deepcopy(model)
    hf_model = sentence_parts(model).hf_model
    # A SentenceTransformer is an inference wrapper whose encode() puts it in eval mode on every
    # call; a freshly built one still says training.  Its HF model is checked as any other
    # (a refusal leaves both as they were).
    hf_was_training = hf_model.training
    hf_model.eval()
    try:
        patch_hf(hf_model, inplace=True, padding_free=padding_free)
    except (TypeError, ValueError):
        hf_model.train(hf_was_training)
        raise
    model.eval()
    if not isinstance(model, SentenceModel):
        patched_classes.mix_in(model, SentenceModel)
    return model
