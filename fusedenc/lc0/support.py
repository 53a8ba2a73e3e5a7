"""Whether fusedenc can run an Lc0 net: ``check_supported`` and ``expected_shapes``.

fusedenc runs attention bodies (formats 6, 7, 134) with the PE_DENSE embedding, no
relative position encodings, and every weight the body and heads need, at the size the
rest of the file implies (``expected_shapes``: derived from the file's own bias lengths,
as lc0 derives them).  ``check_supported`` raises ``Lc0FormatError`` listing every problem,
before any tensor reaches a device: besides the format and each missing or mis-sized weight,
every size fusedenc's network builder cannot use (an attention width other than d_model,
body widths that are not multiples of 8), and with ``dtype=`` the layers whose values do
not fit that dtype.  (A policy head's own encoder layers, which ``reference`` runs, are
refused by ``Lc0Network`` before it builds anything.)

The rules read only each layer's element count and presence, so they run as well on a net
whose layers are not decoded yet: ``read_net`` plans every layer (``weights.LayerPlan``, its
count from its byte length) and calls ``refuse_mis_sized`` before decoding any, so a file
whose layers contradict its own sizes is refused before it costs float32 memory.

Values: ``read_net`` refuses a layer with NaN or infinite values.  For a dtype,
``check_supported(net, dtype=...)`` refuses the layers with values beyond the dtype's range
(they would be inf on the device: float16's is +-65504) and warns (``Lc0ValueWarning``) about
layers beyond float16's range in a wider dtype: lc0's fp16 backends cannot run such a net,
and values that large usually overflow in the forward (a LayerNorm squares them), giving
NaN heads.  ``check_finite_heads`` is the forward's opt-in check
(``Lc0Network(..., check_finite=True)``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Mapping, Optional

import torch

from ..common.activations import LC0_ACTIVATIONS
from .errors import Lc0FileError, Lc0FormatError, Lc0NonFiniteError, Lc0ValueWarning
from .schema import (
    ATTENTION_BODIES,
    InputEmbeddingFormat,
    InputFormat,
    MovesLeftFormat,
    NetworkStructure,
    PolicyFormat,
    ValueFormat,
    enum_label,
    enum_name,
)
from .weights import present

__all__ = [
    "FLOAT16_MAX",
    "Lc0MisSizedError",
    "check_finite_heads",
    "check_supported",
    "expected_shapes",
    "refuse_mis_sized",
    "shaped_as_expected",
]

#: What the rules read: a ``netfile.NetFile``, its layers decoded (tensors) or, while
#: ``read_net`` checks it before decoding, planned (``weights.LayerPlan``: counts from the byte
#: lengths).  Only ``numel``, presence and the format fields are read, so the one set of rules
#: serves both.  An alias, not an import: ``netfile`` runs these rules, so it sits above this module.
Net = Any


class Lc0MisSizedError(Lc0FormatError, Lc0FileError):
    """A layer holds another number of values than the sizes its own file gives it: a net
    fusedenc cannot run (``Lc0FormatError``, as ``check_supported`` says) and a damaged file
    (``Lc0FileError``, as ``read_net`` refuses it, before decoding any layer), so that callers
    of either keep catching it."""

#: float16's largest finite value: weights beyond it are refused for a float16 net and warned
#: about for a wider one (lc0's fp16 backends cannot run them either).
FLOAT16_MAX = 65504.0
#: Row lengths fusedenc's encoder blocks need a multiple of (16-byte rows of fp16/bf16).
BODY_DIM_MULTIPLE = 8

Shape = Optional[tuple[Optional[int], ...]]


class _Specs:
    """The weight layers a net must (or, when present, may) hold and their shapes, derived
    from the file's own bias lengths as lc0 derives them; plus problems found on the way."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.layers: list[tuple[str, Shape, bool]] = []
        self.problems: list[str] = []

    def numel(self, path: str) -> Optional[int]:
        return self.net.numel(path)

    def add(self, path: str, shape: tuple[Optional[int], ...], required: bool = True) -> None:
        known = all(isinstance(s, int) for s in shape)
        if required or self.net.get(path) is not None:
            self.layers.append((path, shape if known else None, required))

    def encoder_layer(
        self, p: str, width: Optional[int], heads: Optional[int], body: bool = False
    ) -> tuple[bool, Optional[int]]:
        """An encoder layer at ``p`` working on ``width``-wide rows; returns whether it has
        smolgen and its gen size (None where unknown).  ``body``: a layer of the body, which
        fusedenc runs as an ``EncoderBlock`` (attention width = d_model, multiples of 8)."""
        dm = self.numel(f"{p}.mha.q_b")
        d_ff = self.numel(f"{p}.ffn.dense1_b")
        if body and dm and width and dm != width:
            self.problems.append(
                f"{p}.mha.q_b: attention width {dm} differs from d_model {width} (weights.ip_emb_b): "
                "fusedenc's encoder blocks need them equal"
            )
        if body and dm and dm % BODY_DIM_MULTIPLE:
            self.problems.append(f"{p}.mha.q_b: attention width {dm} is not a multiple of {BODY_DIM_MULTIPLE} "
                                 "(fusedenc's GEMMs need 16-byte rows)")
        if body and d_ff and d_ff % BODY_DIM_MULTIPLE:
            self.problems.append(f"{p}.ffn.dense1_b: FFN width {d_ff} is not a multiple of {BODY_DIM_MULTIPLE} "
                                 "(fusedenc's GEMMs need 16-byte rows)")
        for x in "qkv":
            self.add(f"{p}.mha.{x}_w", (dm, width))
            self.add(f"{p}.mha.{x}_b", (dm,))
        self.add(f"{p}.mha.dense_w", (width, dm))
        self.add(f"{p}.mha.dense_b", (width,))
        if dm and heads and dm % heads:
            self.problems.append(f"{p}.mha: attention width {dm} is not a multiple of {heads} heads")
        for ln in ("ln1", "ln2"):
            self.add(f"{p}.{ln}_gammas", (width,))
            self.add(f"{p}.{ln}_betas", (width,))
        self.ffn(f"{p}.ffn", width, d_ff)
        for rpe in ("rpe_q", "rpe_k", "rpe_v"):
            if self.net.get(f"{p}.mha.{rpe}") is not None:
                self.problems.append(f"{p}.mha.{rpe}: relative position encodings are not supported (nor by lc0)")
        if self.net.get(f"{p}.mha.smolgen") is None:
            return False, None
        s = f"{p}.mha.smolgen"
        compress = self.numel(f"{s}.compress")
        hidden_channels = compress // width if compress and width else None
        hidden = self.numel(f"{s}.dense1_b")
        gen_total = self.numel(f"{s}.dense2_b")
        self.add(f"{s}.compress", (hidden_channels, width))
        self.add(f"{s}.dense1_w", (hidden, 64 * hidden_channels if hidden_channels else None))
        self.add(f"{s}.dense1_b", (hidden,))
        self.add(f"{s}.ln1_gammas", (hidden,))
        self.add(f"{s}.ln1_betas", (hidden,))
        self.add(f"{s}.dense2_w", (gen_total, hidden))
        self.add(f"{s}.dense2_b", (gen_total,))
        self.add(f"{s}.ln2_gammas", (gen_total,))
        self.add(f"{s}.ln2_betas", (gen_total,))
        if gen_total and heads and gen_total % heads:
            self.problems.append(f"{s}.dense2_b: {gen_total} values is not a multiple of {heads} heads")
            return True, None
        return True, gen_total // heads if gen_total and heads else None

    def ffn(self, p: str, width: Optional[int], d_ff: Optional[int]) -> None:
        self.add(f"{p}.dense1_w", (d_ff, width))
        self.add(f"{p}.dense1_b", (d_ff,))
        self.add(f"{p}.dense2_w", (width, d_ff))
        self.add(f"{p}.dense2_b", (width,))


