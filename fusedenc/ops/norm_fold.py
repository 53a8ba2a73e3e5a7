"""LayerNorm folded into the GEMMs around it.

A post-LN encoder layer spends ~11% of its time in two LayerNorm passes, each reading
and writing the whole residual stream.  Here no pass is left:

* the GEMM that ends a residual branch (out-projection, FFN2) writes
  ``z = alpha * (x W^T + b) + residual`` and, from its epilogue, per-row partial sums
  of ``z`` and ``z^2``; a tiny kernel turns them into ``rstd`` and
  ``shift = -mean * rstd`` (``NormedRows``: rows whose norm is still pending);
* a GEMM that reads ``LN(z)`` (FFN1, the next layer's QKV, smolgen's compress) reads
  ``z`` with gamma folded into its weight and applies the norm in its epilogue:
  ``LN(z) W^T + b = rstd * z (W*gamma)^T + shift * colsum(W*gamma) + (W beta + b)``;
* the next residual, ``LN(z)`` itself, is recomputed in the next residual GEMM's
  epilogue from ``z``, the statistics, gamma and beta.

Only a stack's last output gets an explicit LayerNorm.  The kernels are the Hopper
CUTLASS GEMMs (``sm90_gemm.h``); everywhere else (other GPUs, CPU) the same algebra
runs in torch, which is what the CPU tests exercise and what ``mode("force")`` selects.

Numerics: the statistics come from sums of ``z`` and ``z^2`` in fp32, finished in
double; ``z`` itself is the 16-bit stream the unfolded path normalizes too, so for
rows with a large mean its rounding dominates either way (tests cover such rows).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

import torch

from .. import core
from ..common.activations import apply_activation
from ..common.device import current_stream
from .norm import layer_norm

__all__ = [
    "Folded",
    "applies",
    "fills_gpu",
    "FoldCache",
    "NormedRows",
    "fold",
    "folded_bias",
    "folded_epilogue",
    "kernel_args",
    "materialize",
    "mode",
    "norm_linear",
    "normalized",
    "pending_rows",
    "residual_linear",
    "residual_sum",
    "stack_rows",
    "stats",
    "statistics_buffer",
]

# ------------------------------------------------------------ switch ----

_MODES = ("auto", "off", "force")
_mode = "off" if os.environ.get("FUSEDENC_FOLD_NORM", "").lower() in ("0", "off") else "auto"


def current_mode() -> str:
    """``auto``: folded where the Hopper kernels run every GEMM of a layer; ``off``: the
    LayerNorm passes (the A/B baseline; ``FUSEDENC_FOLD_NORM=0`` for a whole process);
    ``force``: folded everywhere, in torch where no kernel applies (tests)."""
    return _mode


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Run the block inside with LayerNorm folding ``name`` (see ``current_mode``).
    Public as ``fusedenc.testing.layer_norm_folding``."""
    global _mode
    if name not in _MODES:
        raise ValueError(f"layer norm folding mode must be one of {_MODES}, got {name!r}")
    was = _mode
    _mode = name
    try:
        yield
    finally:
        _mode = was


# ------------------------------------------------------------ values ----


class NormedRows(NamedTuple):
    """Rows ``[T, D]`` whose LayerNorm is pending: ``LN(z) = (z * rstd + shift) * gamma + beta``."""

    z: torch.Tensor  # [T, D], the pre-norm residual stream (the model's dtype)
    rstd: torch.Tensor  # [T] fp32
    shift: torch.Tensor  # [T] fp32, -mean * rstd
    gamma: torch.Tensor  # [D]
    beta: Optional[torch.Tensor]  # [D] or None (0)


class Folded(NamedTuple):
    """A Linear layer with the LayerNorm before it folded in."""

    weight: torch.Tensor  # [N, K] W * gamma, the model's dtype
    colsum: torch.Tensor  # [N] fp32, row sums of that (rounded) weight
    bias: torch.Tensor  # [N] W beta + b, the model's dtype


def fold(
    weight: torch.Tensor, bias: Optional[torch.Tensor], gamma: torch.Tensor, beta: Optional[torch.Tensor]
) -> Folded:
    """``weight`` [N, K] (and ``bias``) after a LayerNorm with ``gamma``/``beta`` [K], folded.

    The column sums are taken of the weight as rounded to the model's dtype: they must
    cancel exactly what the GEMM multiplies."""
    w = (weight.float() * gamma.float()).to(weight.dtype)
    return Folded(w.contiguous(), w.float().sum(1).contiguous(), folded_bias(weight, bias, beta))


