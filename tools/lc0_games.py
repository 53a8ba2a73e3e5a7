#!/usr/bin/env python3
"""Training games for an Lc0 attention-body net: engine self-play, every position labelled.

Not part of fusedenc: a tool.  It needs python-chess (``pip install chess``) and a UCI
engine; it was written for Stockfish 15.1 from Debian's archive, used without installing::

    apt-get download stockfish && dpkg -x stockfish_*.deb /work/lc0-train/stockfish
    # engine: /work/lc0-train/stockfish/usr/games/stockfish ("Stockfish 15.1")

What a game is
--------------
The engine plays itself.  Every position is searched once, at a fixed node count with
``MultiPV k`` (``Threads 1``, ``Hash 16``, ``UCI_ShowWDL true``), and that one search both
labels the position and picks the move played:

* the first ``r`` plies (``r`` drawn per game from 0..``--random-plies``, small ``r`` more
  likely) are uniform random legal moves: openings no engine would pick, still labelled;
* after that a move is drawn from a softmax over the MultiPV scores (centipawns, side to
  move) with temperature ``tau(ply) = max(--temp-floor, --temp * 0.5 ** (ply / --temp-halflife))``
  centipawns, among moves no more than ``--window`` centipawns below the best (a mate
  counts as +-10000 there); with probability ``--blunder`` a move is instead drawn uniformly
  from the whole MultiPV list, so lost and won positions get seen too;
* the game ends at checkmate, stalemate, insufficient material, the 50-move rule (halfmove
  clock 100), threefold repetition (draws claimed at once, as engines do), or at
  ``--max-plies`` (a draw, ``"end": "max_plies"``).  No resignation: plies left is the
  true remaining length of the game.

Each game is reproducible: its random choices come from ``numpy.random.default_rng([seed,
shard, game])`` and the engine is reset (``ucinewgame``: hash and histories cleared) before
it; with one thread and a node limit Stockfish's search is deterministic, so game ``g`` of
``(seed, shard)`` is the same on every run with the same engine and options.

Output: compact games, not planes
---------------------------------
``--out DIR`` gets ``s{seed}-k{shard}-{part:05d}.jsonl.gz`` files, part ``p`` holding
games ``p * --part-games`` .. ``(p + 1) * --part-games - 1`` of that shard, each written
whole (temporary file, then renamed), so a run can be stopped at any moment and started
again with the same command: it skips the parts that exist and goes on up to ``--games``
games in that shard.  More data: a larger ``--games``, or another ``--shard``/``--seed``.

Each file is gzip'd JSON lines.  The first line is a header::

    {"header": 1, "engine": "Stockfish 15.1", "nodes": 600, "multipv": 6, "seed": S,
     "shard": K, "part": p, "options": {...every generation option...}}

then one line per game::

    {"game": g, "start": "startpos", "moves": ["e2e4", ...], "result": "1-0" | "0-1" | "1/2-1/2",
     "end": "checkmate" | "stalemate" | "insufficient" | "fifty" | "threefold" | "max_plies",
     "random_plies": r,
     "mpv": [[["e2e4", 32], ["d2d4", 30], ...], ...],   # per ply: MultiPV moves, best first
     "wdl": [[43, 955, 2], ...]}                          # per ply: engine WDL, permille

``mpv[i]`` and ``wdl[i]`` label the position before ``moves[i]`` (``len(mpv) ==
len(moves)``; the final position, having no move, is not labelled).  Scores and WDL are
from the side to move's point of view (UCI's convention).  A score is centipawns, or a
mate: ``+(32000 - n)`` when the side to move mates in ``n`` moves, ``-(32000 - n)`` when it
is mated in ``n`` (``abs(score) >= MATE_BOUND = 31000`` means a mate).  The engine's best move
is ``mpv[i][0][0]``; plies left at ply ``i`` is ``len(moves) - i``; the result is White's.
Moves are UCI as python-chess writes them (castling e1g1).

Usage::

    nice -n 19 python tools/lc0_games.py --engine /work/lc0-train/stockfish/usr/games/stockfish \\
        --out /work/lc0-train/data --games 20000 --nodes 600 --multipv 6 --seed 1 --shard 0
    python tools/lc0_games.py --out /work/lc0-train/data --stats      # positions so far

The rate is printed every part.  Measured here (Stockfish 15.1, one thread, 2 shared
cores, ``nice -n 19``): ~450-550 positions/s at 600 nodes with MultiPV 6 (700-970 on an idle
core; 1000 nodes ~400, 3000 nodes ~175); a game is ~120 plies, so 10,000 games are ~1.2M
positions in about 45 minutes.  Searches at 600 nodes with MultiPV 6 reach depth 3-5:
the labels are those of a fast, shallow engine.  Lines that were still being searched
when the node limit hit keep their previous (shallower) score, and a line whose last report
was an aspiration bound keeps its last exact score.

Sets made so far (``/work/lc0-train``): training games ``--seed 1 --shard 0`` in ``data/``;
the held-back set ``--seed 2 --shard 0 --games 100`` (13,163 positions) in ``heldout/``,
copied to ``tests/data/lc0_trained/``.  ``/work/lc0-train/gen.sh`` runs both commands; run
it again (``nohup nice -n 19 ./gen.sh &``) to go on where it stopped.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Optional

import numpy as np

try:
    import chess
except ImportError:  # pragma: no cover - a tool, not a dependency; reading games needs no chess
    chess = None

MATE = 32000
MATE_BOUND = 31000
DEFAULT_ENGINE = "/work/lc0-train/stockfish/usr/games/stockfish"
NAME_RE = re.compile(r"s(\d+)-k(\d+)-(\d+)\.jsonl\.gz$")


class Engine:
    """A UCI engine over pipes: one search per call, the final MultiPV lines parsed."""

    def __init__(self, path: str, multipv: int, hash_mb: int = 16) -> None:
        self.proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.name = "?"
        self._send("uci")
        for line in self._lines():
            if line.startswith("id name "):
                self.name = line[8:].strip()
            if line == "uciok":
                break
        for name, value in (("Threads", 1), ("Hash", hash_mb), ("MultiPV", multipv), ("UCI_ShowWDL", "true")):
            self._send(f"setoption name {name} value {value}")
        self.multipv = multipv
        self.ready()

    def _send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def _lines(self):
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the engine exited")
            yield line.rstrip("\n")

    def ready(self) -> None:
        self._send("isready")
        for line in self._lines():
            if line == "readyok":
                return

    def new_game(self) -> None:
        self._send("ucinewgame")
        self.ready()

    def search(self, start: str, moves: list[str], nodes: int) -> tuple[list[list], list[int], str]:
        """(MultiPV ``[[uci, score], ...]`` best first, WDL of line 1, bestmove)."""
        pos = "position startpos" if start == "startpos" else f"position fen {start}"
        if moves:
            pos += " moves " + " ".join(moves)
        self._send(pos)
        self._send(f"go nodes {nodes}")
        lines: dict[int, tuple[str, int, list[int]]] = {}
        wdl_any: list[int] = []
        for line in self._lines():
            if line.startswith("bestmove"):
                best = line.split()[1]
                break
            if not line.startswith("info depth") or " pv " not in line:
                continue
            t = line.split()
            if "wdl" in t and (t[t.index("multipv") + 1] if "multipv" in t else "1") == "1":
                i = t.index("wdl")
                wdl_any = [int(t[i + 1]), int(t[i + 2]), int(t[i + 3])]
            if "upperbound" in t or "lowerbound" in t:
                continue  # a fail-high/low bound of an aspiration window: keep the line's last exact score
            k = int(t[t.index("multipv") + 1]) if "multipv" in t else 1
            s = t.index("score")
            if t[s + 1] == "cp":
                score = int(t[s + 2])
            else:
                n = int(t[s + 2])
                score = MATE - n if n > 0 else -(MATE + n)
            wdl = [int(t[i]) for i in range(t.index("wdl") + 1, t.index("wdl") + 4)] if "wdl" in t else []
            lines[k] = (t[t.index("pv") + 1], score, wdl)
        mpv, seen = [], set()
        for k in sorted(lines):  # a move can sit in two lines when they come from different depths
            if lines[k][0] not in seen:
                seen.add(lines[k][0])
                mpv.append([lines[k][0], lines[k][1]])
        wdl = lines[1][2] if 1 in lines and lines[1][2] else wdl_any
        return mpv, wdl, best

    def close(self) -> None:
        try:
            self._send("quit")
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001
            self.proc.kill()


def _sampling_score(score: int) -> float:
    return float(np.sign(score) * 10000) if abs(score) >= MATE_BOUND else float(score)


def choose(rng: np.random.Generator, mpv: list[list], ply: int, opts: argparse.Namespace) -> str:
    """The move played from one search's MultiPV list (see the module doc)."""
    if len(mpv) > 1 and rng.random() < opts.blunder:
        return mpv[int(rng.integers(len(mpv)))][0]
    scores = np.array([_sampling_score(s) for _, s in mpv])
    tau = max(opts.temp_floor, opts.temp * 0.5 ** (ply / opts.temp_halflife))
    keep = scores >= scores.max() - opts.window
    if tau <= 0:
        return mpv[int(np.argmax(scores))][0]
    z = np.where(keep, (scores - scores.max()) / tau, -np.inf)
    p = np.exp(z)
    p /= p.sum()
    return mpv[int(rng.choice(len(mpv), p=p))][0]


