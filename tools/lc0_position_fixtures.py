#!/usr/bin/env python3
"""Chess-position fixtures from lc0 itself: the outside oracle for ``fusedenc/lc0``'s
position type, ``encode_planes``, legal-move generation and policy decoding.

What it does
------------
``generate`` plays random legal games and records positions (a start FEN plus UCI moves),
with every move drawn from lc0's own ``GameState(fen, moves).moves()`` (the only legality
oracle; this file's small board tracker only *classifies* moves and steers the random
choice: castling, en passant, promotions, repetition shuffles).  For every position it asks
lc0 (its Python bindings, ``lczero.backends``, built with the BLAS backend) for

* the legal moves (``gs.moves()``, lc0's order, UCI on the real board) and their policy
  indices (``gs.policy_indices()``: always the identity transform, see README);
* the 112 input planes in each of the seven input formats (1, 2, 3, 4, 5, 132, 133), via
  ``gs.as_input(backend)`` with a backend whose net has that format (8 history steps,
  ``FillEmptyHistory::FEN_ONLY``);
* lc0's BLAS evaluation of the first positions by each format's net.

``nets`` writes the seven synthetic nets (one per input format) with the repository's own
``tests/lc0_writer.py`` (needs torch and fusedenc; ``generate`` does not).

Layout written to ``--out`` (``tests/data/lc0_positions/``)
---------------------------------------------------------
* ``net_<fmt>.pb.gz``: the net of input format ``fmt`` (``nets``);
* ``positions.json.gz``: a JSON list, one record per position,
  ``{"fen": start FEN, "moves": [uci, ...], "legal": [uci, ...], "indices": [int, ...]}``;
  ``legal[i]`` has policy index ``indices[i]``; every position has at least one legal move;
* ``planes_<fmt>.npz``: ``digest`` uint64 [N], ``ok`` bool [N], ``masks`` uint64 [F, 112],
  ``values`` float32 [F, 112] (the first F = ``--full`` positions; rows where ``ok`` is False
  are zero).  ``digest[n] = int.from_bytes(blake2b(dense.tobytes(), digest_size=8).digest(),
  "little")`` where ``dense`` is float32 C-contiguous [112, 64] with ``dense[p, sq] =
  values[p]`` if bit ``sq`` of ``masks[p]`` is set (a1 = bit 0, h1 = 7, a8 = 56) else 0.0:
  the bytes of a float32 [112, 8, 8] tensor [plane, rank, file].  ``ok`` is False (digest 0)
  where lc0 cannot encode the position in that format (formats 5 and 133 only; README);
* ``eval_<fmt>.npz``: ``index`` int64 [K] (positions evaluated: the first K positions whose
  ``ok`` is True for that format), ``policy`` float32 [K, 1858] (``p_raw(*range(1858))``),
  ``q``, ``d``, ``m`` float32 [K].

Usage (``--lc0-module-dir`` is the folder holding ``lczero/backends*.so``)::

    python tools/lc0_position_fixtures.py nets --out tests/data/lc0_positions
    python tools/lc0_position_fixtures.py generate --lc0-module-dir DIR \\
        --out tests/data/lc0_positions --seed 2026 --positions 12000 --full 1000 --evals 48 --check-hangs 8

``generate`` needs numpy and lc0's module only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import select
import subprocess
import sys
import time
from collections import Counter

import numpy as np

FORMATS = (1, 2, 3, 4, 5, 132, 133)
#: Canonical v2 formats: lc0's history walk never ends for some positions (README).
V2_FORMATS = (5, 133)
STARTPOS = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"
#: Public perft positions (chessprogramming.org "Perft Results" 2-6).
PERFT_FENS = (
    "r3k2r/p1ppqpb1/bn2pnp1/3PN3/1p2P3/2N2Q1p/PPPBBPPP/R3K2R w KQkq - 0 1",
    "8/2p5/3p4/KP5r/1R3p1k/8/4P1P1/8 w - - 0 1",
    "r3k2r/Pppp1ppp/1b3nbN/nP6/BBP1P3/q4N2/Pp1P2PP/R2Q1RK1 w kq - 0 1",
    "rnbq1k1r/pp1Pbppp/2p5/8/2B5/8/PPP1NnPP/RNBQK2R w KQ - 1 8",
    "r4rk1/1pp1qppp/p1np1n2/2b1p1B1/2B1P1b1/P1NP1N2/1PP1QPPP/R4RK1 w - - 0 10",
)

#: One small net per input format: lc0_writer.build_net arguments (besides input_format).
_COMMON = {
    "layers": 2,
    "d_model": 16,
    "heads": 2,
    "d_ff": 32,
    "smolgen": (2, 8, 2),
    "embedding_dense": 1,
    "value_channels": 1,
    "value_hidden": 128,
    "mlh_channels": 1,
    "mlh_hidden": 8,
}
NET_SPECS = {
    1: {"encoding": "LINEAR16", "default_activation": "mish", "ffn_activation": "swish",
            "smolgen_activation": "swish", "seed": 3001},
    2: {"encoding": "FLOAT16", "default_activation": "relu", "ffn_activation": "relu2",
            "smolgen_activation": "selu", "seed": 3002},
    3: {"encoding": "BFLOAT16", "default_activation": "mish", "ffn_activation": "default",
            "smolgen_activation": "swish", "seed": 3003},
    4: {"encoding": "LINEAR16", "default_activation": "relu", "ffn_activation": "swish",
            "smolgen_activation": "default", "seed": 3004},
    5: {"encoding": "FLOAT16", "default_activation": "mish", "ffn_activation": "mish",
            "smolgen_activation": "sigmoid", "seed": 3005},
    132: {"encoding": "BFLOAT16", "default_activation": "mish", "ffn_activation": "relu2",
              "smolgen_activation": "swish", "seed": 3132},
    133: {"encoding": "LINEAR16", "default_activation": "relu", "ffn_activation": "swish",
              "smolgen_activation": "tanh", "seed": 3133},
}  # fmt: skip
FORMAT_NAMES = {1: "CLASSICAL_112_PLANE", 2: "WITH_CASTLING_PLANE", 3: "WITH_CANONICALIZATION",
                4: "WITH_CANONICALIZATION_HECTOPLIES", 5: "WITH_CANONICALIZATION_V2",
                132: "WITH_CANONICALIZATION_HECTOPLIES_ARMAGEDDON",
                133: "WITH_CANONICALIZATION_V2_ARMAGEDDON"}  # fmt: skip


# ---------------------------------------------------------------------------------------
# A small board tracker: classifies lc0's moves and writes FENs.  Not a legality oracle.
# ---------------------------------------------------------------------------------------

FILES = "abcdefgh"


def sq_index(name: str) -> int:
    return FILES.index(name[0]) + 8 * (int(name[1]) - 1)


def sq_name(i: int) -> str:
    return FILES[i % 8] + str(i // 8 + 1)


class Board:
    def __init__(self, fen: str) -> None:
        parts = fen.split()
        self.sq: dict[int, str] = {}
        for r, row in enumerate(parts[0].split("/")):
            f = 0
            for ch in row:
                if ch.isdigit():
                    f += int(ch)
                else:
                    self.sq[(7 - r) * 8 + f] = ch
                    f += 1
        self.white = parts[1] == "w"
        self.castling = "" if parts[2] == "-" else parts[2]
        self.ep: int | None = None if parts[3] == "-" else sq_index(parts[3])
        self.halfmove = int(parts[4]) if len(parts) > 4 else 0
        self.fullmove = int(parts[5]) if len(parts) > 5 else 1

    def copy(self) -> Board:
        b = Board.__new__(Board)
        b.sq, b.white, b.castling, b.ep = (
            dict(self.sq),
            self.white,
            self.castling,
            self.ep,
        )
        b.halfmove, b.fullmove = self.halfmove, self.fullmove
        return b

    def classify(self, uci: str) -> set[str]:
        """Tags of a move in this position: castle_K/castle_Q (white) castle_k/castle_q
        (black), ep, promo_<p>, capture, pawn, double, piece letter."""
        fr, to = sq_index(uci[:2]), sq_index(uci[2:4])
        piece = self.sq.get(fr, "?")
        tags = {piece.upper()}
        if piece.upper() == "K" and abs(fr % 8 - to % 8) == 2:
            side = "K" if to % 8 == 6 else "Q"
            tags.add("castle_" + (side if piece == "K" else side.lower()))
        if piece.upper() == "P":
            tags.add("pawn")
            if fr % 8 != to % 8 and to not in self.sq:
                tags.add("ep")
            if abs(to - fr) == 16:
                tags.add("double")
        if to in self.sq:
            tags.add("capture")
        if len(uci) == 5:
            tags.add("promo_" + uci[4])
        return tags

    def push(self, uci: str) -> None:
        fr, to = sq_index(uci[:2]), sq_index(uci[2:4])
        piece = self.sq.pop(fr)
        capture = to in self.sq
        self.ep = None
        if (
            piece.upper() == "K" and abs(fr % 8 - to % 8) == 2
        ):  # castling (standard chess)
            rank = fr // 8 * 8
            rf, rt = (rank + 7, rank + 5) if to % 8 == 6 else (rank + 0, rank + 3)
            self.sq[rt] = self.sq.pop(rf)
        if piece.upper() == "P":
            if fr % 8 != to % 8 and not capture:  # en passant
                self.sq.pop(to - 8 if self.white else to + 8)
                capture = True
            if abs(to - fr) == 16:
                self.ep = (fr + to) // 2
        if len(uci) == 5:
            piece = uci[4].upper() if self.white else uci[4].lower()
        self.sq[to] = piece
        lost = {4: "KQ", 0: "Q", 7: "K", 60: "kq", 56: "q", 63: "k"}
        for s in (fr, to):
            for c in lost.get(s, ""):
                self.castling = self.castling.replace(c, "")
        self.halfmove = (
            0
            if (capture or piece.upper() == "P" or len(uci) == 5)
            else self.halfmove + 1
        )
        if not self.white:
            self.fullmove += 1
        self.white = not self.white

    def ep_capturable(self) -> bool:
        """lc0 keeps an en-passant square after a double push only if an enemy pawn stands
        beside the pushed pawn."""
        if self.ep is None:
            return False
        pushed = (
            self.ep - 8 if self.white else self.ep + 8
        )  # white to move: black pushed
        pawn = "P" if self.white else "p"
        return any(
            self.sq.get(pushed + d) == pawn and abs((pushed + d) % 8 - pushed % 8) == 1
            for d in (-1, 1)
        )

    def key(self) -> tuple:
        """What lc0 compares for repetitions (pieces, side, castling, live e.p.)."""
        ep = self.ep if self.ep_capturable() else None
        return (tuple(sorted(self.sq.items())), self.white, self.castling, ep)

    def fen(self, ep_mode: str = "capturable") -> str:
        rows = []
        for r in range(7, -1, -1):
            row, empty = "", 0
            for f in range(8):
                p = self.sq.get(r * 8 + f)
                if p is None:
                    empty += 1
                else:
                    row += (str(empty) if empty else "") + p
                    empty = 0
            rows.append(row + (str(empty) if empty else ""))
        ep = "-"
        if self.ep is not None and (ep_mode == "always" or self.ep_capturable()):
            ep = sq_name(self.ep)
        order = "".join(c for c in "KQkq" if c in self.castling) or "-"
        return f"{'/'.join(rows)} {'w' if self.white else 'b'} {order} {ep} {self.halfmove} {self.fullmove}"

    def attacked(self, target: int, by_white: bool) -> bool:
        tf, tr = target % 8, target // 8
        for s, p in self.sq.items():
            if p.isupper() != by_white:
                continue
            t, f, r = p.upper(), s % 8, s // 8
            df, dr = tf - f, tr - r
            if t == "P":
                if abs(df) == 1 and dr == (1 if by_white else -1):
                    return True
            elif t == "N":
                if {abs(df), abs(dr)} == {1, 2}:
                    return True
            elif t == "K":
                if max(abs(df), abs(dr)) == 1:
                    return True
            else:
                straight, diag = (df == 0 or dr == 0), abs(df) == abs(dr)
                if (df, dr) == (0, 0) or not (
                    (straight and t in "RQ") or (diag and t in "BQ")
                ):
                    continue
                sf, sr = (df > 0) - (df < 0), (dr > 0) - (dr < 0)
                x, y = f + sf, r + sr
                while (x, y) != (tf, tr):
                    if y * 8 + x in self.sq:
                        break
                    x, y = x + sf, y + sr
                else:
                    return True
        return False

    def king(self, white: bool) -> int:
        return next(s for s, p in self.sq.items() if p == ("K" if white else "k"))


# ---------------------------------------------------------------------------------------
# lc0
# ---------------------------------------------------------------------------------------


def import_lc0(module_dir: str):
    sys.path.insert(0, module_dir)
    import lczero.backends as lb

    if "blas" not in lb.Backend.available_backends():
        raise SystemExit(
            f"lc0 module in {module_dir} has no blas backend: {lb.Backend.available_backends()}"
        )
    return lb


def load_backends(lb, net_dir: str, formats) -> dict:
    backends = {}
    for fmt in formats:
        w = lb.Weights(os.path.join(net_dir, f"net_{fmt}.pb.gz"))
        be = lb.Backend(weights=w, backend="blas")
        got = be.capabilities().input_format()
        if got != fmt:
            raise SystemExit(f"net_{fmt}.pb.gz: lc0 reports input format {got}")
        backends[fmt] = be
    return backends


def read_input(inp) -> tuple[list[int], list[float]]:
    return [inp.mask(p) for p in range(112)], [inp.val(p) for p in range(112)]


def dense_planes(masks, values) -> np.ndarray:
    """float32 [112, 64]: values[p] where bit sq of masks[p] is set, else 0."""
    m = np.asarray(masks, dtype=np.uint64)
    bits = (m[:, None] >> np.arange(64, dtype=np.uint64)[None, :]) & np.uint64(1)
    v = np.asarray(values, dtype=np.float32)
    return np.ascontiguousarray(
        np.where(bits.astype(bool), v[:, None], np.float32(0)).astype(np.float32)
    )


def digest(masks, values) -> int:
    return int.from_bytes(
        hashlib.blake2b(dense_planes(masks, values).tobytes(), digest_size=8).digest(),
        "little",
    )


def worker_main(args) -> None:
    """Child process for the canonical v2 formats: one JSON request per line
    ``[fmt, fen, moves]``, one JSON answer per line ``[masks, values]``."""
    lb = import_lc0(args.lc0_module_dir)
    backends = load_backends(lb, args.nets, V2_FORMATS)
    for line in sys.stdin:
        fmt, fen, moves = json.loads(line)
        gs = lb.GameState(fen=fen, moves=moves)
        masks, values = read_input(gs.as_input(backends[fmt]))
        sys.stdout.write(json.dumps([masks, values]) + "\n")
        sys.stdout.flush()


class Worker:
    """The v2 encoder in a child process, so that a hang or crash costs one position."""

    def __init__(self, args) -> None:
        self.cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "worker",
            "--lc0-module-dir",
            args.lc0_module_dir,
            "--nets",
            args.out,
        ]
        self.proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def encode(
        self, fmt: int, fen: str, moves: list[str], timeout: float
    ) -> tuple[str, object]:
        """('ok', (masks, values)), ('timeout', seconds) or ('died', returncode)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps([fmt, fen, moves]) + "\n")
        self.proc.stdin.flush()
        start = time.monotonic()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return "timeout", time.monotonic() - start
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            self.proc = None
            return "died", rc
        return "ok", json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()


