"""The two ways an EncoderBlock's data path runs: through the public ops, or straight to the core.

The data path is written once (``EncoderBlock._run``) against these two small
executors; each step returns a new tensor.

* ``OpsExecutor`` calls the public ops (``fusedenc.linear``, ``layer_norm``,
  ``attention``): it serves CPU tensors (the PyTorch references), a build
  without a native core.  (Under ``torch.compile`` a block or stack is one custom
  op whose implementation runs whichever executor the eager call would.)
* ``NativeExecutor``, for eager calls on the GPU, calls ``core.gemm`` and
  ``core.layer_norm`` with dense ``[T, D]`` rows and the attention plan the
  block made for its call signature: the block validated the signature once,
  so no per-call argument checks run.  ``core.gemm`` is also what
  ``fusedenc.linear`` calls, so both executors run the same plan for the same
  problem and give bit-identical results on the GPU (tested).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import core
from ..attention import attention
from ..common.device import current_stream
from ..fp8 import rowwise as fp8
from ..ops.gemm import linear
from ..ops.norm import layer_norm

__all__ = ["Fp8Executor", "NativeExecutor", "ObservingExecutor", "OpsExecutor"]


class OpsExecutor:
    """Runs each step through the public ops: the references on CPU or without a native core."""

    def linear(self, x, w, b, activation="none", residual=None, alpha=1.0):
        return linear(x, w, b, activation, residual, alpha=alpha)

    def layer_norm(self, x, w, b, eps, residual=None, alpha=1.0, x_bias=None):
        return layer_norm(x, w, b, eps, residual=residual, alpha=alpha, x_bias=x_bias)

    def layer_norm_sum(self, x, w, b, eps, residual, alpha, x_bias):
        """(h, LN(h)) with h = alpha * (x + x_bias) + residual."""
        h = torch.empty_like(x)
        out = layer_norm(x, w, b, eps, residual=residual, alpha=alpha, x_bias=x_bias, sum_out=h)
        return h, out

    def attention(self, plan, qkv, batch, seq, heads, attn_bias, key_padding_mask, out_scale=None):
        q, k, v = qkv.view(batch, seq, 3, heads, -1).unbind(2)
        # plan: None (the op plans its own call), or the packed rows' VarlenPlan.
        out = attention(q, k, v, attn_bias, key_padding_mask) if plan is None else plan.run(q, k, v)
        return out if out_scale is None else fp8.e4m3_columns(out.reshape(batch * seq, -1), out_scale)


class NativeExecutor:
    """Calls the native core directly on dense rows: no per-call argument checks (done once per signature).

    One executor serves every block of a stack's forward (same device, stream and dtype).
    ``fp8_rows``: ``(out, fp8.Quantized)``, the last LayerNorm output written in FP8 too
    (``layer_norm_fp8``), so the FP8 GEMM that reads it next, in this block or the next
    one, skips the quantization pass.
    """

    __slots__ = ("device", "stream", "workspace", "dtype", "fp8_rows")

    def __init__(self, device: torch.device, dtype: torch.dtype, workspace: Optional[torch.Tensor] = None):
        self.device = device
        self.stream = current_stream(device)
        # Hold the tensor, not just its address: during CUDA-graph capture the
        # workspace is a fresh allocation from the graph's pool, and if it were
        # freed here the block's own GEMM outputs could be carved from the same
        # memory while the library still uses it as scratch (seen: a hang in
        # replay at bt4 shapes).  Freed when the forward returns, after every
        # GEMM that uses it is queued: later reuse is stream-ordered.
        # ``workspace``: the caller's own scratch instead (the compiled graph's op: see blocks.py).
        self.workspace = core.workspace(device, self.stream) if workspace is None else workspace
        self.dtype = dtype
        self.fp8_rows = None

    def linear(self, x, w, b, activation="none", residual=None, alpha=1.0):
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        core.gemm(
            a=x, lda=k, w=w, ldw=k, out=out, ldo=n, m=m, n=n, k=k, bias=b, residual=residual, ldr=n,
            activation=activation, alpha=alpha, stream=self.stream, workspace=self.workspace,
        )  # fmt: skip
        return out

    def _layer_norm(self, x, w, b, eps, residual, alpha, x_bias, sum_out, quantized=None):
        rows, cols = x.shape
        out = torch.empty((rows, cols), dtype=self.dtype, device=self.device)
        q, scale = quantized if quantized is not None else (None, None)
        core.layer_norm(
            x=x, ldx=cols, rows=rows, cols=cols, out=out, ldo=cols, weight=w, bias=b, residual=residual, ldr=cols,
            x_bias=x_bias, sum_out=sum_out, lds=cols, eps=eps, alpha=alpha, stream=self.stream,
            q_out=None if q is None else q.view(torch.uint8), q_scale=scale,
        )  # fmt: skip
        return out

    def layer_norm_fp8(self, x, w, b, eps, residual, alpha, x_bias, sum_out):
        """``_layer_norm`` whose kernel also writes its output's e4m3 copy (``fp8_rows``)."""
        rows, cols = x.shape
        quantized = fp8.Quantized(
            torch.empty((rows, cols), dtype=fp8.E4M3, device=self.device),
            torch.empty(rows, dtype=torch.float32, device=self.device),
        )  # fmt: skip
        out = self._layer_norm(x, w, b, eps, residual, alpha, x_bias, sum_out, quantized)
        self.fp8_rows = (out, quantized)
        return out

    def layer_norm(self, x, w, b, eps, residual=None, alpha=1.0, x_bias=None):
        return self._layer_norm(x, w, b, eps, residual, alpha, x_bias, None)

    def layer_norm_sum(self, x, w, b, eps, residual, alpha, x_bias):
        h = torch.empty_like(x)
        return h, self._layer_norm(x, w, b, eps, residual, alpha, x_bias, h)

    def attention(self, plan, qkv, batch, seq, heads, attn_bias, key_padding_mask, out_scale=None):
        """``out_scale``: the rows as e4m3 codes of ``out * out_scale`` per column, written by
        the kernel where the plan's backend can, by a pass otherwise."""
        q, k, v = qkv.view(batch, seq, 3, heads, -1).unbind(2)
        if out_scale is not None and plan.writes_e4m3:
            return plan.run(q, k, v, attn_bias, key_padding_mask, out_scale)
        out = plan.run(q, k, v, attn_bias, key_padding_mask)
        # The next GEMM is told these are dense rows (lda = D): guarantee it
        # whatever layout a backend returns (a no-op for every backend today).
        out = out if out.is_contiguous() else out.contiguous()
        return out if out_scale is None else fp8.e4m3_columns(out, out_scale)