def folded_bias(weight: torch.Tensor, bias: Optional[torch.Tensor], beta: Optional[torch.Tensor]) -> torch.Tensor:
    """``W beta + b`` in fp32, rounded to ``weight``'s dtype: the bias of a Linear layer with
    the LayerNorm before it folded in (``fold``, ``fusedenc.encoder.fp8_fold.fold_weight``)."""
    b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    if beta is not None:
        b = weight.float() @ beta.float()
    if bias is not None:
        b = b + bias.float()
    return b.to(weight.dtype).contiguous()


class FoldCache:
    """Folded weights by their sources, refolded when a source is replaced or changed in
    place (keyed on storage address and version counter)."""

    def __init__(self) -> None:
        self._entries: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(*tensors: Optional[torch.Tensor]) -> tuple:
        # Inference tensors (made under torch.inference_mode) keep no version counter.
        return tuple(
            (0, 0) if t is None else (t.data_ptr(), 0 if t.is_inference() else t._version) for t in tensors
        )

    def get(self, weight, bias, gamma, beta) -> Folded:
        return self.cached(fold, weight, bias, gamma, beta)

    def cached(self, make: Any, *sources: Optional[torch.Tensor]) -> Any:
        """``make(*sources)``, made again when a source is replaced or changed in place
        (``fusedenc.encoder.fp8_fold`` keeps its FP8 folds here too, ``make`` telling them apart)."""
        key = (make,) + self._key(*sources)
        found = self._entries.get(key)
        if found is None:
            with torch.no_grad():
                found = make(*sources)
            with self._lock:
                if len(self._entries) >= 64:
                    self._entries.clear()
                self._entries[key] = found
        return found

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    # Copies and pickles start empty (a lock cannot be copied; entries belong to tensors).
    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def stats(z: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rstd, shift)`` of each row of ``z`` in fp32 (biased variance, like torch)."""
    var, mean = torch.var_mean(z.float(), dim=1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    return rstd, -mean * rstd


def normalized(rows: NormedRows) -> torch.Tensor:
    """LN(z) in fp32 from the pending rows' statistics."""
    n = (rows.z.float() * rows.rstd[:, None] + rows.shift[:, None]) * rows.gamma.float()
    return n if rows.beta is None else n + rows.beta.float()


def materialize(rows: Union[torch.Tensor, NormedRows], eps: float) -> torch.Tensor:
    """Plain rows: ``rows`` itself, or the pending LayerNorm applied: one fused LayerNorm
    pass over ``z`` (it recomputes the statistics)."""
    if isinstance(rows, torch.Tensor):
        return rows
    return layer_norm(rows.z, rows.gamma, rows.beta, eps)


def stack_rows(blocks: Sequence[Any], rows, batch, seq, attn_bias, key_padding_mask, executor) -> torch.Tensor:
    """``rows`` [T, D] through ``blocks`` (where ``applies``) folded, and the last one's LayerNorm."""
    pending = rows
    for block in blocks:
        pending = block.folded_rows(pending, batch, seq, attn_bias, key_padding_mask, executor)
    return materialize(pending, blocks[-1].layer_norm_eps)


def applies(blocks: Sequence[Any], rows: torch.Tensor) -> bool:
    """Whether encoder ``blocks`` run on ``rows`` [T, D] with their LayerNorms folded into
    the GEMMs: post-LN blocks with norm weights, and either ``current_mode()`` is
    ``force`` or it is ``auto`` and the Hopper kernels run every GEMM of every block at
    this size (otherwise the folded algebra would run in torch: correct, but slower
    than the LayerNorm passes)."""
    if _mode == "off" or rows.shape[0] == 0:
        return False
    if any(b.norm_first or b.norm1_weight is None for b in blocks):
        return False
    if _mode == "force":
        return True
    if not core.active_on(rows.device):
        return False
    t, dev = rows.shape[0], rows.device.index
    for b in blocks:
        d, f = b.d_model, b.d_ff
        if not fills_gpu(rows, d):
            return False
        shapes = ((3 * d, d, False), (d, d, True), (f, d, False), (d, f, True))  # QKV, out, FFN1, FFN2
        if not all(core.sm90_fold_fits(dev, rows.dtype, t, n, k, residual) for n, k, residual in shapes):
            return False
    return True


