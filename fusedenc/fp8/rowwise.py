"""FP8 (float8 e4m3) quantization: the reference math of fusedenc's FP8 mode.

The scheme is the one the issue names: weights in e4m3 with one fp32 scale per output
channel, activations in e4m3 with one fp32 scale per row, products accumulated in fp32
and the GEMM's output in fp16/bf16.  A scale maps the row's (or channel's) largest
magnitude onto e4m3's largest finite value, so nothing saturates:

    scale = amax(|row|) / max,   q = e4m3(row / scale),   row ~= q * scale

e4m3 comes in two flavours and the device picks (``format_for``): OCP's
(``torch.float8_e4m3fn``, max 448) on NVIDIA, AMD gfx95x and the CPU, and the FNUZ one of
AMD's MI300 (gfx94x; ``torch.float8_e4m3fnuz``, max 240, exponent bias 8, no -0, 0x80 the
only NaN).  The reference math below takes the format; the kernels write the same codes.

``scaled_linear`` is what an FP8 GEMM with row and column scales computes (cuBLASLt's
outer-vector scaling, ``torch._scaled_mm`` with row-wise scales): ``(qx qw^T) * sx[m] *
sw[n] + bias``.  ``bench/fp8_accuracy.py`` uses these functions to measure what FP8 costs
in accuracy on any machine.

On a GPU whose native core runs FP8 (``fusedenc.capabilities()["fp8"]``: cuBLASLt 12.9+
on Hopper), ``quantize_rows`` runs one kernel (bit for bit the math above) and ``linear``
one cuBLASLt FP8 GEMM with per-row scales, the bias (and relu / tanh-GELU) in its
epilogue and other activations in one pass after it.  Elsewhere both run the reference
math; ``linear`` on a GPU without FP8 refuses with the reason.

A row of zeros gets scale 1 (its codes are zeros).  NaN anywhere in a row makes its
scale NaN, so the whole row comes back NaN: FP8 has no room to carry one bad value
quietly.  +-inf in a row likewise (inf / inf).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence

import torch

from .. import core
from ..common import dtypes
from ..common.activations import apply_activation, canonical_activation
from ..common.device import current_stream
from ..core import gemm_routes
from ..ops import norm_fold

__all__ = ["E4M3", "E4M3_MAX", "E4M3_FNUZ", "Fp8Format", "BLOCK_GEMMS", "CALIBRATION_HEADROOM", "INPUT_HEADROOM", "Calibration",
           "Quantized", "QuantizedWeights", "calibrate", "dequantize", "format_for", "linear",
           "producers_disabled", "producers_write_fp8", "quantize_blocks", "quantize_config", "quantize_rows",
           "scaled_linear"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(E4M3).max


class Fp8Format(NamedTuple):
    """An e4m3 flavour: the torch dtype of its codes and its largest finite value."""

    dtype: torch.dtype
    max: float


E4M3_FNUZ = Fp8Format(torch.float8_e4m3fnuz, 240.0)  # torch.finfo(torch.float8_e4m3fnuz).max
_OCP = Fp8Format(E4M3, E4M3_MAX)
_BY_NAME = {"e4m3fn": _OCP, "e4m3fnuz": E4M3_FNUZ}


def format_for(device: Any) -> Fp8Format:
    """The e4m3 flavour of ``device`` (a ``torch.device`` or a tensor): what the core's FP8
    kernels read and write there (``core.fp8.fp8_format``), OCP where no core runs."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if device.type != "cuda":
        return _OCP
    return _BY_NAME[core.fp8.fp8_format(device)]


def _format_of(q: torch.Tensor) -> Fp8Format:
    """The flavour of codes ``q`` (their dtype says it)."""
    return E4M3_FNUZ if q.dtype == E4M3_FNUZ.dtype else _OCP