def v2_walk_never_ends(fen: str, moves: list[str]) -> bool:
    """True where lc0's canonical-v2 history walk (EncodePositionForNN with
    skip_non_repeats, 8 history steps, FEN_ONLY) runs past the first position and never
    stops: it steps to index -1 (which re-reads position 0) only when every position back
    to the start FEN has a non-zero rule-50 count, castling rights never changed, no
    earlier position has an en-passant square, fewer than 7 earlier positions are
    repetitions, and the start FEN is not the standard start position; then position 0 is
    "not a repetition" with rule-50 > 0, so it is skipped (``continue`` with ``--i``)
    forever."""
    b = Board(fen)
    if (
        fen.split()[0] == STARTPOS.split()[0]
        and b.white
        and b.castling == "KQkq"
        and b.ep is None
    ):
        return False  # the FEN_ONLY start-position check stops the walk
    boards = [b.copy()]
    for m in moves:
        b.push(m)
        boards.append(b.copy())
    seen: Counter = Counter()
    reps = []
    for x in boards:  # lc0 counts repetitions within the current rule-50 window only
        if x.halfmove == 0:
            seen.clear()
        k = x.key()
        reps.append(seen[k])
        seen[k] += 1
    last = boards[-1]
    if last.halfmove == 0:
        return False
    written = 1
    for i in range(len(boards) - 2, -1, -1):
        x = boards[i]
        if x.castling != last.castling:
            return False
        if i == 0 and x.ep is not None:  # a FEN's e.p. square stays set (lc0 keeps it)
            return False
        if i > 0 and x.ep_capturable():
            return False
        if reps[i] >= 1:
            written += 1
            if written >= 8:
                return False
        if x.halfmove == 0:
            return False
    return True


