#!/usr/bin/env python3
"""Train a small Lc0 attention-body network on engine-labelled games and write it as a ``.pb.gz``.

Not part of fusedenc: a tool (PyTorch and numpy, fusedenc for the encoder and the writer;
no python-chess).  The data are ``tools/lc0_games.py``'s compact games; the model is
exactly the layout ``fusedenc.lc0.reference`` computes, so the file it writes is read by
``fusedenc.lc0.load_network`` (and by lc0) and gives the model's own outputs.

The model (``ModelConfig``; defaults: 9.63M weights, an 18.7 MB LINEAR16 .pb.gz)
--------------------------------------------------------------------------------
lc0's attention body with PE_DENSE embedding (``ip_emb_preproc`` over the first 12 planes,
``ip_emb`` + default activation, LayerNorm eps 1e-3, multiplicative/additive input gates,
embedding FFN ``x + alpha * ffn(x)`` + LayerNorm), ``layers`` encoder layers
(``LN1(x + alpha * attn(x))``, ``LN2(y + alpha * ffn(y))``, ``alpha = (2 * layers) ** -0.25``,
eps 1e-3) whose attention logits get smolgen's bias (compress without bias -> dense1 + act
+ LN -> dense2 + act + LN -> ``[B, H, gen]`` times the one global ``smolgen_w``), the
attention policy head (``ip_pol`` + act, ``q = ip2_pol``, ``k = ip3_pol``, promotion logits
from the last rank's keys through ``ip4_pol``, gathered into the 1858 moves), the WDL
value head (``ip_val``, dense ``value_hidden``, dense 3) and the moves-left head
(``ip_mov``, dense, dense 1, relu).  Activations: default mish, FFN mish, smolgen swish
(BT4's).  Every parameter has the name and ``[out][in]`` shape of the net file's weight
path (``Lc0Model.export_weights``), e.g. ``weights.encoder[3].mha.smolgen.dense1_w``.

Defaults: 8 layers, d_model 256, 8 heads (depth 32, as lc0's big nets), d_ff 512,
smolgen (32, 128, 128), PE_DENSE 16 per square.  Why not smolgen (32, 256, 256): at d_model
256 that smolgen alone is 1.06M weights a layer (dense1 2048 x 256, dense2 256 x 8 * 256),
two thirds of each layer, and 8 such layers make a ~25 MB LINEAR16 file, over the 20 MB
budget; (32, 128, 128) keeps smolgen's structure (a 2048-wide compressed board, one shared
``[4096, gen]`` bias table) at 0.4M a layer.  ``--smolgen 32,256,256 --layers 5`` is the
other way to fit.

Input format: classical 112 planes (format 1) by default (``--input-format`` takes any that
fusedenc encodes).  Classical because its planes and move indices are the same in lc0 and
fusedenc for every position: the canonical formats turn pawnless boards across the
diagonal where fusedenc deliberately differs from lc0 909a408's move mapping, and lc0's v2
encoder can loop (``fusedenc/lc0/encoding.py``, ``policy.py``); a net trained on those would
be right in fusedenc and subtly wrong in lc0.  The cost is the symmetry the canonical
formats give for free, which a net of this size learns from the data.  Its rule-50 plane
holds raw halfmoves (0-100), so that input column starts 100x smaller.

Data and targets
----------------
``--data DIR`` (repeatable): folders of ``s{seed}-k{shard}-{part}.jsonl.gz`` files.  Worker
processes (``--workers``) replay each part file's games with fusedenc's vectorized rules
(``prepare``), encode every labelled position with its history (``encode_masks``: lc0's
compact planes, 112 64-bit masks) and map its MultiPV moves to policy indices
(``policy_indices``); the planes are expanded on the device per batch (``expand_planes``).
The last ``--val-parts`` part files are held out for validation.  Targets:

* policy: ``(1 - best_weight) * softmax(score / policy_temp) + best_weight * onehot(best)``
  over the MultiPV moves (scores in centipawns, clamped to +-2000; a mate in n counts
  3000 - 10 n), cross-entropy against the softmax over all 1858 logits (not masked to the
  legal moves, so illegal moves are pushed down too).  The one-hot share gives every
  position a clear first move, which keeps the net's top move stable in bf16/fp16;
* WDL: ``(1 - result_weight) * engine WDL + result_weight * game result`` (side to move),
  cross-entropy;
* moves left: Huber (delta 10) of ``raw / 20`` against ``plies_left / 20`` on the head's
  output before its relu.

Training: AdamW (weight decay on matrices only), linear warmup then cosine to
``--lr * --final-lr`` over ``--steps``, bf16 autocast on CUDA (fp32 weights), batches
drawn from a per-epoch permutation seeded by ``--seed``.  ``--minutes`` bounds one call
(data build included); the checkpoint (``--ckpt``, saved every ``--save-minutes`` and at
the end) holds the model, the optimizer, the step and the config, and the next call with
the same command resumes from it.  ``--export FILE`` writes the net (LINEAR16) at the end.

Writer: ``fusedenc.lc0.writer.build_net(..., weights=...)`` (each value reshaped to
``weight_shapes``), or, with a writer that lacks ``weights=``, ``tests/lc0_writer.py``'s
``build_net`` with each layer re-encoded from the model's values (the same paths, the same
encoder).

Check (``--check``): the exported file loaded with ``load_network(path, device="cpu",
dtype=torch.float32)`` must give the model's outputs on the same planes (policy logits,
WDL, moves left; relative max difference <= 1e-4; written as FLOAT32 for this, so only
the layout is compared), the LINEAR16 file's effect is reported (top-1 agreement, max
difference), and the device-side planes of the dataset must equal ``encode_planes`` of
the same games' ``(start, moves)`` histories.

Usage::

    # CPU smoke test: a tiny model, a few steps, export and check
    python tools/lc0_train.py --data tests/data/lc0_trained --val-parts 0 --layers 2 --d-model 64 --heads 4 \\
        --d-ff 128 --smolgen 8,32,32 --batch 64 --steps 5 --ckpt /tmp/t.pt --export /tmp/t.pb.gz --check

    # GPU: one call of at most ~9 minutes; run it again to go on
    python tools/lc0_train.py --data DATA --steps 30000 --batch 1024 --minutes 8.5 \\
        --ckpt OUT/ckpt.pt --export OUT/net.pb.gz --check

    # only the check of a checkpoint (or of a fresh model without --ckpt)
    python tools/lc0_train.py --check-only --ckpt ckpt.pt --data tests/data/lc0_trained

Output: one JSON line per ``--log-every`` steps (loss parts, training top-1 against the
engine's best move, moves-left error, positions/s), the validation line, ``report:``
(``--report-data``) and ``check:`` lines.

The GPU run (device tool)
-------------------------
Measured on an H100 with the default model (9.63M weights) on 13k positions: eager
~8k positions/s at batch 512, ~21k at 1024, ~33k at 2048, ~37k at 4096 (a fixed cost of
some 40 ms a step dominates small batches); ``--compile`` at 2048 ~36-39k after a ~45 s
warm-up.  So one call of under 10 minutes does ~7000 steps of 2048 (~14M positions, about
12 epochs of 1.2M positions); the default ``--steps 7000`` finishes its cosine in that call.
The data build (``--workers`` processes, ~10k positions/s each) takes ~10-20 s for 1M
positions on that machine's 16 cores; the dataset sits on the GPU (~1 KB a position).

The part files (~30 bytes a position: 1.2M positions ~36 MB) travel with the working tree,
in a folder git ignores, named in ``carry``; once, here::

    echo /.lc0data/ >> .git/info/exclude
    mkdir -p .lc0data && cp /work/lc0-train/data/*.jsonl.gz .lc0data/

and the call (``carry: [".lc0data"]``, ``timeout_s: 600``)::

    export PYTHONUNBUFFERED=1; mkdir -p build/lc0; python3 tools/lc0_train.py --data .lc0data \
      --val-parts 1 --batch 2048 --steps 7000 --minutes 9.2 --reserve 1.0 --compile \
      --ckpt build/lc0/ckpt.pt --export build/lc0/net.pb.gz --check --check-data tests/data/lc0_trained \
      --report-data tests/data/lc0_trained --description "..." 2>&1 | tee $OUT/train.log;
      split -b 15m build/lc0/net.pb.gz $OUT/net.pb.gz.part-

The net (~18.7 MB) is over the 16 MiB a file that comes back from ``$OUT``, hence the
``split``; ``cat net.pb.gz.part-* > net.pb.gz`` here.  The checkpoint (~116 MB with Adam's
moments) cannot come back (64 MiB in all) nor travel: it lives in ``build/lc0`` on the
machine, so a second call that resumes it must follow while that machine is still held
(same command, a larger ``--steps``); otherwise train in one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import lc0_games  # noqa: E402  (the part-file reader; python-chess is not needed for it)

from fusedenc.common.activations import apply_activation  # noqa: E402
from fusedenc.lc0 import board as B  # noqa: E402
from fusedenc.lc0.encoding import (  # noqa: E402
    _V2,
    encode_masks,
    encode_planes,
    expand_planes,
    resolve_input_format,
)
from fusedenc.lc0.moves import gather_policy  # noqa: E402
from fusedenc.lc0.policy import policy_indices  # noqa: E402
from fusedenc.lc0.positions import PositionBatch, prepare  # noqa: E402

RULE50_PLANE = 109
MATE_BOUND = lc0_games.MATE_BOUND
MATE = lc0_games.MATE


# ----------------------------------------------------------------------------- the model


@dataclasses.dataclass
class ModelConfig:
    layers: int = 8
    d_model: int = 256
    heads: int = 8
    d_ff: int = 512
    smolgen: tuple = (32, 128, 128)  # hidden channels, hidden size, gen size; () for none
    embedding_dense: int = 16
    policy_d_model: int = 256
    value_channels: int = 32
    value_hidden: int = 128
    mlh_channels: int = 8
    mlh_hidden: int = 128
    gating: bool = True
    default_activation: str = "mish"
    ffn_activation: str = "mish"
    smolgen_activation: str = "swish"
    input_format: int = 1

    def writer_spec(self) -> dict[str, Any]:
        """``build_net``'s keyword arguments for this shape."""
        return dict(
            layers=self.layers, d_model=self.d_model, heads=self.heads, d_ff=self.d_ff,
            smolgen=tuple(self.smolgen) or None, embedding="PE_DENSE", embedding_dense=self.embedding_dense,
            default_activation=self.default_activation, ffn_activation=self.ffn_activation,
            smolgen_activation=self.smolgen_activation, head_format="multi", policy_heads=("vanilla",),
            value_heads=("winner",), wdl=True, moves_left=True, policy_d_model=self.policy_d_model,
            value_channels=self.value_channels, value_hidden=self.value_hidden, mlh_channels=self.mlh_channels,
            mlh_hidden=self.mlh_hidden, gating=self.gating, input_format=self.input_format,
        )


