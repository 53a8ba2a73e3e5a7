"""The trained Lc0 net of ``nets/`` and its held-back positions: test and bench material.

``held_back()`` reads the held-back games (``tests/data/lc0_trained``: another seed than the
training games) as ``HeldBack`` positions: each one's history, the engine's best move and
WDL.  ``agreement(a, b)`` compares two lists of ``Evaluation`` of the same positions the
way the trained-network acceptance and the FP8 gate do (top-1 move, KL divergence of the
move distributions, WDL differences); ``strength(evals, held)`` says how the net's moves
and WDL compare with the engine's.  ``tests/test_lc0_trained*.py`` and
``bench/fp8_accuracy.py --lc0-net`` use them.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import NamedTuple, Optional, Sequence

import numpy as np

from fusedenc.lc0 import board as B
from fusedenc.lc0.positions import board_fens, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NET = os.path.join(ROOT, "nets", "fusedenc-lc0-8x256.pb.gz")
GAMES = os.path.join(ROOT, "tests", "data", "lc0_trained", "s2-k0-00000.jsonl.gz")


class HeldBack(NamedTuple):
    """One held-back position: ``history`` (``(start, [uci moves])``, what ``evaluate``
    takes), the engine's best move there (UCI) and its WDL (side to move, probabilities)."""

    history: tuple
    best: str
    wdl: tuple


def held_back(limit: Optional[int] = None, path: str = GAMES) -> list[HeldBack]:
    """Every position of the held-back games, once each (the first occurrence of each FEN
    without move counters: the start position and common openings recur across games),
    in game order; the first ``limit`` of them."""
    out, seen = [], set()
    with gzip.open(path, "rt") as fh:
        games = [json.loads(line) for line in fh]
    for game in games:
        if "header" in game:
            continue
        histories = [(game["start"], game["moves"][:ply]) for ply in range(len(game["moves"]))]
        fens = board_fens(prepare(histories).current)
        for ply, fen in enumerate(fens):
            key = " ".join(fen.split()[:4])
            if key in seen:
                continue
            seen.add(key)
            w, d, l = (v / 1000.0 for v in game["wdl"][ply])
            out.append(HeldBack(histories[ply], game["mpv"][ply][0][0], (w, d, l)))
            if limit is not None and len(out) >= limit:
                return out
    return out


def _probs_by_index(e) -> dict:
    return dict(zip(np.asarray(e.policy_indices).tolist(), np.asarray(e.probs, np.float64).tolist()))


def agreement(evals: Sequence, base: Sequence) -> dict:
    """``evals`` against ``base`` (the same positions): the share whose top move agrees,
    the mean KL(base || evals) of the move distributions over the legal moves (nats), and
    the largest and mean absolute WDL difference (over W, D and L)."""
    if len(evals) != len(base):
        raise ValueError(f"{len(evals)} evaluations against {len(base)}")
    top = np.mean([a.best_move == b.best_move for a, b in zip(evals, base)])
    kl = []
    for a, b in zip(evals, base):
        pa, pb = _probs_by_index(a), _probs_by_index(b)
        p_base = np.array(list(pb.values()))
        p_eval = np.array([max(pa.get(i, 0.0), 1e-30) for i in pb])
        keep = p_base > 0
        kl.append(float(np.sum(p_base[keep] * (np.log(p_base[keep]) - np.log(p_eval[keep])))))
    wdl = np.abs(np.array([a.wdl for a in evals], np.float64) - np.array([b.wdl for b in base], np.float64))
    return {"positions": len(evals), "top1_agreement": float(top), "kl": float(np.mean(kl)),
            "wdl_max_abs": float(wdl.max()), "wdl_mean_abs": float(wdl.mean())}


def strength(evals: Sequence, held: Sequence[HeldBack]) -> dict:
    """How the net's view compares with the engine's on the held-back positions: the share
    whose top move is the engine's best move, the median probability of the net's top move,
    the mean absolute difference of its WDL from the engine's, and whether every top move is
    legal (``evaluate`` only returns legal moves: this checks that the decoding did)."""
    legal_all = True
    for start in range(0, len(held), 2048):
        chunk = held[start:start + 2048]
        moves, starts, counts = prepare([h.history for h in chunk]).legal_moves()
        for j, e in enumerate(evals[start:start + 2048]):
            codes = moves[starts[j]:starts[j] + counts[j]]
            legal_all &= e.best_move in {B.UCI_TEXT[int(c)] for c in codes}
    best = np.mean([e.best_move == h.best for e, h in zip(evals, held)])
    top_p = np.median([float(e.probs[0]) for e in evals])
    wdl = np.abs(np.array([e.wdl for e in evals], np.float64) - np.array([h.wdl for h in held], np.float64))
    return {"positions": len(evals), "top_move_legal": bool(legal_all), "top1_engine_best": float(best),
            "median_top1_prob": float(top_p), "wdl_mean_abs_vs_engine": float(wdl.mean())}