# ---------------------------------------------------------------------------------------
# Random games
# ---------------------------------------------------------------------------------------


class Gen:
    def __init__(self, lb, rng: random.Random) -> None:
        self.lb, self.rng = lb, rng

    def legal(self, fen: str, moves: list[str]) -> list[str]:
        return list(self.lb.GameState(fen=fen, moves=moves).moves())

    def pick(self, board: Board, legal: list[str]) -> str:
        rng = self.rng
        tags = {m: board.classify(m) for m in legal}
        castles = [m for m in legal if any(t.startswith("castle") for t in tags[m])]
        eps = [m for m in legal if "ep" in tags[m]]
        promos = [m for m in legal if any(t.startswith("promo") for t in tags[m])]
        doubles = [m for m in legal if "double" in tags[m]]
        live = []  # double pushes that leave an en-passant capture for the opponent
        for m in doubles:
            b = board.copy()
            b.push(m)
            if b.ep_capturable():
                live.append(m)
        if castles and rng.random() < 0.5:
            return rng.choice(castles)
        if eps and rng.random() < 0.8:
            return rng.choice(eps)
        if promos and rng.random() < 0.7:
            return rng.choice(promos)
        if live and rng.random() < 0.6:
            return rng.choice(live)
        if doubles and rng.random() < 0.25:
            return rng.choice(doubles)
        return rng.choice(legal)

    def shuffle(self, fen: str, moves: list[str], board: Board, cycles: int) -> None:
        """Append back-and-forth piece moves (4 plies a cycle, ``cycles`` times, so the
        positions repeat) while lc0 allows them."""
        rng = self.rng
        plan: list[str] = []
        b = board.copy()
        for _ in range(2):
            cands = []
            for m in self.legal(fen, moves + plan):
                t = b.classify(m)
                if (
                    len(m) == 4
                    and t & {"N", "B", "R", "Q", "K"}
                    and not any(x == "capture" or x.startswith("castle") for x in t)
                ):
                    cands.append(m)
            if not cands:
                return
            knights = [m for m in cands if "N" in b.classify(m)]
            m = rng.choice(knights if knights and rng.random() < 0.6 else cands)
            plan.append(m)
            b.push(m)
        cycle = plan + [plan[0][2:] + plan[0][:2], plan[1][2:] + plan[1][:2]]
        for _ in range(cycles):
            for m in cycle:
                if m not in self.legal(fen, moves) or not self.legal(fen, moves + [m]):
                    return
                moves.append(m)
                board.push(m)

    def game(
        self, fen: str, length: int, shuffle_rate: float
    ) -> list[tuple[list[str], list[str]]]:
        """A random game from ``fen``: (moves, lc0's legal moves) of every position that
        has a legal move (the move lists are prefixes of one list)."""
        board = Board(fen)
        moves: list[str] = []
        legal = self.legal(fen, moves)
        out = [(list(moves), legal)] if legal else []
        while len(moves) < length and legal:
            if self.rng.random() < shuffle_rate:
                before = len(moves)
                self.shuffle(fen, moves, board, self.rng.choice((1, 1, 2, 2, 3)))
                if len(moves) > before:
                    legal = self.legal(fen, moves)
                    out.append((list(moves), legal))
                    continue
            order = [self.pick(board, legal)] + self.rng.sample(legal, len(legal))
            for m in order:
                nxt = self.legal(fen, moves + [m])
                if nxt:
                    break
            else:
                break
            moves.append(m)
            board.push(m)
            legal = nxt
            out.append((list(moves), legal))
        return out


