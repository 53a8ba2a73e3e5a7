"""Writing lc0 network files (``.pb.gz``): random nets in lc0's shapes, or given weights.

``python -m fusedenc.lc0 synth OUT.pb.gz --preset tiny|t82|bt4`` writes a net with *random*
weights: something to try fusedenc on and to time it without downloading a network (its
moves and evaluations mean nothing).  ``build_net(..., weights=...)`` writes given float32
weights instead (a trained PyTorch model exported by weight path).  The tests use the same
writer for their synthetic nets (``tests/lc0_writer.py`` re-exports it).

Nothing here is needed to *run* a net; it writes files the way lc0's training pipeline lays
them out, through fusedenc's own protobuf encoder.  Shapes (dense weights stored
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
files) and the float32 values written per weight path (``"weights.ip_emb_w"``,
``"weights.encoder[3].mha.q_w"``, ...; ``weight_shapes`` lists them without writing
anything); ``encode_net`` gzips it; ``write_net`` does both into a file.  ``PRESETS`` holds
tiny, t82- and bt4-shaped nets.
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import math
import os
import sys
from types import SimpleNamespace
from typing import Any, Mapping, Optional, Sequence

import torch

from ..common.activations import LC0_ACTIVATIONS
from .protobuf import encode
from .schema import (
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
from .weights import encode_layer

__all__ = [
    "PRESETS", "build_net", "encode_net", "synth_main", "weight_shapes", "write_net", "write_preset",
]  # fmt: skip

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

#: The ``license`` field says where the weights came from, so a file never passes for a trained net.
RANDOM_LICENSE = "synthetic test network (random weights)"
GIVEN_LICENSE = "written by fusedenc.lc0.writer from weights given by its caller"


class _Layers:
    """Draws random layers (or takes the given ones), encodes them and remembers the float32
    values per path.  ``shapes_only``: records each path's shape and encodes nothing."""

    def __init__(
        self, seed: int, encoding: str, dims: bool, keep_values: bool,
        given: Optional[Mapping[str, torch.Tensor]] = None, shapes_only: bool = False,
    ) -> None:  # fmt: skip
        self.gen = torch.Generator().manual_seed(seed)
        self.encoding = encoding
        self.dims = dims
        self.keep_values = keep_values
        self.given = given
        self.shapes_only = shapes_only
        self.values: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def _layer(self, path: str, shape: tuple[int, ...], draw) -> dict[str, Any]:
        self.shapes[path] = shape
        if self.shapes_only:
            return {}
        # Random values are drawn only without given weights, in the order they always were:
        # a seed names the same net it always did (the tests' fixtures depend on it).
        values = draw() if self.given is None else self.given[path]
        if self.keep_values:
            self.values[path] = values
        return encode_layer(values, self.encoding, dims=self.dims)

    def weight(self, path: str, out: int, inp: int) -> dict[str, Any]:
        return self._layer(path, (out, inp), lambda: torch.randn(out, inp, generator=self.gen) / math.sqrt(inp))

    def bias(self, path: str, n: int) -> dict[str, Any]:
        return self._layer(path, (n,), lambda: 0.1 * torch.randn(n, generator=self.gen))

    def gamma(self, path: str, n: int) -> dict[str, Any]:
        return self._layer(path, (n,), lambda: 1.0 + 0.1 * torch.randn(n, generator=self.gen))

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


