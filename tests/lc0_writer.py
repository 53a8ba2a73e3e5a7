"""Synthetic Lc0 network files for the tests: random weights in lc0's shapes.

Nothing here is needed to *run* a net; it writes ``.pb.gz`` files the way lc0's
training pipeline lays them out, through fusedenc's own protobuf encoder, so the
reader can be tested without shipping real networks.  Shapes (dense weights stored
``[out][in]``), from lc0's ONNX converter and backends:

* PE_DENSE embedding: ``ip_emb_preproc_w [64 * E, 64 * 12]`` over the first 12 planes
  of all squares, ``ip_emb_w [D, 112 + E]``, LayerNorm, optional gates ``[D, 64]``,
  an embedding FFN ``[F, D]``/``[D, F]`` and its LayerNorm;
* each encoder layer: ``q/k/v_w [D, D]``, ``dense_w [D, D]``, two LayerNorms, FFN;
  smolgen ``compress [hc, D]`` (no bias), ``dense1_w [hs, 64 * hc]``, LN,
  ``dense2_w [H * gen, hs]``, LN; the global ``smolgen_w [64 * 64, gen]``;
* attention policy: ``ip_pol_w [Pe, D]`` (shared in ``policy_heads``), ``ip2_pol_w``
  and ``ip3_pol_w [Pd, Pe]``, ``ip4_pol_w [4, Pd]``;
* value: ``ip_val_w [Vc, D]``, ``ip1_val_w [Vh, 64 * Vc]``, ``ip2_val_w [3 or 1, Vh]``;
* moves left: ``ip_mov_w [Mc, D]``, ``ip1_mov_w [Mh, 64 * Mc]``, ``ip2_mov_w [1, Mh]``.

``build_net`` returns the ``Net`` message as nested dicts (tests edit it to make bad
files) and the float32 values written per weight path; ``encode_net`` gzips it;
``write_net`` does both into a file.  ``PRESETS`` holds tiny, t82- and bt4-shaped nets.
"""

from __future__ import annotations

import gzip
import math
import os
from typing import Any, Optional, Sequence

import torch

from fusedenc.activations import LC0_ACTIVATIONS
from fusedenc.lc0.protobuf import encode
from fusedenc.lc0.schema import (
    LC0_MAGIC,
    SCHEMA,
    FileEncoding,
    InputEmbeddingFormat,
    InputFormat,
    MovesLeftFormat,
    NetworkStructure,
    OutputFormat,
    PolicyFormat,
    ValueFormat,
)
from fusedenc.lc0.weights import encode_layer

#: fusedenc activation name (or "default") -> lc0's ActivationFunction value.
ACTIVATION_IDS = {"default": 0, **{name: i for i, name in LC0_ACTIVATIONS.items()}}
#: lc0's DefaultActivation has only these two.
DEFAULT_ACTIVATION_IDS = {"relu": 0, "mish": 1}
#: lc0's name of each multi-head policy head -> the PolicyHeads field.
POLICY_HEAD_FIELDS = {"vanilla": "vanilla", "optimistic": "optimistic_st", "soft": "soft", "opponent": "opponent"}

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for every CPU test.
    "tiny": dict(layers=2, d_model=64, heads=4, d_ff=128, smolgen=(8, 32, 32), embedding_dense=16,
                 default_activation="mish", ffn_activation="swish", smolgen_activation="swish"),
    # T82-shaped (768 x 15 layers x 24 heads).  lc0's sources do not pin T82's activations down (the
    # file's format fields do); these follow fusedenc's t82 benchmark preset.
    "t82": dict(layers=15, d_model=768, heads=24, d_ff=2304, smolgen=(32, 256, 256), embedding_dense=128,
                default_activation="mish", ffn_activation="swish", smolgen_activation="swish"),
    # BT4-shaped (1024 x 15 layers x 32 heads, PE_DENSE 512).
    "bt4": dict(layers=15, d_model=1024, heads=32, d_ff=1536, smolgen=(32, 256, 256), embedding_dense=512,
                default_activation="mish", ffn_activation="mish", smolgen_activation="swish"),
}  # fmt: skip