class Quantized(NamedTuple):
    """``q`` (``[rows, k]`` e4m3) and ``scale`` (``[rows]`` fp32): row ``i`` is ``q[i] * scale[i]``."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_rows(x: torch.Tensor, fmt: Optional[Fp8Format] = None) -> Quantized:
    """``x`` (``[rows, k]``, floating) in e4m3 with one scale per row.  For a weight
    ``[out, in]`` that is one scale per output channel.  ``fmt``: the e4m3 flavour, by
    default ``x``'s device's (``format_for``); the kernel runs only in that one."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise TypeError(f"x must be a 2-D floating tensor, got {getattr(x, 'dtype', type(x))} of shape {getattr(x, 'shape', '?')}")
    native = format_for(x.device)
    fmt = native if fmt is None else fmt
    if (x.dtype in dtypes.SUPPORTED and x.stride(1) == 1 and x.shape[0] and fmt == native
            and core.fp8_status(x.device)[0]):  # fmt: skip
        q = torch.empty(x.shape, dtype=fmt.dtype, device=x.device)
        scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        core.fp8_quantize_rows(x, q.view(torch.uint8), scale, current_stream(x.device))
        return Quantized(q, scale)
    xf = x.float()
    amax = xf.abs().amax(dim=1) if x.shape[1] else xf.new_zeros(x.shape[0])  # NaN/inf propagate
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / fmt.max)
    return Quantized((xf / scale[:, None]).to(fmt.dtype), scale)


# The A/B switch for FP8 written by its producers (``FUSEDENC_FP8_PRODUCERS=0`` for a process).
_producers = os.environ.get("FUSEDENC_FP8_PRODUCERS", "").lower() not in ("0", "off")


def producers_write_fp8(device: torch.device) -> bool:
    """Whether the FP8 mode's LayerNorm kernels write their outputs in e4m3 too on ``device``
    (the codes ``quantize_rows`` would make, so this changes speed, never results)."""
    # The LayerNorm kernels write OCP codes only: on MI300 (FNUZ) a pass quantizes instead.
    return _producers and device.type == "cuda" and core.fp8_status(device)[0] and format_for(device) == _OCP


@contextlib.contextmanager
def producers_disabled() -> Iterator[None]:
    """Inside, every FP8 GEMM input is quantized by its own pass: the A/B baseline of
    ``producers_write_fp8``.  Public as ``fusedenc.testing.fp8_producers_disabled``."""
    global _producers
    was = _producers
    _producers = False
    try:
        yield
    finally:
        _producers = was


def dequantize(t: Quantized) -> torch.Tensor:
    """The fp32 values ``t`` stands for."""
    return t.q.float() * t.scale[:, None]