def fills_gpu(rows: torch.Tensor, d: int) -> bool:
    """Whether the folded GEMMs pay at ``rows`` [T, D] on its GPU (a speed rule, not a limit)."""
    tile_m, tile_n = core.stats_tile()
    sms = torch.cuda.get_device_properties(rows.device).multi_processor_count
    # The narrowest GEMMs (N = D) must give the persistent kernels four full waves of
    # 128 x 128 tiles.  Measured on an H100 (whole Lc0 nets, bench/NOTES.md): folding
    # gains ~4% at 256 positions (16384 rows, 5.8 waves at D = 768) but loses 3-9% at
    # 64 (1.5-1.9 waves), where the folded epilogues' extra work is not hidden.
    return (-(-rows.shape[0] // tile_m)) * (-(-d // tile_n)) >= 4 * sms


# ------------------------------------------------------------ the GEMMs ----


def _native_fits(a, w, out, c=None) -> bool:
    if _mode == "off" or not core.active_on(a.device):
        return False
    return core.sm90_fold_applies(a, w, out, c)[0]


def kernel_args(device: torch.device, stream: Optional[int], workspace: Optional[torch.Tensor]):
    """``(stream, workspace)`` for a kernel on ``device``: the caller's, else the current ones."""
    stream = current_stream(device) if stream is None else stream
    return stream, (core.workspace(device, stream) if workspace is None else workspace)


def statistics_buffer(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """``[2, tiles, ld]`` fp32: where a residual kernel writes its partial row sums of z and z^2."""
    tm, tn = core.stats_tile()
    return torch.empty((2, -(-cols // tn), -(-rows // tm) * tm), dtype=torch.float32, device=device)


def pending_rows(z, sums, eps, gamma, beta, stream) -> NormedRows:
    """``z`` pending its LayerNorm, ``rstd`` and ``shift`` made from the residual kernel's ``sums``."""
    rstd = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    shift = torch.empty_like(rstd)
    core.norm_stats(sums[0], sums[1], z.shape[1], eps, rstd, shift, stream)
    return NormedRows(z, rstd, shift, gamma, beta)


def residual_sum(acc, bias, residual, alpha, z, gamma, beta, eps) -> tuple[NormedRows, torch.Tensor]:
    """The residual GEMMs' torch math after the product ``acc`` (fp32): ``z = alpha * (acc +
    bias) + residual`` (a pending ``residual`` normalized first) into ``z``, with its statistics;
    returns the pending rows and ``z`` in fp32."""
    r = residual if isinstance(residual, torch.Tensor) else normalized(residual)
    if bias is not None:
        acc = acc + bias.float()
    zf = torch.add(r.float(), acc, alpha=alpha)
    z.copy_(zf)
    rstd, shift = stats(zf, eps)
    return NormedRows(z, rstd, shift, gamma, beta), zf


def norm_linear(
    rows: NormedRows,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    cache: FoldCache,
    *,
    stream: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``act(LN(z) W^T + b)`` for pending rows.  ``activation``: a canonical name."""
    f = cache.get(weight, bias, rows.gamma, rows.beta)
    z = rows.z
    out = torch.empty((z.shape[0], weight.shape[0]), dtype=z.dtype, device=z.device)
    if out.shape[0] and _native_fits(z, f.weight, out):
        stream, workspace = kernel_args(z.device, stream, workspace)
        if core.sm90_norm_gemm(z, f.weight, out, f.bias, activation, rows.rstd, rows.shift, f.colsum, stream, workspace):
            return out
    y = folded_epilogue(torch.mm(z.float(), f.weight.float().t()), rows, f.colsum, f.bias)
    out.copy_(apply_activation(y, activation))
    return out


def folded_epilogue(acc: torch.Tensor, rows: NormedRows, colsum: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The folded GEMMs' epilogue in torch (fp32): ``rstd * acc + (shift * colsum + bias)``."""
    return torch.addcmul(torch.addcmul(bias.float(), rows.shift[:, None], colsum), acc, rows.rstd[:, None])


def residual_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Union[torch.Tensor, NormedRows],
    alpha: float,
    gamma: torch.Tensor,
    beta: Optional[torch.Tensor],
    eps: float,
    *,
    stream: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
) -> NormedRows:
    """``z = alpha * (x W^T + b) + residual`` (a pending ``residual`` is normalized on the
    fly) with the statistics of the LayerNorm ``gamma``/``beta``/``eps`` that follows it."""
    src = residual.z if isinstance(residual, NormedRows) else residual
    rows, n = x.shape[0], weight.shape[0]
    z = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows and _native_fits(x, weight, z, src):
        sums = statistics_buffer(rows, n, x.device)
        stream, workspace = kernel_args(x.device, stream, workspace)
        pending = residual if isinstance(residual, NormedRows) else None
        if core.sm90_residual_gemm(x, weight, z, bias, src, alpha, pending, sums[0], sums[1], stream, workspace):
            return pending_rows(z, sums, eps, gamma, beta, stream)
    acc = torch.mm(x.float(), weight.float().t())
    return residual_sum(acc, bias, residual, alpha, z, gamma, beta, eps)[0]