def random_plies(rng: np.random.Generator, most: int) -> int:
    """0..most, small counts more likely (weights most+1-r)."""
    w = np.arange(most + 1, 0, -1, dtype=np.float64)
    return int(rng.choice(most + 1, p=w / w.sum()))


def play_game(engine: Engine, seed: int, shard: int, game: int, opts: argparse.Namespace) -> dict:
    rng = np.random.default_rng([seed, shard, game])
    engine.new_game()
    board = chess.Board()
    start = "startpos"
    r = random_plies(rng, opts.random_plies)
    moves: list[str] = []
    mpv_all, wdl_all = [], []
    end = None
    while True:
        if board.is_checkmate():
            end = "checkmate"
        elif board.is_stalemate():
            end = "stalemate"
        elif board.is_insufficient_material():
            end = "insufficient"
        elif board.halfmove_clock >= 100:
            end = "fifty"
        elif board.is_repetition(3):
            end = "threefold"
        elif len(moves) >= opts.max_plies:
            end = "max_plies"
        if end:
            break
        mpv, wdl, best = engine.search(start, moves, opts.nodes)
        if not mpv or mpv[0][0] != best:  # the engine's bestmove leads the list, with its own score if listed
            listed = [m for m in mpv if m[0] == best]
            top = listed[0][1] if listed else (mpv[0][1] if mpv else 0)
            mpv = [[best, max(top, mpv[0][1]) if mpv else top]] + [m for m in mpv if m[0] != best]
        ply = len(moves)
        if ply < r:
            legal = list(board.legal_moves)
            move = legal[int(rng.integers(len(legal)))].uci()
        else:
            move = choose(rng, mpv, ply, opts)
        mpv_all.append(mpv)
        wdl_all.append(wdl or [0, 1000, 0])
        moves.append(move)
        board.push_uci(move)
    if end == "checkmate":
        result = "0-1" if board.turn == chess.WHITE else "1-0"
    else:
        result = "1/2-1/2"
    return {"game": game, "start": start, "moves": moves, "result": result, "end": end, "random_plies": r,
            "mpv": mpv_all, "wdl": wdl_all}