def _act(x: torch.Tensor, name: str) -> torch.Tensor:
    return apply_activation(x, name)


class FFN(nn.Module):
    def __init__(self, d: int, d_ff: int, act: str):
        super().__init__()
        self.dense1, self.dense2, self.act = nn.Linear(d, d_ff), nn.Linear(d_ff, d), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense2(_act(self.dense1(x), self.act))


class Smolgen(nn.Module):
    def __init__(self, d: int, heads: int, hc: int, hs: int, gen: int, act: str):
        super().__init__()
        self.compress = nn.Linear(d, hc, bias=False)
        self.dense1 = nn.Linear(64 * hc, hs)
        self.ln1 = nn.LayerNorm(hs, eps=1e-3)
        self.dense2 = nn.Linear(hs, heads * gen)
        self.ln2 = nn.LayerNorm(heads * gen, eps=1e-3)
        self.heads, self.act = heads, act

    def forward(self, x: torch.Tensor, global_w: nn.Linear) -> torch.Tensor:
        b = x.shape[0]
        h = self.compress(x).reshape(b, -1)
        h = self.ln1(_act(self.dense1(h), self.act))
        h = self.ln2(_act(self.dense2(h), self.act))
        return global_w(h.view(b, self.heads, -1)).view(b, self.heads, 64, 64)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, alpha: float):
        super().__init__()
        d = cfg.d_model
        self.q, self.k, self.v, self.dense = (nn.Linear(d, d) for _ in range(4))
        self.smolgen = Smolgen(d, cfg.heads, *cfg.smolgen, cfg.smolgen_activation) if cfg.smolgen else None
        self.ln1 = nn.LayerNorm(d, eps=1e-3)
        self.ffn = FFN(d, cfg.d_ff, cfg.ffn_activation)
        self.ln2 = nn.LayerNorm(d, eps=1e-3)
        self.heads, self.alpha = cfg.heads, alpha

    def forward(self, x: torch.Tensor, smolgen_w: Optional[nn.Linear]) -> torch.Tensor:
        b, _, d = x.shape
        split = lambda t: t.view(b, 64, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        bias = self.smolgen(x, smolgen_w).to(q.dtype) if self.smolgen is not None else None
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # scale 1/sqrt(depth)
        a = a.transpose(1, 2).reshape(b, 64, d)
        y = self.ln1(x + self.alpha * self.dense(a))
        return self.ln2(y + self.alpha * self.ffn(y))


class Lc0Model(nn.Module):
    """The trainable net.  ``forward(planes [B, 112, 8, 8])`` -> ``{"policy": [B, 1858]
    logits, "wdl_logits": [B, 3], "moves_left_raw": [B, 1]}`` (``outputs`` gives the file's
    heads: WDL probabilities and relu'd moves left)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, e = cfg.d_model, cfg.embedding_dense
        self.alpha = (2.0 * cfg.layers) ** -0.25
        self.preproc = nn.Linear(64 * 12, 64 * e)
        self.ip_emb = nn.Linear(112 + e, d)
        self.ip_emb_ln = nn.LayerNorm(d, eps=1e-3)
        if cfg.gating:
            self.mult_gate = nn.Parameter(torch.ones(64, d))  # the file stores it [D][64]
            self.add_gate = nn.Parameter(torch.zeros(64, d))
        self.emb_ffn = FFN(d, cfg.d_ff, cfg.ffn_activation)
        self.emb_ffn_ln = nn.LayerNorm(d, eps=1e-3)
        self.layers = nn.ModuleList(EncoderLayer(cfg, self.alpha) for _ in range(cfg.layers))
        self.smolgen_w = nn.Linear(cfg.smolgen[2], 64 * 64, bias=False) if cfg.smolgen else None
        pe, pd = d, cfg.policy_d_model
        self.ip_pol = nn.Linear(d, pe)
        self.ip2_pol, self.ip3_pol = nn.Linear(pe, pd), nn.Linear(pe, pd)
        self.ip4_pol = nn.Linear(pd, 4, bias=False)
        self.ip_val = nn.Linear(d, cfg.value_channels)
        self.ip1_val = nn.Linear(64 * cfg.value_channels, cfg.value_hidden)
        self.ip2_val = nn.Linear(cfg.value_hidden, 3)
        self.ip_mov = nn.Linear(d, cfg.mlh_channels)
        self.ip1_mov = nn.Linear(64 * cfg.mlh_channels, cfg.mlh_hidden)
        self.ip2_mov = nn.Linear(cfg.mlh_hidden, 1)
        self._init()

    def _init(self) -> None:
        beta = (8.0 * self.cfg.layers) ** -0.25  # DeepNorm's scale for the residual branches
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                gain = beta if name.split(".")[-1] in ("v", "dense", "dense1", "dense2") and "smolgen" not in name else 1.0
                nn.init.xavier_normal_(m.weight, gain=gain)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        fmt = resolve_input_format(self.cfg.input_format)
        if fmt.name in ("CLASSICAL_112_PLANE", "WITH_CASTLING_PLANE", "WITH_CANONICALIZATION"):
            with torch.no_grad():  # raw halfmoves (0-100) on the rule-50 plane
                self.ip_emb.weight[:, RULE50_PLANE] *= 0.01
        with torch.no_grad():
            self.ip2_mov.bias.fill_(60.0)  # about the mean plies left of a game

    def body(self, planes: torch.Tensor) -> torch.Tensor:
        b = planes.shape[0]
        x = planes.permute(0, 2, 3, 1).reshape(b, 64, 112)
        pos = self.preproc(x[:, :, :12].reshape(b, 64 * 12)).view(b, 64, -1)
        x = _act(self.ip_emb(torch.cat([x, pos.to(x.dtype)], dim=-1)), self.cfg.default_activation)
        x = self.ip_emb_ln(x)
        if self.cfg.gating:
            x = x * self.mult_gate + self.add_gate
        x = self.emb_ffn_ln(x + self.alpha * self.emb_ffn(x))
        for layer in self.layers:
            x = layer(x, self.smolgen_w)
        return x

    def policy(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        p = _act(self.ip_pol(x), self.cfg.default_activation)
        q, k = self.ip2_pol(p), self.ip3_pol(p)
        pd = q.shape[-1]
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(pd)  # [B, 64 from, 64 to]
        prom = self.ip4_pol(k[:, 56:64, :])  # [B, 8, 4]
        prom = (prom[:, :, :3] + prom[:, :, 3:4]).reshape(b, 1, 24)
        sl = logits[:, 48:56, 56:64].reshape(b, 64, 1).expand(b, 64, 3).reshape(b, 8, 24)
        prom = (sl + prom).reshape(b, 3, 64)
        return gather_policy(torch.cat([logits, prom], dim=1).reshape(b, 67 * 64))

    def forward(self, planes: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.body(planes)
        b = x.shape[0]
        act = self.cfg.default_activation
        v = _act(self.ip_val(x), act).reshape(b, -1)
        v = self.ip2_val(_act(self.ip1_val(v), act))
        m = _act(self.ip_mov(x), act).reshape(b, -1)
        m = self.ip2_mov(_act(self.ip1_mov(m), act))
        return {"policy": self.policy(x), "wdl_logits": v, "moves_left_raw": m}

    @torch.no_grad()
    def outputs(self, planes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The heads as the net file gives them: policy logits, WDL probabilities, moves left."""
        out = self(planes)
        return {"policy": out["policy"].float(), "wdl": torch.softmax(out["wdl_logits"].float(), -1),
                "moves_left": F.relu(out["moves_left_raw"].float())}

    def parameters_by_path(self) -> dict[str, tuple[nn.Parameter, bool]]:
        """Every weight path of the net file -> (its parameter, stored transposed in the file)."""
        w: dict[str, tuple[nn.Parameter, bool]] = {}

        def lin(path: str, m: nn.Linear, bias: bool = True) -> None:
            w[f"{path}_w"] = (m.weight, False)
            if bias:
                w[f"{path}_b"] = (m.bias, False)

        def ln(path: str, m: nn.LayerNorm) -> None:
            w[f"{path}_gammas"], w[f"{path}_betas"] = (m.weight, False), (m.bias, False)

        def ffn(path: str, m: FFN) -> None:
            lin(f"{path}.dense1", m.dense1)
            lin(f"{path}.dense2", m.dense2)

        lin("weights.ip_emb_preproc", self.preproc)
        lin("weights.ip_emb", self.ip_emb)
        ln("weights.ip_emb_ln", self.ip_emb_ln)
        if self.cfg.gating:
            w["weights.ip_mult_gate"] = (self.mult_gate, True)  # the file's [D][64]
            w["weights.ip_add_gate"] = (self.add_gate, True)
        ffn("weights.ip_emb_ffn", self.emb_ffn)
        ln("weights.ip_emb_ffn_ln", self.emb_ffn_ln)
        for i, layer in enumerate(self.layers):
            p = f"weights.encoder[{i}]"
            for name in ("q", "k", "v", "dense"):
                lin(f"{p}.mha.{name}", getattr(layer, name))
            if layer.smolgen is not None:
                s, sg = f"{p}.mha.smolgen", layer.smolgen
                w[f"{s}.compress"] = (sg.compress.weight, False)
                lin(f"{s}.dense1", sg.dense1)
                ln(f"{s}.ln1", sg.ln1)
                lin(f"{s}.dense2", sg.dense2)
                ln(f"{s}.ln2", sg.ln2)
            ln(f"{p}.ln1", layer.ln1)
            ffn(f"{p}.ffn", layer.ffn)
            ln(f"{p}.ln2", layer.ln2)
        if self.smolgen_w is not None:
            w["weights.smolgen_w"] = (self.smolgen_w.weight, False)  # [4096][gen]
        lin("weights.policy_heads.ip_pol", self.ip_pol)
        v = "weights.policy_heads.vanilla"
        lin(f"{v}.ip2_pol", self.ip2_pol)
        lin(f"{v}.ip3_pol", self.ip3_pol)
        lin(f"{v}.ip4_pol", self.ip4_pol, bias=False)
        h = "weights.value_heads.winner"
        lin(f"{h}.ip_val", self.ip_val)
        lin(f"{h}.ip1_val", self.ip1_val)
        lin(f"{h}.ip2_val", self.ip2_val)
        lin("weights.ip_mov", self.ip_mov)
        lin("weights.ip1_mov", self.ip1_mov)
        lin("weights.ip2_mov", self.ip2_mov)
        covered = {id(p) for p, _ in w.values()}
        left = [n for n, p in self.named_parameters() if id(p) not in covered]
        if left:
            raise AssertionError(f"parameters without a weight path: {left}")
        return w

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Every weight as the net file's path -> float32 CPU values in the file's shape."""
        return {k: (p.t() if tr else p).detach().float().cpu().contiguous()
                for k, (p, tr) in self.parameters_by_path().items()}

    @torch.no_grad()
    def load_file_values(self, values: dict[str, torch.Tensor]) -> None:
        """The inverse of ``export_weights`` (e.g. the values a file decodes to)."""
        for k, (p, tr) in self.parameters_by_path().items():
            shape = (p.shape[1], p.shape[0]) if tr else tuple(p.shape)
            t = values[k].reshape(shape).to(p)
            p.copy_(t.t() if tr else t)


# ----------------------------------------------------------------------------- writing the net file


def _writer():
    """``fusedenc.lc0.writer`` where it exists, else the tests' ``lc0_writer`` module."""
    try:
        from fusedenc.lc0 import writer  # type: ignore[attr-defined]

        return writer
    except ImportError:
        tests = os.path.join(REPO, "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        import lc0_writer

        return lc0_writer


def _set_layer(weights: dict, path: str, layer: dict) -> None:
    """Put an encoded layer at ``path`` ("weights.encoder[3].mha.q_w") of the Net's weights dict."""
    parts = path.split(".")
    if parts[0] != "weights":
        raise ValueError(path)
    node: Any = weights
    for part in parts[1:-1]:
        if part.endswith("]"):
            name, index = part[:-1].split("[")
            node = node[name][int(index)]
        else:
            node = node[part]
    last = parts[-1]
    if last not in node:
        raise KeyError(f"{path}: not in the writer's net")
    node[last] = layer


def build_net_message(model: Lc0Model, encoding: str = "LINEAR16", description: str = "",
                      steps: int = 0) -> dict[str, Any]:
    """The ``Net`` message (nested dicts) of ``model``'s weights through the repository's writer."""
    writer = _writer()
    values = model.export_weights()
    spec = dict(model.cfg.writer_spec(), encoding=encoding)
    if "weights" in inspect.signature(writer.build_net).parameters:
        shapes = writer.weight_shapes(**spec) if hasattr(writer, "weight_shapes") else {}
        values = {k: v.reshape(shapes.get(k, v.shape)) for k, v in values.items()}  # the gates are written flat
        net, _ = writer.build_net(**spec, weights=values, keep_values=False)
    else:
        # The writer of tests/lc0_writer.py draws random layers; every one is replaced by the model's
        # values at the same path (the path sets must be equal), encoded by fusedenc's own encoder.
        from fusedenc.lc0.weights import encode_layer

        net, random_values = writer.build_net(**spec, seed=0, keep_values=True)
        if set(random_values) != set(values):
            raise AssertionError(f"weight paths differ from the writer's: only ours {sorted(set(values) - set(random_values))[:5]}, "
                                 f"only the writer's {sorted(set(random_values) - set(values))[:5]}")
        for path, t in values.items():
            if random_values[path].numel() != t.numel():
                raise AssertionError(f"{path}: shape {tuple(t.shape)}, the writer's {tuple(random_values[path].shape)}")
            _set_layer(net["weights"], path, encode_layer(t, encoding))
    net["license"] = description or "fusedenc tools/lc0_train.py"
    net["training_params"] = {"training_steps": int(steps)}
    return net


def write_net_file(model: Lc0Model, path: str, encoding: str = "LINEAR16", description: str = "",
                   steps: int = 0) -> int:
    """Write ``model`` as an lc0 ``.pb.gz`` (gzip level 9); returns the file's size."""
    import gzip

    from fusedenc.lc0.protobuf import encode
    from fusedenc.lc0.schema import SCHEMA

    payload = encode(build_net_message(model, encoding, description, steps), "Net", SCHEMA)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(gzip.compress(payload, compresslevel=9, mtime=0))
    os.replace(tmp, path)
    return os.path.getsize(path)


# ----------------------------------------------------------------------------- data


def _history_rows(states_rule50: np.ndarray, first: np.ndarray, cur: np.ndarray, v2: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per position, the slice of its game's states its planes read: the last 8 (for the v2
    formats back to the last irreversible move, which they may reach).  Returns the state
    indices of every slice, concatenated, and the slices' lengths."""
    want = np.maximum(8, states_rule50[cur].astype(np.int64) + 1) if v2 else np.full(len(cur), 8)
    length = np.minimum(cur - first + 1, want)
    lo = cur - length + 1
    starts = np.zeros(len(cur), np.int64)
    np.cumsum(length[:-1], out=starts[1:])
    idx = np.repeat(lo - starts, length) + np.arange(int(length.sum()))
    return idx, length


def build_arrays(games: list[dict], input_format: Any, k: int = 8) -> dict[str, np.ndarray]:
    """Every labelled position of ``games`` as training arrays: lc0's compact planes
    (``masks`` [N, 112] uint64, the rule-50 plane's value, the canonical turn), the MultiPV
    moves' policy indices and scores (``k`` columns, -1 / 0 padded), the engine's WDL
    (permille, side to move), the result for the side to move (+1, 0, -1), plies left, and
    (game, ply) of each position."""
    fmt = resolve_input_format(input_format)
    if not games:
        raise ValueError("no games")
    batch = prepare([(g["start"], g["moves"]) for g in games])  # every game replayed and checked at once
    states, offsets, reps = batch.states, batch.offsets, batch.repetitions
    n_moves = np.array([len(g["moves"]) for g in games], np.int64)
    game = np.repeat(np.arange(len(games)), n_moves)
    ply = np.arange(int(n_moves.sum())) - np.repeat(np.cumsum(n_moves) - n_moves, n_moves)
    first = offsets[:-1][game]
    cur = first + ply
    idx, length = _history_rows(states.rule50, first, cur, fmt in _V2)
    sub_offsets = np.zeros(len(cur) + 1, np.int64)
    np.cumsum(length, out=sub_offsets[1:])
    pb = PositionBatch(states.take(idx), sub_offsets, reps[idx], labels=None)
    masks, values, transforms = encode_masks(pb, fmt)
    varying = np.ones(values.shape[1], bool)
    varying[RULE50_PLANE] = False
    if not (values[:, varying] == 1).all():
        raise AssertionError("a plane other than rule-50 has a value other than 1")
    moves, indices, starts, counts = policy_indices(pb, fmt)
    # The engine's MultiPV moves -> policy indices, by (position, move code) among the legal moves.
    n = len(cur)
    rows = np.repeat(np.arange(n), counts)
    legal_keys = rows * 65536 + moves
    order = np.argsort(legal_keys, kind="stable")
    legal_keys = legal_keys[order]
    pol_idx = np.full((n, k), -1, np.int16)
    pol_score = np.zeros((n, k), np.int32)
    wdl = np.zeros((n, 3), np.int16)
    result = np.zeros(n, np.int8)
    flat_pos, flat_col, flat_code = [], [], []
    i = 0
    white_result = {"1-0": 1, "0-1": -1, "1/2-1/2": 0}
    for g in games:
        r = white_result[g["result"]]
        for p, (mpv, w) in enumerate(zip(g["mpv"], g["wdl"])):
            for c, (uci, score) in enumerate(mpv[:k]):
                flat_pos.append(i)
                flat_col.append(c)
                flat_code.append(B.UCI_CODE[uci])
                pol_score[i, c] = score
            wdl[i] = w
            result[i] = r
            i += 1
    flat_pos, flat_col = np.array(flat_pos, np.int64), np.array(flat_col, np.int64)
    keys = flat_pos * 65536 + np.array(flat_code, np.int64)
    at = np.minimum(np.searchsorted(legal_keys, keys), len(legal_keys) - 1)
    if not (legal_keys[at] == keys).all():
        bad = int(np.nonzero(legal_keys[at] != keys)[0][0])
        raise ValueError(f"game {game[flat_pos[bad]]} ply {ply[flat_pos[bad]]}: engine move "
                         f"{B.UCI_TEXT[flat_code[bad]]} is not legal there")
    pol_idx[flat_pos, flat_col] = indices[order][at]
    black = states.turn[cur] == B.BLACK
    result = np.where(black, -result, result).astype(np.int8)
    return {
        "masks": masks, "rule50": values[:, RULE50_PLANE].astype(np.float32), "transforms": transforms.astype(np.int8),
        "pol_idx": pol_idx, "pol_score": pol_score, "wdl": wdl, "result": result,
        "plies_left": (n_moves[game] - ply).astype(np.int16), "game": game.astype(np.int32), "ply": ply.astype(np.int16),
    }


def _build_part(args: tuple[str, Any]) -> dict[str, np.ndarray]:
    path, fmt = args
    return build_arrays(list(lc0_games.read_games([path])), fmt)


def load_dataset(paths: list[str], input_format: Any, workers: int) -> dict[str, np.ndarray]:
    """``build_arrays`` of every part file (one task per file, ``workers`` processes), concatenated
    (``game`` numbered across files)."""
    tasks = [(p, int(resolve_input_format(input_format))) for p in paths]
    if workers > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(workers) as ex:
            parts = list(ex.map(_build_part, tasks))
    else:
        parts = [_build_part(t) for t in tasks]
    base = 0
    for part in parts:
        part["game"] = part["game"] + base
        base = int(part["game"].max()) + 1 if len(part["game"]) else base
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def find_parts(folders: list[str]) -> list[str]:
    files = []
    for folder in folders:
        found = lc0_games.part_files(folder)
        if not found:
            raise SystemExit(f"no part files (s*-k*-*.jsonl.gz) in {folder}")
        files.extend(found)
    return files


class DeviceData:
    """The dataset's arrays on the training device; ``batch(index)`` expands planes there and
    builds the targets."""

    def __init__(self, arrays: dict[str, np.ndarray], device: torch.device):
        t = lambda a, dt=None: torch.from_numpy(np.ascontiguousarray(a)).to(device, dt)  # noqa: E731
        self.masks = t(arrays["masks"].view(np.int64))
        self.rule50 = t(arrays["rule50"])
        self.transforms = t(arrays["transforms"], torch.int64)
        self.pol_idx = t(arrays["pol_idx"], torch.int64)
        self.pol_score = t(arrays["pol_score"], torch.float32)
        self.wdl = t(arrays["wdl"], torch.float32) / 1000.0
        self.result = t(arrays["result"], torch.int64)
        self.plies_left = t(arrays["plies_left"], torch.float32)
        self.n = len(arrays["rule50"])
        self.device = device

    def planes(self, index: torch.Tensor) -> torch.Tensor:
        values = torch.ones((len(index), 112), device=self.device)
        values[:, RULE50_PLANE] = self.rule50[index]
        return expand_planes(self.masks[index], values, self.transforms[index])

    def targets(self, index: torch.Tensor, args: argparse.Namespace) -> dict[str, torch.Tensor]:
        idx = self.pol_idx[index]
        valid = idx >= 0
        score = self.pol_score[index]
        mate = score.abs() >= MATE_BOUND
        n = MATE - score.abs()
        eff = torch.where(mate, torch.sign(score) * (3000.0 - 10.0 * n), score.clamp(-2000.0, 2000.0))
        z = torch.where(valid, eff / args.policy_temp, torch.full_like(eff, -math.inf))
        soft = torch.softmax(z, dim=-1) * (1.0 - args.best_weight)
        soft[:, 0] += args.best_weight  # column 0 is the engine's best move
        policy = torch.zeros((len(index), 1858), device=self.device)
        policy.scatter_add_(1, idx.clamp(min=0), torch.where(valid, soft, torch.zeros_like(soft)))
        result = F.one_hot(1 - self.result[index], 3).float()  # +1 win -> 0, 0 draw -> 1, -1 loss -> 2
        wdl = (1.0 - args.result_weight) * self.wdl[index] + args.result_weight * result
        return {"policy": policy, "best": idx[:, 0], "wdl": wdl, "plies_left": self.plies_left[index]}


def losses(out: dict[str, torch.Tensor], tgt: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, torch.Tensor]:
    logp = F.log_softmax(out["policy"].float(), dim=-1)
    policy = -(tgt["policy"] * logp).sum(-1).mean()
    wdl = -(tgt["wdl"] * F.log_softmax(out["wdl_logits"].float(), dim=-1)).sum(-1).mean()
    mlh = F.huber_loss(out["moves_left_raw"].float().squeeze(-1) / 20.0, tgt["plies_left"] / 20.0, delta=10.0)
    total = args.policy_weight * policy + args.value_weight * wdl + args.mlh_weight * mlh
    with torch.no_grad():
        top1 = (out["policy"].argmax(-1) == tgt["best"]).float().mean()
        mae = (F.relu(out["moves_left_raw"].float().squeeze(-1)) - tgt["plies_left"]).abs().mean()
    return {"loss": total, "policy": policy, "wdl": wdl, "mlh": mlh, "top1": top1, "mlh_mae": mae}


# ----------------------------------------------------------------------------- training


def lr_at(step: int, args: argparse.Namespace) -> float:
    warm = max(1, int(args.warmup * args.steps))
    if step < warm:
        return args.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, args.steps - warm))
    return args.lr * (args.final_lr + (1.0 - args.final_lr) * 0.5 * (1.0 + math.cos(math.pi * t)))


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("_gate")]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not n.endswith("_gate"))]
    kw = {"fused": True} if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98), **kw)