def _specs(net: Net) -> _Specs:
    """Every layer an attention-body net with PE_DENSE embedding needs (see the module doc)."""
    specs = _Specs(net)
    w = net.weights
    d = specs.numel("weights.ip_emb_b")
    heads = w.get("headcount")
    if not heads:
        specs.problems.append("weights.headcount: missing (the encoder layers' number of heads)")
        heads = None

    # Embedding.  PE_DENSE: a dense over the first 12 planes of all squares appends ``dense``
    # values per square, then the dense to d_model, LN, gates, FFN, LN.  The others (refused,
    # but their layers still listed) append lc0's 64-wide table (PE_MAP) or nothing.
    if net.input_embedding == InputEmbeddingFormat.PE_DENSE:
        preproc = specs.numel("weights.ip_emb_preproc_b")
        dense = preproc // 64 if preproc else None
        if preproc and preproc % 64:
            specs.problems.append(f"weights.ip_emb_preproc_b: {preproc} values is not 64 squares x a dense size")
        specs.add("weights.ip_emb_preproc_w", (64 * dense if dense else None, 64 * 12))
        specs.add("weights.ip_emb_preproc_b", (64 * dense if dense else None,))
        embedding_in = 112 + dense if dense else None
    else:
        embedding_in = 112 + (64 if net.input_embedding == InputEmbeddingFormat.PE_MAP else 0)
    specs.add("weights.ip_emb_w", (d, embedding_in))
    specs.add("weights.ip_emb_b", (d,))
    if net.input_embedding == InputEmbeddingFormat.PE_DENSE:
        specs.add("weights.ip_emb_ln_gammas", (d,))
        specs.add("weights.ip_emb_ln_betas", (d,))
    specs.add("weights.ip_mult_gate", (d, 64), required=False)
    specs.add("weights.ip_add_gate", (d, 64), required=False)
    if net.input_embedding == InputEmbeddingFormat.PE_DENSE:
        specs.ffn("weights.ip_emb_ffn", d, specs.numel("weights.ip_emb_ffn.dense1_b"))
        specs.add("weights.ip_emb_ffn_ln_gammas", (d,))
        specs.add("weights.ip_emb_ffn_ln_betas", (d,))

    any_smolgen = False
    gen_sizes = set()
    for i in range(len(w.get("encoder", []))):
        has_smolgen, gen = specs.encoder_layer(f"weights.encoder[{i}]", d, heads, body=True)
        any_smolgen |= has_smolgen
        if gen is not None:
            gen_sizes.add(gen)
    if len(gen_sizes) > 1:
        specs.problems.append(f"weights.encoder: smolgen gen sizes differ between layers ({sorted(gen_sizes)})")
    if any_smolgen:  # every layer's smolgen ends in the one global smolgen_w (unused without, as in lc0)
        gen = next(iter(gen_sizes)) if len(gen_sizes) == 1 else None
        specs.add("weights.smolgen_w", (64 * 64, gen))

    # Policy: the attention policy of every head lc0 would build (vanilla is the one it runs).
    for name, paths in net.policy_head_paths().items():
        required = name == "vanilla"
        if not required and not any(present(net.get(p)) for p in paths.values()):
            continue
        embed = specs.numel(paths["ip_pol_b"])
        pd = specs.numel(paths["ip2_pol_b"])
        specs.add(paths["ip_pol_w"], (embed, d))
        specs.add(paths["ip_pol_b"], (embed,))
        specs.add(paths["ip2_pol_w"], (pd, embed))
        specs.add(paths["ip2_pol_b"], (pd,))
        specs.add(paths["ip3_pol_w"], (pd, embed))
        specs.add(paths["ip3_pol_b"], (pd,))
        specs.add(paths["ip4_pol_w"], (4, pd))
        pol_encoder = net.get(paths["pol_encoder"]) or []
        pol_heads = net.get(paths["pol_headcount"])
        if pol_encoder and not pol_heads:
            specs.problems.append(f"{paths['pol_headcount']}: missing (the policy encoder layers' number of heads)")
        for i in range(len(pol_encoder)):
            specs.encoder_layer(f"{paths['pol_encoder']}[{i}]", embed, pol_heads or None)

    # Value: embedding per square, dense over 64 squares, dense to 3 (WDL) or 1 outputs.
    outputs = 3 if net.value_format == ValueFormat.WDL else 1
    for name, paths in net.value_head_paths().items():
        if name != "winner" and not any(present(net.get(p)) for p in paths.values()):
            continue
        channels = specs.numel(paths["ip_val_b"])
        hidden = specs.numel(paths["ip1_val_b"])
        specs.add(paths["ip_val_w"], (channels, d))
        specs.add(paths["ip_val_b"], (channels,))
        specs.add(paths["ip1_val_w"], (hidden, 64 * channels if channels else None))
        specs.add(paths["ip1_val_b"], (hidden,))
        specs.add(paths["ip2_val_w"], (outputs, hidden))
        specs.add(paths["ip2_val_b"], (outputs,))

    if net.moves_left_format == MovesLeftFormat.V1:
        channels = specs.numel("weights.ip_mov_b")
        hidden = specs.numel("weights.ip1_mov_b")
        specs.add("weights.ip_mov_w", (channels, d))
        specs.add("weights.ip_mov_b", (channels,))
        specs.add("weights.ip1_mov_w", (hidden, 64 * channels if channels else None))
        specs.add("weights.ip1_mov_b", (hidden,))
        specs.add("weights.ip2_mov_w", (1, hidden))
        specs.add("weights.ip2_mov_b", (1,))
    return specs