class Fp8Executor:
    """Another executor (ops or native) with the GEMMs of quantized weights in FP8
    (``EncoderBlock.quantize``): each such GEMM's input rows are quantized (one scale per
    row, ``fp8.quantize_rows``) and multiplied with the weight's e4m3 copy (``fp8.linear``);
    everything else, and GEMMs whose weight stays in the block's dtype or that carry a
    residual (the pre-LN FFN2), runs on the wrapped executor.

    On the GPU the LayerNorms write their outputs in FP8 too (``NativeExecutor.layer_norm_fp8``,
    the codes ``quantize_rows`` would make), and a GEMM reading such an output takes that copy
    instead of quantizing: QKV and FFN1 read LayerNorm outputs in both layouts, so only the
    out-projection's and FFN2's inputs (and a stack's first input) get a quantization pass."""

    __slots__ = ("base", "weights", "produce")

    def __init__(self, base, weights: fp8.QuantizedWeights):
        self.base = base
        self.weights = weights
        self.produce = isinstance(base, NativeExecutor) and fp8.producers_write_fp8(base.device)

    def linear(self, x, w, b, activation="none", residual=None, alpha=1.0):
        q = self.weights.get(w)
        if q is None or residual is not None or alpha != 1.0:
            return self.base.linear(x, w, b, activation, residual, alpha)
        if x.dtype == fp8.E4M3:  # FFN1's codes with static column scales, which FFN2's copy holds
            qx = fp8.Quantized(x, torch.ones(x.shape[0], dtype=torch.float32, device=x.device))
        else:
            handed = self.base.fp8_rows if self.produce else None
            qx = handed[1] if handed is not None and handed[0] is x else fp8.quantize_rows(x)
        return fp8.linear(qx, q, b, activation, out_dtype=self.weights.dtype, fast_accum=self.weights.fast_accum,
                          out_scale=self.weights.out_scale(w))  # fmt: skip

    def layer_norm(self, x, w, b, eps, residual=None, alpha=1.0, x_bias=None):
        if self.produce:
            return self.base.layer_norm_fp8(x, w, b, eps, residual, alpha, x_bias, None)
        return self.base.layer_norm(x, w, b, eps, residual, alpha, x_bias)

    def layer_norm_sum(self, x, w, b, eps, residual, alpha, x_bias):
        if self.produce:
            h = torch.empty_like(x)
            return h, self.base.layer_norm_fp8(x, w, b, eps, residual, alpha, x_bias, h)
        return self.base.layer_norm_sum(x, w, b, eps, residual, alpha, x_bias)

    def attention(self, plan, qkv, batch, seq, heads, attn_bias, key_padding_mask):
        # Calibrated: the out-projection's input as e4m3 codes with static column scales.
        out_scale = self.weights.attention_out_scale(qkv.device)
        return self.base.attention(plan, qkv, batch, seq, heads, attn_bias, key_padding_mask, out_scale)


class ObservingExecutor:
    """Another executor, reporting the block's FFN1 and attention outputs and its LayerNorms'
    inputs to a calibration (``fp8.calibrating``: what static FP8 scales are made from)."""

    __slots__ = ("base", "calibration", "block")

    def __init__(self, base, calibration: fp8.Calibration, block):
        self.base, self.calibration, self.block = base, calibration, block

    def linear(self, x, w, b, activation="none", residual=None, alpha=1.0):
        y = self.base.linear(x, w, b, activation, residual, alpha)
        if w is self.block.ffn1_weight:
            self.calibration.observe(self.block, y)
        return y

    def layer_norm(self, x, w, b, eps, residual=None, alpha=1.0, x_bias=None):
        # A post-LN block's LayerNorm input, alpha * (x + x_bias) + residual: what its codes'
        # scales are made from where the LayerNorms are folded (fusedenc.encoder.fp8_fold).
        which = "norm1" if w is self.block.norm1_weight else "norm2" if w is self.block.norm2_weight else None
        if which is not None and residual is not None:
            z = x.float() if x_bias is None else x.float() + x_bias.float()
            self.calibration.observe(self.block, torch.add(residual.float(), z, alpha=alpha), which)
        return self.base.layer_norm(x, w, b, eps, residual, alpha, x_bias)

    def layer_norm_sum(self, *args, **kw):
        return self.base.layer_norm_sum(*args, **kw)

    def attention(self, plan, qkv, batch, seq, heads, attn_bias, key_padding_mask):
        out = self.base.attention(plan, qkv, batch, seq, heads, attn_bias, key_padding_mask)
        self.calibration.observe(self.block, out.reshape(batch * seq, -1), "attention")
        return out