def _weights_message(lay: _Layers, a: SimpleNamespace) -> tuple[dict[str, Any], NetworkStructure]:
    """The ``Weights`` message of the net ``a`` (``build_net``'s arguments) and its structure."""
    if a.d_model % a.heads:
        raise ValueError(f"d_model {a.d_model} is not a multiple of heads {a.heads}")
    d, embedding = a.d_model, a.embedding
    w: dict[str, Any] = {}
    if embedding == "PE_DENSE":
        w["ip_emb_preproc_w"] = lay.weight("weights.ip_emb_preproc_w", 64 * a.embedding_dense, 64 * 12)
        w["ip_emb_preproc_b"] = lay.bias("weights.ip_emb_preproc_b", 64 * a.embedding_dense)
        embedding_in = 112 + a.embedding_dense
    else:
        embedding_in = 112 + (64 if embedding == "PE_MAP" else 0)  # PE_MAP appends lc0's 64-wide table
    w["ip_emb_w"] = lay.weight("weights.ip_emb_w", d, embedding_in)
    w["ip_emb_b"] = lay.bias("weights.ip_emb_b", d)
    if embedding == "PE_DENSE":
        w["ip_emb_ln_gammas"] = lay.gamma("weights.ip_emb_ln_gammas", d)
        w["ip_emb_ln_betas"] = lay.bias("weights.ip_emb_ln_betas", d)
    if a.gating:
        w["ip_mult_gate"] = lay.gamma("weights.ip_mult_gate", d * 64)  # stored [D][64]
        w["ip_add_gate"] = lay.bias("weights.ip_add_gate", d * 64)
    if embedding == "PE_DENSE":
        w["ip_emb_ffn"] = lay.ffn("weights.ip_emb_ffn", d, a.d_ff)
        w["ip_emb_ffn_ln_gammas"] = lay.gamma("weights.ip_emb_ffn_ln_gammas", d)
        w["ip_emb_ffn_ln_betas"] = lay.bias("weights.ip_emb_ffn_ln_betas", d)
    w["encoder"] = [_encoder_layer(lay, f"weights.encoder[{i}]", d, a.heads, a.d_ff, a.smolgen) for i in range(a.layers)]
    w["headcount"] = a.heads
    if a.smolgen is not None:
        w["smolgen_w"] = lay.weight("weights.smolgen_w", 64 * 64, a.smolgen[2])

    embed, pd = d, a.policy_d_model or d
    outputs = 3 if a.wdl else 1
    if a.head_format == "multi":
        w["policy_heads"] = {
            "ip_pol_w": lay.weight("weights.policy_heads.ip_pol_w", embed, d),
            "ip_pol_b": lay.bias("weights.policy_heads.ip_pol_b", embed),
        }
        for name in a.policy_heads:
            key = POLICY_HEAD_FIELDS[name]
            w["policy_heads"][key] = _policy_head(lay, f"weights.policy_heads.{key}", embed, pd)
        w["value_heads"] = {
            name: _value_head(lay, f"weights.value_heads.{name}", d, a.value_channels, a.value_hidden, outputs)
            for name in a.value_heads
        }
        network = NetworkStructure.ATTENTIONBODY_WITH_MULTIHEADFORMAT
    elif a.head_format == "single":
        w["ip_pol_w"] = lay.weight("weights.ip_pol_w", embed, d)
        w["ip_pol_b"] = lay.bias("weights.ip_pol_b", embed)
        w.update(_policy_head(lay, "weights", embed, pd))
        w.update(_value_head(lay, "weights", d, a.value_channels, a.value_hidden, outputs))
        network = NetworkStructure.ATTENTIONBODY_WITH_HEADFORMAT
    else:
        raise ValueError(f"head_format must be 'multi' or 'single', got {a.head_format!r}")
    if a.moves_left:
        w["ip_mov_w"] = lay.weight("weights.ip_mov_w", a.mlh_channels, d)
        w["ip_mov_b"] = lay.bias("weights.ip_mov_b", a.mlh_channels)
        w["ip1_mov_w"] = lay.weight("weights.ip1_mov_w", a.mlh_hidden, 64 * a.mlh_channels)
        w["ip1_mov_b"] = lay.bias("weights.ip1_mov_b", a.mlh_hidden)
        w["ip2_mov_w"] = lay.weight("weights.ip2_mov_w", 1, a.mlh_hidden)
        w["ip2_mov_b"] = lay.bias("weights.ip2_mov_b", 1)
    return w, network


