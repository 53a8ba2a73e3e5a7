"""What a network says about positions: ``Evaluation`` and ``evaluate``.

``evaluate`` is the whole path for a batch: positions are parsed and checked
(``positions.prepare``), encoded in the network's input format (``encoding``), run
(``run(planes)``: an ``Lc0Network``, its graph runner, or any callable returning the heads),
and the policy decoded onto the real board (``policy``).  Every check happens before the
network runs, so a bad position costs no GPU work.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from .encoding import encode_masks, expand_planes, resolve_input_format
from .policy import DecodedPolicies, MovePolicy, decode_arrays, policy_indices
from .positions import prepare

__all__ = ["Evaluation", "evaluate", "json_lines"]


class Evaluation:
    """A network's view of one position, from the side to move.

    ``moves`` (UCI, on the real board) with ``probs``, most probable first, and their
    ``policy_indices`` (places in the 1858 logits); ``wdl``: win, draw, loss probabilities
    (None for a net without a WDL head); ``q``: W - L (or the value head's tanh output for
    such a net); ``moves_left``: the moves-left head's estimate in plies (None where the net
    has none).  Made from a batch's arrays, an evaluation builds its move list when first
    read, so that the thread that owns the GPU does no per-move work."""

    __slots__ = ("_policies", "_index", "_policy", "_heads")

    def __init__(self, moves: Sequence[str], probs: Any, q: float, wdl: Any = None, moves_left: Optional[float] = None,
                 policy_indices: Any = None) -> None:
        indices = np.zeros(len(moves), np.int64) if policy_indices is None else np.asarray(policy_indices)
        self._policy: Optional[MovePolicy] = MovePolicy(list(moves), np.asarray(probs, np.float32), indices)
        self._policies: Optional[DecodedPolicies] = None
        self._index = 0
        self._heads = _Heads(np.array([q], np.float64), None if wdl is None else np.asarray(wdl, np.float32)[None],
                             None if moves_left is None else np.array([moves_left], np.float32))

    @classmethod
    def _of_batch(cls, policies: DecodedPolicies, heads: "_Heads", index: int) -> "Evaluation":
        e = cls.__new__(cls)
        e._policies, e._index, e._policy, e._heads = policies, index, None, heads
        return e

    def _decoded(self) -> MovePolicy:
        if self._policy is None:
            self._policy = self._policies[self._index]
        return self._policy

    @property
    def moves(self) -> list[str]:
        return self._decoded().moves

    @property
    def probs(self) -> np.ndarray:
        return self._decoded().probs

    @property
    def policy_indices(self) -> np.ndarray:
        return self._decoded().indices

    @property
    def q(self) -> float:
        return float(self._heads.q[self._row])

    @property
    def wdl(self) -> Optional[np.ndarray]:
        return None if self._heads.wdl is None else self._heads.wdl[self._row]

    @property
    def moves_left(self) -> Optional[float]:
        return None if self._heads.moves_left is None else float(self._heads.moves_left[self._row])

    @property
    def _row(self) -> int:
        return self._index if self._policies is not None else 0

    @property
    def best_move(self) -> Optional[str]:
        """The most probable move (None without legal moves)."""
        moves = self.moves
        return moves[0] if moves else None

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

    def __repr__(self) -> str:
        return (f"Evaluation(best_move={self.best_move!r}, moves={len(self.moves)}, q={self.q:.4f}, "
                f"wdl={None if self.wdl is None else [round(float(x), 4) for x in self.wdl]}, "
                f"moves_left={self.moves_left})")


class _Heads:
    """A batch's value heads as arrays: ``q`` (W - L, or the value), ``wdl``, ``moves_left``."""

    __slots__ = ("q", "wdl", "moves_left")

    def __init__(self, q: np.ndarray, wdl: Optional[np.ndarray], moves_left: Optional[np.ndarray]) -> None:
        self.q, self.wdl, self.moves_left = q, wdl, moves_left


def evaluations(heads: Mapping[str, Any], policies: DecodedPolicies) -> list[Evaluation]:
    """Join a batch's decoded policies with its value heads (``[B, 3]`` WDL or ``[B, 1]``
    value, and ``[B, 1]`` moves left; tensors or arrays) into ``Evaluation`` objects."""
    def array(name: str) -> Optional[np.ndarray]:
        t = heads.get(name)
        # A copy always: the heads may be buffers the caller reuses (the Evaluator's pinned
        # slots), and the evaluations outlive the batch.
        if t is None:
            return None
        if isinstance(t, np.ndarray):
            return t.astype(np.float32)  # a copy
        return t.detach().to("cpu", torch.float32, copy=True).numpy()

    wdl, value, ml = array("wdl"), array("value"), array("moves_left")
    q = (wdl[:, 0].astype(np.float64) - wdl[:, 2]) if wdl is not None else value.reshape(-1).astype(np.float64)
    values = _Heads(q, wdl, None if ml is None else ml.reshape(-1))
    make = Evaluation._of_batch
    return [make(policies, values, b) for b in range(len(policies))]