def batch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


def evaluate_set(model: nn.Module, data: DeviceData, args: argparse.Namespace, limit: int = 20000) -> dict[str, float]:
    model.eval()
    sums: dict[str, float] = {}
    count = 0
    with torch.no_grad():
        for s in range(0, min(data.n, limit), args.batch):
            index = torch.arange(s, min(s + args.batch, data.n, limit), device=data.device)
            with _autocast(data.device, args):
                out = model(data.planes(index))
            for k, v in losses(out, data.targets(index, args), args).items():
                sums[k] = sums.get(k, 0.0) + float(v) * len(index)
            count += len(index)
    model.train()
    return {k: round(v / max(count, 1), 4) for k, v in sums.items()}


def _autocast(device: torch.device, args: argparse.Namespace):
    enabled = device.type == "cuda" and args.precision == "bf16"
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def save_checkpoint(path: str, model: Lc0Model, opt: torch.optim.Optimizer, step: int, args: argparse.Namespace,
                    history: list) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "config": dataclasses.asdict(model.cfg), "args": vars(args), "history": history}, tmp)
    os.replace(tmp, path)


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    smolgen = tuple(int(x) for x in args.smolgen.split(",")) if args.smolgen not in ("", "none") else ()
    return ModelConfig(layers=args.layers, d_model=args.d_model, heads=args.heads, d_ff=args.d_ff, smolgen=smolgen,
                       embedding_dense=args.embedding_dense, policy_d_model=args.policy_d_model or args.d_model,
                       gating=not args.no_gating, input_format=int(resolve_input_format(_format_arg(args.input_format))))


