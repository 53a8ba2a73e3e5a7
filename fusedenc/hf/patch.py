"""Run the encoder layers of Hugging Face BERT-family models on fusedenc.

``patch_hf(model)`` swaps every encoder layer of a ``BertModel``,
``RobertaModel`` (or XLM-RoBERTa, CamemBERT, ELECTRA, Data2VecText) and of
their task heads (``BertForSequenceClassification``, ...) for an
``HFEncoderLayer``: a thin adapter around one ``fusedenc.EncoderBlock``
(post-LN, ``residual_alpha=1``) holding the layer's weights, with the QKV
projections packed into one GEMM.  Embeddings, pooler and heads stay
Hugging Face's.  The adapter takes the arguments the installed transformers
version passes its layers and returns what that version's layer returns, so
the rest of the model (and its outputs, ``output_hidden_states`` included)
is unchanged.

transformers is not imported by fusedenc itself; it is only needed to build
the model being patched.  Tested with transformers 4.46, 4.57, 5.17 and 5.23.
"""

from __future__ import annotations

import copy
import inspect
from typing import NamedTuple, Optional

import torch
from torch import nn

from ..common import dtypes
from ..common.activations import HF_ACTIVATIONS
from ..encoder.blocks import EncoderBlock
from ..ops.gemm import pack_qkv
from . import classes as patched_classes
from . import embedded as hf_embedded
from . import sentences
from . import varlen as hf_varlen
from .masks import SUPPORTED_ATTN_IMPLEMENTATIONS, MaskCache, convert_mask

__all__ = [
    "HF_ACTIVATIONS",
    "HFEncoderLayer",
    "SUPPORTED_ATTN_IMPLEMENTATIONS",
    "SUPPORTED_MODEL_TYPES",
    "convert_mask",
    "patch_hf",
]

#: ``config.model_type`` of models whose layers are BertLayer copies (post-LN,
#: absolute positions, separate Q/K/V): the only ones ``patch_hf`` accepts.
#: RoFormer, BigBird, ConvBERT, ESM, MegatronBERT, ... have layers that look
#: alike but compute something else (rotary, sparse, convolutions, pre-LN).
SUPPORTED_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "data2vec-text")

#: Where each EncoderBlock parameter comes from in a BertLayer.
_LINEARS = {
    "q": "attention.self.query",
    "k": "attention.self.key",
    "v": "attention.self.value",
    "out": "attention.output.dense",
    "ffn1": "intermediate.dense",
    "ffn2": "output.dense",
}
_NORMS = {"norm1": "attention.output.LayerNorm", "norm2": "output.LayerNorm"}


# ------------------------------------------------------------ the layer ----


