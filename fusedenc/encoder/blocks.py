"""EncoderBlock and EncoderStack: a transformer encoder layer built from the fused ops.

Data path of one post-LN block (docs/ARCHITECTURE.md), ``T = B*S`` rows of ``D``::

    qkv = x @ Wqkv^T + bqkv              one GEMM, bias in the epilogue        [T, 3D]
    a   = attention(q, k, v views)       reads the packed buffer, writes       [T, D]
    y   = a @ Wo^T + bo                  GEMM, bias in the epilogue
    h   = LN1(x + alpha * y)             one fused residual + scale + LayerNorm kernel
    f   = act(h @ W1^T + b1)             GEMM + bias + activation epilogue (or + one kernel)
    g   = f @ W2^T + b2                  GEMM
    out = LN2(h + alpha * g)             fused kernel

Pre-LN (``norm_first=True``) computes ``x + alpha * sublayer(LN(x))`` for both
sublayers; the attention residual rides in the LayerNorm kernel (which also
writes the new residual stream) and the FFN residual in the last GEMM's
epilogue (``beta * C``).  No separate add, scale or bias kernel runs.

Two executors run the same data path (``executors.py``): the *ops* path through
the public ops (CPU, no native core) and the *native* path
for eager calls on the GPU, which validates a call's signature once and then
calls ``core`` directly, so a block costs a few microseconds of host time per
op instead of the ops' per-call argument checks.  Both compute bit-identical
results on the GPU (tested).  ``graphs/runner.py`` replays a whole stack as CUDA graphs;
under ``torch.compile`` a block or stack is one custom op (``traced.py``).

Inference only (``torch_modules``): blocks and stacks are made in eval mode, refuse to run in
training mode, and run without autograd, so no output carries a ``grad_fn``; no dropout.
"""

from __future__ import annotations

import math
import threading
from typing import Iterable, Optional, Sequence

import torch
import torch.nn as nn

from .. import core
from ..attention import VarlenPlan, plan_for
from ..common import activations
from ..common.checks import check_block_call, check_block_operands
from ..common.device import check_device, check_dtype
from ..common.torch_modules import block_from_torch, inference_only, stack_from_torch
from ..fp8 import rowwise as fp8
from ..graphs import auto as auto_graphs
from ..graphs.runner import GraphRunner
from ..ops import norm_fold
from ..ops.norm import layer_norm
from ..varlen.calls import PaddingFreeCalls
from . import fp8_fold, traced
from .executors import Fp8Executor, NativeExecutor, ObservingExecutor, OpsExecutor

__all__ = ["EncoderBlock", "EncoderStack", "GraphRunner"]  # GraphRunner lives in graphs/runner.py

_QKV_KEYS = ("q_weight", "k_weight", "v_weight")
_QKV_BIAS_KEYS = ("q_bias", "k_bias", "v_bias")

#: Row length (elements) every GEMM operand and LayerNorm row must be a multiple of:
#: 16 bytes of fp16/bf16.  fp32 would need only 4; one rule keeps it simple.
_DIM_MULTIPLE = 8


def _native_active(device: torch.device) -> bool:
    """Whether the block runs the native executor on ``device`` (a seam the tests patch)."""
    return core.active_on(device)


# ------------------------------------------------------------ the block ----