def part_path(out: str, seed: int, shard: int, part: int) -> str:
    return os.path.join(out, f"s{seed}-k{shard}-{part:05d}.jsonl.gz")


OPTION_NAMES = ("nodes", "multipv", "random_plies", "temp", "temp_halflife", "temp_floor", "window", "blunder",
                "max_plies", "part_games", "hash")


def generate(opts: argparse.Namespace) -> None:
    if chess is None:
        sys.exit("playing games needs python-chess: pip install chess")
    os.makedirs(opts.out, exist_ok=True)
    engine = Engine(opts.engine, opts.multipv, opts.hash)
    options = {k: getattr(opts, k) for k in OPTION_NAMES}
    parts = math.ceil(opts.games / opts.part_games)
    total_pos, total_s = 0, 0.0
    print(f"engine {engine.name!r}; shard s{opts.seed}-k{opts.shard}: {opts.games} games in {parts} parts of "
          f"{opts.part_games}", flush=True)
    try:
        for part in range(parts):
            path = part_path(opts.out, opts.seed, opts.shard, part)
            if os.path.exists(path):
                continue
            t0 = time.time()
            games = []
            first = part * opts.part_games
            for g in range(first, min(first + opts.part_games, opts.games)):
                games.append(play_game(engine, opts.seed, opts.shard, g, opts))
            header = {"header": 1, "engine": engine.name, "nodes": opts.nodes, "multipv": opts.multipv,
                      "seed": opts.seed, "shard": opts.shard, "part": part, "options": options}
            tmp = path + f".tmp{os.getpid()}"
            text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in [header, *games])
            with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as f:
                f.write(text.encode())  # no name, no time in the gzip header: the same games, the same bytes
            os.replace(tmp, path)
            n = sum(len(g["moves"]) for g in games)
            dt = time.time() - t0
            total_pos += n
            total_s += dt
            ends = {}
            for g in games:
                ends[g["end"]] = ends.get(g["end"], 0) + 1
            print(f"{time.strftime('%H:%M:%S')} part {part}: {len(games)} games, {n} positions in {dt:.0f} s "
                  f"({n / dt:.0f} pos/s; run {total_pos / total_s:.0f} pos/s); ends {ends}", flush=True)
    finally:
        engine.close()


