"""Whether fusedenc can run an Lc0 net: ``check_supported`` and ``expected_shapes``.

fusedenc runs attention bodies (formats 6, 7, 134) with the PE_DENSE embedding, no
relative position encodings, and every weight the body and heads need, at the size the
rest of the file implies (``expected_shapes``: derived from the file's own bias lengths,
as lc0 derives them).  ``check_supported`` raises ``Lc0FormatError`` listing every problem,
before any tensor reaches a device.
"""

from __future__ import annotations

import math
from typing import Optional

from ..activations import LC0_ACTIVATIONS
from .errors import Lc0FormatError
from .netfile import NetFile, enum_label, enum_name, present
from .schema import (
    ATTENTION_BODIES,
    InputEmbeddingFormat,
    InputFormat,
    MovesLeftFormat,
    NetworkStructure,
    PolicyFormat,
    ValueFormat,
)

__all__ = ["check_supported", "expected_shapes"]

Shape = Optional[tuple[Optional[int], ...]]


class _Specs:
    """The weight layers a net must (or, when present, may) hold and their shapes, derived
    from the file's own bias lengths as lc0 derives them; plus problems found on the way."""

    def __init__(self, net: NetFile) -> None:
        self.net = net
        self.layers: list[tuple[str, Shape, bool]] = []
        self.problems: list[str] = []

    def numel(self, path: str) -> Optional[int]:
        return self.net.numel(path)

    def add(self, path: str, shape: tuple[Optional[int], ...], required: bool = True) -> None:
        known = all(isinstance(s, int) for s in shape)
        if required or self.net.get(path) is not None:
            self.layers.append((path, shape if known else None, required))

    def encoder_layer(self, p: str, width: Optional[int], heads: Optional[int]) -> tuple[bool, Optional[int]]:
        """An encoder layer at ``p`` working on ``width``-wide rows; returns whether it has
        smolgen and its gen size (None where unknown)."""
        dm = self.numel(f"{p}.mha.q_b")
        d_ff = self.numel(f"{p}.ffn.dense1_b")
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


def _specs(net: NetFile) -> _Specs:
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
        has_smolgen, gen = specs.encoder_layer(f"weights.encoder[{i}]", d, heads)
        any_smolgen |= has_smolgen
        if gen is not None:
            gen_sizes.add(gen)
    if len(gen_sizes) > 1:
        specs.problems.append(f"weights.encoder: smolgen gen sizes differ between layers ({sorted(gen_sizes)})")
    if any_smolgen or "smolgen_w" in w:  # every layer's smolgen ends in the one global smolgen_w
        gen = next(iter(gen_sizes)) if len(gen_sizes) == 1 else None
        specs.add("weights.smolgen_w", (64 * 64, gen), required=any_smolgen)

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


def expected_shapes(net: NetFile) -> dict[str, tuple[int, ...]]:
    """Weight path -> the shape fusedenc reads it as (``[out, in]`` for dense weights), for
    every layer of an attention-body PE_DENSE net that the file's sizes determine: the
    required ones and the optional ones it holds (gates, smolgen, extra heads)."""
    return {path: shape for path, shape, _ in _specs(net).layers if shape is not None}


MAX_PROBLEMS_SHOWN = 25


def _format_problems(net: NetFile) -> list[str]:
    """Why fusedenc cannot run ``net``: the body and format first (when they rule the net out,
    nothing else is checked), then every missing or mis-sized weight."""
    if not net.has_weights:
        detail = " (it carries an ONNX model, which fusedenc does not run)" if net.has_onnx_model else ""
        return [f"no weights{detail}"]
    network = net.network
    if network not in ATTENTION_BODIES:
        if network in (NetworkStructure.CLASSICAL, NetworkStructure.SE, NetworkStructure.CLASSICAL_WITH_HEADFORMAT,
                       NetworkStructure.SE_WITH_HEADFORMAT):
            why = "a residual (convolutional) body; fusedenc runs attention-body (transformer) nets only"
        elif network == NetworkStructure.ONNX:
            why = "an ONNX model, not weights fusedenc can run"
        else:
            why = "not a network format fusedenc knows; it runs attention bodies (6, 7, 134)"
        return [f"network format {enum_label(NetworkStructure, network)}: {why}"]

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
    for path, shape, required in specs.layers:
        value = net.get(path)
        if not present(value):
            if required:
                problems.append(f"{path}: missing")
            continue
        if shape is not None and value.numel() != math.prod(shape):
            problems.append(f"{path}: has {value.numel()} values, expected shape {shape} = {math.prod(shape)} values")
    problems.extend(specs.problems)
    return problems


def check_supported(net: NetFile) -> None:
    """Raise ``Lc0FormatError`` naming every reason fusedenc cannot run ``net``: a body that
    is not an attention body, an unsupported embedding (PE_MAP, NONE), relative position
    encodings, an activation, policy or value format it lacks, and each missing or
    mis-sized weight (sizes as lc0 derives them from the file's bias lengths)."""
    problems = _format_problems(net)
    if problems:
        shown = problems[:MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        lines = "\n".join(f"  - {p}" for p in shown) + (f"\n  ... and {more} more" if more else "")
        raise Lc0FormatError(f"{net.source}: fusedenc cannot run this net:\n{lines}")
