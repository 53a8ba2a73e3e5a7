"""``Lc0Network``: a whole Lc0 attention-body net on fusedenc, planes in, heads out.

The body is a list of ``EncoderBlock``s (post-LN, ``alpha = (2 * layers) ** -0.25``),
the same fast path as every other fusedenc encoder; each layer's smolgen bias
``[B, H, 64, 64]`` is generated from that layer's input and passed to the block as
its additive attention bias.  Embedding, smolgen and heads run on ``fusedenc.linear``
(bias and activation fused in the GEMM epilogue) and ``fusedenc.layer_norm`` where the
shapes allow (rows of whole 16-byte vectors), torch ops otherwise.  The math is
``reference.reference_forward``'s, which the tests hold it to.

First version: smolgen is a few GEMMs per layer and one ``[B*H, gen] x [gen, 4096]``
GEMM straight into the ``[B, H, 64, 64]`` layout attention reads; fusing its
generation into the attention kernel is a possible next step.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import core
from ..common.activations import apply_activation
from ..common.checks import align_elems
from ..common.device import check_device, check_dtype
from ..common.torch_modules import inference_only, runs_eagerly_when_compiled
from ..encoder import fp8_fold
from ..encoder.blocks import EncoderBlock
from ..fp8.rowwise import quantize_blocks
from ..graphs import auto as auto_graphs
from ..graphs.runner import BucketedGraphs
from ..ops import norm_fold
from ..ops.gemm import linear
from ..ops.norm import layer_norm
from ..ops.norm_fold import NormedRows
from . import moves
from .errors import Lc0FormatError
from .netfile import NetFile, read_net
from .reference import BODY_LAYER_NORM_EPS
from .schema import InputFormat, MovesLeftFormat, ValueFormat
from .support import check_finite_heads, check_supported, shaped_as_expected

__all__ = ["Lc0GraphRunner", "Lc0Network", "load_network"]

# Smolgen beside the QKV GEMM (Lc0Network._folded_layer_beside): SMs left to it, by batch.
# Measured on an H100 (bench/NOTES.md): at 256 positions (16384 rows) 8 SMs gain 1-2% (4 are
# too few for the chain to finish inside QKV, 12 send dense1 to cuBLASLt, whose clustered
# kernels wait for a free GPC); at 1024 positions no count gains, so smolgen runs before.
# Only for a CUDA graph (captured, or warmed up for capture by Lc0GraphRunner): run eagerly,
# the stream switches, events and SM limits cost host time a graph replays for free, and
# eager Lc0 calls are host-bound at these batches (measured on the H100 machine: bt4 256
# 13.5 -> 10.4 ms a call, t82 256 24.9 -> 19.2, without the side stream).
_SIDE_SMS_ROWS, _SIDE_SMS_SMALL, _SIDE_SMS_LARGE = 16384, 8, 0


def _param(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(t.reshape(shape).to(device=device, dtype=dtype).contiguous(), requires_grad=False)


class _Dense(nn.Module):
    """``act(x @ W^T + b)`` from a stored ``[out][in]`` weight: one fused GEMM where rows are
    whole 16-byte vectors, ``F.linear`` + the activation otherwise."""

    def __init__(self, w: torch.Tensor, b: Optional[torch.Tensor], out: int, activation: str, dtype, device):
        super().__init__()
        self.weight = _param(w, (out, w.numel() // out), dtype, device)
        self.bias = None if b is None else _param(b, (out,), dtype, device)
        self.activation = activation
        align = align_elems(dtype)
        self.fused = self.weight.shape[0] % align == 0 and self.weight.shape[1] % align == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_contiguous():
            return linear(x, self.weight, self.bias, self.activation)
        return apply_activation(F.linear(x, self.weight, self.bias), self.activation)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """The layer in float32 (input and weights upcast): for the heads' last, tiny layers."""
        bias = None if self.bias is None else self.bias.float()
        return apply_activation(F.linear(x.float(), self.weight.float(), bias), self.activation)