def random_endgame(
    rng: random.Random, pawns: bool, symmetric: bool = False
) -> str | None:
    """A random legal-looking position without castling rights: kings anywhere (often on
    the diagonals, so lc0's transpose tie-break is exercised), a few pieces, pawns on
    ranks 2-7 when ``pawns`` (many on the 7th/2nd, for promotions)."""
    b = Board("8/8/8/8/8/8/8/8 w - - 0 1")
    diag = [i * 9 for i in range(8)] + [7 + i * 7 for i in range(8)]
    free = lambda s: s not in b.sq
    if (
        symmetric
    ):  # symmetric under the a1-h8 transpose: kings on the diagonal, pairs mirrored
        wk = rng.choice([i * 9 for i in range(8)])
        b.sq[wk] = "K"
        bk = rng.choice(
            [s for s in (i * 9 for i in range(8)) if abs(s // 8 - wk // 8) > 1]
        )
        b.sq[bk] = "k"
        for _ in range(rng.randint(1, 3)):
            p = rng.choice("QRBNqrbn")
            s = rng.randrange(64)
            t = (s % 8) * 8 + s // 8
            if free(s) and free(t):
                b.sq[s] = p
                b.sq[t] = p
        if (
            rng.random() < 0.3 and b.sq.__len__() < 9
        ):  # then break the symmetry a little
            s = rng.randrange(64)
            if free(s):
                b.sq[s] = rng.choice("QRBNqrbn")
    else:
        wk = rng.choice(diag) if rng.random() < 0.35 else rng.randrange(64)
        b.sq[wk] = "K"
        bk = rng.choice(
            [
                s
                for s in range(64)
                if max(abs(s % 8 - wk % 8), abs(s // 8 - wk // 8)) > 1
            ]
        )
        b.sq[bk] = "k"
        for _ in range(rng.randint(1, 5)):
            s = rng.randrange(64)
            if free(s):
                b.sq[s] = rng.choice("QRRBBNNqrrbbnn")
        if pawns:
            for _ in range(rng.randint(1, 6)):
                color = rng.random() < 0.5
                rank = rng.choice(
                    (6, 6, 5, 4, 3, 2, 1) if color else (1, 1, 2, 3, 4, 5, 6)
                )
                s = rank * 8 + rng.randrange(8)
                if free(s):
                    b.sq[s] = "P" if color else "p"
    b.white = rng.random() < 0.5
    if b.attacked(
        b.king(not b.white), b.white
    ):  # side not to move must not be in check
        return None
    b.halfmove = (
        rng.choice((0, 0, rng.randint(1, 30), rng.randint(40, 95), rng.randint(80, 98)))
        if not pawns or rng.random() < 0.5
        else 0
    )
    b.fullmove = rng.randint(1, 120)
    return b.fen()


class Steps:
    def __init__(self, gen: Gen) -> None:
        self.gen = gen
        self.rng = gen.rng

    def midgame_fen(self) -> str:
        """A FEN from a random game from the start position, at a random ply, sometimes with
        castling rights dropped, a large rule-50 count, or an en-passant square written even
        when no capture is possible."""
        rng = self.rng
        plies = self.gen.game(STARTPOS, rng.randint(1, 50), 0.0)
        moves = rng.choice(plies[1:] if len(plies) > 1 else plies)[0]
        b = Board(STARTPOS)
        for m in moves:
            b.push(m)
        if b.castling and rng.random() < 0.4:
            b.castling = "".join(c for c in b.castling if rng.random() < 0.5)
        if rng.random() < 0.3:
            b.halfmove = rng.randint(40, 95)
        elif rng.random() < 0.3:
            b.halfmove = rng.randint(1, 20)
        return b.fen("always" if rng.random() < 0.5 else "capturable")


def build_positions(lb, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    gen = Gen(lb, rng)
    steps = Steps(gen)
    seen: set = set()
    out: list[tuple[str, list[str]]] = []

    def add(fen: str, moves: list[str]) -> None:
        k = (fen, tuple(moves))
        if k not in seen:
            seen.add(k)
            out.append((fen, list(moves)))

    def take(fen: str, plies: list, extra: int) -> None:
        """Keep the game's last position, ``extra`` random ones and a few with castling,
        en passant or a promotion among the legal moves or a live e.p. square."""
        if not plies:
            return
        add(fen, plies[-1][0])
        for ms, _ in rng.sample(plies, min(extra, len(plies))):
            add(fen, ms)
        special = []
        for ms, legal in plies:
            b = Board(fen)
            for m in ms:
                b.push(m)
            if (
                b.ep_capturable()
                or any(len(m) == 5 for m in legal)
                or any(
                    {"ep", "castle_K", "castle_Q", "castle_k", "castle_q"}
                    & b.classify(m)
                    for m in legal
                )
            ):
                special.append(ms)
        for ms in rng.sample(special, min(2, len(special))):
            add(fen, ms)

    kinds = [
        "start",
        "perft",
        "midfen",
        "pawnless",
        "symmetric",
        "pawns",
        "shuffle_start",
        "shuffle_end",
    ]
    weights = [14, 14, 22, 12, 4, 14, 10, 10]
    while len(out) < n:
        kind = rng.choices(kinds, weights)[0]
        if kind == "start":
            take(STARTPOS, gen.game(STARTPOS, rng.randint(0, 140), 0.05), 2)
        elif kind == "perft":
            fen = rng.choice(PERFT_FENS)
            take(
                fen,
                gen.game(
                    fen, rng.choice((0, rng.randint(1, 12), rng.randint(1, 60))), 0.08
                ),
                2,
            )
        elif kind == "midfen":
            fen = steps.midgame_fen()
            take(
                fen,
                gen.game(
                    fen, rng.choice((0, 0, rng.randint(1, 6), rng.randint(1, 40))), 0.1
                ),
                1,
            )
        elif kind in ("pawnless", "symmetric", "pawns"):
            fen = random_endgame(
                rng, pawns=kind == "pawns", symmetric=kind == "symmetric"
            )
            if fen is None:
                continue
            take(
                fen,
                gen.game(
                    fen, rng.choice((0, 0, rng.randint(1, 4), rng.randint(1, 30))), 0.15
                ),
                1,
            )
        elif kind == "shuffle_start":
            fen = rng.choice((STARTPOS, steps.midgame_fen()))
            take(fen, gen.game(fen, rng.randint(4, 60), 0.3), 2)
        else:
            fen = random_endgame(rng, pawns=rng.random() < 0.5)
            if fen is None:
                continue
            take(fen, gen.game(fen, rng.randint(8, 50), 0.4), 2)
    out = out[:n]
    rng.shuffle(out)
    records = []
    for fen, moves in out:
        gs = lb.GameState(fen=fen, moves=moves)
        legal = list(gs.moves())
        assert legal, (fen, moves)
        records.append(
            {
                "fen": fen,
                "moves": moves,
                "legal": legal,
                "indices": list(gs.policy_indices()),
            }
        )
    return records


def coverage(records: list[dict]) -> Counter:
    c: Counter = Counter()
    for r in records:
        b = Board(r["fen"])
        c["positions"] += 1
        c["fen is start position"] += r["fen"] == STARTPOS
        c["fen is a perft position"] += r["fen"] in PERFT_FENS
        c["fen black to move"] += not b.white
        c["fen with en-passant square"] += b.ep is not None
        c["fen halfmove > 0"] += b.halfmove > 0
        c["no moves after fen"] += not r["moves"]
        c["moves > 8 plies"] += len(r["moves"]) > 8
        c["moves > 40 plies"] += len(r["moves"]) > 40
        tags: set = set()
        seen: Counter = Counter()
        maxrep = 0
        rep_window = []
        for m in r["moves"]:
            tags |= b.classify(m)
            b.push(m)
            if b.halfmove == 0:
                seen.clear()
            seen[b.key()] += 1
            rep_window.append(seen[b.key()] - 1)
        maxrep = max(rep_window[-8:], default=0)
        for t in (
            "castle_K",
            "castle_Q",
            "castle_k",
            "castle_q",
            "ep",
            "promo_q",
            "promo_n",
            "promo_b",
            "promo_r",
        ):
            c[f"history has {t}"] += t in tags
        c["history has capture-promotion"] += any(
            len(m) == 5 and m[2] != m[0] for m in r["moves"]
        )
        c["last move is an underpromotion"] += (
            bool(r["moves"]) and len(r["moves"][-1]) == 5 and r["moves"][-1][4] != "q"
        )
        c["black to move"] += not b.white
        c["e.p. square live in position"] += b.ep_capturable()
        c["e.p. capture among legal moves"] += any(
            "ep" in b.classify(m) for m in r["legal"]
        )
        c["promotion among legal moves"] += any(len(m) == 5 for m in r["legal"])
        c["castling among legal moves"] += any(
            any(t.startswith("castle") for t in b.classify(m)) for m in r["legal"]
        )
        c["repetition (>=1) in last 8 positions"] += maxrep >= 1
        c["repetition (>=2) in last 8 positions"] += maxrep >= 2
        c["rule50 > 0"] += b.halfmove > 0
        c["rule50 > 50"] += b.halfmove > 50
        c["rule50 >= 90"] += b.halfmove >= 90
        c["no castling rights"] += not b.castling
        c["castling rights one wing only (some side)"] += any(
            (x in b.castling) != (y in b.castling) for x, y in (("K", "Q"), ("k", "q"))
        )
        pawnless = not any(p in "Pp" for p in b.sq.values())
        if pawnless and not b.castling:
            c["pawnless, no castling"] += 1
            k = b.king(b.white)
            f, rk = k % 8, k // 8
            c[
                f"pawnless, no castling: our king in {'abcd' if f < 4 else 'efgh'}/{'1234' if rk < 4 else '5678'}"
            ] += 1
            if f == rk or f + rk == 7:
                c["pawnless, no castling: our king on a long diagonal"] += 1
        if not pawnless and not b.castling:
            c["pawns, no castling"] += 1
    return c


def generate(args) -> None:
    lb = import_lc0(args.lc0_module_dir)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    records = build_positions(lb, args.positions, args.seed)
    print(f"{len(records)} positions in {time.time() - t0:.0f} s", flush=True)
    with open(
        os.path.join(args.out, "positions.json.gz"), "wb"
    ) as f:  # mtime 0: reproducible bytes
        f.write(
            gzip.compress(
                json.dumps(records, separators=(",", ":")).encode(),
                compresslevel=9,
                mtime=0,
            )
        )
    cov = coverage(records)
    for k, v in cov.items():
        print(f"  {k}: {v}")

    backends = load_backends(lb, args.out, FORMATS)
    worker = Worker(args)
    n, full = len(records), min(args.full, len(records))
    v2_log: Counter = Counter()
    v2_checked_hang = 0
    for fmt in FORMATS:
        t0 = time.time()
        digests = np.zeros(n, np.uint64)
        ok = np.ones(n, bool)
        masks = np.zeros((full, 112), np.uint64)
        values = np.zeros((full, 112), np.float32)
        for i, r in enumerate(records):
            if fmt in V2_FORMATS:
                predicted_hang = v2_walk_never_ends(r["fen"], r["moves"])
                if predicted_hang and v2_checked_hang >= args.check_hangs:
                    ok[i] = False
                    v2_log[f"fmt {fmt}: skipped (predicted endless walk)"] += 1
                    continue
                status, res = worker.encode(
                    fmt,
                    r["fen"],
                    r["moves"],
                    args.timeout if not predicted_hang else args.hang_timeout,
                )
                v2_log[
                    f"fmt {fmt}: predicted {'endless' if predicted_hang else 'fine'}, lc0 {status}"
                ] += 1
                if predicted_hang:
                    v2_checked_hang += 1
                    print(
                        f"  fmt {fmt} predicted endless walk: {r['fen']} {r['moves']} -> {status} {res if status != 'ok' else ''}",
                        flush=True,
                    )
                if status != "ok":
                    ok[i] = False
                    if not predicted_hang:
                        print(
                            f"  UNEXPECTED fmt {fmt} {status} {res}: {r['fen']} {r['moves']}",
                            flush=True,
                        )
                    continue
                mk, vl = res
            else:
                inp = lb.GameState(fen=r["fen"], moves=r["moves"]).as_input(
                    backends[fmt]
                )
                mk, vl = read_input(inp)
            digests[i] = digest(mk, vl)
            if i < full:
                masks[i] = np.asarray(mk, np.uint64)
                values[i] = np.asarray(vl, np.float32)
        np.savez_compressed(
            os.path.join(args.out, f"planes_{fmt}.npz"),
            digest=digests,
            ok=ok,
            masks=masks,
            values=values,
        )
        print(
            f"format {fmt}: {int(ok.sum())}/{n} encoded, {len(set(digests[ok].tolist()))} distinct digests, {time.time() - t0:.0f} s",
            flush=True,
        )

        idx = np.flatnonzero(ok)[: args.evals]
        outs = []
        for s in range(0, len(idx), 32):
            inputs = (
                [
                    lb.GameState(
                        fen=records[i]["fen"], moves=records[i]["moves"]
                    ).as_input(backends[fmt])
                    for i in idx[s : s + 32]
                ]
                if fmt not in V2_FORMATS
                else None
            )
            if inputs is None:  # v2: rebuild lc0's Input from the worker's planes
                inputs = []
                for i in idx[s : s + 32]:
                    status, (mk, vl) = worker.encode(
                        fmt, records[i]["fen"], records[i]["moves"], args.timeout
                    )
                    inp = lb.Input()
                    for p in range(112):
                        inp.set_mask(p, mk[p])
                        inp.set_val(p, vl[p])
                    inputs.append(inp)
            outs += backends[fmt].evaluate(*inputs)
        np.savez_compressed(
            os.path.join(args.out, f"eval_{fmt}.npz"),
            index=idx.astype(np.int64),
            policy=np.array([o.p_raw(*range(1858)) for o in outs], np.float32),
            q=np.array([o.q() for o in outs], np.float32),
            d=np.array([o.d() for o in outs], np.float32),
            m=np.array([o.m() for o in outs], np.float32),
        )
    worker.close()
    for k, v in sorted(v2_log.items()):
        print(f"  {k}: {v}")


def write_nets(args) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.join(repo, "tests"), repo]
    from lc0_writer import write_net

    from fusedenc.lc0.schema import InputFormat

    os.makedirs(args.out, exist_ok=True)
    for fmt, spec in NET_SPECS.items():
        path = os.path.join(args.out, f"net_{fmt}.pb.gz")
        write_net(
            path, compresslevel=9, input_format=InputFormat(fmt), **_COMMON, **spec
        )
        print(f"{path}: {os.path.getsize(path)} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "nets", help="write the seven synthetic nets (needs torch + fusedenc)"
    )
    p.add_argument("--out", required=True)
    p = sub.add_parser("generate", help="positions, planes and evaluations from lc0")
    p.add_argument(
        "--lc0-module-dir", required=True, help="folder holding lczero/backends*.so"
    )
    p.add_argument(
        "--out", required=True, help="fixture folder (holds net_<fmt>.pb.gz)"
    )
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--positions", type=int, default=12000)
    p.add_argument(
        "--full", type=int, default=1000, help="positions with full planes stored"
    )
    p.add_argument(
        "--evals", type=int, default=48, help="positions evaluated per format"
    )
    p.add_argument(
        "--timeout", type=float, default=20.0, help="seconds per v2 encoding"
    )
    p.add_argument(
        "--check-hangs",
        type=int,
        default=4,
        help="predicted-endless v2 walks actually tried",
    )
    p.add_argument("--hang-timeout", type=float, default=60.0)
    p = sub.add_parser("worker", help=argparse.SUPPRESS)
    p.add_argument("--lc0-module-dir", required=True)
    p.add_argument("--nets", required=True)
    args = ap.parse_args()
    {"nets": write_nets, "generate": generate, "worker": worker_main}[args.cmd](args)


if __name__ == "__main__":
    main()