class _Layers:
    """Draws random layers, encodes them and remembers the float32 values per path."""

    def __init__(self, seed: int, encoding: str, dims: bool, keep_values: bool) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.encoding = encoding
        self.dims = dims
        self.keep_values = keep_values
        self.values: dict[str, torch.Tensor] = {}

    def _layer(self, path: str, values: torch.Tensor) -> dict[str, Any]:
        if self.keep_values:
            self.values[path] = values
        return encode_layer(values, self.encoding, dims=self.dims)

    def weight(self, path: str, out: int, inp: int) -> dict[str, Any]:
        return self._layer(path, torch.randn(out, inp, generator=self.gen) / math.sqrt(inp))

    def bias(self, path: str, n: int) -> dict[str, Any]:
        return self._layer(path, 0.1 * torch.randn(n, generator=self.gen))

    def gamma(self, path: str, n: int) -> dict[str, Any]:
        return self._layer(path, 1.0 + 0.1 * torch.randn(n, generator=self.gen))

    def ffn(self, path: str, width: int, d_ff: int) -> dict[str, Any]:
        return {
            "dense1_w": self.weight(f"{path}.dense1_w", d_ff, width),
            "dense1_b": self.bias(f"{path}.dense1_b", d_ff),
            "dense2_w": self.weight(f"{path}.dense2_w", width, d_ff),
            "dense2_b": self.bias(f"{path}.dense2_b", width),
        }


def _encoder_layer(lay: _Layers, p: str, d: int, heads: int, d_ff: int, smolgen: Optional[Sequence[int]]) -> dict:
    mha: dict[str, Any] = {}
    for x in "qkv":
        mha[f"{x}_w"] = lay.weight(f"{p}.mha.{x}_w", d, d)
        mha[f"{x}_b"] = lay.bias(f"{p}.mha.{x}_b", d)
    mha["dense_w"] = lay.weight(f"{p}.mha.dense_w", d, d)
    mha["dense_b"] = lay.bias(f"{p}.mha.dense_b", d)
    if smolgen is not None:
        hc, hs, gen = smolgen
        s = f"{p}.mha.smolgen"
        mha["smolgen"] = {
            "compress": lay.weight(f"{s}.compress", hc, d),
            "dense1_w": lay.weight(f"{s}.dense1_w", hs, 64 * hc),
            "dense1_b": lay.bias(f"{s}.dense1_b", hs),
            "ln1_gammas": lay.gamma(f"{s}.ln1_gammas", hs),
            "ln1_betas": lay.bias(f"{s}.ln1_betas", hs),
            "dense2_w": lay.weight(f"{s}.dense2_w", heads * gen, hs),
            "dense2_b": lay.bias(f"{s}.dense2_b", heads * gen),
            "ln2_gammas": lay.gamma(f"{s}.ln2_gammas", heads * gen),
            "ln2_betas": lay.bias(f"{s}.ln2_betas", heads * gen),
        }
    return {
        "mha": mha,
        "ln1_gammas": lay.gamma(f"{p}.ln1_gammas", d),
        "ln1_betas": lay.bias(f"{p}.ln1_betas", d),
        "ffn": lay.ffn(f"{p}.ffn", d, d_ff),
        "ln2_gammas": lay.gamma(f"{p}.ln2_gammas", d),
        "ln2_betas": lay.bias(f"{p}.ln2_betas", d),
    }


def _policy_head(lay: _Layers, p: str, embed: int, pd: int) -> dict:
    return {
        "ip2_pol_w": lay.weight(f"{p}.ip2_pol_w", pd, embed),
        "ip2_pol_b": lay.bias(f"{p}.ip2_pol_b", pd),
        "ip3_pol_w": lay.weight(f"{p}.ip3_pol_w", pd, embed),
        "ip3_pol_b": lay.bias(f"{p}.ip3_pol_b", pd),
        "ip4_pol_w": lay.weight(f"{p}.ip4_pol_w", 4, pd),
    }


def _value_head(lay: _Layers, p: str, d: int, channels: int, hidden: int, outputs: int) -> dict:
    return {
        "ip_val_w": lay.weight(f"{p}.ip_val_w", channels, d),
        "ip_val_b": lay.bias(f"{p}.ip_val_b", channels),
        "ip1_val_w": lay.weight(f"{p}.ip1_val_w", hidden, 64 * channels),
        "ip1_val_b": lay.bias(f"{p}.ip1_val_b", hidden),
        "ip2_val_w": lay.weight(f"{p}.ip2_val_w", outputs, hidden),
        "ip2_val_b": lay.bias(f"{p}.ip2_val_b", outputs),
    }


