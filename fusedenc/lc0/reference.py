"""An independent PyTorch reference of a whole Lc0 attention-body network: planes in, heads out.

Written from the semantics of lc0's ONNX converter (``src/neural/onnx/converter.cc``)
in plain tensor operations, apart from fusedenc's fast path: it is the CPU oracle
the fast network is tested against, and it computes in whatever dtype it is given
(float32 or float64 for references), but for the heads' last products (the policy's
query-key logits, the value and moves-left outputs), which run in float32 at least from
16-bit activations, as ``Lc0Network``'s do.

The network, as lc0 builds it (``T = B * 64`` rows, one per square):

* input planes ``[B, 112, 8, 8]`` become rows ``[B, 64, 112]`` (square-major);
* PE_DENSE embedding: the first 12 planes of all 64 squares, flattened, go through
  ``ip_emb_preproc`` (-> ``64 * E``) and are appended to each square's 112 values;
  then ``ip_emb`` + the default activation, LayerNorm (eps 1e-3), the
  multiplicative and additive gates (``[64, D]``, stored transposed), and an
  embedding FFN with residual ``x + alpha * ffn(x)`` and LayerNorm (eps 1e-3);
* each encoder layer: ``LN1(x + alpha * attn(x))``, ``LN2(y + alpha * ffn(y))``,
  ``alpha = (2 * layers) ** -0.25``, LayerNorm eps 1e-3 for PE_DENSE nets, else
  1e-6; attention logits ``q k^T / sqrt(depth)`` plus the smolgen bias;
* smolgen: ``compress`` (no bias) -> ``[B, 64 * hc]`` -> dense1 + act + LN ->
  dense2 + act + LN -> ``[B, H, gen]`` -> times the global ``smolgen_w`` ->
  ``[B, H, 64, 64]`` (its LayerNorms use eps 1e-3);
* attention policy head ("vanilla"): ``ip_pol`` + act, its own encoder layers
  (alpha 1), ``q = ip2_pol``, ``k = ip3_pol``, ``q k^T / sqrt(d)`` over 64 x 64
  square pairs, promotion logits from the last rank's keys through ``ip4_pol``,
  gathered into the 1858 lc0 moves (``moves.gather_policy``);
* WDL value head ("winner"): ``ip_val`` + act per square, dense 128 + act, dense 3,
  softmax; moves-left head (when present): ``ip_mov`` + act, dense + act, dense 1, relu.

Dense weights are stored ``[out][in]`` in the file, so every linear layer here is
``x @ W^T + b`` with ``W = w.view(out, -1)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..common.activations import apply_activation
from . import moves
from .netfile import NetFile, present
from .schema import ActivationFunction, MovesLeftFormat, ValueFormat
from .support import check_supported

__all__ = ["BODY_LAYER_NORM_EPS", "ReferenceNetwork", "placed", "reference_forward"]

#: LayerNorm eps of the encoder layers: lc0 uses 1e-3 for PE_DENSE nets (the only embedding
#: ``check_supported`` passes) and 1e-6 for others; smolgen's and the embedding's LayerNorms
#: use 1e-3 whatever the net.
BODY_LAYER_NORM_EPS = 1e-3


def _dense(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    out = b.numel() if b is not None else None
    weight = w.view(out, -1) if out is not None else w
    y = x @ weight.to(x).t()
    return y if b is None else y + b.to(x)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 at least: the heads' last products run in float32 from 16-bit
    activations, as ``Lc0Network``'s do (float64 references stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _ln(x: torch.Tensor, gammas: torch.Tensor, betas: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), gammas.to(x), betas.to(x), eps)


def _ffn(x: torch.Tensor, ffn: Mapping[str, Any], act: str, alpha: float) -> torch.Tensor:
    h = apply_activation(_dense(x, ffn["dense1_w"], ffn["dense1_b"]), act)
    return x + alpha * _dense(h, ffn["dense2_w"], ffn["dense2_b"])


def _smolgen(x: torch.Tensor, sg: Mapping[str, Any], smolgen_w: torch.Tensor, heads: int, act: str) -> torch.Tensor:
    """The additive attention bias ``[B, H, 64, 64]`` of one layer from its input rows ``[B, 64, D]``."""
    b = x.shape[0]
    d = x.shape[-1]
    hidden_channels = sg["compress"].numel() // d
    c = x @ sg["compress"].view(hidden_channels, d).to(x).t()  # [B, 64, hc], no bias
    h = _dense(c.reshape(b, 64 * hidden_channels), sg["dense1_w"], sg["dense1_b"])
    h = _ln(apply_activation(h, act), sg["ln1_gammas"], sg["ln1_betas"], 1e-3)
    h = _dense(h, sg["dense2_w"], sg["dense2_b"])
    h = _ln(apply_activation(h, act), sg["ln2_gammas"], sg["ln2_betas"], 1e-3)
    gen = h.view(b, heads, -1)  # [B, H, gen]
    w = smolgen_w.view(64 * 64, gen.shape[-1]).to(x)  # stored [4096][gen]
    return (gen @ w.t()).view(b, heads, 64, 64)


def _encoder_layer(
    x: torch.Tensor,
    layer: Mapping[str, Any],
    heads: int,
    act: str,
    ffn_act: str,
    smolgen_act: str,
    smolgen_w: Optional[torch.Tensor],
    alpha: float,
    eps: float,
) -> torch.Tensor:
    b = x.shape[0]
    mha = layer["mha"]
    d_model = mha["q_b"].numel()
    depth = d_model // heads

    def split(t: torch.Tensor) -> torch.Tensor:  # [B, 64, d_model] -> [B, H, 64, depth]
        return t.view(b, 64, heads, depth).transpose(1, 2)

    q = split(_dense(x, mha["q_w"], mha["q_b"]))
    k = split(_dense(x, mha["k_w"], mha["k_b"]))
    v = split(_dense(x, mha["v_w"], mha["v_b"]))
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(depth)
    if mha.get("smolgen"):
        logits = logits + _smolgen(x, mha["smolgen"], smolgen_w, heads, smolgen_act)
    a = torch.softmax(logits, dim=-1) @ v  # [B, H, 64, depth]
    a = a.transpose(1, 2).reshape(b, 64, d_model)
    y = x + alpha * _dense(a, mha["dense_w"], mha["dense_b"])
    y = _ln(y, layer["ln1_gammas"], layer["ln1_betas"], eps)
    y = _ffn(y, layer["ffn"], ffn_act, alpha)
    return _ln(y, layer["ln2_gammas"], layer["ln2_betas"], eps)


def _policy(
    x: torch.Tensor,
    head: Mapping[str, Any],
    act: str,
    ffn_act: str,
    smolgen_act: str,
    smolgen_w: Optional[torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """The attention policy head: ``[B, 64, D]`` -> ``[B, 1858]`` logits.  Its encoder layers
    run with alpha 1 and the head's activation (their FFN's unless the net names one)."""
    b = x.shape[0]
    p = apply_activation(_dense(x, head["ip_pol_w"], head["ip_pol_b"]), act)
    for layer in head.get("pol_encoder", []):
        p = _encoder_layer(p, layer, head["pol_headcount"], act, ffn_act, smolgen_act, smolgen_w, 1.0, eps)
    q = _wide(_dense(p, head["ip2_pol_w"], head["ip2_pol_b"]))  # [B, 64, pd]
    k = _wide(_dense(p, head["ip3_pol_w"], head["ip3_pol_b"]))
    pd = q.shape[-1]
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(pd)  # [B, 64 from, 64 to]
    # Promotions: the last rank's keys give 4 logits per file (q, r, b, n); the queen's is
    # added to the other three, which are then added to the from-rank-7 move logits.
    prom = k[:, 56:64, :] @ head["ip4_pol_w"].view(4, pd).to(k).t()  # [B, 8, 4]
    prom = (prom[:, :, :3] + prom[:, :, 3:4]).reshape(b, 1, 24)  # [B, 1, 8 files x 3 pieces]
    sl = logits[:, 48:56, 56:64].reshape(b, 64, 1).expand(b, 64, 3).reshape(b, 8, 24)
    prom = (sl + prom).reshape(b, 3, 64)
    flat = torch.cat([logits, prom], dim=1).reshape(b, 67 * 64)
    return moves.gather_policy(flat)


def _value(x: torch.Tensor, head: Mapping[str, Any], act: str, wdl: bool) -> torch.Tensor:
    b = x.shape[0]
    v = apply_activation(_dense(x, head["ip_val_w"], head["ip_val_b"]), act).reshape(b, -1)
    v = apply_activation(_dense(v, head["ip1_val_w"], head["ip1_val_b"]), act)
    v = _dense(_wide(v), head["ip2_val_w"], head["ip2_val_b"])
    return torch.softmax(v, dim=-1) if wdl else torch.tanh(v)


def _moves_left(x: torch.Tensor, w: Mapping[str, Any], act: str) -> torch.Tensor:
    b = x.shape[0]
    m = apply_activation(_dense(x, w["ip_mov_w"], w["ip_mov_b"]), act).reshape(b, -1)
    m = apply_activation(_dense(m, w["ip1_mov_w"], w["ip1_mov_b"]), act)
    return F.relu(_dense(_wide(m), w["ip2_mov_w"], w["ip2_mov_b"]))


class ReferenceNetwork(nn.Module):
    """The whole network of ``net`` in plain PyTorch, decided once: the format checks, the
    activations and the heads are resolved here, ``forward`` is only the math, in the dtype
    and on the device of its input (``placed`` puts the weights there first for speed).

    ``forward(planes [B, 112, 8, 8])`` returns ``{"policy": [B, 1858], "wdl": [B, 3]}``
    (``"value": [B, 1]`` for a net without a WDL head) plus ``"moves_left": [B, 1]`` when the
    net has that head.
    """

    def __init__(self, net: NetFile):
        super().__init__()
        check_supported(net)
        acts = net.activation_names()
        self.default_act, self.ffn_act, self.smolgen_act = acts["default"], acts["ffn"], acts["smolgen"]
        self.policy_act = acts["policy"]
        # The policy head's encoder layers take the net's FFN activation when it names one, else the head's.
        self.policy_ffn_act = self.ffn_act if net.ffn_activation != ActivationFunction.DEFAULT else self.policy_act
        self.weights = net.weights
        self.policy_head = net.policy_heads()["vanilla"]
        self.value_head = net.value_heads()["winner"]
        self.wdl = net.value_format == ValueFormat.WDL
        self.moves_left = net.moves_left_format == MovesLeftFormat.V1

    def forward(self, planes: torch.Tensor) -> dict[str, torch.Tensor]:
        if planes.dim() != 4 or tuple(planes.shape[1:]) != (112, 8, 8):
            raise ValueError(f"planes must be [B, 112, 8, 8], got shape {tuple(planes.shape)}")
        w = self.weights
        b = planes.shape[0]
        x = planes.permute(0, 2, 3, 1).reshape(b, 64, 112)
        # PE_DENSE: the first 12 planes of every square, as one vector, give each square more inputs.
        pos = _dense(x[:, :, :12].reshape(b, 64 * 12), w["ip_emb_preproc_w"], w["ip_emb_preproc_b"])
        x = torch.cat([x, pos.view(b, 64, -1)], dim=-1)
        x = apply_activation(_dense(x, w["ip_emb_w"], w["ip_emb_b"]), self.default_act)
        d = x.shape[-1]
        x = _ln(x, w["ip_emb_ln_gammas"], w["ip_emb_ln_betas"], 1e-3)
        if present(w.get("ip_mult_gate")):
            x = x * w["ip_mult_gate"].view(d, 64).t().to(x)  # stored [D][64]
        if present(w.get("ip_add_gate")):
            x = x + w["ip_add_gate"].view(d, 64).t().to(x)
        layers = w["encoder"]
        alpha = (2.0 * len(layers)) ** -0.25
        eps = BODY_LAYER_NORM_EPS
        x = _ffn(x, w["ip_emb_ffn"], self.ffn_act, alpha)
        x = _ln(x, w["ip_emb_ffn_ln_gammas"], w["ip_emb_ffn_ln_betas"], 1e-3)
        heads = w["headcount"]
        smolgen_w = w.get("smolgen_w")
        for layer in layers:
            x = _encoder_layer(x, layer, heads, self.default_act, self.ffn_act, self.smolgen_act, smolgen_w, alpha, eps)
        out = {
            "policy": _policy(
                x, self.policy_head, self.policy_act, self.policy_ffn_act, self.smolgen_act, smolgen_w, eps
            )
        }
        out["wdl" if self.wdl else "value"] = _value(x, self.value_head, self.default_act, self.wdl)
        if self.moves_left:
            out["moves_left"] = _moves_left(x, w, self.default_act)
        return out


def reference_forward(net: NetFile, planes: torch.Tensor) -> dict[str, torch.Tensor]:
    """``ReferenceNetwork(net)(planes)``: the whole network of ``net`` (``read_net``'s result)
    on ``planes [B, 112, 8, 8]``, computed in ``planes``'s dtype (float32 or float64 for
    references).  Raises ``Lc0FormatError`` for what ``check_supported`` refuses."""
    return ReferenceNetwork(net)(planes)


def placed(net: NetFile, device: Union[str, torch.device], dtype: torch.dtype) -> NetFile:
    """A copy of ``net`` with every weight already in ``dtype`` on ``device``: the reference then
    runs as an idiomatic PyTorch implementation would (no conversion per call), which is how the
    benchmarks time it as the torch peer."""

    def move(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return node.to(device=device, dtype=dtype) if node.is_floating_point() else node.to(device)
        if isinstance(node, dict):
            return {k: move(v) for k, v in node.items()}
        if isinstance(node, list):
            return [move(v) for v in node]
        return node

    return dataclasses.replace(net, weights=move(net.weights))