class HFEncoderLayer(nn.Module):
    """A BertLayer's replacement: one fusedenc ``EncoderBlock`` behind HF's layer interface.

    ``forward`` takes the arguments of the replaced layer's ``forward`` (its
    positional order differs between transformers 4.x and 5.x; the names are
    taken from the replaced class) and returns what it returned: a tuple
    ``(hidden_states,)`` in 4.x, the tensor in 5.x.  ``attention_mask`` is
    converted by ``convert_mask``.  Arguments that would change the result and
    that the block cannot honour (``head_mask``, ``output_attentions``, a KV
    cache, ``is_causal``, packed-sequence metadata) raise ``ValueError``;
    the rest are ignored, as a non-decoder BertLayer ignores them
    (``encoder_hidden_states``, ``position_ids``, ``cache_position``, ...).

    Inference only: forward runs without autograd and raises ``RuntimeError``
    in training mode.  ``patch_hf`` installs a subclass that also derives from
    the replaced layer class (``FusedBertLayer`` for ``BertLayer``), so
    ``isinstance`` checks, among them transformers 5's hooks that record
    ``output_hidden_states``, still find the layers.
    """

    name_prefix = "Fused"  # patched_classes: the class is "Fused" + the HF layer class's name

    def __init__(
        self,
        block: EncoderBlock,
        config,
        arg_names: tuple[str, ...],
        returns_tuple: bool,
        masks: Optional[MaskCache] = None,
        first: bool = True,
    ):
        # nn.Module's __init__, not super(): the HF layer class mixed into the
        # installed subclass would build its own submodules.
        nn.Module.__init__(self)
        self.block = block
        self.config = config
        self.num_heads = config.num_attention_heads
        self._arg_names = arg_names  # the replaced forward's positional names after hidden_states, attention_mask
        self._returns_tuple = returns_tuple
        self._masks = masks if masks is not None else MaskCache()  # shared by the layers of one encoder
        self._first = first  # the encoder's first layer converts the mask afresh every call
        self._padding_free: Optional[hf_varlen.PaddingFree] = None  # shared with the encoder (hf_varlen.install)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs):
        if args:
            if len(args) > len(self._arg_names):
                raise TypeError(f"{type(self).__name__}.forward got {2 + len(args)} positional arguments")
            kwargs.update(zip(self._arg_names, args))
        self._refuse(kwargs)
        shared = self._padding_free
        packing = shared.packed(hidden_states, attention_mask) if shared is not None else None
        if packing is not None:  # the encoder packed the real tokens: [1, T_real, D] rows (hf_varlen)
            if shared.result is not None:  # ... and ran every layer's block as one stack: hand its rows on
                return (shared.result,) if self._returns_tuple else shared.result
            with torch.no_grad():
                out = self.block.forward_packed(hidden_states[0], packing)[None]
            return (out,) if self._returns_tuple else out
        refresh = self._first and not (shared is not None and shared.converted)
        bias, key_padding_mask = self._masks(attention_mask, hidden_states, self.num_heads, refresh)
        with torch.no_grad():
            out = self.block(hidden_states, attn_bias=bias, key_padding_mask=key_padding_mask)
        return (out,) if self._returns_tuple else out

    def _refuse(self, kwargs: dict) -> None:
        if self.training:
            raise RuntimeError(
                f"{type(self).__name__} is inference-only (fusedenc.patch_hf): call model.eval() before running it"
            )
        # transformers 5 reads output_attentions from the config when the call does not pass it.
        if kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)):
            raise ValueError(
                "output_attentions is not supported by fusedenc-patched layers: the fused attention "
                "never forms the attention weights"
            )
        for name in ("head_mask", "past_key_value", "past_key_values"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} is not supported by fusedenc-patched layers (encoder inference only)")
        if kwargs.get("is_causal"):
            raise ValueError("is_causal=True is not supported by fusedenc-patched layers (bidirectional encoders only)")
        for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} (packed sequences) is not supported by fusedenc-patched layers")

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, returns_tuple={self._returns_tuple}"


def _fused_class(layer_cls: type) -> type:
    """``HFEncoderLayer`` mixed with the layer class it replaces (one class per HF class)."""
    return patched_classes.subclass(HFEncoderLayer, layer_cls)


# ------------------------------------------------------------ patching ----


class _LayerPlan(NamedTuple):
    encoder: nn.Module
    index: int
    layer: nn.Module
    config: object
    activation: str
    masks: MaskCache