def _checked_weights(weights: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``weights`` as float32 CPU tensors by path, every problem found at once: a missing or
    unexpected name, something not a floating-point tensor, a wrong shape, a value that is not
    finite (lc0's readers, fusedenc's among them, refuse those files)."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping of weight path -> torch.Tensor, got {type(weights).__name__}")
    problems = []
    missing = [p for p in shapes if p not in weights]
    extra = [k for k in weights if k not in shapes]
    for what, names in (("missing", missing), ("not a weight of this net", extra)):
        if names:
            shown = ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            problems.append(f"{what} ({len(names)}): {shown}")
    out = {}
    for path, shape in shapes.items():
        t = weights.get(path)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            kind = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            problems.append(f"{path!r} is {kind}, not a floating-point tensor")
        elif tuple(t.shape) != shape:
            problems.append(f"{path!r} has shape {tuple(t.shape)}, expected {shape}")
        else:
            t = t.detach().to(device="cpu", dtype=torch.float32)
            if not bool(torch.isfinite(t).all()):
                problems.append(f"{path!r} holds NaN or infinite values")
            out[path] = t
    if problems:
        raise ValueError("weights: " + "; ".join(problems) + " (fusedenc.lc0.writer.weight_shapes lists every name and shape)")
    return out


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
    weights: Optional[Mapping[str, torch.Tensor]] = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``Net`` message of an attention-body net and the values written per weight path
    (empty when ``keep_values`` is False).

    ``weights``: None writes random values (from ``seed``); otherwise a mapping holding every
    weight path of this net (``weight_shapes(**same arguments)`` lists them: the names of the
    returned values dict, e.g. ``"weights.ip_emb_w"`` ``[D, 112 + E]``,
    ``"weights.encoder[0].mha.q_w"`` ``[D, D]``, ``"weights.smolgen_w"``) with floating-point
    tensors of exactly that shape (converted to float32; dense weights ``[out][in]`` as
    ``nn.Linear.weight``).  A missing or unexpected name, a wrong shape or a non-finite value
    raises ValueError listing every such problem, before anything is encoded.
    ``encoding="FLOAT32"`` (or ``"FLOAT16"``) keeps trained values closer than LINEAR16.

    ``smolgen`` is ``(hidden_channels, hidden_size, gen_size)`` or None; ``embedding`` is
    ``PE_DENSE`` (``embedding_dense`` values per square), ``PE_MAP`` or ``NONE``;
    ``encoding`` is a ``LayerEncoding`` name for every layer; activations are fusedenc
    names (``"default"``: the net's default); ``head_format`` ``"multi"`` writes
    ``policy_heads``/``value_heads`` (network 7), ``"single"`` Weights' own head fields
    (network 6).  ``dims`` records each layer's shape in the file.
    """
    a = SimpleNamespace(**{k: v for k, v in locals().items() if k != "weights"})
    given = None
    if weights is not None:
        probe = _Layers(seed, encoding, dims, keep_values=False, shapes_only=True)
        _weights_message(probe, a)
        given = _checked_weights(weights, probe.shapes)
    lay = _Layers(seed, encoding, dims, keep_values, given)
    w, network = _weights_message(lay, a)
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
        "license": RANDOM_LICENSE if weights is None else GIVEN_LICENSE,
        "min_version": {"major": 0, "minor": 31, "patch": 0},
        "format": {"weights_encoding": int(FileEncoding.LINEAR16), "network_format": network_format},
        "training_params": {"training_steps": 0},
        "weights": w,
    }
    return net, lay.values


def weight_shapes(**spec: Any) -> dict[str, tuple[int, ...]]:
    """Weight path -> shape of every weight ``build_net(**spec)`` writes, in file order: what its
    ``weights=`` must hold.  Nothing is drawn or encoded (cheap for a BT4-sized net)."""
    bound = inspect.signature(build_net).bind(**spec)  # TypeError for an unknown argument
    bound.apply_defaults()
    a = SimpleNamespace(**{k: v for k, v in bound.arguments.items() if k != "weights"})
    probe = _Layers(a.seed, a.encoding, a.dims, keep_values=False, shapes_only=True)
    _weights_message(probe, a)
    return probe.shapes


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
    """Write a net (``build_net``'s arguments, ``weights=`` included) to ``path``; returns the values written."""
    net, values = build_net(**spec)
    with open(path, "wb") as f:
        f.write(encode_net(net, compresslevel=compresslevel))
    return values


def write_preset(path: "str | os.PathLike[str]", name: str, **overrides: Any) -> dict[str, torch.Tensor]:
    """``write_net`` with a ``PRESETS`` entry (``tiny``, ``t82``, ``bt4``) and overrides."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is not one of {', '.join(PRESETS)}")
    return write_net(path, **{**PRESETS[name], **overrides})


# ------------------------------------------------------------ CLI: synth ----


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def synth_main(argv: list[str], prog: str = "python -m fusedenc.lc0 synth") -> int:
    """``python -m fusedenc.lc0 synth OUT.pb.gz [--preset tiny|t82|bt4] [--seed N] [--layers N]
    [--force]``: write a net with random weights and say so.  Exit 0, or 2 with one line on
    stderr (an existing file without ``--force``, a path that cannot be written)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Write an lc0 network file with RANDOM weights in the shape of a preset: untrained, for "
                    "trying fusedenc and timing it (its moves and evaluations mean nothing).",
    )  # fmt: skip
    ap.add_argument("out", metavar="OUT.pb.gz", help="the file to write")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="tiny (2 x 64, seconds on a CPU), t82 (15 x 768) or bt4 (15 x 1024); default tiny")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--layers", type=_positive, default=None, help="encoder layers (default: the preset's)")
    ap.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = ap.parse_args(argv)
    spec = {**PRESETS[args.preset], "seed": args.seed, "keep_values": False}
    if args.layers is not None:
        spec["layers"] = args.layers
    if os.path.exists(args.out) and not args.force:
        print(f"{prog}: {args.out} exists (pass --force to overwrite it)", file=sys.stderr)
        return 2
    tmp = f"{args.out}.tmp{os.getpid()}"
    try:
        write_net(tmp, **spec)  # then renamed: an interrupted run leaves no half-written net under OUT
        os.replace(tmp, args.out)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        print(f"{prog}: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    mb = os.path.getsize(args.out) / 2**20
    print(f"wrote {args.out} ({mb:.1f} MiB): a RANDOM, untrained {args.preset}-shaped lc0 net ({spec['layers']} layers, "
          f"d_model {spec['d_model']}, {spec['heads']} heads, FFN {spec['d_ff']}, seed {args.seed}).  Its moves and "
          f"evaluations mean nothing: use it to try fusedenc and to time it (python -m fusedenc.lc0 {args.out}).")
    return 0
