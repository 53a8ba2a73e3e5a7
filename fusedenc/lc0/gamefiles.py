"""Positions from the two text formats chess tools exchange: EPD and PGN.

An engine or an analysis script gets its positions from files: test suites are EPD (one
position a line, with operations such as ``id`` and ``bm``), games are PGN (tags, then the
moves in SAN).  This module turns both into what the rest of ``fusedenc.lc0`` takes:

* ``read_epd(source)`` yields ``EpdRecord``s: the position as a FEN (the four board fields,
  plus the half-move clock and move number from ``hmvc``/``fmvn`` or a FEN's own counters,
  else ``0 1``) and its operations, with the line number for messages;
* ``read_pgn(source)`` yields ``PgnGame``s: the tags, the start position (``startpos``,
  or the ``[FEN]`` tag's) and the moves in UCI, converted from SAN by the legal moves of the
  ``Position`` API, so that every move of every game is checked on the way in.  Comments
  (``{...}`` and ``;`` to the end of the line), variations (``(...)``, nested), NAGs
  (``$1``), annotation marks (``!``, ``?!``...), move numbers (``12.``, ``12...``) and results
  are skipped;
* ``san_to_uci(position, san)`` is the conversion on its own.

A malformed line, an illegal or ambiguous move raises ``ValueError`` naming the file, the
line or game, and the move.  Only text parsing lives here: the chess rules are
``positions.Position``'s.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Union

import numpy as np

from . import board as B
from .board import Boards
from .positions import Position, board_fens, parse_fens

__all__ = ["EpdRecord", "PgnGame", "read_epd", "parse_epd_line", "read_pgn", "san_to_uci", "START_FEN"]

START_FEN = "rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1"

#: A file path (str or path-like), or the lines themselves: an open text file, an
#: ``io.StringIO(text)`` or any iterable of lines.
Source = Union[str, "os.PathLike[str]", io.TextIOBase, Iterable[str]]


def _lines(source: Source) -> tuple[str, Iterator[str]]:
    """(a name for messages, the source's lines)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by the generator

        def gen() -> Iterator[str]:
            with f:
                yield from f

        return path, gen()
    return getattr(source, "name", "<text>"), iter(source)


# ------------------------------------------------------------------ EPD ----


@dataclass
class EpdRecord:
    """One EPD line: ``fen`` (six fields, ready for ``Position.from_fen``), ``ops`` (opcode ->
    list of operand strings, quotes removed; an opcode without operands maps to ``[]``) and
    ``line``, the 1-based line number in the file."""

    fen: str
    ops: dict[str, list[str]]
    line: int

    @property
    def id(self) -> Optional[str]:
        ids = self.ops.get("id")
        return ids[0] if ids else None

    def best_moves_uci(self) -> list[str]:
        """The ``bm`` operation's moves (SAN) in UCI; ValueError naming the line if one is not legal."""
        pos = Position.from_fen(self.fen)
        out = []
        for san in self.ops.get("bm", []):
            try:
                out.append(san_to_uci(pos, san))
            except ValueError as exc:
                raise ValueError(f"EPD line {self.line}: bm {san!r}: {exc}") from None
        return out


_BOARD_CHARS = set("pnbrqkPNBRQK12345678/")


def _split_ops(text: str, where: str) -> dict[str, list[str]]:
    """``'bm Nf3 Ne5; id "a; b";'`` -> ``{"bm": ["Nf3", "Ne5"], "id": ["a; b"]}``."""
    ops: dict[str, list[str]] = {}
    tokens: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == ";":
            if tokens:
                ops[tokens[0]] = tokens[1:]
            tokens = []
            i += 1
        elif c == '"':
            j = text.find('"', i + 1)
            if j < 0:
                raise ValueError(f"{where}: unterminated string in the operations: {text[i:]!r}")
            tokens.append(text[i + 1 : j])
            i = j + 1
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in ';"':
                j += 1
            tokens.append(text[i:j])
            i = j
    if tokens:  # the last operation without its ';' (common in hand-written files)
        ops[tokens[0]] = tokens[1:]
    return ops


def parse_epd_line(text: str, line: int = 1, name: str = "<text>") -> Optional[EpdRecord]:
    """One EPD line -> an ``EpdRecord`` (None for a blank or ``#`` comment line).

    The four board fields are checked for form only here (``prepare`` checks the position);
    a line that carries a FEN's two counters after them is read as a FEN with operations."""
    s = text.strip()
    if not s or s.startswith("#"):
        return None
    where = f"{name}: line {line}"
    parts = s.split(None, 4)
    if len(parts) < 4:
        raise ValueError(f"{where}: an EPD line needs 4 FEN fields (board, side, castling, en passant), got {s!r}")
    board, side, castling, ep = parts[:4]
    if not set(board) <= _BOARD_CHARS or board.count("/") != 7:
        raise ValueError(f"{where}: {board!r} is not a FEN board field")
    if side not in ("w", "b"):
        raise ValueError(f"{where}: side to move must be 'w' or 'b', got {side!r}")
    rest = parts[4] if len(parts) == 5 else ""
    counters = None
    m = re.match(r"(\d+)\s+(\d+)(?:\s+|$)(.*)$", rest, re.S)
    if m:  # a full FEN followed by operations
        counters, rest = (m.group(1), m.group(2)), m.group(3)
    ops = _split_ops(rest, where)
    if counters is None:
        counters = (_counter(ops, "hmvc", "0", where), _counter(ops, "fmvn", "1", where))
    return EpdRecord(fen=f"{board} {side} {castling} {ep} {counters[0]} {counters[1]}", ops=ops, line=line)


def _counter(ops: dict[str, list[str]], op: str, default: str, where: str) -> str:
    values = ops.get(op)
    if not values:
        return default
    if not values[0].isdigit():
        raise ValueError(f"{where}: {op} must be a non-negative integer, got {values[0]!r}")
    return values[0]


def read_epd(source: Source) -> Iterator[EpdRecord]:
    """The records of an EPD file (a path, an open file or lines), blank and ``#`` lines
    skipped.  ``OSError`` if the file cannot be opened; ``ValueError`` naming the line for a
    malformed one."""
    name, lines = _lines(source)
    for i, text in enumerate(lines, 1):
        rec = parse_epd_line(text, i, name)
        if rec is not None:
            yield rec


# ------------------------------------------------------------------ SAN ----

_SAN = re.compile(
    r"^(?:(?P<castle>[O0]-[O0](?:-[O0])?)"
    r"|(?P<piece>[NBRQK])(?P<ff>[a-h])?(?P<fr>[1-8])?x?(?P<to>[a-h][1-8])"
    r"|(?P<pfile>[a-h])(?:x(?P<pto>[a-h][1-8])|(?P<prank>[1-8]))(?:=?(?P<promo>[NBRQnbrq]))?)$"
)
_MARKS = re.compile(r"[+#!?]+$")
#: Annotation symbols written as a token of their own ("!", "+-", "=", "+/-"): not moves.
_ANNOTATION = re.compile(r"[!?+#=/\-~\u221e\u00b1\u2213\u2a72\u2a71]+")


def san_to_uci(position: Position, san: str) -> str:
    """The legal move of ``position`` that ``san`` names, in UCI (castling ``e1g1``).

    Reads standard SAN and the usual variants: castling with ``O`` or ``0``, promotion with
    or without ``=`` (``e8=Q``, ``e8Q``), check and mate marks and annotations after the move
    (``+ # ! ? !? ?!``), a redundant or full-square disambiguation (``Ng1f3``).  The capture
    mark is not required to match a capture (files written by hand omit it).  ValueError for
    a token that is not SAN, a move that is not legal, or one that fits several legal moves.
    """
    legal = position.legal_moves()
    return _resolve_san(san, legal, lambda uci: (position.piece_at(uci[:2]) or "").upper(), position.turn)


def _resolve_san(san: str, legal: list[str], piece_of, turn: str) -> str:
    """``san_to_uci`` given the legal moves (UCI), ``piece_of(uci)`` (the moving piece's
    upper-case letter) and the side to move ("w" or "b")."""
    text = _MARKS.sub("", san.strip())
    m = _SAN.match(text)
    if m is None:
        raise ValueError(f"{san!r} is not a move in SAN")
    if m.group("castle"):
        long = m.group("castle").count("-") == 2
        rank = "1" if turn == "w" else "8"
        uci = f"e{rank}{'c' if long else 'g'}{rank}"
        if uci not in legal or piece_of(uci) != "K":
            raise ValueError(f"{san!r}: castling {'queenside' if long else 'kingside'} is not legal here")
        return uci
    if m.group("piece"):
        piece, to = m.group("piece"), m.group("to")
        ff, fr, promo = m.group("ff"), m.group("fr"), None
    else:
        piece, ff, fr = "P", m.group("pfile"), None
        to = m.group("pto") or f"{m.group('pfile')}{m.group('prank')}"
        promo = (m.group("promo") or "").lower() or None
    found = []
    for uci in legal:
        if uci[2:4] != to or (ff and uci[0] != ff) or (fr and uci[1] != fr):
            continue
        if (promo or None) != (uci[4] if len(uci) == 5 else None):
            continue
        if piece_of(uci) != piece:
            continue
        found.append(uci)
    if len(found) == 1:
        return found[0]
    if not found:
        need = " (a promotion piece is missing)" if piece == "P" and not promo and to[1] in "18" else ""
        raise ValueError(f"{san!r} is not a legal move here{need}")
    raise ValueError(f"{san!r} is ambiguous: it fits {', '.join(sorted(found))}")


# ------------------------------------------------------------------ PGN ----


@dataclass
class PgnGame:
    """One game of a PGN file: ``number`` (1-based, in file order), ``headers`` (tag name ->
    value), ``start_fen`` (``"startpos"`` or the ``[FEN]`` tag's FEN), ``moves`` (UCI),
    ``sans`` (the moves as written, marks removed), ``line`` (where the game starts), ``fens``
    (the position before each move and the one after the last, ``len(moves) + 1`` of them),
    ``ended`` (no legal move is left after the last move: mate or stalemate)."""

    number: int
    headers: dict[str, str]
    start_fen: str
    moves: list[str]
    sans: list[str]
    line: int
    fens: list[str] = field(default_factory=list, repr=False)
    ended: bool = False
    _positions: Optional[list[Position]] = field(default=None, repr=False, compare=False)

    @property
    def result(self) -> Optional[str]:
        return self.headers.get("Result")

    def history(self, ply: int) -> tuple[str, list[str]]:
        """The position before move ``ply`` (0-based; ``len(moves)``: after the last) as the
        ``(start_fen, moves)`` pair ``prepare`` takes."""
        return self.start_fen, self.moves[:ply]

    @property
    def positions(self) -> list[Position]:
        """The ``Position`` before each move and the one after the last (made when first
        asked: each holds its history; ``history(ply)`` is the cheap form)."""
        if self._positions is None:
            pos = Position.from_fen(self.start_fen)
            self._positions = [pos]
            for uci in self.moves:
                pos = pos.push(uci)
                self._positions.append(pos)
        return self._positions


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<tag>\[\s*(?P<tname>[A-Za-z0-9_]+)\s+"(?P<tvalue>(?:[^"\\]|\\.)*)"\s*\])
      | (?P<comment>\{[^}]*\}?)
      | (?P<line_comment>;[^\n]*)
      | (?P<open>\()
      | (?P<close>\))
      | (?P<nag>\$\d+)
      | (?P<result>1-0|0-1|1/2-1/2|½-½|\*)(?=\s|$|[)\[{;])
      | (?P<number>\d+\s*\.+)
      | (?P<dots>\.+)
      | (?P<word>[^\s{}()\[\];$]+)
    )""",
    re.X,
)


class _PgnParser:
    """Collects games (tags and move tokens) and converts their SAN in batches: all games of
    a batch advance one ply at a time, each ply one vectorized legal-move generation and one
    vectorized move application (``board``), the SAN matched per game against its moves."""

    BATCH = 256

    def __init__(self, name: str) -> None:
        self.name = name
        self.games = 0
        self.pending: list[tuple[int, dict[str, str], list[tuple[str, int]], int]] = []

    def add(self, headers: dict[str, str], tokens: list[tuple[str, int]], line: int) -> list[PgnGame]:
        """Queue a game; the converted games once a batch is full."""
        self.games += 1
        self.pending.append((self.games, headers, tokens, line))
        return self.flush() if len(self.pending) >= self.BATCH else []

    def flush(self) -> list[PgnGame]:
        """Convert the queued games; the ones before the first bad game, then its error."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        games: list[Optional[PgnGame]] = []
        errors: dict[int, ValueError] = {}
        starts = []
        for k, (number, headers, tokens, line) in enumerate(pending):
            where = f"{self.name}: game {number} (line {line})"
            fen = headers.get("FEN")
            if fen is not None and headers.get("SetUp", "1") not in ("1",):
                fen = None  # [SetUp "0"]: the FEN tag does not apply
            try:
                starts.append(parse_fens([fen or "startpos"]))
            except ValueError as exc:
                errors[k] = ValueError(f"{where}: bad [FEN] tag {fen!r}: {str(exc).split(': ', 1)[-1]}")
                starts.append(parse_fens(["startpos"]))
            games.append(PgnGame(number=number, headers=headers, start_fen=fen or "startpos", moves=[], sans=[],
                                 line=line))  # fmt: skip
        boards = Boards.concat(starts)
        states: list[list[Boards]] = [[] for _ in pending]
        active = [k for k in range(len(pending)) if k not in errors]
        current = boards.take(active)
        ply = 0
        while active:
            rows, codes = B.legal_moves(current)
            counts = np.bincount(rows, minlength=len(active))
            offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
            texts = [B.UCI_TEXT[c] for c in codes.tolist()]
            us = current.turn.astype(np.int64)[rows]
            mine = current.bb.reshape(-1, 2, 6)[rows, us] & B.SQUARE_BB[codes & 63][:, None]
            letters = [B.PIECE_LETTERS[p] for p in np.argmax(mine != 0, axis=1).tolist()]
            turns = current.turn.tolist()
            chosen, keep = [], []
            for i, k in enumerate(active):
                tokens = pending[k][2]
                if ply >= len(tokens):
                    games[k].ended = offsets[i + 1] == offsets[i]
                    continue
                tok, tok_line = tokens[ply]
                legal = texts[offsets[i]: offsets[i + 1]]
                piece = dict(zip(legal, letters[offsets[i]: offsets[i + 1]]))
                side = "white" if turns[i] == B.WHITE else "black"
                try:
                    if tok in ("--", "Z0"):
                        raise ValueError(f"null move {tok!r} is not supported")
                    uci = _resolve_san(tok, legal, piece.get, "wb"[turns[i]])
                except ValueError as exc:
                    where = f"{self.name}: game {pending[k][0]} (line {pending[k][3]})"
                    text = str(exc)
                    prefix = f"{where}, line {tok_line}: "
                    move = f"move {len(games[k].moves) // 2 + 1} ({side}) {tok!r}: "
                    errors[k] = ValueError(prefix + (text if text.startswith("null move") else move + text))
                    continue
                games[k].moves.append(uci)
                games[k].sans.append(_MARKS.sub("", tok))
                chosen.append(B.UCI_CODE[uci])
                keep.append(i)
            for i, k in enumerate(active):
                states[k].append(current.take([i]))
            if not keep:
                break
            current = B.apply_moves(current.take(keep), np.array(chosen, np.int64))
            active = [active[i] for i in keep]
            ply += 1
        out = []
        for k, game in enumerate(games):
            if k in errors:
                self.pending = []
                return out + [_Raise(errors[k])]
            game.fens = board_fens(Boards.concat(states[k])) if states[k] else []
            out.append(game)
        return out