def _format_arg(text: str) -> Any:
    return int(text) if str(text).strip().isdigit() else text


def train(args: argparse.Namespace) -> None:
    t_start = time.time()
    deadline = t_start + args.minutes * 60.0
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=False) if args.ckpt and os.path.exists(args.ckpt) else None
    cfg = config_from_args(args)
    if ckpt:
        saved = ModelConfig(**{**ckpt["config"], "smolgen": tuple(ckpt["config"]["smolgen"])})
        if saved != cfg:
            print(f"note: the checkpoint's model shape is used, not the command line's: {saved}", flush=True)
        cfg = saved
    files = find_parts(args.data)
    if args.max_parts:
        files = files[: args.max_parts]
    val_files = files[len(files) - args.val_parts:] if args.val_parts else []
    train_files = files[: len(files) - args.val_parts] if args.val_parts else files
    t0 = time.time()
    arrays = load_dataset(train_files, cfg.input_format, args.workers)
    data = DeviceData(arrays, device)
    val = DeviceData(load_dataset(val_files, cfg.input_format, args.workers), device) if val_files else None
    print(f"data: {data.n} training positions from {len(train_files)} files, {val.n if val else 0} validation "
          f"({time.time() - t0:.1f} s)", flush=True)
    del arrays

    model = Lc0Model(cfg).to(device)
    opt = make_optimizer(model, args)
    step, history = 0, []
    if ckpt:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, history = ckpt["step"], ckpt.get("history", [])
        print(f"resumed from {args.ckpt} at step {step}", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg} -- {n_params / 1e6:.2f}M weights, ~{2 * n_params / 1e6:.1f} MB as LINEAR16", flush=True)
    fwd = torch.compile(model) if args.compile else model

    per_epoch = max(1, data.n // args.batch)
    t_last_save = time.time()
    t_log, seen_log = time.time(), 0
    run_sums: dict[str, torch.Tensor] = {}
    run_count = 0
    order, order_epoch = None, -1
    model.train()
    stop_reason = "steps"
    while step < args.steps:
        if time.time() > deadline - args.reserve * 60.0:
            stop_reason = "minutes"
            break
        epoch, k = divmod(step, per_epoch)
        if order_epoch != epoch:
            order, order_epoch = batch_order(data.n, args.seed, epoch).to(device), epoch
        index = order[k * args.batch:(k + 1) * args.batch]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        with _autocast(device, args):
            out = fwd(data.planes(index))
        parts = losses(out, data.targets(index, args), args)
        opt.zero_grad(set_to_none=True)
        parts["loss"].backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        seen_log += len(index)
        for key, v in parts.items():  # summed on the device: no sync per step
            run_sums[key] = run_sums[key] + v.detach() if key in run_sums else v.detach().clone()
        run_count += 1
        if step % args.log_every == 0 or step == args.steps:
            dt = time.time() - t_log
            rec = {"step": step, "epoch": round(step / per_epoch, 3), "lr": round(lr_at(step - 1, args), 7),
                   "pos_per_s": round(seen_log / dt, 1),
                   **{k: round(float(v) / run_count, 4) for k, v in run_sums.items()}}
            print(json.dumps(rec), flush=True)
            history.append(rec)
            run_sums, run_count, t_log, seen_log = {}, 0, time.time(), 0
        if val is not None and args.val_every and step % args.val_every == 0 and step < args.steps:
            rec = {"step": step, "val": evaluate_set(model, val, args)}  # the curve: where overfitting starts
            print(json.dumps(rec), flush=True)
            history.append(rec)
        if args.ckpt and time.time() - t_last_save > args.save_minutes * 60.0:
            save_checkpoint(args.ckpt, model, opt, step, args, history)
            t_last_save = time.time()
    if val is not None:
        rec = {"step": step, "val": evaluate_set(model, val, args)}
        print(json.dumps(rec), flush=True)
        history.append(rec)
    if args.ckpt:
        save_checkpoint(args.ckpt, model, opt, step, args, history)
    print(f"stopped at step {step}/{args.steps} ({stop_reason}); {time.time() - t_start:.0f} s in all", flush=True)
    model.eval()
    if args.report_data:
        report(model, args, device)
    if args.export:
        size = write_net_file(model.cpu(), args.export, "LINEAR16", args.description, step)
        print(f"wrote {args.export}: {size / 1e6:.2f} MB", flush=True)
    if args.check:
        check(model.cpu(), args)


# ----------------------------------------------------------------------------- the check


def report(model: Lc0Model, args: argparse.Namespace, device: torch.device, limit: int = 0) -> dict[str, Any]:
    """The model on held-back games (``--report-data``), in fp32 on ``device``: the share of
    positions whose raw top logit is a legal move, whose top legal move is the engine's best,
    the median top-1 probability (softmax over the legal moves, as ``decode_policy``), WDL
    cross-entropy against the engine's WDL, moves-left error, and the top-1 (legal) agreement
    of bf16 and fp16 autocast with fp32 -- a first look at what the acceptance tests measure
    with fusedenc's fast path."""
    model = model.to(device).eval()
    games = list(lc0_games.read_games(find_parts(args.report_data)))
    fmt = model.cfg.input_format
    arrays = build_arrays(games, fmt)
    n = len(arrays["rule50"]) if not limit else min(limit, len(arrays["rule50"]))
    data = DeviceData({k: v[:n] for k, v in arrays.items()}, device)
    hist = [(games[g]["start"], games[g]["moves"][:p]) for g, p in zip(arrays["game"][:n].tolist(), arrays["ply"][:n].tolist())]
    _, indices, _, counts = policy_indices(hist, fmt)
    rows = torch.from_numpy(np.repeat(np.arange(n), counts)).to(device)
    legal = torch.zeros((n, 1858), dtype=torch.bool, device=device)
    legal[rows, torch.from_numpy(indices).to(device)] = True
    stats: dict[str, list] = {k: [] for k in ("raw_legal", "best", "p1", "wdl_ce", "mlh_err", "bf16", "fp16")}
    with torch.no_grad():
        for s in range(0, n, 1024):
            index = torch.arange(s, min(s + 1024, n), device=device)
            planes = data.planes(index)
            out = model(planes)
            lg = legal[index]
            masked = out["policy"].float().masked_fill(~lg, -math.inf)
            top = masked.argmax(-1)
            stats["raw_legal"].append(lg.gather(1, out["policy"].argmax(-1, keepdim=True)).squeeze(1))
            stats["best"].append(top == data.pol_idx[index, 0])
            stats["p1"].append(torch.softmax(masked, -1).max(-1).values)
            stats["wdl_ce"].append(-(data.wdl[index] * F.log_softmax(out["wdl_logits"].float(), -1)).sum(-1))
            stats["mlh_err"].append((F.relu(out["moves_left_raw"].float().squeeze(-1)) - data.plies_left[index]).abs())
            for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
                if device.type == "cuda":
                    with torch.autocast("cuda", dtype=dt):
                        low = model(planes)["policy"].float().masked_fill(~lg, -math.inf).argmax(-1)
                    stats[name].append(low == top)
    cat = {k: torch.cat(v).float() for k, v in stats.items() if v}
    rep = {"positions": n, "raw_top_legal": float(cat["raw_legal"].mean()), "top1_engine_best": float(cat["best"].mean()),
           "median_top1_prob": float(cat["p1"].median()), "wdl_ce_vs_engine": float(cat["wdl_ce"].mean()),
           "moves_left_mae": float(cat["mlh_err"].mean())}
    for name in ("bf16", "fp16"):
        if name in cat:
            rep[f"{name}_autocast_top1_agreement"] = float(cat[name].mean())
    print("report: " + json.dumps(rep), flush=True)
    return rep


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def check(model: Lc0Model, args: argparse.Namespace, positions: int = 256) -> bool:
    """The exported file against the model (see the module doc).  Raises SystemExit on a mismatch."""
    from fusedenc.lc0 import load_network, read_net

    model = model.float().cpu().eval()
    fmt = model.cfg.input_format
    files = find_parts(args.check_data or args.data)[:1]
    games = list(lc0_games.read_games(files))
    arrays = build_arrays(games, fmt)
    n = min(positions, len(arrays["rule50"]))
    pick = np.linspace(0, len(arrays["rule50"]) - 1, n).astype(np.int64)  # across whole games, endgames too
    data = DeviceData({k: v[pick] for k, v in arrays.items()}, torch.device("cpu"))
    planes = data.planes(torch.arange(n))
    # 1. The dataset's planes are encode_planes of the same histories.
    game, ply = arrays["game"][pick], arrays["ply"][pick]
    hist = [(games[g]["start"], games[g]["moves"][:p]) for g, p in zip(game.tolist(), ply.tolist())]
    ref_planes = encode_planes(hist, fmt)
    ok_planes = bool(torch.equal(planes, ref_planes))
    report: dict[str, Any] = {"positions": n, "planes_equal_encode_planes": ok_planes}
    mine = model.outputs(planes)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.pb.gz")
        write_net_file(model, f32, "FLOAT32")
        net = load_network(f32, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            theirs = net(planes)
        rel = {k: _rel(mine[k], theirs[k]) for k in ("policy", "wdl", "moves_left")}
        report["float32_file_rel_diff"] = rel
        # LINEAR16: the file as shipped; its decoded values loaded back into the model must agree
        # exactly as well (layout), and the quantization's effect is reported.
        l16 = os.path.join(tmp, "l16.pb.gz")
        report["linear16_bytes"] = write_net_file(model, l16, "LINEAR16")
        q = Lc0Model(model.cfg)
        flat = {}

        def walk(node: Any, path: str) -> None:
            if isinstance(node, torch.Tensor):
                flat[path] = node
            elif isinstance(node, dict):
                for key, v in node.items():
                    walk(v, f"{path}.{key}")
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    walk(v, f"{path}[{i}]")

        walk(read_net(l16).weights, "weights")
        q.load_file_values(flat)
        q_out = q.outputs(planes)
        net16 = load_network(l16, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            theirs16 = net16(planes)
        report["linear16_file_vs_its_values_rel_diff"] = {k: _rel(q_out[k], theirs16[k]) for k in rel}
        report["linear16_vs_model"] = {
            "top1_agreement": float((theirs16["policy"].argmax(-1) == mine["policy"].argmax(-1)).float().mean()),
            "policy_max_abs": float((theirs16["policy"] - mine["policy"]).abs().max()),
            "wdl_max_abs": float((theirs16["wdl"] - mine["wdl"]).abs().max()),
        }
    worst = max(max(rel.values()), max(report["linear16_file_vs_its_values_rel_diff"].values()))
    report["pass"] = ok_planes and worst <= 1e-4
    print("check: " + json.dumps(report), flush=True)
    if not report["pass"]:
        raise SystemExit("check failed: the exported net does not reproduce the model")
    return True


def check_only(args: argparse.Namespace) -> None:
    if args.ckpt and os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, map_location="cpu", weights_only=False)
        model = Lc0Model(ModelConfig(**{**ckpt["config"], "smolgen": tuple(ckpt["config"]["smolgen"])}))
        model.load_state_dict(ckpt["model"])
    else:
        # A fresh model, every parameter moved off its initial value (LayerNorm gains of 1, zero
        # biases, unit gates would hide a swapped or misplaced layer from the check).
        torch.manual_seed(args.seed)
        model = Lc0Model(config_from_args(args))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p) * (p.std() if p.numel() > 1 and p.std() > 0 else 1.0))
    if args.export:
        size = write_net_file(model, args.export, "LINEAR16", args.description)
        print(f"wrote {args.export}: {size / 1e6:.2f} MB", flush=True)
    check(model, args)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--data", action="append", default=[], help="folder of part files (repeatable)")
    a("--max-parts", type=int, default=0, help="use only the first N part files (0: all)")
    a("--val-parts", type=int, default=1, help="the last N part files are the validation set")
    a("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)), help="data build processes")
    a("--device", default="", help="cuda / cpu (default: cuda if there is one)")
    # model
    a("--layers", type=int, default=8)
    a("--d-model", type=int, default=256)
    a("--heads", type=int, default=8)
    a("--d-ff", type=int, default=512)
    a("--smolgen", default="32,128,128", help="hidden channels,hidden size,gen size, or none")
    a("--embedding-dense", type=int, default=16)
    a("--policy-d-model", type=int, default=0, help="0: d_model")
    a("--no-gating", action="store_true")
    a("--input-format", default="1", help="lc0 input format (number or name); default classical 112")
    # targets and losses
    a("--policy-temp", type=float, default=60.0, help="centipawns")
    a("--best-weight", type=float, default=0.5, help="share of the engine's best move in the policy target")
    a("--result-weight", type=float, default=0.25, help="share of the game result in the WDL target")
    a("--policy-weight", type=float, default=1.0)
    a("--value-weight", type=float, default=1.0)
    a("--mlh-weight", type=float, default=0.1)
    # optimisation
    a("--steps", type=int, default=7000, help="total steps of the schedule, across calls")
    a("--batch", type=int, default=2048)
    a("--lr", type=float, default=1e-3)
    a("--final-lr", type=float, default=0.05, help="cosine floor as a fraction of --lr")
    a("--warmup", type=float, default=0.02, help="warmup as a fraction of --steps")
    a("--weight-decay", type=float, default=0.01)
    a("--clip", type=float, default=1.0)
    a("--precision", choices=("bf16", "fp32"), default="bf16", help="autocast on CUDA")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--seed", type=int, default=0)
    # budget, files
    a("--minutes", type=float, default=8.5, help="wall-clock budget of this call")
    a("--reserve", type=float, default=0.5, help="minutes kept for the final save, export and check")
    a("--save-minutes", type=float, default=2.0)
    a("--val-every", type=int, default=500, help="validation loss every N steps (0: only at the end)")
    a("--log-every", type=int, default=100)
    a("--ckpt", default="", help="checkpoint to resume from and save to")
    a("--export", default="", help="write the net here (.pb.gz, LINEAR16) at the end")
    a("--description", default="", help="the net file's license/description field")
    a("--check", action="store_true", help="after training, check the exported net against the model")
    a("--check-only", action="store_true", help="no training: check (and --export) the --ckpt model")
    a("--check-data", action="append", default=[], help="part files for the check (default: --data)")
    a("--report-data", action="append", default=[],
      help="held-back part files to report on after training (e.g. tests/data/lc0_trained)")
    args = ap.parse_args(argv)
    if not args.data and not args.check_data:
        ap.error("--data is required")
    if args.check_only:
        check_only(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