def read_games(paths: list[str]):
    """Every game of the given part files, in order (header lines skipped)."""
    for path in paths:
        with gzip.open(path, "rt") as f:
            for line in f:
                rec = json.loads(line)
                if "header" not in rec:
                    yield rec


def part_files(out: str, seed: Optional[int] = None, shard: Optional[int] = None) -> list[str]:
    """The complete part files in ``out`` (optionally of one seed / shard), sorted."""
    found = []
    for path in glob.glob(os.path.join(out, "s*-k*-*.jsonl.gz")):
        m = NAME_RE.search(os.path.basename(path))
        if m and (seed is None or int(m[1]) == seed) and (shard is None or int(m[2]) == shard):
            found.append((int(m[1]), int(m[2]), int(m[3]), path))
    return [p for *_, p in sorted(found)]


def stats(opts: argparse.Namespace) -> None:
    files = part_files(opts.out)
    games = positions = 0
    results: dict[str, int] = {}
    ends: dict[str, int] = {}
    for g in read_games(files):
        games += 1
        positions += len(g["moves"])
        results[g["result"]] = results.get(g["result"], 0) + 1
        ends[g["end"]] = ends.get(g["end"], 0) + 1
    print(json.dumps({"files": len(files), "games": games, "positions": positions,
                      "mean_plies": round(positions / max(games, 1), 1), "results": results, "ends": ends}))


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder of the part files")
    ap.add_argument("--engine", default=DEFAULT_ENGINE)
    ap.add_argument("--games", type=int, default=1000, help="games in this (seed, shard) in all, across runs")
    ap.add_argument("--nodes", type=int, default=600)
    ap.add_argument("--multipv", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shard", type=int, default=0)
    ap.add_argument("--part-games", type=int, default=100, help="games per part file")
    ap.add_argument("--random-plies", type=int, default=6, help="at most this many uniform random plies first")
    ap.add_argument("--temp", type=float, default=80.0, help="sampling temperature at ply 0, centipawns")
    ap.add_argument("--temp-halflife", type=float, default=16.0, help="plies over which the temperature halves")
    ap.add_argument("--temp-floor", type=float, default=8.0, help="lowest temperature, centipawns")
    ap.add_argument("--window", type=float, default=150.0, help="sample only moves this close to the best (cp)")
    ap.add_argument("--blunder", type=float, default=0.02, help="chance of a uniform MultiPV move instead")
    ap.add_argument("--max-plies", type=int, default=400)
    ap.add_argument("--hash", type=int, default=16, help="engine hash, MB")
    ap.add_argument("--stats", action="store_true", help="count the games and positions in --out and exit")
    opts = ap.parse_args(argv)
    if opts.stats:
        stats(opts)
    else:
        generate(opts)


if __name__ == "__main__":
    main()