def json_lines(evaluations: Sequence[Evaluation], prefixes: Sequence[str], top: Optional[int] = None) -> list[str]:
    """Each evaluation as one line of JSON: its prefix (the opening of a JSON object with the
    caller's own fields, e.g. ``json.dumps(ids)[:-1]``) followed by ``best_move`` and
    ``to_dict(top)``'s fields, the same values as ``json.dumps({**ids, "best_move": ...,
    **to_dict(top)})`` (numbers written with fixed decimals: 0.25 as 0.250000).  Evaluations of
    one batch are formatted from the batch's arrays at once, so that writing a file of 100,000
    positions costs the process that owns the GPU a few microseconds a position (``json.dumps``
    of each dict: about 50)."""
    if len(prefixes) != len(evaluations):
        raise ValueError(f"{len(evaluations)} evaluations but {len(prefixes)} prefixes")
    out: list[str] = []
    i, n = 0, len(evaluations)
    while i < n:
        policies = evaluations[i]._policies
        j = i + 1
        if policies is not None:
            while j < n and evaluations[j]._policies is policies:
                j += 1
        out.extend(_batch_lines(evaluations[i:j], prefixes[i:j], top))
        i = j
    return out


def _batch_lines(group: Sequence[Evaluation], prefixes: Sequence[str], top: Optional[int]) -> list[str]:
    """The lines of evaluations of one batch (or one stand-alone evaluation): positions with
    the same number of moves written share one format string, filled for all of them by one
    ``%`` (Python work per field, in C, not per position)."""
    first = group[0]
    if first._policies is None:  # a stand-alone Evaluation
        moves = first.moves if top is None else first.moves[:top]
        texts = np.array(moves, dtype=object)
        probs, k, rows = np.asarray(first.probs[:len(moves)], np.float32), np.array([len(moves)]), [0]
    else:
        rows = [e._index for e in group]
        texts, probs, k = first._policies.top_arrays(np.array(rows, np.int64), top)
    heads = first._heads
    q = heads.q[rows]
    wdl = None if heads.wdl is None else heads.wdl[rows].astype(np.float64)
    ml = None if heads.moves_left is None else heads.moves_left[rows].astype(np.float64)
    if not all(np.isfinite(a).all() for a in (probs, q, wdl, ml) if a is not None):
        # json.dumps writes NaN / Infinity, which fixed decimals cannot: the slow way
        return [json.dumps({**json.loads(p + "}"), "best_move": e.best_move, **e.to_dict(top)})
                for p, e in zip(prefixes, group, strict=True)]
    m = len(group)
    tail = ', "q": %.6f' + (', "wdl": [%.6f, %.6f, %.6f]' if wdl is not None else "") + (
        ', "moves_left": %.3f' if ml is not None else "") + "}\x00"
    ends = np.cumsum(k)
    width = 3 + (3 if wdl is not None else 0) + (1 if ml is not None else 0)  # prefix, best, q, wdl, moves left
    out: list[Optional[str]] = [None] * m
    sizes = np.unique(k).tolist()
    for kk in sizes:  # usually one: every position with at least ``top`` moves
        sel = np.arange(m) if len(sizes) == 1 else np.flatnonzero(k == kk)
        g = len(sel)
        table = np.empty((g, width + 2 * kk), object)  # the format's values, a row a position
        table[:, 0] = [p if p[-1] == "{" else p + ", " for p in (prefixes[i] for i in sel.tolist())]
        if kk:
            at = (ends[sel] - kk)[:, None] + np.arange(kk)
            table[:, 2:2 + kk] = texts[at]
            table[:, 1] = table[:, 2]
            table[:, 2 + kk:2 + 2 * kk] = probs[at].astype(np.float64)
            template = ('%s"best_move": "%s", "moves": [' + ", ".join(['"%s"'] * kk) + '], "probs": ['
                        + ", ".join(["%.6f"] * kk) + "]")
        else:  # no moves written: mate or stalemate, or top == 0
            table[:, 1] = ["null" if b is None else f'"{b}"' for b in (group[i].best_move for i in sel.tolist())]
            template = '%s"best_move": %s, "moves": [], "probs": []'
        c = 2 + 2 * kk
        table[:, c] = q[sel]
        if wdl is not None:
            table[:, c + 1:c + 4] = wdl[sel]
        if ml is not None:
            table[:, -1] = ml[sel]
        lines = ((template + tail) * g % tuple(table.ravel().tolist())).split("\x00")
        if g == m:
            return lines[:-1]
        for i, line in zip(sel.tolist(), lines):
            out[i] = line
    return out  # type: ignore[return-value]


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
    moves, indices, _, counts = policy_indices(batch, fmt)
    logits = heads["policy"].detach().float().cpu().numpy()
    return evaluations(heads, decode_arrays(logits, moves, indices, counts, temperature))