def expected_shapes(net: Net) -> dict[str, tuple[int, ...]]:
    """Weight path -> the shape fusedenc reads it as (``[out, in]`` for dense weights), for
    every layer of an attention-body PE_DENSE net that the file's sizes determine: the
    required ones and the optional ones it holds (gates, smolgen, extra heads)."""
    return {path: shape for path, shape, _ in _specs(net).layers if shape is not None}


MAX_PROBLEMS_SHOWN = 25


def _format_problems(net: Net, dtype: Optional[torch.dtype] = None) -> tuple[list[str], list[str]]:
    """Why fusedenc cannot run ``net``: the body and format first (when they rule the net out,
    nothing else is checked), then every missing or mis-sized weight, then (for ``dtype``)
    the layers whose values do not fit it.  Also, apart: the mis-sized weights (a layer with
    another number of values than the file's own sizes give it)."""
    if not net.has_weights:
        detail = " (it carries an ONNX model, which fusedenc does not run)" if net.has_onnx_model else ""
        return [f"no weights{detail}"], []
    network = net.network
    if network not in ATTENTION_BODIES:
        if network in (NetworkStructure.CLASSICAL, NetworkStructure.SE, NetworkStructure.CLASSICAL_WITH_HEADFORMAT,
                       NetworkStructure.SE_WITH_HEADFORMAT):
            why = "a residual (convolutional) body; fusedenc runs attention-body (transformer) nets only"
        elif network == NetworkStructure.ONNX:
            why = "an ONNX model, not weights fusedenc can run"
        else:
            why = "not a network format fusedenc knows; it runs attention bodies (6, 7, 134)"
        return [f"network format {enum_label(NetworkStructure, network)}: {why}"], []

    problems = []
    w = net.weights
    if not w.get("encoder"):
        problems.append("weights.encoder: missing (an attention-body net has encoder layers)")
    if w.get("residual"):
        problems.append(f"weights.residual: {len(w['residual'])} residual blocks before the encoders are not supported")
    embedding = net.input_embedding
    if embedding == InputEmbeddingFormat.PE_MAP:
        problems.append("input embedding PE_MAP: it needs lc0's fixed position-encoding table, which fusedenc does "
                        "not ship (PE_DENSE nets carry their embedding in the file)")
    elif embedding == InputEmbeddingFormat.NONE:
        problems.append("input embedding NONE on an attention body: lc0 runs it as PE_MAP (CUDA) or refuses it "
                        "(ONNX); fusedenc supports PE_DENSE")
    elif embedding != InputEmbeddingFormat.PE_DENSE:
        problems.append(f"input embedding {enum_name(InputEmbeddingFormat, embedding)}: fusedenc supports PE_DENSE")
    for role, value in net.activation_ids().items():
        if value not in LC0_ACTIVATIONS and role != "policy":
            problems.append(net.activation_problem(role, value))
    if net.policy_format != PolicyFormat.ATTENTION:
        problems.append(f"policy format {enum_name(PolicyFormat, net.policy_format)}: an attention body needs the "
                        "ATTENTION policy")
    if net.value_format not in (ValueFormat.WDL, ValueFormat.CLASSICAL):
        problems.append(f"value format {enum_name(ValueFormat, net.value_format)}: fusedenc supports WDL and CLASSICAL")
    if net.moves_left_format not in (MovesLeftFormat.NONE, MovesLeftFormat.V1):
        problems.append(f"moves-left format {enum_name(MovesLeftFormat, net.moves_left_format)} is not in net.proto")
    if not isinstance(net.input_format, InputFormat):
        problems.append(f"input format {net.input_format} is not in net.proto")

    specs = _specs(net)
    mis_sized = []
    for path, shape, required in specs.layers:
        value = net.get(path)
        if not present(value):
            if required:
                problems.append(f"{path}: missing")
            continue
        if shape is not None and value.numel() != math.prod(shape):
            mis_sized.append(f"{path}: has {value.numel()} values, expected shape {shape} = {math.prod(shape)} values")
            problems.append(mis_sized[-1])
    problems.extend(specs.problems)
    if dtype is not None:
        problems.extend(_range_problems(net, [path for path, _, _ in specs.layers], dtype))
    return problems, mis_sized