class EncoderBlock(PaddingFreeCalls, auto_graphs.GraphedModule):
    """A transformer encoder layer (self-attention + FFN) on fusedenc's fused ops.

    Args:
        d_model: model width D (a multiple of 8).
        n_heads: attention heads H (must divide D).
        d_ff: FFN width F (a multiple of 8).
        activation: FFN activation, one of ``fusedenc.ACTIVATIONS`` ("gelu" is exact erf).
        norm_first: pre-LN (``x + alpha * f(LN(x))``) instead of post-LN (``LN(x + alpha * f(x))``).
        residual_alpha: the Lc0 scale alpha on each sublayer's output (1 for plain post-LN).
        layer_norm_eps: epsilon of both LayerNorms.
        bias: whether the linear layers and LayerNorms have biases (as ``nn.TransformerEncoderLayer``).
        batch_first: input is ``[B, S, D]`` (True) or ``[S, B, D]`` (False).
        dtype: of the parameters, a torch.dtype: torch.float16, torch.bfloat16 or torch.float32
            (None: torch's default dtype; strings such as "float16" are refused, naming the dtype to pass).
        device: of the parameters: "cuda", "cuda:N", "cpu", a GPU index or a torch.device (None: torch's default).

    Inference only: made in eval mode; in training mode a call raises ``RuntimeError``; calls run
    without autograd.

    Parameters: ``qkv_weight [3D, D]`` (rows q, k, v, like ``in_proj_weight``),
    ``qkv_bias [3D]``, ``out_weight [D, D]``, ``out_bias``, ``norm1_weight``,
    ``norm1_bias`` (the LayerNorm after attention in post-LN, before it in
    pre-LN), ``ffn1_weight [F, D]``, ``ffn1_bias [F]``, ``ffn2_weight [D, F]``,
    ``ffn2_bias``, ``norm2_weight``, ``norm2_bias``.  ``load_state_dict`` also
    accepts separate ``q_weight``, ``k_weight``, ``v_weight`` (and ``q_bias``,
    ``k_bias``, ``v_bias``) in place of the packed ones.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        activation: str = "relu",
        *,
        norm_first: bool = False,
        residual_alpha: float = 1.0,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        batch_first: bool = True,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ) -> None:
        super().__init__()
        self._handle = traced.register(self._eager_rows)  # the compiled graph's way back to this block
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("d_ff", d_ff)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} does not divide d_model={d_model}")
        for name, value in (("d_model", d_model), ("d_ff", d_ff)):
            if value % _DIM_MULTIPLE:
                raise ValueError(f"{name}={value} must be a multiple of {_DIM_MULTIPLE} (16-byte rows for the GEMMs)")
        for name, value in (("residual_alpha", residual_alpha), ("layer_norm_eps", layer_norm_eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if layer_norm_eps < 0:
            raise ValueError(f"layer_norm_eps={layer_norm_eps} must be >= 0")
        dtype, device = check_dtype(dtype), check_device(device)
        self.training = False  # inference only: born in eval mode (nn.Module starts in training mode)
        self.d_model, self.n_heads, self.d_ff = d_model, n_heads, d_ff
        self.head_dim = d_model // n_heads
        self.activation = activations.canonical_activation(activation)
        self.norm_first = bool(norm_first)
        self.residual_alpha = float(residual_alpha)
        self.layer_norm_eps = float(layer_norm_eps)
        self.batch_first = bool(batch_first)

        kw = {"dtype": dtype, "device": device}
        d, f = d_model, d_ff

        def param(*shape):
            return nn.Parameter(torch.empty(shape, **kw), requires_grad=False)

        shapes = {"qkv": (3 * d, d), "out": (d, d), "norm1": (d,), "ffn1": (f, d), "ffn2": (d, f), "norm2": (d,)}
        for name, shape in shapes.items():
            self.register_parameter(f"{name}_weight", param(*shape))
            # bias=False drops every bias, the LayerNorms' too (as nn.TransformerEncoderLayer does).
            self.register_parameter(f"{name}_bias", param(shape[0]) if bias else None)
        self.reset_parameters()
        self._plans: dict = {}
        self._plans_lock = threading.Lock()
        self._fold_cache = norm_fold.FoldCache()  # QKV and FFN1 weights with a LayerNorm folded in
        self._fp8_config: Optional[tuple] = None  # fp8.quantize_config's result while quantized
        self._fp8: Optional[fp8.QuantizedWeights] = None
        self.fp8_observer: Optional[fp8.Calibration] = None  # set while fp8.calibrating runs the block

    _PARAM_NAMES = (
        "qkv_weight", "qkv_bias", "out_weight", "out_bias", "norm1_weight", "norm1_bias",
        "ffn1_weight", "ffn1_bias", "ffn2_weight", "ffn2_bias", "norm2_weight", "norm2_bias",
    )  # fmt: skip

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The initialisation of ``nn.TransformerEncoderLayer`` (xavier QKV, Linear defaults, zero biases)."""
        nn.init.xavier_uniform_(self.qkv_weight)
        for w in (self.out_weight, self.ffn1_weight, self.ffn2_weight):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        for b, fan_in in ((self.ffn1_bias, self.d_model), (self.ffn2_bias, self.d_ff)):
            if b is not None:
                bound = 1 / math.sqrt(fan_in)
                nn.init.uniform_(b, -bound, bound)
        for b in (self.qkv_bias, self.out_bias, self.norm1_bias, self.norm2_bias):
            if b is not None:
                nn.init.zeros_(b)
        nn.init.ones_(self.norm1_weight)
        nn.init.ones_(self.norm2_weight)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_heads={self.n_heads}, d_ff={self.d_ff}, activation={self.activation!r}, "
            f"norm_first={self.norm_first}, residual_alpha={self.residual_alpha:g}, "
            f"layer_norm_eps={self.layer_norm_eps:g}, bias={self.qkv_bias is not None}, batch_first={self.batch_first}"
        )

    # -------------------------------------------------------- state dicts ----

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Separate q/k/v projections (as most checkpoints store them) are packed
        # into the one [3D, D] weight the QKV GEMM reads.
        names = [prefix + k for k in _QKV_KEYS]
        if all(n in state_dict for n in names) and prefix + "qkv_weight" not in state_dict:
            state_dict[prefix + "qkv_weight"] = torch.cat([state_dict.pop(n) for n in names], dim=0)
        bias_names = [prefix + k for k in _QKV_BIAS_KEYS]
        if all(n in state_dict for n in bias_names) and prefix + "qkv_bias" not in state_dict:
            state_dict[prefix + "qkv_bias"] = torch.cat([state_dict.pop(n) for n in bias_names], dim=0)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    # --------------------------------------------------------- conversion ----

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> "EncoderBlock":
        """An EncoderBlock computing what ``layer`` computes in eval mode, on its dtype and device
        (a layer in training mode with dropout > 0 is refused: call ``layer.eval()`` first)."""
        return block_from_torch(cls, layer)

    # ------------------------------------------------------------------ FP8 ----

    _GEMM_WEIGHTS = {"qkv": "qkv_weight", "out_proj": "out_weight", "ffn1": "ffn1_weight", "ffn2": "ffn2_weight"}

    def quantize(
        self, mode: Optional[str] = "fp8", *, keep: Iterable[str] = (), fast_accum=False, calibration=None, fold_norms=True,
        input_headroom: float = fp8.INPUT_HEADROOM,
    ) -> "EncoderBlock":  # fmt: skip
        """Run the block's GEMMs in FP8 (``mode="fp8"``) or back in its own dtype (``None``).

        FP8: e4m3 weight copies with one scale per output channel (re-made when a weight
        changes), GEMM inputs with one scale per row (``fusedenc.fp8.rowwise``); fp32 sums, outputs
        in the block's dtype.  ``keep``: GEMMs that stay in the block's dtype (names in
        ``fp8.BLOCK_GEMMS``).  ``fast_accum``: Hopper's faster, less precise accumulation.
        ``calibration`` (post-LN, both FFN GEMMs in FP8): sample inputs or an
        ``fp8.Calibration``; FFN1 and attention then write FFN2's and the out-projection's
        inputs in e4m3 with static per-column scales, and a stack folds its LayerNorms into the FP8
        GEMMs (``fusedenc.encoder.fp8_fold``; no GEMM kept) unless ``fold_norms`` is False.
        ``input_headroom``: how far above the calibration sample's the scales that follow the
        block's input (its attention output, its first LayerNorm's input) reach: a wide
        default, since callers feed larger inputs than their sample (``fp8.INPUT_HEADROOM``);
        a stack gives its later blocks, fed by a LayerNorm, ``fp8.CALIBRATION_HEADROOM``.
        Needs a float16/bfloat16 block, widths multiples of 16, an FP8 GPU (``capabilities()["fp8"]``)."""
        self._fp8_config = fp8.quantize_config(self, mode, keep, fast_accum, calibration, fold_norms, input_headroom)
        self._fp8 = None if self._fp8_config is None else self._fp8_weights()
        auto_graphs.invalidate()  # graphs captured before ran the other precision
        return self

    @property
    def quantized(self) -> Optional[str]:
        """``"fp8"`` while ``quantize("fp8")`` is in effect, else None."""
        return "fp8" if self._fp8_config is not None else None

    def _fp8_weights(self) -> fp8.QuantizedWeights:
        keep, fast_accum, static = self._fp8_config
        chosen = {g: self._parameters[n] for g, n in self._GEMM_WEIGHTS.items() if g not in keep}
        return fp8.QuantizedWeights(chosen, fast_accum, static or ())  # None: pickled by an older version

    # ------------------------------------------------------------ forward ----

    @inference_only
    def forward(
        self,
        x: torch.Tensor,
        attn_bias: Optional[torch.Tensor] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        *,
        seq_len: Optional[int] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Apply the block.

        x: ``[B, S, D]`` (``[S, B, D]`` when ``batch_first=False``), or ``[T, D]``
        with ``seq_len=S`` (T = B*S rows, sequences contiguous).  attn_bias:
        optional additive ``[B or 1, H, S, S]`` (e.g. Lc0's smolgen), in the
        block's dtype or float32.  key_padding_mask: optional bool ``[B, S]``,
        True = that key is padding (``nn.TransformerEncoderLayer``'s
        ``src_key_padding_mask``).  Returns a new tensor of x's shape, or ``out`` (x's shape,
        dtype and device) with the result written into it.  On a GPU, repeated calls replay
        CUDA graphs (``fusedenc.graphs.auto``; ``self.auto_graphs``).
        """
        x_bsd, batch, seq = self._as_rows(x, seq_len)
        if torch.compiler.is_compiling():
            rows = self._forward_rows(x_bsd, batch, seq, attn_bias, key_padding_mask)
            return auto_graphs.finish(self._restore(rows, x, batch, seq), out)
        rows = auto_graphs.encoder_call(self, self._eager_rows, x_bsd, batch, seq, attn_bias, key_padding_mask,
                                        native=_native_active(x_bsd.device),
                                        out=auto_graphs.out_view(out, x, batch, seq, self.batch_first))
        return out if out is not None else self._restore(rows, x, batch, seq)

    def _as_rows(self, x, seq_len):
        """x as contiguous [T, D] rows, and (B, S)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 2:
            if seq_len is None:
                raise ValueError("x of shape [T, D] needs seq_len=S")
            if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
                raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
            if x.shape[0] % seq_len:
                raise ValueError(f"T=x.shape[0]={x.shape[0]} is not a multiple of seq_len={seq_len}")
            self._check_width(x)
            return x.contiguous(), x.shape[0] // seq_len, seq_len
        if x.dim() != 3:
            raise ValueError(f"x must be [B, S, D] or [T, D] with seq_len, got shape {tuple(x.shape)}")
        if seq_len is not None and seq_len != x.shape[1 if self.batch_first else 0]:
            raise ValueError(f"seq_len={seq_len} does not match x of shape {tuple(x.shape)}")
        self._check_width(x)
        if not self.batch_first:
            x = x.transpose(0, 1)
        batch, seq = x.shape[0], x.shape[1]
        return x.contiguous().view(batch * seq, self.d_model), batch, seq

    def _check_width(self, x):
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x.shape[-1]={x.shape[-1]} does not match d_model={self.d_model}")

    def _restore(self, out, x, batch, seq):
        if x.dim() == 2:
            return out
        out = out.view(batch, seq, self.d_model)
        return out if self.batch_first else out.transpose(0, 1)

    def __getstate__(self):
        # A lock cannot be copied or pickled, and plans belong to the tensors of one process.
        state = self.__dict__.copy()
        del state["_plans_lock"]
        state["_plans"] = {}
        state["_fp8"] = None  # its entries name this module's parameters: re-made from the config
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._plans_lock = threading.Lock()
        self._handle = traced.register(self._eager_rows)  # a copy is a module of its own
        if state.get("_fp8_config") is not None:
            self._fp8 = self._fp8_weights()

    def _forward_rows(self, x2, batch, seq, attn_bias, key_padding_mask, executor=None):
        """The block on contiguous [T, D] rows; returns [T, D].  ``executor``: a
        NativeExecutor shared by the blocks of a stack (made here when None)."""
        if torch.compiler.is_compiling():
            self._validate(x2, batch, seq, attn_bias, key_padding_mask)
            return torch.ops.fusedenc.encoder_rows(x2, self._handle, batch, seq, attn_bias, key_padding_mask)
        return self._eager_rows(x2, batch, seq, attn_bias, key_padding_mask, executor)

    def _prepared(self, x2, batch, seq, attn_bias, key_padding_mask, executor):
        """(executor, attention plan) for ``x2``, validated once per signature; None for an
        empty batch.  ``executor``: a NativeExecutor shared by a stack's blocks, or None."""
        if isinstance(key_padding_mask, VarlenPlan):  # packed rows (varlen/calls.py)
            return self._prepared_varlen(x2, key_padding_mask, executor)
        if not _native_active(x2.device):
            self._validate(x2, batch, seq, attn_bias, key_padding_mask)
            return None if x2.shape[0] == 0 else (OpsExecutor(), None)
        plan = self._plan(x2, batch, seq, attn_bias, key_padding_mask)
        if plan is None:  # empty batch
            return None
        return (executor if executor is not None else NativeExecutor(x2.device, x2.dtype)), plan

    def _eager_rows(self, x2, batch, seq, attn_bias, key_padding_mask, executor=None):
        """``_forward_rows`` outside a trace (also the body of the compiled graph's op)."""
        prepared = self._prepared(x2, batch, seq, attn_bias, key_padding_mask, executor)
        if prepared is None:
            return torch.empty_like(x2)
        ex, plan = prepared
        if self.fp8_observer is not None:
            return self._run(ObservingExecutor(ex, self.fp8_observer, self), plan, x2, batch, seq, attn_bias, key_padding_mask)
        if self._fp8 is not None:
            return self._run(Fp8Executor(ex, self._fp8), plan, x2, batch, seq, attn_bias, key_padding_mask)
        if norm_fold.applies([self], x2):
            pending = self._run_folded(ex, plan, x2, batch, seq, attn_bias, key_padding_mask)
            return norm_fold.materialize(pending, self.layer_norm_eps)
        return self._run(ex, plan, x2, batch, seq, attn_bias, key_padding_mask)

    def folded_rows(self, rows, batch, seq, attn_bias=None, key_padding_mask=None, executor=None, after_qkv=None):
        """The block on ``[T, D]`` rows with both LayerNorms folded into its GEMMs
        (``norm_fold``): ``rows`` plain or a ``norm_fold.NormedRows`` (pending the previous
        block's norm), the result pending this block's norm2 (``norm_fold.materialize``
        makes it plain), for callers that chain blocks (``fusedenc.lc0``).  ``after_qkv()`` runs once QKV
        is enqueued, before attention reads ``attn_bias`` (a filler on another stream joins there)."""
        if self.norm_first:
            raise ValueError("folded_rows runs post-LN blocks only (norm_first=False)")
        z = rows.z if isinstance(rows, norm_fold.NormedRows) else rows
        prepared = self._prepared(z, batch, seq, attn_bias, key_padding_mask, executor)
        if prepared is None:
            raise ValueError("folded_rows needs at least one row")
        return self._run_folded(*prepared, rows, batch, seq, attn_bias, key_padding_mask, after_qkv)

    def _run_folded(self, ex, attn_plan, rows, batch, seq, attn_bias, key_padding_mask, after_qkv=None):
        """The post-LN path with both LayerNorms folded into the GEMMs (``folded_rows``)."""
        alpha, eps, act = self.residual_alpha, self.layer_norm_eps, self.activation
        p = self._parameters
        kw = {"stream": ex.stream, "workspace": ex.workspace} if isinstance(ex, NativeExecutor) else {}
        if isinstance(rows, torch.Tensor):
            qkv = ex.linear(rows, p["qkv_weight"], p["qkv_bias"])
        else:
            qkv = norm_fold.norm_linear(rows, p["qkv_weight"], p["qkv_bias"], "none", self._fold_cache, **kw)
        if after_qkv is not None:
            after_qkv()
        a = ex.attention(attn_plan, qkv, batch, seq, self.n_heads, attn_bias, key_padding_mask)
        # h = LN1(rows + alpha * (a Wo^T + bo)), pending; the FFN reads it through its fold.
        h = norm_fold.residual_linear(
            a, p["out_weight"], p["out_bias"], rows, alpha, p["norm1_weight"], p["norm1_bias"], eps, **kw
        )
        f = norm_fold.norm_linear(h, p["ffn1_weight"], p["ffn1_bias"], act, self._fold_cache, **kw)
        return norm_fold.residual_linear(
            f, p["ffn2_weight"], p["ffn2_bias"], h, alpha, p["norm2_weight"], p["norm2_bias"], eps, **kw
        )

    def _run(self, ex, attn_plan, x2, batch, seq, attn_bias, key_padding_mask):
        """The data path, once for both executors (see the module docstring)."""
        alpha, eps, act = self.residual_alpha, self.layer_norm_eps, self.activation
        # Parameters straight from the registry (nn.Module.__getattr__: ~0.5 us a lookup, a dozen here).
        p = self._parameters
        if not self.norm_first:
            qkv = ex.linear(x2, p["qkv_weight"], p["qkv_bias"])
            a = ex.attention(attn_plan, qkv, batch, seq, self.n_heads, attn_bias, key_padding_mask)
            y = ex.linear(a, p["out_weight"], p["out_bias"])
            h = ex.layer_norm(y, p["norm1_weight"], p["norm1_bias"], eps, residual=x2, alpha=alpha)
            f = ex.linear(h, p["ffn1_weight"], p["ffn1_bias"], act)
            g = ex.linear(f, p["ffn2_weight"], p["ffn2_bias"])
            return ex.layer_norm(g, p["norm2_weight"], p["norm2_bias"], eps, residual=h, alpha=alpha)
        n1 = ex.layer_norm(x2, p["norm1_weight"], p["norm1_bias"], eps)
        qkv = ex.linear(n1, p["qkv_weight"], p["qkv_bias"])
        a = ex.attention(attn_plan, qkv, batch, seq, self.n_heads, attn_bias, key_padding_mask)
        y = ex.linear(a, p["out_weight"], None)
        # h = x + alpha * (y + bo) is the new residual stream; n2 = LN2(h) feeds the FFN.
        h, n2 = ex.layer_norm_sum(y, p["norm2_weight"], p["norm2_bias"], eps, x2, alpha, p["out_bias"])
        f = ex.linear(n2, p["ffn1_weight"], p["ffn1_bias"], act)
        # out = alpha * (f @ W2^T) + alpha * b2 + h: the residual in the GEMM epilogue.
        b2 = p["ffn2_bias"]
        if b2 is not None and alpha != 1.0:
            b2 = b2 * alpha
        return ex.linear(f, p["ffn2_weight"], b2, residual=h, alpha=alpha)

    # -------------------------------------------------------- validation ----

    def _parameters_in_order(self):
        p = self._parameters
        return [p[n] for n in self._PARAM_NAMES]

    def _validate(self, x2, batch, seq, attn_bias, key_padding_mask):
        """Block-level checks with block-level messages (the ops check their own operands too)."""
        params = [(n, p) for n, p in zip(self._PARAM_NAMES, self._parameters_in_order()) if p is not None]
        check_block_call(params, self.n_heads, x2, batch, seq, attn_bias, key_padding_mask)
        # The attention op's own checks name its q; a block's caller passed x (checked above).
        if attn_bias is not None and attn_bias.dtype not in (x2.dtype, torch.float32):
            want = "" if x2.dtype == torch.float32 else f"the block's dtype ({x2.dtype}) or "
            raise TypeError(f"attn_bias.dtype={attn_bias.dtype}: pass it in {want}torch.float32")
        for name, t in (("attn_bias", attn_bias), ("key_padding_mask", key_padding_mask)):
            if t is not None and t.device != x2.device:
                raise ValueError(f"{name} is on {t.device} but x is on {x2.device}")

    def _plan(self, x2, batch, seq, attn_bias, key_padding_mask):
        """Validate a native call once per signature; returns the attention plan (None: empty batch).

        The signature holds everything validity depends on: x's shape, dtype,
        device and alignment, the bias and mask layouts, and the parameters'
        addresses (moving or replacing a parameter changes them).
        """
        sig = (x2.shape, x2.dtype, x2.device, x2.data_ptr() & 15, batch, seq)
        if attn_bias is not None:
            sig += (attn_bias.shape, attn_bias.stride(), attn_bias.dtype, attn_bias.device, attn_bias.data_ptr() & 15)
        else:
            sig += (None,)
        if key_padding_mask is not None:
            sig += (key_padding_mask.shape, key_padding_mask.dtype, key_padding_mask.device)
        else:
            sig += (None,)
        sig += tuple(0 if p is None else p.data_ptr() for p in self._parameters_in_order())
        found = self._plans.get(sig, _MISSING)
        if found is not _MISSING:
            return found
        self._validate(x2, batch, seq, attn_bias, key_padding_mask)
        if x2.shape[0] == 0:
            plan = None
        else:
            self._check_native_operands(x2)
            qkv = torch.empty((x2.shape[0], 3 * self.d_model), dtype=x2.dtype, device=x2.device)
            q, k, v = qkv.view(batch, seq, 3, self.n_heads, self.head_dim).unbind(2)
            plan = plan_for(q, k, v, attn_bias, key_padding_mask, None, None)
        with self._plans_lock:
            if len(self._plans) >= 256:
                self._plans.clear()
            self._plans[sig] = plan
        return plan

    def _check_native_operands(self, x2):
        """What the core assumes of every operand on the native path (the ops' rules, checked once)."""
        check_block_operands(zip(self._PARAM_NAMES, self._parameters_in_order()), self.d_model, self.d_ff, x2)


_MISSING = object()


# ------------------------------------------------------------ the stack ----


class EncoderStack(PaddingFreeCalls, auto_graphs.GraphedModule):
    """N EncoderBlocks, an optional final LayerNorm, and a CUDA-graph runner.

    ``forward(x, attn_bias=None, key_padding_mask=None, *, seq_len=None, out=None)`` takes
    what ``EncoderBlock.forward`` takes; the same bias and mask go to every block.  On a
    GPU, repeated calls replay CUDA graphs (``fusedenc.graphs.auto``; ``self.auto_graphs``).
    Inference only, as EncoderBlock (the stack puts its blocks in eval mode).
    """

    def __init__(self, blocks: Iterable[EncoderBlock], final_norm: Optional[nn.LayerNorm] = None) -> None:
        super().__init__()
        self._handle = traced.register(self._eager_rows)  # the compiled graph's way back to this stack
        self.blocks = nn.ModuleList(blocks)
        if len(self.blocks) == 0:
            raise ValueError("an EncoderStack needs at least one block")
        first = self.blocks[0]
        for i, b in enumerate(self.blocks):
            if not isinstance(b, EncoderBlock):
                raise TypeError(f"blocks[{i}] is a {type(b).__name__}, not an EncoderBlock")
            if (b.d_model, b.n_heads, b.batch_first) != (first.d_model, first.n_heads, first.batch_first):
                raise ValueError(f"blocks[{i}] has d_model/n_heads/batch_first different from blocks[0]")
        if final_norm is not None:
            if not isinstance(final_norm, nn.LayerNorm):
                raise TypeError(f"final_norm must be an nn.LayerNorm, got {type(final_norm).__name__}")
            if tuple(final_norm.normalized_shape) != (first.d_model,):
                raise ValueError(f"final_norm normalizes {tuple(final_norm.normalized_shape)}, not ({first.d_model},)")
        self.final_norm = final_norm
        self.train(False)  # inference only: the stack and what it holds in eval mode

    @classmethod
    def build(cls, num_layers: int, d_model: int, n_heads: int, d_ff: int, *, final_norm: bool = False, **block_kwargs):
        """``num_layers`` fresh blocks of one configuration (keyword arguments as EncoderBlock's)."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        blocks = [EncoderBlock(d_model, n_heads, d_ff, **block_kwargs) for _ in range(num_layers)]
        norm = None
        if final_norm:
            eps = block_kwargs.get("layer_norm_eps", 1e-5)
            norm = nn.LayerNorm(d_model, eps=eps, dtype=block_kwargs.get("dtype"), device=block_kwargs.get("device"))
        return cls(blocks, norm)

    @classmethod
    def from_torch(cls, encoder: nn.TransformerEncoder) -> "EncoderStack":
        """An EncoderStack computing what ``encoder`` computes in eval mode (final norm included;
        layers in training mode with dropout > 0 are refused: call ``encoder.eval()`` first)."""
        return stack_from_torch(cls, EncoderBlock, encoder)

    @property
    def batch_first(self) -> bool:
        return self.blocks[0].batch_first

    def __setstate__(self, state):
        super().__setstate__(state)
        self._handle = traced.register(self._eager_rows)  # a copy is a module of its own

    @inference_only
    def forward(self, x, attn_bias=None, key_padding_mask=None, *, seq_len=None, out=None):
        first = self.blocks[0]
        rows, batch, seq = first._as_rows(x, seq_len)
        if torch.compiler.is_compiling():  # the whole stack is one op in the graph (traced.py)
            for block in self.blocks:
                block._validate(rows, batch, seq, attn_bias, key_padding_mask)
            rows = torch.ops.fusedenc.encoder_rows(rows, self._handle, batch, seq, attn_bias, key_padding_mask)
            return auto_graphs.finish(first._restore(rows, x, batch, seq), out)
        rows = auto_graphs.encoder_call(self, self._eager_rows, rows, batch, seq, attn_bias, key_padding_mask,
                                        native=_native_active(rows.device),
                                        out=auto_graphs.out_view(out, x, batch, seq, self.batch_first))
        return out if out is not None else first._restore(rows, x, batch, seq)

    def _eager_rows(self, rows, batch, seq, attn_bias, key_padding_mask, executor=None):
        """The stack on contiguous [T, D] rows outside a trace (also the compiled graph's op)."""
        # One native executor (stream, workspace) for every block of this forward.
        ex = executor
        if ex is None and _native_active(rows.device):
            ex = NativeExecutor(rows.device, rows.dtype)
        if all(b.quantized for b in self.blocks) and fp8_fold.applies(self.blocks, rows):
            rows = fp8_fold.stack_rows(self.blocks, rows, batch, seq, attn_bias, key_padding_mask, ex)
        elif not any(b.quantized for b in self.blocks) and norm_fold.applies(self.blocks, rows):
            rows = norm_fold.stack_rows(self.blocks, rows, batch, seq, attn_bias, key_padding_mask, ex)
        else:
            for block in self.blocks:
                rows = block._eager_rows(rows, batch, seq, attn_bias, key_padding_mask, ex)
        if self.final_norm is not None:
            n = self.final_norm
            rows = layer_norm(rows, n.weight, n.bias, n.eps)
        return rows

    def quantize(
        self, mode: Optional[str] = "fp8", *, keep: Iterable[str] = (), layers: Optional[Iterable[int]] = None,
        fast_accum: bool = False, calibration: Optional[torch.Tensor] = None, fold_norms: bool = True,
    ) -> "EncoderStack":  # fmt: skip
        """``EncoderBlock.quantize`` on the blocks numbered ``layers`` (default all; negative
        numbers count from the end, e.g. ``layers=range(1, n - 1)`` keeps the first and last
        layer in the stack's dtype); the other blocks go back to their dtype.  ``calibration``:
        sample inputs of the stack (run once, see ``EncoderBlock.quantize``).  Returns the stack."""
        fp8.quantize_blocks(self.blocks, mode, keep=keep, layers=layers, fast_accum=fast_accum, calibration=calibration,
                            model=self, fold_norms=fold_norms)
        return self

    def graph_runner(
        self,
        seq_len: int,
        batch_sizes: Sequence[int] = (1, 16, 64, 256, 1024),
        *,
        attn_bias: bool = False,
        key_padding_mask: bool = False,
    ) -> GraphRunner:
        """A CUDA-graph runner over this stack for inputs ``[B, seq_len, D]`` (``fusedenc.GraphRunner``)."""
        return GraphRunner(self, seq_len, batch_sizes, attn_bias=attn_bias, key_padding_mask=key_padding_mask)