class _Raise:
    """An error kept in the order of the games: raised when the reader reaches it."""

    def __init__(self, error: ValueError) -> None:
        self.error = error


def read_pgn(source: Source) -> Iterator[PgnGame]:
    """The games of a PGN file (a path, an open file or lines), in file order, each move
    converted to UCI and checked.  ``OSError`` if the file cannot be opened; ``ValueError``
    naming the game, its line and the move for a move that is not legal or is ambiguous.

    A game ends at its result token (``1-0``, ``0-1``, ``1/2-1/2``, ``*``), at the next tag
    section, or at the end of the file.  Lines starting with ``%`` are escapes (skipped)."""
    for item in _read_pgn_batched(source):
        if isinstance(item, _Raise):
            raise item.error
        yield item


def _read_pgn_batched(source: Source) -> Iterator[Any]:
    name, lines = _lines(source)
    parser = _PgnParser(name)
    headers: dict[str, str] = {}
    tokens: list[tuple[str, int]] = []
    start_line: Optional[int] = None
    depth = 0  # variation nesting
    in_comment = False
    in_moves = False

    def finish() -> list[Any]:
        nonlocal headers, tokens, start_line, in_moves
        if start_line is None:
            return []
        done = parser.add(headers, tokens, start_line)
        headers, tokens, start_line, in_moves = {}, [], None, False
        return done

    for lineno, text in enumerate(lines, 1):
        if text.startswith("%"):
            continue
        pos = 0
        if in_comment:  # a {comment} that spans lines
            end = text.find("}")
            if end < 0:
                continue
            in_comment, pos = False, end + 1
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                break  # only whitespace left
            pos = m.end()
            if m.group("tag") is not None:
                if depth:
                    continue
                if in_moves:  # a tag after movetext without a result: a new game
                    yield from finish()
                if start_line is None:
                    start_line = lineno
                headers[m.group("tname")] = re.sub(r"\\(.)", r"\1", m.group("tvalue"))
            elif m.group("comment") is not None:
                in_comment = not m.group("comment").endswith("}")
            elif m.group("open") is not None:
                depth += 1
            elif m.group("close") is not None:
                if depth == 0:
                    raise ValueError(f"{name}: line {lineno}: ')' without an open variation")
                depth -= 1
            elif m.group("result") is not None:
                if depth:
                    continue
                if start_line is None:
                    start_line = lineno
                headers.setdefault("Result", m.group("result"))
                yield from finish()
            elif m.group("word") is not None:
                word = m.group("word")
                if depth or (word != "--" and _ANNOTATION.fullmatch(word)):
                    continue  # a move of a variation, or an evaluation symbol standing alone
                if start_line is None:
                    start_line = lineno
                in_moves = True
                tokens.append((word, lineno))
            # NAGs, ';' comments, move numbers and dots: skipped
    if depth:
        raise ValueError(f"{name}: the file ends inside a variation ('(' without ')')")
    yield from finish()
    yield from parser.flush()