def _ranges(net: Net, paths: list[str]) -> dict[str, tuple[float, float]]:
    """(smallest, largest) value of each present layer of ``paths``: as ``read_net`` recorded
    them, or measured (a ``NetFile`` made some other way)."""
    out = {}
    for path in dict.fromkeys(paths):
        value = net.get(path)
        if present(value):
            r = net.value_ranges.get(path)
            if r is None:
                lo, hi = torch.aminmax(value.detach().float().reshape(-1))
                r = (float(lo), float(hi))
            out[path] = r
    return out


def _range_problems(net: Net, paths: list[str], dtype: torch.dtype) -> list[str]:
    """The layers of ``paths`` whose values are inf in ``dtype`` (refused); warns
    (``Lc0ValueWarning``) about those beyond float16's range when ``dtype`` is wider."""
    if not (dtype.is_floating_point and torch.finfo(dtype).bits >= 16):
        return []
    ranges = _ranges(net, paths)
    if not ranges:
        return []
    names = list(ranges)
    ends = torch.tensor([v for name in names for v in ranges[name]], dtype=torch.float64)
    inf = torch.isinf(ends.to(torch.float32).to(dtype)).view(-1, 2).any(1).tolist()  # float32: as decoded
    largest = {name: max(abs(lo), abs(hi)) for name, (lo, hi) in ranges.items()}
    problems = [
        f"{name}: values up to {largest[name]:.4g} do not fit {_dtype_name(dtype)} (largest "
        f"{torch.finfo(dtype).max:.6g}): they would be inf on the device and the heads NaN"
        + ("; load it in torch.float32" if dtype != torch.float32 else "")
        for name, bad in zip(names, inf)
        if bad
    ]
    if not problems and torch.finfo(dtype).max > FLOAT16_MAX:
        large = [name for name in names if largest[name] > FLOAT16_MAX]
        if large:
            shown = ", ".join(f"{name} (up to {largest[name]:.4g})" for name in large[:8])
            more = f" and {len(large) - 8} more" if len(large) > 8 else ""
            warnings.warn(
                f"{net.source}: {len(large)} weight layers hold values beyond float16's range (+-65504): "
                f"{shown}{more}.  lc0's fp16 backends cannot run this net, and values this large usually "
                f"overflow in the forward (a LayerNorm squares them): its heads may come out inf or NaN in "
                f"{_dtype_name(dtype)} too.  fusedenc runs it as it is; Lc0Network(..., check_finite=True) "
                "makes a forward with non-finite heads raise.",
                Lc0ValueWarning,
                stacklevel=4,
            )
    return problems


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_supported(net: Net, *, dtype: Optional[torch.dtype] = None) -> None:
    """Raise ``Lc0FormatError`` naming every reason fusedenc cannot run ``net``: a body that
    is not an attention body, an unsupported embedding (PE_MAP, NONE), relative position
    encodings, an activation, policy or value format it lacks, each missing or mis-sized
    weight (sizes as lc0 derives them from the file's bias lengths), and each size fusedenc's
    network cannot take (see the module doc).  With ``dtype``: also the layers whose values do
    not fit it, and a ``Lc0ValueWarning`` for layers beyond float16's range in a wider dtype."""
    problems, mis_sized = _format_problems(net, dtype)
    if problems:
        raise _refusal(net, problems, mis_sized=bool(mis_sized))