def _find_encoders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules named ``*Encoder`` holding a ``layer`` ModuleList of ``*Layer`` modules."""
    found = []
    for name, module in model.named_modules():
        layers = getattr(module, "layer", None)
        if (
            type(module).__name__.endswith("Encoder")
            and isinstance(layers, nn.ModuleList)
            and len(layers) > 0
            and all(type(layer).__name__.endswith("Layer") for layer in layers)
        ):
            found.append((name or type(module).__name__, module))
    return found


def _check_config(config, where: str) -> str:
    """Refuse what the block cannot compute; return the fusedenc activation name."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"{where}: model_type={model_type!r} is not supported; patch_hf supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(
            f"{where}: decoders are not supported (config.is_decoder={getattr(config, 'is_decoder', False)}, "
            f"add_cross_attention={getattr(config, 'add_cross_attention', False)}): causal self-attention and "
            f"cross-attention have no fusedenc block"
        )
    position = getattr(config, "position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(
            f"{where}: position_embedding_type={position!r} is not supported: relative position embeddings live "
            f"inside the attention; only 'absolute' can be patched"
        )
    act = getattr(config, "hidden_act", None)
    if not isinstance(act, str):
        raise TypeError(f"{where}: hidden_act must name an activation, got {type(act).__name__}")
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act={act!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
    impl = getattr(config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"{where}: attn_implementation={impl!r} is not supported (its attention masks are not handled); "
            f"load the model with attn_implementation='sdpa' or 'eager' (the patched layers run fusedenc's "
            f"attention either way)"
        )
    if getattr(config, "output_attentions", False):
        raise ValueError(
            f"{where}: config.output_attentions=True is not supported: the fused attention never forms the weights"
        )
    return HF_ACTIVATIONS[act]


def _check_layer(layer: nn.Module, where: str, config) -> None:
    """Refuse a layer that is not a plain post-LN BertLayer with usable weights."""
    if hasattr(layer, "crossattention"):
        raise ValueError(f"{where}: cross-attention layers are not supported")
    attn = getattr(getattr(layer, "attention", None), "self", None)
    position = getattr(attn, "position_embedding_type", "absolute")
    if position != "absolute" or hasattr(attn, "distance_embedding"):
        raise ValueError(f"{where}: relative position embeddings ({position!r}) are not supported")
    modules = {}
    for key, path in {**_LINEARS, **_NORMS}.items():
        try:
            modules[key] = layer.get_submodule(path)
        except AttributeError:
            raise TypeError(f"{where} ({type(layer).__name__}) is not a BERT-style layer: it has no {path}") from None
    for key, path in _LINEARS.items():
        m = modules[key]
        if not isinstance(m, nn.Linear) or m.bias is None:
            raise TypeError(f"{where}.{path} must be an nn.Linear with a bias, got {type(m).__name__}")
    for key, path in _NORMS.items():
        m = modules[key]
        if not isinstance(m, nn.LayerNorm) or m.weight is None or m.bias is None or len(m.normalized_shape) != 1:
            raise TypeError(f"{where}.{path} must be an affine nn.LayerNorm over the last dim, got {m}")
    params = [p for m in modules.values() for p in (m.weight, m.bias)]
    dtype, device = params[0].dtype, params[0].device
    if dtype not in dtypes.SUPPORTED:
        raise TypeError(f"{where}: weights are {dtype}; patch_hf supports float16, bfloat16 and float32")
    if device.type == "meta":
        raise ValueError(f"{where}: weights are on the meta device; load them before patching")
    if any(p.dtype != dtype or p.device != device for p in params):
        raise ValueError(f"{where}: weights must share one dtype and device")
    d = modules["q"].in_features
    f = modules["ffn1"].out_features
    shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "out": (d, d), "ffn1": (f, d), "ffn2": (d, f)}
    for key, shape in shapes.items():
        got = tuple(modules[key].weight.shape)
        if got != shape:
            raise ValueError(f"{where}.{_LINEARS[key]}.weight has shape {got}, expected {shape}")
    for key in _NORMS:
        got = tuple(modules[key].normalized_shape)
        if got != (d,):
            raise ValueError(f"{where}.{_NORMS[key]} normalizes {got}, expected ({d},)")
    eps1, eps2 = modules["norm1"].eps, modules["norm2"].eps
    if eps1 != eps2:
        raise ValueError(f"{where}: the two LayerNorms have different eps ({eps1}, {eps2}); the block has one")
    heads = config.num_attention_heads
    if d % heads:
        raise ValueError(f"{where}: hidden size {d} is not a multiple of num_attention_heads={heads}")


def _build(plan: _LayerPlan, returns_tuple: bool) -> HFEncoderLayer:
    """A new adapter holding a copy of ``plan.layer``'s weights (the layer itself is untouched)."""
    layer = plan.layer
    m = {key: layer.get_submodule(path) for key, path in {**_LINEARS, **_NORMS}.items()}
    d, f = m["q"].in_features, m["ffn1"].out_features
    weight = m["q"].weight
    block = EncoderBlock(
        d,
        plan.config.num_attention_heads,
        f,
        plan.activation,
        norm_first=False,
        residual_alpha=1.0,
        layer_norm_eps=m["norm1"].eps,
        bias=True,
        dtype=weight.dtype,
        device=weight.device,
    )
    qkv_weight, qkv_bias = pack_qkv(m["q"].weight, m["k"].weight, m["v"].weight, m["q"].bias, m["k"].bias, m["v"].bias)
    state = {"qkv_weight": qkv_weight, "qkv_bias": qkv_bias}
    for key in ("out", "ffn1", "ffn2", "norm1", "norm2"):
        state[f"{key}_weight"], state[f"{key}_bias"] = m[key].weight, m[key].bias
    block.load_state_dict(state, strict=True)  # strict: every block parameter must come from the layer
    block.requires_grad_(False).eval()

    # The replaced forward's positional parameters after (hidden_states, attention_mask):
    # 4.x passes head_mask third, 5.x encoder_hidden_states.
    params = list(inspect.signature(type(layer).forward).parameters.values())[1:]  # drop self
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    fused = _fused_class(type(layer))(
        block, plan.config, tuple(positional[2:]), returns_tuple, plan.masks, plan.index == 0
    )
    return fused.eval()


def _transformers_major() -> int:
    import transformers  # present: it built the model being patched

    return int(transformers.__version__.split(".")[0])


