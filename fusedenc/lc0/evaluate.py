"""What a network says about positions: ``Evaluation`` and ``evaluate``.

``evaluate`` is the whole path for a batch: positions are parsed and checked
(``positions.prepare``), encoded in the network's input format (``encoding``), run
(``run(planes)``: an ``Lc0Network``, its graph runner, or any callable returning the heads),
and the policy decoded onto the real board (``policy``).  Every check happens before the
network runs, so a bad position costs no GPU work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from .encoding import encode_masks, expand_planes, resolve_input_format
from .policy import MovePolicy, decode_policy
from .positions import prepare

__all__ = ["Evaluation", "evaluate"]


@dataclass
class Evaluation:
    """A network's view of one position, from the side to move.

    ``moves`` (UCI, on the real board) with ``probs``, most probable first; ``wdl``: win,
    draw, loss probabilities (None for a net without a WDL head); ``q``: W - L (or the
    value head's tanh output for such a net); ``moves_left``: the moves-left head's
    estimate in plies (None where the net has none)."""

    moves: list[str]
    probs: np.ndarray
    q: float
    wdl: Optional[np.ndarray] = None
    moves_left: Optional[float] = None
    policy_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

    @property
    def best_move(self) -> Optional[str]:
        """The most probable move (None without legal moves)."""
        return self.moves[0] if self.moves else None

    def top(self, n: int = 5) -> list[tuple[str, float]]:
        return [(m, float(p)) for m, p in zip(self.moves[:n], self.probs[:n])]

    def to_dict(self, top: Optional[int] = None) -> dict[str, Any]:
        """JSON-ready: moves with probabilities (all, or the ``top`` most probable)."""
        k = len(self.moves) if top is None else top
        out: dict[str, Any] = {"moves": self.moves[:k], "probs": [round(float(p), 6) for p in self.probs[:k]],
                               "q": round(self.q, 6)}
        if self.wdl is not None:
            out["wdl"] = [round(float(x), 6) for x in self.wdl]
        if self.moves_left is not None:
            out["moves_left"] = round(self.moves_left, 3)
        return out


def evaluations(heads: Mapping[str, torch.Tensor], policies: list[MovePolicy]) -> list[Evaluation]:
    """Join decoded policies with the value heads (``[B, 3]`` WDL or ``[B, 1]`` value, and
    ``[B, 1]`` moves left) into ``Evaluation`` objects."""
    wdl = heads.get("wdl")
    wdl = wdl.detach().float().cpu().numpy() if wdl is not None else None
    value = heads.get("value")
    value = value.detach().float().cpu().numpy().reshape(-1) if value is not None else None
    ml = heads.get("moves_left")
    ml = ml.detach().float().cpu().numpy().reshape(-1) if ml is not None else None
    out = []
    for b, pol in enumerate(policies):
        w = wdl[b] if wdl is not None else None
        q = float(w[0] - w[2]) if w is not None else float(value[b])
        out.append(Evaluation(pol.moves, pol.probs, q, w, float(ml[b]) if ml is not None else None, pol.indices))
    return out


def evaluate(
    run: Callable[[torch.Tensor], Mapping[str, torch.Tensor]],
    input_format: Any,
    positions: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    temperature: float = 1.0,
) -> list[Evaluation]:
    """Evaluate positions (any form ``positions.prepare`` takes) with ``run(planes)`` (the
    net's heads for planes ``[B, 112, 8, 8]`` in ``dtype`` on ``device``).  The planes'
    bits are copied to the device as masks and expanded there."""
    fmt = resolve_input_format(input_format)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch = prepare(positions)
    if len(batch) == 0:
        return []
    masks, values, transforms = encode_masks(batch, fmt)
    device = torch.device(device)
    if device.type == "cpu":
        planes = expand_planes(masks, values, transforms, dtype=dtype)
    else:
        m = torch.from_numpy(masks.view(np.int64)).to(device, non_blocking=True)
        planes = expand_planes(m, torch.from_numpy(values).to(device), torch.from_numpy(transforms).to(device), dtype=dtype)
    heads = run(planes)
    policies = decode_policy(heads["policy"], batch, fmt, temperature=temperature)
    return evaluations(heads, policies)
