"""Reading an Lc0 network file: ``read_net`` -> ``NetFile``.

``read_net`` gunzips, decodes the ``pblczero.Net`` message (``protobuf`` + ``schema``),
checks the magic, plans every weight layer (``weights.plan_layer``: checked and counted from
its byte length), checks the net's sizes on those counts, and only then decodes every layer
once (``weights``).  It reads the net's format the way lc0's loader does, including its
upgrades of older files (a ``NETWORK_SE_WITH_HEADFORMAT`` file with encoder layers is an
attention body; 134 is read as 7; an attention body with ``policy_heads`` and
``value_heads`` is the multi-head format with PE_DENSE embedding; one without an embedding
field is PE_MAP).
``NetFile.format_notes`` lists every upgrade applied.

Whether fusedenc can *run* the net is ``support.check_supported``'s question.

Weight paths are spelled from the ``Weights`` message down, as in error messages:
``weights.encoder[3].mha.q_w``, ``weights.policy_heads.vanilla.ip2_pol_w``.

Damaged and hostile files (nets come from anywhere) are refused with ``Lc0FileError``
before they cost much: the gzip stream is inflated in pieces up to ``max_bytes``
(``netbytes``: ``DEFAULT_MAX_BYTES``, 2 GiB, unless ``read_net(..., max_bytes=...)`` or the
``FUSEDENC_LC0_MAX_BYTES`` environment variable says otherwise), while
``protobuf.StructureScan`` checks the protobuf structure as it arrives (a bomb of zeros is
refused after its first piece); concatenated gzip members are read as one stream and bytes
after the last member that are not another member are ignored, as zlib's ``gzread`` (lc0's
reader) ignores them; the decoder bounds fields, repeated entries and strings
(``protobuf``); before any layer is decoded, a net whose layers contradict its own sizes is
refused (``support.refuse_mis_sized``: ``check_supported``'s rules on the counts) and so is one
whose float32 tensors would pass ``max_bytes`` (``netbytes.check_decoded_size``), so a huge
layer costs no more than its bytes in the file; every decoded layer is checked for non-finite
values and its range recorded (``NetFile.value_ranges``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ..common.activations import LC0_ACTIVATIONS
from .errors import Lc0FileError, Lc0FormatError
from .netbytes import Source, check_decoded_size, load_bytes, max_bytes_limit, not_a_net
from .protobuf import UNKNOWN_FIELDS, decode
from .schema import (
    DEFAULT_ACTIVATION_FUNCTION,
    LC0_MAGIC,
    SCHEMA,
    ActivationFunction,
    DefaultActivation,
    InputEmbeddingFormat,
    InputFormat,
    MovesLeftFormat,
    NetworkStructure,
    OutputFormat,
    PolicyFormat,
    ValueFormat,
    enum_label,
    enum_name,
)
from .support import refuse_mis_sized
from .weights import decode_planned_tree, plan_weight_tree, planned_layers, present

__all__ = [
    "NetFile",
    "enum_label",
    "enum_name",
    "lookup",
    "present",
    "read_net",
]

#: NetworkFormat field -> its enum, from the schema.
FORMAT_ENUMS: dict[str, type] = {f.name: f.enum for f in SCHEMA["NetworkFormat"].values()}

#: Policy heads of the multi-head format: lc0's name -> the PolicyHeads field holding it.
MULTIHEAD_POLICY_HEADS = {"vanilla": "vanilla", "optimistic": "optimistic_st", "soft": "soft", "opponent": "opponent"}
#: Value heads of the multi-head format (name = field).
MULTIHEAD_VALUE_HEADS = ("winner", "q", "st")
POLICY_HEAD_FIELDS = tuple(f.name for f in SCHEMA["Weights.PolicyHead"].values())
VALUE_HEAD_FIELDS = tuple(f.name for f in SCHEMA["Weights.ValueHead"].values())
#: The single-head format's value fields in Weights (no err/cat layers there).
LEGACY_VALUE_FIELDS = ("value", "ip_val_w", "ip_val_b", "ip1_val_w", "ip1_val_b", "ip2_val_w", "ip2_val_b")

def _as_enum(enum_cls: type, value: int) -> int:
    """The enum member for a known value, else the plain int (a newer file's value)."""
    try:
        return enum_cls(value)
    except ValueError:
        return value


_PATH_PART = re.compile(r"^([A-Za-z_]\w*)((?:\[\d+\])*)$")


def lookup(root: Mapping[str, Any], path: str) -> Any:
    """The value at ``path`` (``a.b[2].c``) in nested dicts and lists, or None where absent."""
    node: Any = root
    for part in path.split("."):
        m = _PATH_PART.match(part)
        if m is None:
            raise ValueError(f"bad path component {part!r} in {path!r}")
        if not isinstance(node, Mapping) or m.group(1) not in node:
            return None
        node = node[m.group(1)]
        for index in re.findall(r"\[(\d+)\]", m.group(2)):
            if not isinstance(node, list) or int(index) >= len(node):
                return None
            node = node[int(index)]
    return node


@dataclass
class NetFile:
    """A decoded Lc0 network file.

    The format fields are the *effective* ones (after lc0's upgrades of older files:
    ``format_notes`` says which; ``stored_format`` holds the file's own values), as enum
    members where net.proto knows the value, else plain ints.  ``weights`` is the
    ``Weights`` message as nested dicts with float32 tensors for every layer (1-D unless
    the file gave dims; dense weights ``[out][in]``), plain ints for counts, lists for
    repeated messages.
    """

    source: str
    network: int
    input_format: int
    output_format: int
    policy_format: int
    value_format: int
    moves_left_format: int
    default_activation: int
    ffn_activation: int
    smolgen_activation: int
    input_embedding: int
    weights: dict[str, Any] = field(repr=False)
    has_weights: bool = True
    has_onnx_model: bool = False
    min_version: Optional[tuple[int, int, int]] = None
    license: Optional[str] = None
    training_params: dict[str, Any] = field(default_factory=dict, repr=False)
    stored_format: dict[str, int] = field(default_factory=dict)
    format_notes: tuple[str, ...] = ()
    layer_encodings: dict[str, int] = field(default_factory=dict)
    unknown_fields: tuple[str, ...] = ()
    #: Weight path -> (smallest, largest) value of the layer, as decoded (float32).
    value_ranges: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    # -- access -----------------------------------------------------------------------

    def get(self, path: str) -> Any:
        """The value at a weight path (``weights.encoder[0].mha.q_w``), or None."""
        return lookup({"weights": self.weights}, path)

    def policy_head_paths(self) -> dict[str, dict[str, str]]:
        """Each policy head lc0 would build (``vanilla`` first; ``optimistic``, ``soft``,
        ``opponent`` when the file has them) -> field -> the weight path it is read from.
        A multi-head file's heads share ``policy_heads.ip_pol_w/b`` unless they carry their
        own; a single-head file's one head is ``vanilla``, read from Weights' own fields."""
        w = self.weights
        if "policy_heads" not in w:
            return {"vanilla": {f: f"weights.{f}" for f in POLICY_HEAD_FIELDS}}
        ph = w["policy_heads"]
        shared = {f: f"weights.policy_heads.{f}" if f in ph else f"weights.{f}" for f in ("ip_pol_w", "ip_pol_b")}
        heads = {}
        for name, key in MULTIHEAD_POLICY_HEADS.items():
            if key not in ph and name != "vanilla":
                continue
            own = ph.get(key, {})
            paths = {f: f"weights.policy_heads.{key}.{f}" for f in POLICY_HEAD_FIELDS}
            for f in ("ip_pol_w", "ip_pol_b"):
                if not present(own.get(f)):
                    paths[f] = shared[f]
            heads[name] = paths
        return heads

    def value_head_paths(self) -> dict[str, dict[str, str]]:
        """Each value head lc0 would build (``winner`` first; ``q``, ``st`` when present) ->
        field -> weight path; a single-head file's one head is ``winner``."""
        w = self.weights
        if "value_heads" not in w:
            return {"winner": {f: f"weights.{f}" for f in LEGACY_VALUE_FIELDS}}
        vh = w["value_heads"]
        return {
            name: {f: f"weights.value_heads.{name}.{f}" for f in VALUE_HEAD_FIELDS}
            for name in MULTIHEAD_VALUE_HEADS
            if name == "winner" or name in vh
        }

    def policy_heads(self) -> dict[str, dict[str, Any]]:
        """``policy_head_paths`` with the values: head name -> {field: tensor, list or int}."""
        return _resolve(self, self.policy_head_paths())

    def value_heads(self) -> dict[str, dict[str, Any]]:
        """``value_head_paths`` with the values: head name -> {field: tensor}."""
        return _resolve(self, self.value_head_paths())

    def activation_names(self) -> dict[str, str]:
        """fusedenc's names (``fusedenc.common.activations``) of the ``default``, ``ffn``,
        ``smolgen`` and ``policy`` activations, DEFAULT resolved to the net's default as
        lc0 does (the attention policy's embedding uses the default activation).  Raises
        ``Lc0FormatError`` for one fusedenc has no elementwise form of."""
        names = {}
        for role, value in self.activation_ids().items():
            if value not in LC0_ACTIVATIONS:
                raise Lc0FormatError(f"{self.source}: {self.activation_problem(role, value)}")
            names[role] = LC0_ACTIVATIONS[value]
        return names

    def parameter_count(self) -> int:
        """Values over every weight layer of the file."""
        return sum(t.numel() for t in planned_layers(self.weights))

    # -- description ------------------------------------------------------------------

    def activation_ids(self) -> dict[str, int]:
        default = DEFAULT_ACTIVATION_FUNCTION.get(self.default_activation, -1)

        def resolve(value: int) -> int:
            return default if value == ActivationFunction.DEFAULT else value

        return {
            "default": default,
            "ffn": resolve(self.ffn_activation),
            "smolgen": resolve(self.smolgen_activation),
            "policy": default,
        }

    def activation_problem(self, role: str, value: int) -> str:
        if role in ("default", "policy") and value == -1:
            return (f"default_activation {enum_name(DefaultActivation, self.default_activation)}: "
                    "fusedenc knows RELU (0) and MISH (1)")
        field_name = f"{role}_activation"
        return (
            f"{field_name} {enum_name(ActivationFunction, value)} is not an elementwise activation "
            f"fusedenc has (known: {', '.join(ActivationFunction(i).name for i in sorted(LC0_ACTIVATIONS))})"
        )

    def numel(self, path: str) -> Optional[int]:
        value = self.get(path)
        return value.numel() if present(value) else None

    def describe(self) -> dict[str, Any]:
        """What the net is, in plain values: format, body sizes, activations, smolgen,
        heads, parameter count, layer encodings and whatever lc0 upgrades were applied.
        Sizes that the file does not give are None.  Never raises on an unsupported net
        (``check_supported`` does)."""
        w = self.weights
        sizes = _body_sizes(self)
        activations = {}
        for role, value in self.activation_ids().items():
            activations[role] = LC0_ACTIVATIONS.get(value, f"unsupported: {enum_name(ActivationFunction, value)}")

        policy_paths = self.policy_head_paths()
        vanilla = policy_paths["vanilla"]
        value_paths = self.value_head_paths()
        winner = value_paths["winner"]
        moves_left = None
        if self.moves_left_format == MovesLeftFormat.V1:
            moves_left = {
                "format": enum_name(MovesLeftFormat, self.moves_left_format),
                "channels": self.numel("weights.ip_mov_b"),
                "hidden": self.numel("weights.ip1_mov_b"),
            }
        pol_encoder = self.get(vanilla["pol_encoder"]) or []
        return {
            "source": self.source,
            "network": enum_name(NetworkStructure, self.network),
            "stored_network": enum_name(NetworkStructure, self.stored_format.get("network", 0)),
            "input_format": enum_name(InputFormat, self.input_format),
            "embedding": enum_name(InputEmbeddingFormat, self.input_embedding),
            "embedding_dense_size": sizes["embedding_dense_size"],
            "layers": len(w.get("encoder", [])),
            "residual_blocks": len(w.get("residual", [])),
            "d_model": sizes["d_model"],
            "heads": w.get("headcount"),
            "d_ff": sizes["d_ff"],
            "embedding_d_ff": sizes["embedding_d_ff"],
            "input_gating": present(w.get("ip_mult_gate")) or present(w.get("ip_add_gate")),
            "activations": activations,
            "smolgen": sizes["smolgen"],
            "policy": {
                "format": enum_name(PolicyFormat, self.policy_format),
                "heads": list(policy_paths),
                "embedding_size": self.numel(vanilla["ip_pol_b"]),
                "d_model": self.numel(vanilla["ip2_pol_b"]),
                "encoder_layers": len(pol_encoder),
            },
            "value": {
                "format": enum_name(ValueFormat, self.value_format),
                "wdl": self.value_format == ValueFormat.WDL,
                "heads": list(value_paths),
                "channels": self.numel(winner["ip_val_b"]),
                "hidden": self.numel(winner["ip1_val_b"]),
            },
            "moves_left": moves_left,
            "output_format": enum_name(OutputFormat, self.output_format),
            "parameters": self.parameter_count(),
            "encodings": dict(self.layer_encodings),
            "min_version": ".".join(map(str, self.min_version)) if self.min_version else None,
            "notes": list(self.format_notes),
            "unknown_fields": list(self.unknown_fields),
        }


def _resolve(net: NetFile, heads: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, paths in heads.items():
        values = {f: net.get(p) for f, p in paths.items()}
        out[name] = {f: v for f, v in values.items() if v is not None}
    return out


def _body_sizes(net: NetFile) -> dict[str, Any]:
    """The body's sizes as lc0 derives them: from the lengths of bias vectors."""
    d_model = net.numel("weights.ip_emb_b")
    preproc = net.numel("weights.ip_emb_preproc_b")
    heads = net.weights.get("headcount")
    smolgen = None
    if net.get("weights.encoder[0].mha.smolgen") is not None:
        compress = net.numel("weights.encoder[0].mha.smolgen.compress")
        gen_total = net.numel("weights.encoder[0].mha.smolgen.dense2_b")
        smolgen = {
            "hidden_channels": compress // d_model if compress and d_model else None,
            "hidden_size": net.numel("weights.encoder[0].mha.smolgen.dense1_b"),
            "gen_size": gen_total // heads if gen_total and heads else None,
        }
    return {
        "d_model": d_model,
        "embedding_dense_size": preproc // 64 if preproc else None,
        "d_ff": net.numel("weights.encoder[0].ffn.dense1_b"),
        "embedding_d_ff": net.numel("weights.ip_emb_ffn.dense1_b"),
        "smolgen": smolgen,
    }


# -- reading ------------------------------------------------------------------------------


def _collect_unknown(node: Any, path: str, out: list[str]) -> None:
    """``path#number`` of every unknown field outside the weights (``decode_weight_tree``
    reports those)."""
    if isinstance(node, Mapping):
        for number in node.get(UNKNOWN_FIELDS, ()):
            out.append(f"{path or 'Net'}#{number}")
        for key, value in node.items():
            if key == UNKNOWN_FIELDS or (not path and key == "weights"):
                continue
            _collect_unknown(value, f"{path}.{key}" if path else key, out)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _collect_unknown(value, f"{path}[{i}]", out)


def _effective_format(fmt: Mapping[str, Any], weights: Mapping[str, Any]) -> tuple[dict[str, int], list[str]]:
    """The NetworkFormat lc0 runs the file as, and a note for each upgrade it makes."""
    stored = {k: v for k, v in fmt.get("network_format", {}).items() if k != UNKNOWN_FIELDS}
    values = {name: stored.get(name, 0) for name in FORMAT_ENUMS}  # proto2: an absent enum reads as 0
    has_embedding = "input_embedding" in stored
    notes = []
    network = values["network"]
    if "network_format" not in fmt:
        values.update(input=InputFormat.CLASSICAL_112_PLANE, output=OutputFormat.CLASSICAL,
                      network=NetworkStructure.CLASSICAL_WITH_HEADFORMAT, value=ValueFormat.CLASSICAL,
                      policy=PolicyFormat.CLASSICAL)
        notes.append("no network_format: read, as lc0 does, as an old classical residual net")
    elif network == NetworkStructure.CLASSICAL:
        values.update(network=NetworkStructure.CLASSICAL_WITH_HEADFORMAT, value=ValueFormat.CLASSICAL,
                      policy=PolicyFormat.CLASSICAL)
        notes.append("network CLASSICAL read as CLASSICAL_WITH_HEADFORMAT with classical heads")
    elif network == NetworkStructure.SE:
        values.update(network=NetworkStructure.SE_WITH_HEADFORMAT, value=ValueFormat.CLASSICAL,
                      policy=PolicyFormat.CLASSICAL)
        notes.append("network SE read as SE_WITH_HEADFORMAT with classical heads")
    elif network == NetworkStructure.SE_WITH_HEADFORMAT and weights.get("encoder"):
        values["network"] = NetworkStructure.ATTENTIONBODY_WITH_HEADFORMAT
        notes.append("network SE_WITH_HEADFORMAT with encoder layers read as ATTENTIONBODY_WITH_HEADFORMAT")
        if "smolgen_w" in weights:  # such files predate the activation fields
            values.update(ffn_activation=ActivationFunction.RELU_2, smolgen_activation=ActivationFunction.SWISH)
            notes.append("smolgen in an old-format attention net: ffn activation RELU_2, smolgen SWISH")
    elif network == NetworkStructure.AB_LEGACY_WITH_MULTIHEADFORMAT:
        values["network"] = NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT
        notes.append("network AB_LEGACY_WITH_MULTIHEADFORMAT (134) read as ATTENTIONBODY_WITH_MULTIHEADFORMAT")
    if values["network"] == NetworkStructure.ATTENTIONBODY_WITH_HEADFORMAT:
        if "policy_heads" in weights and "value_heads" in weights:
            values.update(network=NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT,
                          input_embedding=InputEmbeddingFormat.PE_DENSE)
            has_embedding = True
            notes.append("ATTENTIONBODY_WITH_HEADFORMAT with policy_heads and value_heads read as "
                         "ATTENTIONBODY_WITH_MULTIHEADFORMAT with PE_DENSE embedding")
        if not has_embedding:
            values["input_embedding"] = InputEmbeddingFormat.PE_MAP
            notes.append("attention net without input_embedding: PE_MAP, as lc0 reads it")
    return {name: _as_enum(FORMAT_ENUMS[name], v) for name, v in values.items()}, notes


def read_net(source: Source, *, max_bytes: Optional[int] = None) -> NetFile:
    """Read an Lc0 network: a path to a ``.pb.gz`` (or an uncompressed ``.pb``, which lc0
    also reads), or the file's bytes.  Raises ``Lc0FileError`` for a file that is not a
    well-formed Lc0 net (not gzip, truncated, broken protobuf, wrong magic, an undecodable
    layer, a non-finite value, more than the limits of ``protobuf``), and, before decoding any
    layer, ``check_supported``'s error for a net with a layer whose size contradicts the sizes
    the file gives (``support.refuse_mis_sized``: ``Lc0MisSizedError``, both an ``Lc0FileError``
    and an ``Lc0FormatError``); whether fusedenc can *run* any other net is
    ``check_supported``'s question.

    ``max_bytes``: the most bytes the file may decompress to, and the most bytes its float32
    tensors may take (None: the ``FUSEDENC_LC0_MAX_BYTES`` environment variable, else
    ``DEFAULT_MAX_BYTES``, 2 GiB); a file that passes it is refused as soon as it does, a net
    whose tensors would pass it before any is decoded, naming the limit."""
    limit = max_bytes_limit(max_bytes)
    name = "<bytes>" if isinstance(source, (bytes, bytearray, memoryview)) else os.fspath(source)
    raw = load_bytes(source, name, limit)
    try:
        msg = decode(raw, "Net", SCHEMA)
    except Lc0FileError as exc:
        raise not_a_net(name, raw, exc) from None
    magic = msg.get("magic")
    if magic is None:
        raise Lc0FileError(f"{name}: no magic (Net field 1): not an Lc0 network file")
    if magic != LC0_MAGIC:
        raise Lc0FileError(f"{name}: wrong magic: expected {LC0_MAGIC:#x}, found {magic:#x}")

    encodings: Counter = Counter()
    unknown: list[str] = []
    _collect_unknown(msg, "", unknown)
    # Every layer checked and counted from its byte length, none decoded yet (``weights.plan_layer``).
    try:
        planned = plan_weight_tree(msg["weights"], encodings=encodings, unknown=unknown) if "weights" in msg else {}
    except Lc0FileError as exc:
        raise Lc0FileError(f"{name}: {exc}") from None
    fmt = msg.get("format", {})
    effective, notes = _effective_format(fmt, planned)
    version = msg.get("min_version")
    net = NetFile(
        source=name,
        network=effective["network"],
        input_format=effective["input"],
        output_format=effective["output"],
        policy_format=effective["policy"],
        value_format=effective["value"],
        moves_left_format=effective["moves_left"],
        default_activation=effective["default_activation"],
        ffn_activation=effective["ffn_activation"],
        smolgen_activation=effective["smolgen_activation"],
        input_embedding=effective["input_embedding"],
        weights=planned,
        has_weights="weights" in msg,
        has_onnx_model="onnx_model" in msg,
        min_version=(version.get("major", 0), version.get("minor", 0), version.get("patch", 0)) if version else None,
        license=msg.get("license"),
        training_params={k: v for k, v in msg.get("training_params", {}).items() if k != UNKNOWN_FIELDS},
        stored_format={k: v for k, v in fmt.get("network_format", {}).items() if k != UNKNOWN_FIELDS},
        format_notes=tuple(notes),
        layer_encodings=dict(sorted(encodings.items())),
        unknown_fields=tuple(unknown),
    )
    # The sizes, before any float32 memory is spent: layers that contradict the net's own sizes
    # (check_supported's rules, on the counts), then the total against the limit.
    refuse_mis_sized(net)
    layers = list(planned_layers(planned))
    if layers:
        largest = max(layers, key=lambda p: p.count)
        check_decoded_size(name, sum(p.count for p in layers), (largest.where, largest.count), limit)
    ranges: dict[str, tuple[float, float]] = {}
    try:
        weights = decode_planned_tree(planned, ranges=ranges)
    except Lc0FileError as exc:
        raise Lc0FileError(f"{name}: {exc}") from None
    return dataclasses.replace(net, weights=weights, value_ranges=ranges)