def patch_hf(model: nn.Module, *, inplace: bool = True, padding_free: bool = True) -> nn.Module:
    """Replace the encoder layers of a Hugging Face BERT-family model with fusedenc blocks.

    Finds every ``*Encoder`` module with a ``layer`` ModuleList (``model.encoder``
    of ``BertModel``/``RobertaModel``, ``model.bert.encoder`` /
    ``model.roberta.encoder`` of their heads, and wherever else such a model
    is nested) and replaces each layer with an ``HFEncoderLayer`` running one
    ``EncoderBlock`` (post-LN, ``residual_alpha=1``, the layers' LayerNorm
    eps, the weights' dtype and device): Q/K/V packed into one GEMM, the
    attention output projection, both residual+LayerNorms and the FFN with its
    activation (``config.hidden_act`` "gelu" is the exact erf GELU;
    "gelu_new"/"gelu_pytorch_tanh" the tanh form; also relu, silu/swish,
    tanh, sigmoid, mish).  The outputs match the unpatched model's.

    Not replaced: embeddings, pooler, task heads, loss; they stay Hugging
    Face's.  The old layers are dropped (their weights are copied, so peak
    memory briefly holds both).  The patched model is for inference: the
    layers run without autograd and raise in training mode.  Save the
    original model's weights, not the patched model's (its state-dict keys
    are fusedenc's); the patched model pickles whole (``patched_classes``).

    Refused with ``TypeError``/``ValueError`` naming the problem, before
    anything is changed: no BERT-style encoder found; a model type other than
    ``SUPPORTED_MODEL_TYPES``; decoders and cross-attention
    (``config.is_decoder``, ``add_cross_attention``); relative position
    embeddings; an unsupported ``hidden_act``; ``attn_implementation`` other
    than "eager" or "sdpa"; ``config.output_attentions=True``; weights not
    fp16/bf16/fp32 on one device; a model in training mode (call
    ``model.eval()`` first; raising beats silently dropping dropout).  At call
    time, ``head_mask``, ``output_attentions=True`` and ``is_causal=True``
    raise ``ValueError``.

    Padding-free (``padding_free=True``, the default): when HF passes a mask with
    padding, each encoder packs the batch's real tokens once, every layer computes only
    those, and the output is scattered back to HF's padded shape with **zeros at padding
    positions** (``fusedenc.hf.varlen`` says when the padded path runs instead); a
    BERT/RoBERTa/XLM-R model's plain call runs its embeddings there too (``fusedenc.hf.embedded``).
    ``padding_free=False`` keeps every layer on the padded batch.

    A sentence-transformers ``SentenceTransformer`` is taken too (``fusedenc.hf.sentences.patch``):
    its HF model is patched, and its ``encode()`` runs on fusedenc.

    A model already patched is left as it is.  ``inplace=False`` patches a
    deep copy and leaves ``model`` alone.  Returns the patched model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if sentences.sentence_parts(model) is not None:
        return sentences.patch(model, patch_hf, inplace=inplace, padding_free=padding_free)
    # What the model is comes before its state: a module with no encoder is told so, whatever its mode.
    encoders = _find_encoders(model)
    if not encoders:
        raise TypeError(
            f"found no BERT-style encoder in {type(model).__name__}: expected a module named *Encoder "
            f"with a `layer` ModuleList of *Layer modules (as BertModel.encoder)"
        )
    if model.training:
        raise ValueError(
            "model is in training mode: patched layers are inference-only (no dropout, no autograd); "
            "call model.eval() before patch_hf"
        )
    if not inplace:
        model = copy.deepcopy(model)
        encoders = _find_encoders(model)

    # Check everything first: a refusal must leave the model as it was.
    plans = []
    for name, encoder in encoders:
        config = getattr(encoder, "config", None)
        if config is None:
            raise TypeError(f"{name} ({type(encoder).__name__}) has no config; cannot tell what its layers compute")
        activation = _check_config(config, name)
        masks = MaskCache()
        for i, layer in enumerate(encoder.layer):
            if isinstance(layer, HFEncoderLayer):
                continue  # patched before
            _check_layer(layer, f"{name}.layer.{i}", config)
            plans.append(_LayerPlan(encoder, i, layer, config, activation, masks))

    with torch.no_grad():
        fused = [_build(plan, _transformers_major() < 5) for plan in plans]
    for plan, layer in zip(plans, fused):
        plan.encoder.layer[plan.index] = layer
    if padding_free:
        for _, encoder in encoders:
            if all(isinstance(layer, HFEncoderLayer) for layer in encoder.layer):
                hf_varlen.install(encoder)
        hf_varlen.pass_masks_through(model)
        hf_embedded.install(model)

    # transformers 5 records output_hidden_states with forward hooks that it installs
    # once per model, lazily, on every module of the layer class.  Hooks installed
    # before this call left with the old layers: let it install them again.
    for module in model.modules():
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False
    return model