class _Norm(nn.Module):
    def __init__(self, gammas: torch.Tensor, betas: torch.Tensor, eps: float, dtype, device):
        super().__init__()
        n = gammas.numel()
        self.weight, self.bias, self.eps = _param(gammas, (n,), dtype, device), _param(betas, (n,), dtype, device), eps
        self.fused = n % align_elems(dtype) == 0

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, alpha: float = 1.0) -> torch.Tensor:
        """``LN(alpha * x + residual)``: one pass where the rows allow it (fusedenc's LayerNorm)."""
        if self.fused and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            return layer_norm(x, self.weight, self.bias, self.eps, residual=residual, alpha=alpha)
        h = x if residual is None else residual + alpha * x
        return F.layer_norm(h, (x.shape[-1],), self.weight, self.bias, self.eps)


class _Smolgen(nn.Module):
    """One layer's smolgen: its input rows ``[B, 64, D]`` -> the attention bias ``[B, H, 64, 64]``."""

    def __init__(self, sg: Mapping[str, Any], global_w: torch.Tensor, d: int, heads: int, act: str, dtype, device):
        super().__init__()
        self.hidden_channels = sg["compress"].numel() // d
        self.heads = heads
        self.compress = _Dense(sg["compress"], None, self.hidden_channels, "none", dtype, device)
        self.dense1 = _Dense(sg["dense1_w"], sg["dense1_b"], sg["dense1_b"].numel(), act, dtype, device)
        self.ln1 = _Norm(sg["ln1_gammas"], sg["ln1_betas"], 1e-3, dtype, device)
        self.dense2 = _Dense(sg["dense2_w"], sg["dense2_b"], sg["dense2_b"].numel(), act, dtype, device)
        self.ln2 = _Norm(sg["ln2_gammas"], sg["ln2_betas"], 1e-3, dtype, device)
        self.global_w = global_w  # shared by every layer: [4096, gen]
        self.fold_cache = norm_fold.FoldCache()  # compress with the previous layer's LayerNorm folded in

    def forward(self, x: Union[torch.Tensor, NormedRows]) -> torch.Tensor:
        """``x``: the layer input ``[B, 64, D]``, or its rows pending a LayerNorm (the body's
        folded path, ``norm_fold``), which compress reads through the fold."""
        c, b = self.compress_rows(x)
        return self.expand(self.generate(c, b), b)

    def compress_rows(self, x: Union[torch.Tensor, NormedRows]) -> tuple[torch.Tensor, int]:
        """(compress(x) ``[B * 64, hidden_channels]``, B)."""
        if isinstance(x, NormedRows):
            return norm_fold.norm_linear(x, self.compress.weight, None, "none", self.fold_cache), x.z.shape[0] // 64
        b = x.shape[0] if x.dim() == 3 else x.shape[0] // 64  # [B, 64, D], or its rows [B * 64, D]
        return self.compress(x), b

    def generate(self, c: torch.Tensor, b: int) -> torch.Tensor:
        """Compressed rows -> the per-head ``gen`` vectors ``[B * H, gen]`` (small GEMMs and LayerNorms)."""
        h = self.ln2(self.dense2(self.ln1(self.dense1(c.reshape(b, 64 * self.hidden_channels)))))
        return h.view(b * self.heads, -1)

    def expand(self, gen: torch.Tensor, b: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``gen`` times the global weight: one GEMM straight into the ``[B, H, 64, 64]`` layout
        the attention call reads (into ``out`` when given)."""
        if out is None:
            return torch.mm(gen, self.global_w.t()).view(b, self.heads, 64, 64)
        torch.mm(gen, self.global_w.t(), out=out.view(b * self.heads, 64 * 64))
        return out


class _FFN(nn.Module):
    """The FFN branch ``dense2(act(dense1(x)))``; its residual ``x + alpha * branch`` is
    formed inside the LayerNorm that follows (one pass instead of three)."""

    def __init__(self, ffn: Mapping[str, Any], act: str, dtype, device):
        super().__init__()
        d_ff, d = ffn["dense1_b"].numel(), ffn["dense2_b"].numel()
        self.dense1 = _Dense(ffn["dense1_w"], ffn["dense1_b"], d_ff, act, dtype, device)
        self.dense2 = _Dense(ffn["dense2_w"], ffn["dense2_b"], d, "none", dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense2(self.dense1(x))


def _block(layer: Mapping[str, Any], heads: int, ffn_act: str, alpha: float, eps: float, dtype, device) -> EncoderBlock:
    mha, ffn = layer["mha"], layer["ffn"]
    d, d_ff = mha["q_b"].numel(), ffn["dense1_b"].numel()
    block = EncoderBlock(d, heads, d_ff, ffn_act, residual_alpha=alpha, layer_norm_eps=eps, dtype=dtype, device=device)
    sources = {
        "qkv_weight": torch.cat([mha["q_w"], mha["k_w"], mha["v_w"]]).view(3 * d, d),
        "qkv_bias": torch.cat([mha["q_b"], mha["k_b"], mha["v_b"]]),
        "out_weight": mha["dense_w"].view(d, d), "out_bias": mha["dense_b"],
        "norm1_weight": layer["ln1_gammas"], "norm1_bias": layer["ln1_betas"],
        "ffn1_weight": ffn["dense1_w"].view(d_ff, d), "ffn1_bias": ffn["dense1_b"],
        "ffn2_weight": ffn["dense2_w"].view(d, d_ff), "ffn2_bias": ffn["dense2_b"],
        "norm2_weight": layer["ln2_gammas"], "norm2_bias": layer["ln2_betas"],
    }  # fmt: skip
    with torch.no_grad():
        for name, src in sources.items():
            getattr(block, name).copy_(src.view(getattr(block, name).shape))
    return block.eval()


class Lc0Network(auto_graphs.GraphedModule):
    """A whole Lc0 attention-body network (``load_network`` builds one from a file).

    ``forward(planes)``: input planes ``[B, 112, 8, 8]`` in the network's dtype on its
    device (lc0's encoding of a position and its history); returns ``{"policy": [B, 1858]
    logits in lc0's move order (``fusedenc.lc0.moves``), "wdl": [B, 3] probabilities}``
    (``"value": [B, 1]`` for a net without a WDL head) and ``"moves_left": [B, 1]`` where
    the net has that head.  Inference only.  On a GPU, repeated calls replay CUDA graphs
    (``fusedenc.graphs.auto``; ``self.auto_graphs``); ``forward(planes, out=heads)`` writes
    into a dict of tensors like the result.
    """

    def __init__(
        self,
        net: NetFile,
        *,
        dtype: torch.dtype = torch.float16,
        device: Union[str, torch.device] = "cuda",
        check_finite: bool = False,
    ):
        super().__init__()
        # Everything about the file is checked before anything is built or reaches the device:
        # the format, every size the builder uses, and the values against ``dtype`` (a layer that
        # would be inf in it is refused; one beyond float16's range in a wider dtype is warned about).
        # ``dtype`` itself first (the range check needs one), ``device`` after the file (what the
        # file is comes before where it goes), both in fusedenc's words rather than ``.to()``'s.
        dtype = check_dtype(dtype, optional=False)
        check_supported(net, dtype=dtype)
        if net.get(net.policy_head_paths()["vanilla"]["pol_encoder"]):
            raise Lc0FormatError(f"{net.source}: policy-head encoder layers are not supported yet")
        device = check_device(device, optional=False)
        net = shaped_as_expected(net)  # every layer in the shape the builder reads (the file's dims set aside, as lc0 does)
        #: Opt-in: a forward whose heads are NaN or infinite raises ``Lc0NonFiniteError`` naming
        #: them (one sync per call; eager calls only: inside a CUDA graph capture, i.e.
        #: ``Lc0GraphRunner``, nothing is checked).  Off: the forward does no extra work.
        self.check_finite = bool(check_finite)
        w = net.weights
        acts = net.activation_names()
        self.activations = acts
        self.source = net.source
        self.description = net.describe()
        # How positions become planes for this net (checked against the encoder's formats
        # when positions are evaluated, so a net of another format still runs on planes).
        fmt = net.input_format
        self.input_format = InputFormat(fmt) if fmt in InputFormat._value2member_map_ else fmt
        d = w["ip_emb_b"].numel()
        heads = w["headcount"]
        layers = w["encoder"]
        alpha = (2.0 * len(layers)) ** -0.25
        eps = BODY_LAYER_NORM_EPS
        kw = {"dtype": dtype, "device": device}
        self.d_model, self.heads, self.dtype = d, heads, dtype
        # SMs smolgen's small kernels get beside each QKV GEMM (None: by batch size while a CUDA
        # graph is captured, none when run eagerly; 0: none, smolgen runs before its block).
        # The side streams are made on first use, per device.
        self.smolgen_side_sms: Optional[int] = None
        self._side_streams: dict = {}
        self._for_graph = False  # set by Lc0GraphRunner while it warms up and captures

        # Embedding.
        e64 = w["ip_emb_preproc_b"].numel()
        self.preproc = _Dense(w["ip_emb_preproc_w"], w["ip_emb_preproc_b"], e64, "none", **kw)
        self.ip_emb = _Dense(w["ip_emb_w"], w["ip_emb_b"], d, acts["default"], **kw)
        self.ip_emb_ln = _Norm(w["ip_emb_ln_gammas"], w["ip_emb_ln_betas"], 1e-3, **kw)
        gates = {}
        for name in ("ip_mult_gate", "ip_add_gate"):
            t = w.get(name)
            gates[name] = None if t is None or t.numel() == 0 else _param(t.view(d, 64).t(), (64, d), **kw)
        self.mult_gate, self.add_gate = gates["ip_mult_gate"], gates["ip_add_gate"]
        self.emb_ffn = _FFN(w["ip_emb_ffn"], acts["ffn"], **kw)
        self.alpha = alpha
        self.emb_ffn_ln = _Norm(w["ip_emb_ffn_ln_gammas"], w["ip_emb_ffn_ln_betas"], 1e-3, **kw)

        # Body: blocks and their smolgen.
        global_w = w.get("smolgen_w")
        self.smolgen_w = None
        if global_w is not None and global_w.numel() and any(layer["mha"].get("smolgen") for layer in layers):
            self.smolgen_w = _param(global_w, (64 * 64, global_w.numel() // 4096), **kw)
        self.blocks = nn.ModuleList(_block(layer, heads, acts["ffn"], alpha, eps, **kw) for layer in layers)
        self.smolgen = nn.ModuleList(
            _Smolgen(layer["mha"]["smolgen"], self.smolgen_w, d, heads, acts["smolgen"], **kw)
            if layer["mha"].get("smolgen") else nn.Identity()
            for layer in layers
        )  # fmt: skip

        # Heads.
        ph = net.policy_heads()["vanilla"]
        pe, pd = ph["ip_pol_b"].numel(), ph["ip2_pol_b"].numel()
        self.pol_embed = _Dense(ph["ip_pol_w"], ph["ip_pol_b"], pe, acts["policy"], **kw)
        self.pol_q = _Dense(ph["ip2_pol_w"], ph["ip2_pol_b"], pd, "none", **kw)
        self.pol_k = _Dense(ph["ip3_pol_w"], ph["ip3_pol_b"], pd, "none", **kw)
        self.pol_promotion = _param(ph["ip4_pol_w"], (4, pd), **kw)
        self.pol_scale = 1.0 / math.sqrt(pd)
        vh = net.value_heads()["winner"]
        self.wdl = net.value_format == ValueFormat.WDL
        self.val_channels = vc = vh["ip_val_b"].numel()
        self.has_moves_left = net.moves_left_format == MovesLeftFormat.V1
        embed_w, embed_b = vh["ip_val_w"].view(vc, -1), vh["ip_val_b"]
        if self.has_moves_left:
            # The value and moves-left embeddings read the same rows: one GEMM for both
            # (measured on an H100 at t82 256 positions: 16 us against 25 for two).
            embed_w = torch.cat([embed_w, w["ip_mov_w"].view(w["ip_mov_b"].numel(), -1)])
            embed_b = torch.cat([embed_b, w["ip_mov_b"]])
        self.val_embed = _Dense(embed_w, embed_b, embed_b.numel(), acts["default"], **kw)  # value [+ moves-left]
        self.val_dense1 = _Dense(vh["ip1_val_w"], vh["ip1_val_b"], vh["ip1_val_b"].numel(), acts["default"], **kw)
        self.val_dense2 = _Dense(vh["ip2_val_w"], vh["ip2_val_b"], vh["ip2_val_b"].numel(), "none", **kw)
        if self.has_moves_left:
            self.mov_dense1 = _Dense(w["ip1_mov_w"], w["ip1_mov_b"], w["ip1_mov_b"].numel(), acts["default"], **kw)
            self.mov_dense2 = _Dense(w["ip2_mov_w"], w["ip2_mov_b"], 1, "none", **kw)
        self.eval()  # inference only (``forward`` refuses training mode), as the blocks are

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state["_side_streams"] = {}  # CUDA streams do not copy or pickle: made again on first use
        return state

    def extra_repr(self) -> str:
        a = self.activations
        return (
            f"source={self.source!r}, layers={len(self.blocks)}, d_model={self.d_model}, heads={self.heads}, "
            f"activations=(default {a['default']}, ffn {a['ffn']}, smolgen {a['smolgen']}), "
            f"smolgen={self.smolgen_w is not None}, wdl={self.wdl}, moves_left={self.has_moves_left}"
        )

    def evaluate(self, positions: Any, *, temperature: float = 1.0) -> list:
        """Moves with probabilities, WDL, Q and moves-left for positions (FEN strings,
        ``(fen, [uci moves])`` pairs, ``Position`` or ``chess.Board`` objects): see
        ``fusedenc.lc0.evaluate``.  Bad positions and input formats fusedenc does not encode
        raise before the network runs."""
        from .evaluate import evaluate

        p = self.preproc.weight
        with torch.inference_mode():
            return evaluate(self, self.input_format, positions, dtype=p.dtype, device=p.device, temperature=temperature)

    def graph_runner(self, batch_sizes: Sequence[int] = (1, 16, 64, 256, 1024)) -> "Lc0GraphRunner":
        """The whole network as one CUDA graph per batch-size bucket (``Lc0GraphRunner``).

        What an engine should call: eager calls launch ~20 small kernels a layer (smolgen
        among them) and are host-bound below a few hundred positions (measured on an H100
        at 64 positions: 3.5-4.7k positions/s eager, 19.6-23.8k as a graph)."""
        return Lc0GraphRunner(self, batch_sizes)

    def _check(self, planes: torch.Tensor) -> None:
        if not isinstance(planes, torch.Tensor):
            raise TypeError(f"planes must be a torch.Tensor, got {type(planes).__name__}")
        if planes.dim() != 4 or tuple(planes.shape[1:]) != (112, 8, 8):
            raise ValueError(f"planes must be [B, 112, 8, 8], got shape {tuple(planes.shape)}")
        p = self.preproc.weight
        if planes.dtype != p.dtype or planes.device != p.device:
            raise TypeError(f"planes are {planes.dtype} on {planes.device}; the network is {p.dtype} on {p.device}")

    @runs_eagerly_when_compiled  # a compiled caller runs the net (and replays its graphs) at run time
    @inference_only
    def forward(self, planes: torch.Tensor, *, out: Optional[dict] = None) -> dict[str, torch.Tensor]:
        self._check(planes)
        native = core.active_on(planes.device) and not auto_graphs.observing(self)
        heads = auto_graphs.call(self, self._forward_heads, (planes,), key=self.smolgen_side_sms, rows_per_item=64,
                                 native=native, out=out, around_capture=self._graph_warmup)  # fmt: skip
        if self.check_finite and not (planes.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_finite_heads(heads, self.source)
        return heads

    @contextlib.contextmanager
    def _graph_warmup(self):
        """Warm-up and capture take the path a graph replays (smolgen beside QKV: its plans
        and streams are made before capture, like everything else)."""
        self._for_graph = True
        try:
            yield
        finally:
            self._for_graph = False

    def _forward_heads(self, planes: torch.Tensor) -> dict[str, torch.Tensor]:
        """``forward``'s work on planes it has checked (``_check``, once a call); ``EncodedRunner``
        passes planes it made itself."""
        b = planes.shape[0]
        if b == 0:  # an empty batch: empty heads, nothing launched
            empty = {"policy": 1858, "wdl" if self.wdl else "value": 3 if self.wdl else 1}
            if self.has_moves_left:
                empty["moves_left"] = 1
            return {name: planes.new_empty((0, n), dtype=torch.float32) for name, n in empty.items()}
        x = self._embed_gated(planes)
        rows = x.view(-1, x.shape[-1])
        if not any(block.quantized for block in self.blocks) and norm_fold.applies(self.blocks, rows):
            # The body's LayerNorms folded into its GEMMs (norm_fold): each layer's input
            # stays pending, and smolgen's compress reads it through the fold too.  The
            # embedding's FFN ends like a body FFN, so its LayerNorm is left pending as well:
            # layer 0 then runs the folded kernels with smolgen beside QKV like the others.
            pending = self._embedding_ffn_pending(rows)
            side_sms = self._side_sms(rows)
            for i, block in enumerate(self.blocks):
                if side_sms and not isinstance(self.smolgen[i], nn.Identity):
                    pending = self._folded_layer_beside(
                        i, pending, b, side_sms,
                        lambda bias, join, block=block, pending=pending: block.folded_rows(pending, b, 64, bias,
                                                                                            after_qkv=join))  # fmt: skip
                else:
                    pending = block.folded_rows(pending, b, 64, self.attention_bias(i, pending))
            x = norm_fold.materialize(pending, self.blocks[-1].layer_norm_eps).view(x.shape)
            return self.head_outputs(x)
        x = self._embedding_ffn(x)
        rows = x.view(-1, x.shape[-1])
        if all(block.quantized for block in self.blocks) and fp8_fold.applies(self.blocks, rows):
            # The calibrated FP8 body with its LayerNorms folded (fp8_fold); smolgen reads each
            # layer's input through the 16-bit fold, beside QKV as above.
            pending, last = rows, len(self.blocks) - 1
            side_sms = self._side_sms(rows)
            for i, block in enumerate(self.blocks):
                normed = pending if isinstance(pending, torch.Tensor) else pending.rows

                def run(bias, join=None, block=block, pending=pending, codes_out=i < last):
                    return fp8_fold.block_rows(block, pending, b, 64, bias, None, None, codes_out, after_qkv=join)

                if side_sms and not isinstance(self.smolgen[i], nn.Identity):
                    pending = self._folded_layer_beside(i, normed, b, side_sms, run)
                else:
                    pending = run(self.attention_bias(i, normed))
            x = norm_fold.materialize(pending.rows, self.blocks[-1].layer_norm_eps).view(x.shape)
        else:
            for i in range(len(self.blocks)):
                x = self.layer(i, x)
        return self.head_outputs(x)

    def _side_sms(self, rows: torch.Tensor) -> int:
        """SMs for smolgen's small kernels beside the QKV GEMM (0: smolgen runs before the block)."""
        if rows.device.type != "cuda" or not core.active_on(rows.device) or self.smolgen_w is None:
            return 0
        n = self.smolgen_side_sms
        if n is None:
            if not (getattr(self, "_for_graph", False) or torch.cuda.is_current_stream_capturing()):
                return 0
            return _SIDE_SMS_SMALL if rows.shape[0] <= _SIDE_SMS_ROWS else _SIDE_SMS_LARGE
        sms = torch.cuda.get_device_properties(rows.device).multi_processor_count
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < sms:
            raise ValueError(f"smolgen_side_sms must be None or an int in [0, {sms}) on {rows.device}, got {n!r}")
        return n

    def _folded_layer_beside(self, i: int, pending, b: int, side_sms: int, run):
        """Folded layer ``i`` with smolgen's latency-bound middle (dense1, LN1, dense2, LN2: ~30 us
        of small kernels a layer at t82 256) on a side stream and ``side_sms`` SMs while the QKV
        GEMM runs on the others; the global GEMM (the whole chip) runs between QKV and attention.
        ``pending``: the layer's input (rows, or rows pending a LayerNorm) that smolgen reads;
        ``run(bias, join)``: the block (16-bit or FP8 folded), calling ``join()`` after QKV."""
        smolgen, device = self.smolgen[i], pending.z.device if isinstance(pending, NormedRows) else pending.device
        main = torch.cuda.current_stream(device)
        side = self._side_streams.get(device.index)
        if side is None:
            side = self._side_streams[device.index] = torch.cuda.Stream(device)
        # Compress reads every row: on the few SMs it would outlast QKV (measured), so it stays here.
        c, _ = smolgen.compress_rows(pending)  # read by the side stream: referenced until the join
        side.wait_stream(main)
        with torch.cuda.stream(side):
            outer = core.set_sm90_sm_limit(side_sms)
            try:
                gen = smolgen.generate(c, b)
            finally:
                core.set_sm90_sm_limit(outer)
        bias = torch.empty((b, self.heads, 64, 64), dtype=gen.dtype, device=device)

        def join() -> None:
            core.set_sm90_sm_limit(outer)
            main.wait_stream(side)
            smolgen.expand(gen, b, out=bias)

        core.set_sm90_sm_limit(torch.cuda.get_device_properties(device).multi_processor_count - side_sms)
        try:
            return run(bias, join)
        finally:
            core.set_sm90_sm_limit(outer)

    def quantize(
        self, mode: Optional[str] = "fp8", *, keep: Sequence[str] = (), layers: Optional[Sequence[int]] = None,
        fast_accum: bool = False, calibration: Optional[torch.Tensor] = None, fold_norms: bool = True,
    ) -> "Lc0Network":  # fmt: skip
        """The body's GEMMs in FP8 (``EncoderStack.quantize``'s arguments; ``None``: back to the
        net's dtype; ``calibration``: sample input planes, run once for static FFN2 input
        scales; with it, ``fold_norms`` folds the body's LayerNorms into its FP8 GEMMs as in
        ``EncoderStack.quantize``).  Embedding, smolgen and heads stay in the net's dtype.
        Returns the net."""
        quantize_blocks(self.blocks, mode, keep=keep, layers=layers, fast_accum=fast_accum, calibration=calibration,
                        model=self, fold_norms=fold_norms)
        return self

    # The stages of ``forward``, public so that a benchmark can time each (``bench/lc0.py
    # --parts``); they take what ``forward`` passes and check nothing.
    def embed(self, planes: torch.Tensor) -> torch.Tensor:
        """Input planes ``[B, 112, 8, 8]`` -> the body's input ``[B, 64, d_model]``."""
        return self._embedding_ffn(self._embed_gated(planes))

    def _embedding_ffn(self, x: torch.Tensor) -> torch.Tensor:
        """The embedding's FFN and its LayerNorm: ``LN(x + alpha * ffn(x))``."""
        return self.emb_ffn_ln(self.emb_ffn(x), residual=x, alpha=self.alpha)

    def _embedding_ffn_pending(self, rows: torch.Tensor) -> NormedRows:
        """``_embedding_ffn`` on the folded path: FFN2 is the residual GEMM with row statistics,
        and the LayerNorm stays pending for layer 0's folded GEMMs (``norm_fold``)."""
        ffn, ln = self.emb_ffn, self.emb_ffn_ln
        return norm_fold.residual_linear(ffn.dense1(rows), ffn.dense2.weight, ffn.dense2.bias, rows, self.alpha,
                                         ln.weight, ln.bias, ln.eps)

    def _embed_gated(self, planes: torch.Tensor) -> torch.Tensor:
        """Planes -> the embedding up to its gates (the embedding FFN's input ``[B, 64, d_model]``)."""
        b = planes.shape[0]
        x = planes.permute(0, 2, 3, 1).reshape(b, 64, 112)
        pos = self.preproc(x[:, :, :12].reshape(b, 64 * 12).contiguous()).view(b, 64, -1)
        # The transposed planes made contiguous first: the concatenation of two contiguous
        # tensors is the vectorized copy (measured on an H100 at bt4 1024: 94 us against 175).
        x = torch.cat([x.contiguous(), pos], dim=-1)
        x = self.ip_emb_ln(self.ip_emb(x))
        if self.mult_gate is not None and self.add_gate is not None:
            x = torch.addcmul(self.add_gate, x, self.mult_gate)  # one pass for both gates
        elif self.mult_gate is not None:
            x = x * self.mult_gate
        elif self.add_gate is not None:
            x = x + self.add_gate
        return x

    def attention_bias(self, i: int, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Layer ``i``'s smolgen bias ``[B, H, 64, 64]`` from its input (None without smolgen)."""
        smolgen = self.smolgen[i]
        return None if isinstance(smolgen, nn.Identity) else smolgen(x)

    def layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Encoder layer ``i`` with its smolgen bias."""
        return self.blocks[i](x, self.attention_bias(i, x))

    def head_outputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The body's output ``[B, 64, d_model]`` -> the heads' outputs (``forward``'s dict).

        Every head comes out in float32, whatever the net's dtype: the heads' last products
        (the policy's query-key dot products, the value and moves-left outputs) run in float32
        from the net-dtype activations.  Rounding 1858 policy logits of magnitude ~7 to bf16
        (steps of 1/32) alone moved the top move of a trained net on 0.7% of held-back
        positions (0.1% in fp16); the float32 step costs well under 1% of a batch."""
        b = x.shape[0]
        out = {"policy": self._policy(x)}
        embedded = self.val_embed(x)  # [B, 64, value channels (+ moves-left channels)]
        v = self.val_dense1(embedded[..., : self.val_channels].reshape(b, -1))
        v = self.val_dense2.float32(v)
        out["wdl" if self.wdl else "value"] = torch.softmax(v, -1) if self.wdl else torch.tanh(v)
        if self.has_moves_left:
            m = self.mov_dense1(embedded[..., self.val_channels :].reshape(b, -1))
            out["moves_left"] = F.relu(self.mov_dense2.float32(m))
        return out

    def _policy(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pol_embed(x)
        q, k = self.pol_q(p).float(), self.pol_k(p).float()
        square = torch.bmm(q, k.transpose(1, 2)) * self.pol_scale
        promotion_keys = k[:, 56:64, :] @ self.pol_promotion.float().t()
        return moves.gather_policy(moves.attention_policy_logits(square, promotion_keys))


class Lc0GraphRunner(BucketedGraphs):
    """Replays one CUDA graph of a whole ``Lc0Network`` per batch-size bucket.

    ``runner(planes)`` takes what ``Lc0Network.forward`` takes (``[B, 112, 8, 8]`` in the
    network's dtype on its GPU) and returns the same heads, computed by the graph of the
    smallest bucket ``>= B`` (rows past B are padding; positions are independent).  The
    outputs are views into the graph's static outputs, valid until the next call
    (``.clone()`` them to keep them); a batch larger than every bucket runs in chunks of
    the largest and returns new tensors.  Graphs are captured on first use of a bucket
    (``capture_all()`` does it up front) and share one memory pool.  Not thread-safe:
    one runner per thread.
    """

    def __init__(self, net: Lc0Network, batch_sizes: Sequence[int]):
        if not isinstance(net, Lc0Network):
            raise TypeError(f"net must be an Lc0Network, got {type(net).__name__}")
        p = net.preproc.weight
        if p.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the network on a GPU; its parameters are on {p.device}")
        super().__init__(net, batch_sizes, p.device)
        self.net = net

    def _static_inputs(self, bucket: int) -> tuple[Optional[torch.Tensor], ...]:
        p = self.net.preproc.weight
        return (torch.zeros((bucket, 112, 8, 8), dtype=p.dtype, device=p.device),)

    def __call__(self, planes: torch.Tensor) -> dict[str, torch.Tensor]:
        self.net._check(planes)
        return self._dispatch((planes,))

    def evaluate(self, positions: Any, *, temperature: float = 1.0) -> list:
        """``Lc0Network.evaluate`` through this runner's graphs."""
        from .evaluate import evaluate

        p = self.net.preproc.weight
        with torch.inference_mode():
            return evaluate(self, self.net.input_format, positions, dtype=p.dtype, device=p.device,
                            temperature=temperature)

    def _capture(self, bucket: int):
        with self.net._graph_warmup():
            return super()._capture(bucket)


def load_network(
    path: Union[str, bytes],
    *,
    dtype: torch.dtype = torch.float16,
    device: Union[str, torch.device] = "cuda",
    max_bytes: Optional[int] = None,
    check_finite: bool = False,
) -> Lc0Network:
    """Read an lc0 network file (``.pb.gz``) and build its ``Lc0Network`` in ``dtype`` on ``device``.

    ``dtype``: torch.float16 (default), torch.bfloat16 or torch.float32 (a torch.dtype; strings
    are refused naming the dtype to pass).  ``device``: "cuda" (default), "cuda:N", "cpu", a GPU
    index or a torch.device; without a GPU pass ``device="cpu", dtype=torch.float32``.  ``dtype``
    is checked before the file is read, ``device`` once the file is (a damaged file is named as
    such wherever it was to go).

    Everything about the file is checked before any tensor reaches the device: a file that
    is not an lc0 net, a damaged one, or a net in a format fusedenc does not run raises
    ``Lc0FileError`` / ``Lc0FormatError`` naming what is wrong.  ``max_bytes``: ``read_net``'s
    limit on the decompressed file (None: 2 GiB or ``FUSEDENC_LC0_MAX_BYTES``);
    ``check_finite``: ``Lc0Network``'s opt-in check of each forward's heads.
    """
    dtype = check_dtype(dtype, optional=False)
    return Lc0Network(read_net(path, max_bytes=max_bytes), dtype=dtype, device=device, check_finite=check_finite)