def refuse_mis_sized(net: Net) -> None:
    """Raise ``check_supported``'s error (``Lc0MisSizedError``, every problem listed) when a
    layer of ``net`` holds another number of values than the sizes the file itself gives imply.

    ``read_net`` runs this on the net *planned* (every layer a ``weights.LayerPlan``, its count
    from its byte length) before it decodes any layer, so that a huge mis-sized layer, or a
    net whose layers contradict its ``d_model``, ``d_ff`` or other sizes, is refused before it
    costs float32 memory.  A net that is only unsupported (its format, a missing layer, a
    width fusedenc's builder cannot take) is read, and refused by ``check_supported``."""
    problems, mis_sized = _format_problems(net)
    if mis_sized:
        raise _refusal(net, problems, " (refused before its layers were decoded)", mis_sized=True)


def _refusal(net: Net, problems: list[str], when: str = "", *, mis_sized: bool = False) -> Lc0FormatError:
    shown = problems[:MAX_PROBLEMS_SHOWN]
    more = len(problems) - len(shown)
    lines = "\n".join(f"  - {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
    error = Lc0MisSizedError if mis_sized else Lc0FormatError
    return error(f"{net.source}: fusedenc cannot run this net{when}:\n{lines}")


def shaped_as_expected(net: Net) -> Net:
    """``net`` with every layer of ``expected_shapes`` viewed in that shape (the file's
    ``dims`` set aside, as lc0 sets them aside: only the count matters), so that a builder can
    rely on the shapes; other layers as they are.  For a net ``check_supported`` passed."""
    shapes = expected_shapes(net)

    return dataclasses.replace(net, weights=_reshaped(net.weights, "weights", shapes))


def _reshaped(node: Any, path: str, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """``node`` (a tensor, or a dict/list tree of them) with the tensors at ``shapes``' paths
    viewed in those shapes.  A module-level function: a recursive closure is a reference
    cycle left for the cycle collector at every load."""
    if isinstance(node, torch.Tensor):
        shape = shapes.get(path)
        return node.reshape(shape) if shape is not None and node.numel() == math.prod(shape) else node
    if isinstance(node, Mapping):
        return {k: _reshaped(v, f"{path}.{k}", shapes) for k, v in node.items()}
    if isinstance(node, list):
        return [_reshaped(v, f"{path}[{i}]", shapes) for i, v in enumerate(node)]
    return node


def check_finite_heads(out: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise ``Lc0NonFiniteError`` naming each head of a forward's output with NaN or infinite
    values.  One device sync for all heads; not for use inside a CUDA graph capture."""
    heads = [(name, t) for name, t in out.items() if t.numel()]
    if not heads:
        return
    finite = torch.stack([torch.isfinite(t).all() for _, t in heads]).tolist()
    if all(finite):
        return
    bad = []
    for (name, t), ok in zip(heads, finite):
        if not ok:
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            bad.append(f"{name} ({nan} NaN and {inf} infinite of {t.numel()} values)")
    raise Lc0NonFiniteError(
        f"{source}: the forward's heads are not finite: {', '.join(bad)}: the net's weights overflow in this "
        "dtype (see the Lc0ValueWarning when it was loaded) or the planes hold non-finite values"
    )