def build_net(
    *,
    layers: int,
    d_model: int,
    heads: int,
    d_ff: int,
    smolgen: Optional[Sequence[int]] = None,
    embedding: str = "PE_DENSE",
    embedding_dense: int = 16,
    encoding: str = "LINEAR16",
    default_activation: str = "mish",
    ffn_activation: str = "default",
    smolgen_activation: str = "default",
    head_format: str = "multi",
    policy_heads: Sequence[str] = ("vanilla",),
    value_heads: Sequence[str] = ("winner",),
    wdl: bool = True,
    moves_left: bool = True,
    policy_d_model: Optional[int] = None,
    value_channels: int = 32,
    value_hidden: int = 128,
    mlh_channels: int = 8,
    mlh_hidden: int = 128,
    gating: bool = False,
    input_format: InputFormat = InputFormat.CLASSICAL_112_PLANE,
    dims: bool = False,
    seed: int = 0,
    keep_values: bool = True,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``Net`` message of a random attention-body net and the values written per weight
    path (empty when ``keep_values`` is False).

    ``smolgen`` is ``(hidden_channels, hidden_size, gen_size)`` or None; ``embedding`` is
    ``PE_DENSE`` (``embedding_dense`` values per square), ``PE_MAP`` or ``NONE``;
    ``encoding`` is a ``LayerEncoding`` name for every layer; activations are fusedenc
    names (``"default"``: the net's default); ``head_format`` ``"multi"`` writes
    ``policy_heads``/``value_heads`` (network 7), ``"single"`` Weights' own head fields
    (network 6).  ``dims`` records each layer's shape in the file.
    """
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    lay = _Layers(seed, encoding, dims, keep_values)
    d = d_model
    w: dict[str, Any] = {}
    if embedding == "PE_DENSE":
        w["ip_emb_preproc_w"] = lay.weight("weights.ip_emb_preproc_w", 64 * embedding_dense, 64 * 12)
        w["ip_emb_preproc_b"] = lay.bias("weights.ip_emb_preproc_b", 64 * embedding_dense)
        embedding_in = 112 + embedding_dense
    else:
        embedding_in = 112 + (64 if embedding == "PE_MAP" else 0)  # PE_MAP appends lc0's 64-wide table
    w["ip_emb_w"] = lay.weight("weights.ip_emb_w", d, embedding_in)
    w["ip_emb_b"] = lay.bias("weights.ip_emb_b", d)
    if embedding == "PE_DENSE":
        w["ip_emb_ln_gammas"] = lay.gamma("weights.ip_emb_ln_gammas", d)
        w["ip_emb_ln_betas"] = lay.bias("weights.ip_emb_ln_betas", d)
    if gating:
        w["ip_mult_gate"] = lay.gamma("weights.ip_mult_gate", d * 64)  # stored [D][64]
        w["ip_add_gate"] = lay.bias("weights.ip_add_gate", d * 64)
    if embedding == "PE_DENSE":
        w["ip_emb_ffn"] = lay.ffn("weights.ip_emb_ffn", d, d_ff)
        w["ip_emb_ffn_ln_gammas"] = lay.gamma("weights.ip_emb_ffn_ln_gammas", d)
        w["ip_emb_ffn_ln_betas"] = lay.bias("weights.ip_emb_ffn_ln_betas", d)
    w["encoder"] = [_encoder_layer(lay, f"weights.encoder[{i}]", d, heads, d_ff, smolgen) for i in range(layers)]
    w["headcount"] = heads
    if smolgen is not None:
        w["smolgen_w"] = lay.weight("weights.smolgen_w", 64 * 64, smolgen[2])

    embed, pd = d, policy_d_model or d
    outputs = 3 if wdl else 1
    if head_format == "multi":
        w["policy_heads"] = {
            "ip_pol_w": lay.weight("weights.policy_heads.ip_pol_w", embed, d),
            "ip_pol_b": lay.bias("weights.policy_heads.ip_pol_b", embed),
        }
        for name in policy_heads:
            key = POLICY_HEAD_FIELDS[name]
            w["policy_heads"][key] = _policy_head(lay, f"weights.policy_heads.{key}", embed, pd)
        w["value_heads"] = {
            name: _value_head(lay, f"weights.value_heads.{name}", d, value_channels, value_hidden, outputs)
            for name in value_heads
        }
        network = NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT
    elif head_format == "single":
        w["ip_pol_w"] = lay.weight("weights.ip_pol_w", embed, d)
        w["ip_pol_b"] = lay.bias("weights.ip_pol_b", embed)
        w.update(_policy_head(lay, "weights", embed, pd))
        w.update(_value_head(lay, "weights", d, value_channels, value_hidden, outputs))
        network = NetworkStructure.ATTENTIONBODY_WITH_HEADFORMAT
    else:
        raise ValueError(f"head_format must be 'multi' or 'single', got {head_format!r}")
    if moves_left:
        w["ip_mov_w"] = lay.weight("weights.ip_mov_w", mlh_channels, d)
        w["ip_mov_b"] = lay.bias("weights.ip_mov_b", mlh_channels)
        w["ip1_mov_w"] = lay.weight("weights.ip1_mov_w", mlh_hidden, 64 * mlh_channels)
        w["ip1_mov_b"] = lay.bias("weights.ip1_mov_b", mlh_hidden)
        w["ip2_mov_w"] = lay.weight("weights.ip2_mov_w", 1, mlh_hidden)
        w["ip2_mov_b"] = lay.bias("weights.ip2_mov_b", 1)

    network_format = {
        "input": int(input_format),
        "output": int(OutputFormat.WDL if wdl else OutputFormat.CLASSICAL),
        "network": int(network),
        "policy": int(PolicyFormat.ATTENTION),
        "value": int(ValueFormat.WDL if wdl else ValueFormat.CLASSICAL),
        "moves_left": int(MovesLeftFormat.V1 if moves_left else MovesLeftFormat.NONE),
        "default_activation": DEFAULT_ACTIVATION_IDS[default_activation],
        "smolgen_activation": ACTIVATION_IDS[smolgen_activation],
        "ffn_activation": ACTIVATION_IDS[ffn_activation],
        "input_embedding": int(InputEmbeddingFormat[embedding]),
    }
    net = {
        "magic": LC0_MAGIC,
        "license": "synthetic test network (random weights)",
        "min_version": {"major": 0, "minor": 31, "patch": 0},
        "format": {"weights_encoding": int(FileEncoding.LINEAR16), "network_format": network_format},
        "training_params": {"training_steps": 0},
        "weights": w,
    }
    return net, lay.values


def encode_net(net: dict[str, Any], *, compresslevel: Optional[int] = None, gzipped: bool = True) -> bytes:
    """The file bytes of a ``Net`` message, gzip'd unless ``gzipped`` is False.  Random
    weights do not compress, so ``compresslevel`` None means 1 for small nets and 0 (stored,
    still valid gzip) above 64 MB, which keeps writing a BT4-sized net to a few seconds."""
    payload = encode(net, "Net", SCHEMA)
    if not gzipped:
        return payload
    if compresslevel is None:
        compresslevel = 1 if len(payload) < 64 << 20 else 0
    return gzip.compress(payload, compresslevel=compresslevel, mtime=0)


def write_net(
    path: "str | os.PathLike[str]", *, compresslevel: Optional[int] = None, **spec: Any
) -> dict[str, torch.Tensor]:
    """Write a random net (``build_net``'s arguments) to ``path``; returns the values written."""
    net, values = build_net(**spec)
    with open(path, "wb") as f:
        f.write(encode_net(net, compresslevel=compresslevel))
    return values


def write_preset(path: "str | os.PathLike[str]", name: str, **overrides: Any) -> dict[str, torch.Tensor]:
    """``write_net`` with a ``PRESETS`` entry (``tiny``, ``t82``, ``bt4``) and overrides."""
    return write_net(path, **{**PRESETS[name], **overrides})


def random_planes(batch: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Input planes like lc0's ``[B, 112, 8, 8]``: sparse 0/1 piece planes, a rule-50-like
    scalar plane (108) and the all-ones plane (111); drawn on the CPU from ``gen``."""
    planes = (torch.rand((batch, 112, 8, 8), generator=gen) < 0.1).float()
    planes[:, 108] = torch.rand((batch, 1, 1), generator=gen)
    planes[:, 111] = 1.0
    return planes.to(dtype)