def scaled_linear(
    x: Quantized, w: Quantized, bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """``x W^T + bias`` from e4m3 operands: fp32 products and sums of the codes, then the row
    and column scales and the bias in fp32, rounded once to ``out_dtype``."""
    if x.q.shape[1] != w.q.shape[1]:
        raise ValueError(f"x has {x.q.shape[1]} columns but the weight {w.q.shape[1]}")
    acc = x.q.float() @ w.q.float().t()
    y = acc * x.scale[:, None] * w.scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _check_operand(t: object, name: str) -> None:
    if not isinstance(t, Quantized):
        raise TypeError(f"{name} must be a fusedenc.fp8.Quantized (from quantize_rows), got {type(t).__name__}")
    q, scale = t
    want = format_for(q.device).dtype if isinstance(q, torch.Tensor) else E4M3
    if not isinstance(q, torch.Tensor) or q.dtype not in (E4M3, E4M3_FNUZ.dtype) or q.dim() != 2:
        raise TypeError(f"{name}.q must be a 2-D {want} tensor, got {getattr(q, 'dtype', type(q))}")
    if q.device.type == "cuda" and q.dtype != want:
        raise TypeError(f"{name}.q is {q.dtype}, but the FP8 kernels on {q.device} read {want}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != (q.shape[0],):
        raise TypeError(f"{name}.scale must be float32 of shape ({q.shape[0]},), got {getattr(scale, 'dtype', type(scale))} "
                        f"{tuple(getattr(scale, 'shape', ()))}")  # fmt: skip
    if scale.device != q.device:
        raise ValueError(f"{name}: codes on {q.device}, scales on {scale.device}")


def linear(
    x: Quantized,
    weight: Quantized,
    bias: Optional[torch.Tensor] = None,
    activation: str = "none",
    *,
    out_dtype: torch.dtype = torch.float16,
    fast_accum: bool = False,
    out: Optional[torch.Tensor] = None,
    out_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``act(x W^T + bias)`` from e4m3 operands with per-row scales (``quantize_rows`` of the
    activations ``[M, K]`` and of the weight ``[N, K]``): fp32 sums, ``[M, N]`` in
    ``out_dtype`` (float16 or bfloat16).  ``fast_accum``: Hopper's faster FP8 accumulation
    (fewer bits kept inside the tensor cores; GPU only, ignored by the reference).

    K must be a multiple of 16 (FP8 GEMMs read 16-byte rows), on every device, so a shape
    that runs here runs on the GPU too.  ``out``: an ``[M, N]`` tensor of ``out_dtype`` with
    unit column stride to write into (returned).

    ``out_scale`` (``[N]`` fp32): the output in e4m3 instead, ``e4m3(act(...) * out_scale)``
    saturating at +-max (448; 240 for FNUZ codes, which the operands' dtype picks): the next
    GEMM's input with static per-column scales (calibration; the next weight carries
    ``1 / out_scale``).  On Hopper with ``fast_accum``, fp16 and an
    activation its epilogue has, the GEMM writes the codes itself; elsewhere a 16-bit result
    is scaled and converted after it (rounded to 16 bits once more than the kernel's).
    """
    activation = canonical_activation(activation)
    m, n = _check_linear(x, weight, bias, out_dtype)
    if out_scale is not None:
        if out is not None:
            raise ValueError("out= writes 16-bit results; with out_scale= the result is new e4m3 codes")
        return _linear_e4m3(x, weight, bias, activation, out_dtype, fast_accum, out_scale)
    device = x.q.device
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != out_dtype or tuple(out.shape) != (m, n):
            raise TypeError(f"out must be {out_dtype} of shape ({m}, {n}), got {getattr(out, 'dtype', type(out))} "
                            f"{tuple(getattr(out, 'shape', ()))}")  # fmt: skip
        if out.device != device or (n > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be on {device} with unit column stride")
    if device.type == "cuda":
        _require_fp8(device)
        if out is None:
            out = torch.empty((m, n), dtype=out_dtype, device=device)
        if m == 0:
            return out
        stream = current_stream(device)
        core.fp8_gemm(*_gpu_operands(x, weight, bias), out, activation, bool(fast_accum), stream,
                      core.workspace(device, stream))  # fmt: skip
        return out
    y = scaled_linear(x, weight, None, torch.float32)
    if bias is not None:
        y = y + bias.float()
    y = apply_activation(y, activation).to(out_dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def _check_linear(x: Quantized, weight: Quantized, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> tuple[int, int]:
    """``linear``'s operand checks; returns (M, N)."""
    _check_operand(x, "x")
    _check_operand(weight, "weight")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    m, k = x.q.shape
    n, kw = weight.q.shape
    if k != kw:
        raise ValueError(f"x has {k} columns but the weight {kw}")
    if k == 0 or k % 16:
        raise ValueError(f"K={k}: FP8 GEMMs need K a positive multiple of 16")
    if x.q.device != weight.q.device:
        raise ValueError(f"x is on {x.q.device}, the weight on {weight.q.device}")
    if x.q.dtype != weight.q.dtype:
        raise TypeError(f"x is {x.q.dtype}, the weight {weight.q.dtype}: one e4m3 flavour for both")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != out_dtype or tuple(bias.shape) != (n,):
            raise TypeError(f"bias must be {out_dtype} of shape ({n},), got {getattr(bias, 'dtype', type(bias))} "
                            f"{tuple(getattr(bias, 'shape', ()))}")  # fmt: skip
        if bias.device != x.q.device:
            raise ValueError(f"bias is on {bias.device}, the operands on {x.q.device}")
    return m, n


def _require_fp8(device: torch.device) -> None:
    ok, why = core.fp8_status(device)
    if not ok:
        raise RuntimeError(f"fusedenc.fp8.linear: FP8 GEMMs do not run here: {why}")


def _gpu_operands(x: Quantized, weight: Quantized, bias: Optional[torch.Tensor]) -> tuple:
    """``core.fp8_gemm``'s first five arguments: the codes as uint8 with 16-byte rows (copied
    dense where a stride or the address is not), the scales and the bias contiguous."""
    a, w = x.q, weight.q
    if a.stride(1) != 1 or a.stride(0) % 16 or a.data_ptr() % 16:
        a = a.contiguous()
    if w.stride(1) != 1 or w.stride(0) % 16 or w.data_ptr() % 16:
        w = w.contiguous()
    b = None if bias is None else bias.contiguous()
    return a.view(torch.uint8), x.scale.contiguous(), w.view(torch.uint8), weight.scale.contiguous(), b


def _linear_e4m3(x, weight, bias, activation, out_dtype, fast_accum, out_scale) -> torch.Tensor:
    """``linear(..., out_scale=)`` (arguments checked but ``out_scale``): the e4m3 codes."""
    m, n, device = x.q.shape[0], weight.q.shape[0], x.q.device
    if (not isinstance(out_scale, torch.Tensor) or out_scale.dtype != torch.float32
            or tuple(out_scale.shape) != (n,) or out_scale.device != device):  # fmt: skip
        raise TypeError(f"out_scale must be float32 of shape ({n},) on {device}, got "
                        f"{getattr(out_scale, 'dtype', type(out_scale))} {tuple(getattr(out_scale, 'shape', ()))} "
                        f"on {getattr(out_scale, 'device', '?')}")  # fmt: skip
    fmt = _format_of(x.q)
    if device.type == "cuda":
        _require_fp8(device)
        codes = torch.empty((m, n), dtype=fmt.dtype, device=device)
        if m == 0:
            return codes
        scale = out_scale.contiguous()
        args = (*_gpu_operands(x, weight, bias), codes.view(torch.uint8), activation)
        if core.sm90_fp8_gemm_applies(*args, fast_accum, scale)[0]:
            stream = current_stream(device)
            core.fp8_gemm(*args, True, stream, core.workspace(device, stream), out_scale=scale)
            return codes
        # 16-bit output (the fallback GEMM's), coded in one pass by e4m3_columns
        y = linear(x, weight, bias, activation, out_dtype=out_dtype, fast_accum=fast_accum)
    else:  # the reference: the activation on the fp32 sum, not rounded to 16 bits first
        y = scaled_linear(x, weight, None, torch.float32)
        y = apply_activation(y if bias is None else y + bias.float(), activation)
    return e4m3_columns(y, out_scale, fmt)


#: The GEMMs of an encoder block, by the name ``EncoderBlock.quantize(keep=...)`` takes.
BLOCK_GEMMS = ("qkv", "out_proj", "ffn1", "ffn2")


#: Static scales leave this much room above the largest value calibration saw (one binade:
#: e4m3's relative precision is the same across its normal range, so headroom costs only
#: the values 2^15 below the largest, which reach the subnormals).
CALIBRATION_HEADROOM = 2.0

#: The headroom of the static scales that follow the scale of a block's own input -- its
#: attention output and its first LayerNorm's input (``x + alpha * attention``) -- where that
#: input is the caller's rather than a LayerNorm's: a stack's first block, a block quantized
#: alone.  Callers do feed inputs larger than the calibration sample, and a post-LN stack's
#: later blocks never see it (a LayerNorm is in between), so only these scales saturate:
#: with the standard headroom a t82-shaped stack had 14% relative error on 3x inputs against
#: the row-wise peer's 2.3%.  Eight binades keep it at the row-wise peer's error from 0.3x to
#: 10x inputs and cost nothing measurable on in-range inputs (the values 2^15 below a
#: column's largest reach e4m3's subnormals; bench/NOTES.md), and nothing at run time.
INPUT_HEADROOM = 256.0


#: What a calibration observes of each block: the inputs of its FP8 GEMMs that a producer
#: can write in e4m3 with static scales (the producer's name, what the report calls it).
#: The LayerNorms' inputs serve the mode with LayerNorms folded (``fusedenc.encoder.fp8_fold``).
OBSERVED = {"ffn1": "FFN1 output", "attention": "attention output", "norm1": "first LayerNorm's input",
            "norm2": "second LayerNorm's input"}

#: The ``static`` producers that are LayerNorm inputs (codes written by the residual GEMMs).
NORM_INPUTS = ("norm1", "norm2")


class Calibration:
    """What ``calibrate`` saw: per encoder block, the largest magnitude of each column of
    its FFN1 output (FFN2's input) and of its attention output (the out-projection's input)
    over the sample inputs.  ``EncoderBlock.quantize("fp8", calibration=...)`` turns them
    into static scales: FFN1's epilogue and the attention kernel write e4m3 with them and
    the next GEMM's weight carries their inverse, so no pass quantizes those inputs."""

    def __init__(self) -> None:
        self._amax: dict[tuple[int, str], tuple[Any, torch.Tensor]] = {}

    def observe(self, block: Any, out: torch.Tensor, what: str = "ffn1") -> None:
        """Record ``out``, ``block``'s ``what`` (a key of ``OBSERVED``), as rows ``[T, N]``."""
        amax = out.detach().abs().amax(dim=0).float()
        seen = self._amax.get((id(block), what))
        self._amax[(id(block), what)] = (block, amax if seen is None else torch.maximum(seen[1], amax))

    def amax(self, block: Any, what: str = "ffn1") -> Optional[torch.Tensor]:
        """The largest magnitude of each column of ``block``'s ``what`` seen, or None."""
        seen = self._amax.get((id(block), what))
        return None if seen is None or seen[0] is not block else seen[1]

    def column_scales(self, block: Any, what: str = "ffn1", power_of_two: bool = False,
                      headroom: float = CALIBRATION_HEADROOM) -> Optional[torch.Tensor]:  # fmt: skip
        """``block``'s per-column scales of ``what`` (the value a code stands for is
        ``code * scale``; ``power_of_two`` and ``headroom``: see ``static_scales``), or None if
        calibration never saw it.  Raises if it saw NaN or inf."""
        seen = self._amax.get((id(block), what))
        if seen is None or seen[0] is not block:
            return None
        amax = seen[1]
        if not torch.isfinite(amax).all():
            raise ValueError(f"calibration: the block's {OBSERVED[what]} was not finite on the sample inputs")
        return static_scales(amax, power_of_two, headroom)


def static_scales(amax: torch.Tensor, power_of_two: bool = False, headroom: float = CALIBRATION_HEADROOM) -> torch.Tensor:
    """Per-column scales for static e4m3 codes (a code stands for ``code * scale``) from the
    largest magnitudes calibration saw: ``headroom`` times above them, 1 for a column of
    zeros, in the flavour of ``amax``'s device (the codes these scales are for are its).
    ``power_of_two``: rounded up to one (at most one binade more headroom, which e4m3's
    uniform relative precision does not notice), so that dividing by it is exact."""
    fmax = format_for(amax.device).max
    scales = torch.where(amax > 0, amax * (headroom / fmax), torch.ones_like(amax))
    return torch.exp2(torch.ceil(torch.log2(scales))) if power_of_two else scales


def e4m3_columns(x: torch.Tensor, out_scale: torch.Tensor, fmt: Optional[Fp8Format] = None) -> torch.Tensor:
    """e4m3 codes of ``x * out_scale`` per column, saturated at +-max (NaN stays NaN): what a
    producer with static scales writes, as a pass where the producer cannot write it.
    ``fmt``: the flavour, by default ``x``'s device's (``format_for``)."""
    fmt = format_for(x.device) if fmt is None else fmt
    if _fused_columns(x, out_scale, fmt):
        from . import triton_e4m3  # imports Triton: only for a CUDA tensor

        return triton_e4m3.e4m3_columns(x, out_scale)
    return (x.float() * out_scale).clamp_(-fmt.max, fmt.max).to(fmt.dtype)


def _fused_columns(x: torch.Tensor, out_scale: torch.Tensor, fmt: Fp8Format) -> bool:
    """Whether ``e4m3_columns`` runs as one Triton kernel (the same codes, one pass instead of
    three): a CUDA 2-D tensor with a unit column stride, OCP codes, Triton importable."""
    if not (x.is_cuda and x.dim() == 2 and (x.shape[1] <= 1 or x.stride(1) == 1)
            and fmt.dtype == torch.float8_e4m3fn and out_scale.dtype == torch.float32
            and out_scale.is_contiguous() and x.dtype in (torch.float16, torch.bfloat16, torch.float32)):  # fmt: skip
        return False
    return gemm_routes.triton_available()


@contextlib.contextmanager
def calibrating(blocks: Sequence[Any]) -> Iterator[Calibration]:
    """Inside, ``blocks`` (EncoderBlocks) run in their own dtype, LayerNorms unfolded, and
    report their FFN1 outputs to the yielded ``Calibration``."""
    cal = Calibration()
    with norm_fold.mode("off"):
        for b in blocks:
            b.fp8_observer = cal
        try:
            yield cal
        finally:
            for b in blocks:
                b.fp8_observer = None


def calibrate(blocks: Sequence[Any], run: Any, sample: Any) -> Calibration:
    """``run(sample)`` (the model the ``blocks`` belong to, on sample inputs) once, eagerly,
    recording what ``Calibration`` holds."""
    with calibrating(blocks) as cal, torch.no_grad():
        run(sample)
    return cal


class QuantizedWeights:
    """The e4m3 copies of a module's weights, each re-made when its parameter changes
    (an in-place update, or ``.to()`` moving it): looked up by the parameter itself.

    ``static``: ``(producer, consumer, scales)`` triples from calibration: the producer
    (FFN1's GEMM, or ``"attention"``) writes e4m3 codes of its output divided by ``scales``
    (``out_scale``, ``attention_out_scale``), and the consumer's copy is made from its
    weight times ``scales`` (per input column).  A producer in ``NORM_INPUTS`` (consumer
    None): the powers of two the LayerNorm inputs are coded with where the LayerNorms are
    folded (``norm_code_scales``, ``fusedenc.encoder.fp8_fold``)."""

    def __init__(self, params: dict[str, torch.Tensor], fast_accum: bool = False,
                 static: Iterable[tuple[str, str, torch.Tensor]] = ()):  # fmt: skip
        self.names = tuple(params)
        self.fast_accum = bool(fast_accum)
        self.dtype = next(iter(params.values())).dtype if params else None
        self._entries: dict[int, list] = {id(p): [p, None, None] for p in params.values()}
        self._out_scale: dict[int, torch.Tensor] = {}
        self._in_scale: dict[int, torch.Tensor] = {}
        self._attention_out_scale: Optional[torch.Tensor] = None
        self._norm_scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: ``{producer: scales}`` of the calibrated tensors (a code stands for ``code * scale``).
        self.static_scales: dict[str, torch.Tensor] = {producer: scales.float() for producer, _, scales in static}
        for producer, consumer, scales in static:
            if producer in NORM_INPUTS:
                self._norm_scales[producer] = (scales.float(), (1.0 / scales).float())
                continue
            if producer == "attention":
                self._attention_out_scale = (1.0 / scales).float()
            else:
                self._out_scale[id(params[producer])] = (1.0 / scales).float()
            self._in_scale[id(params[consumer])] = scales.float()

    def out_scale(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """For the GEMM that writes e4m3 (calibrated): the per-column factor, on ``weight``'s device."""
        scale = self._out_scale.get(id(weight))
        if scale is not None and scale.device != weight.device:
            scale = self._out_scale[id(weight)] = scale.to(weight.device)
        return scale

    @property
    def folds_norms(self) -> bool:
        """Whether calibration gave the LayerNorm inputs' code scales (``fp8_fold`` can run)."""
        return len(self._norm_scales) == len(NORM_INPUTS)

    def norm_code_scales(self, norm: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(c, 1 / c)`` of LayerNorm ``norm``'s input (a name in ``NORM_INPUTS``) on ``device``."""
        scale, inv = self._norm_scales[norm]
        if scale.device != device:
            scale, inv = self._norm_scales[norm] = (scale.to(device), inv.to(device))
        return scale, inv

    def attention_out_scale(self, device: torch.device) -> Optional[torch.Tensor]:
        """The attention output's per-column factor on ``device`` (calibrated), or None."""
        scale = self._attention_out_scale
        if scale is not None and scale.device != device:
            scale = self._attention_out_scale = scale.to(device)
        return scale

    def get(self, weight: torch.Tensor) -> Optional[Quantized]:
        """``weight``'s e4m3 copy, or None where that weight stays in its own dtype."""
        entry = self._entries.get(id(weight))
        if entry is None or entry[0] is not weight:
            return None
        # An inference tensor has no version counter: its copy is re-made when it moves,
        # not when it is written in place (inside inference mode, the only place it can be).
        version = -1 if weight.is_inference() else weight._version
        stamp = (version, weight.data_ptr(), weight.device)
        if entry[1] != stamp:
            with torch.no_grad():
                w = weight.detach()
                scales = self._in_scale.get(id(weight))
                if scales is not None:  # the input arrives divided by these: fold them in
                    scales = self._in_scale[id(weight)] = scales.to(w.device)
                    w = w.float() * scales[None, :]
                entry[2] = quantize_rows(w)
            entry[1] = stamp
        return entry[2]


def quantize_config(
    block: Any, mode: Optional[str], keep: Iterable[str], fast_accum: bool, calibration: Any = None,
    fold_norms: bool = True, input_headroom: float = INPUT_HEADROOM,
) -> Optional[tuple[tuple[str, ...], bool, Optional[torch.Tensor]]]:  # fmt: skip
    """``EncoderBlock.quantize``'s arguments checked against the block (its weights' dtype
    and device, its widths): ``(kept GEMMs, fast_accum, static)``, ``static`` the
    ``QuantizedWeights`` triples of the calibrated inputs (FFN2's; the out-projection's unless
    kept; with ``fold_norms`` and no GEMM kept, the LayerNorm inputs'), or None for
    ``mode=None``.  ``calibration``: sample inputs of the block (run here) or a
    ``Calibration`` of the model it belongs to."""
    if mode is None:
        return None
    if mode != "fp8":
        raise ValueError(f"mode must be 'fp8' or None, got {mode!r}")
    keep = tuple(keep) if not isinstance(keep, str) else (keep,)
    unknown = [k for k in keep if k not in BLOCK_GEMMS]
    if unknown:
        raise ValueError(f"keep names GEMMs {unknown}; the block's are {list(BLOCK_GEMMS)}")
    weight = block.qkv_weight
    if weight.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"FP8 mode needs a float16 or bfloat16 block; this one is {weight.dtype}")
    if block.d_model % 16 or block.d_ff % 16:
        raise ValueError(f"FP8 GEMMs need d_model and d_ff multiples of 16, got {block.d_model} and {block.d_ff}")
    if weight.device.type == "cuda":
        ok, why = core.fp8_status(weight.device)
        if not ok:
            raise RuntimeError(f"FP8 does not run on {weight.device}: {why}")
    if calibration is None:
        return keep, bool(fast_accum), ()
    if block.norm_first or "ffn1" in keep or "ffn2" in keep:
        raise ValueError("calibration sets static scales for FFN2's input, written by FFN1: it needs a post-LN "
                         "block (norm_first=False) with both FFN GEMMs in FP8 (not in keep)")  # fmt: skip
    if isinstance(calibration, torch.Tensor):
        calibration = calibrate([block], block, calibration)
    if not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be sample inputs (a tensor) or a fusedenc.fp8.Calibration, got "
                        f"{type(calibration).__name__}")  # fmt: skip
    scales = calibration.column_scales(block)
    if scales is None:
        raise ValueError("calibration never ran this block (was it part of the model calibrate() ran?)")
    static = [("ffn1", "ffn2", scales)]
    if not input_headroom > 0:
        raise ValueError(f"input_headroom must be positive, got {input_headroom!r}")
    attention = None if "out_proj" in keep else calibration.column_scales(block, "attention", headroom=input_headroom)
    if attention is not None:
        static.append(("attention", "out_proj", attention))
    if fold_norms and not keep:
        for norm in NORM_INPUTS:
            headroom = input_headroom if norm == "norm1" else CALIBRATION_HEADROOM  # norm2's input follows norm1's output
            scales = calibration.column_scales(block, norm, power_of_two=True, headroom=headroom)
            if scales is not None:
                static.append((norm, None, scales))
    return keep, bool(fast_accum), tuple(static)


def quantize_blocks(
    blocks: Sequence[Any], mode: Optional[str], *, keep: Iterable[str] = (),
    layers: Optional[Iterable[int]] = None, fast_accum: bool = False, calibration: Any = None, model: Any = None,
    fold_norms: bool = True,
) -> None:  # fmt: skip
    """``quantize(mode, ...)`` on ``blocks[i]`` (EncoderBlocks) for ``i`` in ``layers`` (default
    all, negative from the end), ``quantize(None)`` on the others; ``layers`` is checked
    before any block changes.  What ``EncoderStack.quantize`` and ``Lc0Network.quantize`` do
    (``calibration``: sample inputs of ``model``, the module the blocks belong to, which
    ``calibrate`` runs once)."""
    n = len(blocks)
    chosen = set(range(n)) if layers is None else set()
    for i in [] if layers is None else list(layers):
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise ValueError(f"layers: {i!r} is not a layer of this {n}-layer body")
        chosen.add(i % n)
    keep = tuple(keep) if not isinstance(keep, str) else (keep,)
    cal = None if calibration is None or mode is None else calibrate(blocks, model, calibration)
    for i, block in enumerate(blocks):
        # Only the first block's input is the caller's; the later ones' come from a LayerNorm.
        block.quantize(mode if i in chosen else None, keep=keep, fast_accum=fast_accum, calibration=cal,
                       fold_norms=fold_norms, input_headroom=INPUT_HEADROOM if i == 0 else CALIBRATION_HEADROOM)
