"""Whether inputs stay within the range of a calibrated FP8 model's static scales.

Calibration (``fusedenc.fp8.rowwise.calibrate``) fixes per-column scales from a sample; inputs larger
than the sample, or a sample too small to show a column's tails, drive values past what
those codes hold, and a saturated code stands for the edge of the range.  ``check_range``
runs inputs like the ones a model will serve once and names every static-scaled tensor
they would saturate, and by how much; nothing is checked on ordinary calls.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple, Sequence

import torch

from . import rowwise as fp8

__all__ = ["RangeExcess", "check_range", "static_limits"]


class RangeExcess(NamedTuple):
    """A static-scaled tensor that inputs drove past its codes' range (``check_range``):
    block ``block``'s ``what`` (a key of ``OBSERVED``), its largest magnitude ``factor``
    times the largest its codes hold, in ``columns`` of its columns."""

    block: int
    what: str
    factor: float
    columns: int


def static_limits(block: Any) -> dict[str, torch.Tensor]:
    """The largest magnitude each static-scaled tensor of a calibrated ``block`` can be coded
    with (per column: ``scale * max``; beyond it the codes saturate): ``{what: [columns]}``,
    empty for a block without static scales."""
    w8 = getattr(block, "_fp8", None)
    if w8 is None:
        return {}
    fmax = fp8.format_for(block.qkv_weight.device).max  # the flavour calibration's scales were made for
    return {what: scales * fmax for what, scales in w8.static_scales.items()}


def check_range(blocks: Sequence[Any], run: Any, sample: Any, *, warn: bool = True) -> list[RangeExcess]:
    """Whether ``sample`` inputs stay within the range calibration gave the static FP8 scales
    of ``blocks`` (calibrated ``EncoderBlock``s of the model ``run`` calls, e.g. a stack's
    ``blocks`` and the stack): ``run(sample)`` once, eagerly and in the blocks' dtype (as
    ``calibrate`` does), and every static-scaled tensor's largest magnitude per column
    compared with what its codes hold.  Returns the tensors that would saturate, largest
    excess first, and (``warn``) warns naming them.  Nothing is checked on ordinary calls:
    run this on inputs like the ones you will serve (a saturated code stands for the range's
    edge, so the error grows with the excess)."""
    limits = {i: static_limits(b) for i, b in enumerate(blocks)}
    seen = fp8.calibrate(blocks, run, sample)
    excess = []
    for i, b in enumerate(blocks):
        for what, limit in limits[i].items():
            amax = seen.amax(b, what)
            if amax is None:
                continue
            ratio = amax.to(limit.device) / limit
            over = int((ratio > 1).sum())
            if over:
                excess.append(RangeExcess(i, what, float(ratio.max()), over))
    excess.sort(key=lambda e: -e.factor)
    if excess and warn:
        worst = ", ".join(f"block {e.block} {fp8.OBSERVED[e.what]} {e.factor:.2g}x in {e.columns} columns" for e in excess[:4])
        warnings.warn(f"FP8 static scales saturate on these inputs ({len(excess)} tensors; {worst}): calibrate on "
                      "inputs like these, or quantize without calibration (row-wise scales)", RuntimeWarning,
                      stacklevel=2)  # fmt: skip
    return excess
