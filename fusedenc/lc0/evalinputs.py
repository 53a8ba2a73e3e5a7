"""What ``python -m fusedenc.lc0 eval`` reads, shared by its single-machine run and its Ray run
(``fusedenc.distributed``): the arguments, and the positions of an EPD or PGN file with their
ids, every position checked before a net is loaded; ``InputError`` for what it cannot take."""

from __future__ import annotations

import argparse
from typing import Any

from ..common.dtypes import CLI_NAMES as DTYPES

PROG = "python -m fusedenc.lc0"

__all__ = ["InputError", "check_positions", "epd_items", "eval_parser", "pgn_items"]


class InputError(Exception):
    """Bad input found before any GPU work: the CLI prints it on one line and exits 2."""


def eval_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=f"{PROG} eval",
        description="Evaluate chess positions with an lc0 network: top moves, WDL, Q, moves left.",
    )
    ap.add_argument("net", help="an lc0 network file (.pb.gz)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--fen", help="one position as a FEN ('startpos': the initial position)")
    src.add_argument("--epd", metavar="FILE", help="every position of an EPD file (JSON lines out)")
    src.add_argument("--pgn", metavar="FILE", help="every position of every game of a PGN file (JSON lines out)")
    src.add_argument("--parquet", metavar="DIR", help="with --ray: a Parquet directory of positions "
                     "(--fen-column, --moves-column), evaluated into the Parquet directory --out")
    src.add_argument("--frames", nargs="+", metavar="FILE", help="with --ray: lc0 training data (.gz, plain or "
                     ".tar files of V6/V7 frames) relabelled by the net into the Parquet directory --out")
    ap.add_argument("--moves", nargs="*", default=[], metavar="UCI",
                    help="with --fen: moves played since it, in UCI (e2e4 e7e5 ...): the history the net sees")
    ap.add_argument("--top", type=int, default=5, help="how many moves to show / write (0: all legal moves; default 5)")
    ap.add_argument("--device", default=None,
                    help="cuda, cuda:N, a comma list of GPUs for --epd/--pgn (cuda:0,cuda:1), or cpu "
                         "(default: cuda if torch sees a GPU)")  # fmt: skip
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp16 on a GPU, fp32 on the CPU")
    ap.add_argument("--temperature", type=float, default=1.0, help="policy softmax temperature (default 1)")
    ap.add_argument("--out", metavar="FILE", default=None,
                    help="--epd/--pgn: write the JSON lines here (default stdout); with --ray also a directory "
                         "(no suffix): Parquet written by the cluster")
    ap.add_argument("--fen-column", default="fen", help="--parquet: the column of FENs (default fen)")
    ap.add_argument("--moves-column", default=None,
                    help="--parquet: a column of the UCI moves played since each FEN (a list or a space-separated "
                         "string; default none)")
    ap.add_argument("--json", action="store_true", help="--fen: print one JSON object instead of text")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="--epd/--pgn: positions per batch (default 1024 on a GPU, 256 on the CPU)")
    ap.add_argument("--no-progress", action="store_true", help="--epd/--pgn: no progress display on stderr")
    return ap


def epd_items(path: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """(positions, per-position ids) of an EPD file, every FEN checked."""
    from .gamefiles import read_epd

    try:
        records = list(read_epd(path))
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    fens = [r.fen for r in records]
    check_positions(fens, lambda i: f"{path}: line {records[i].line}")
    ids = []
    for i, r in enumerate(records):
        rec: dict[str, Any] = {"index": i, "line": r.line}
        if r.id is not None:
            rec["id"] = r.id
        if "bm" in r.ops:
            rec["bm"] = r.ops["bm"]
        rec["fen"] = r.fen
        ids.append(rec)
    return fens, ids


def check_positions(positions: list[Any], where, chunk: int = 4096) -> None:
    """``prepare`` every position (in chunks); InputError naming the first bad one."""
    from .positions import prepare

    for start in range(0, len(positions), chunk):
        part = positions[start : start + chunk]
        try:
            prepare(part)
        except ValueError:
            for i, p in enumerate(part):
                try:
                    prepare([p])
                except ValueError as exc:
                    msg = str(exc).removeprefix("position 0 ")
                    raise InputError(f"{where(start + i)}: {msg}") from None
            raise


def pgn_items(path: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """(positions, per-position ids) of every game of a PGN file: the position before each
    move, and the one after the last move where the game is not over."""
    from .gamefiles import read_pgn

    positions, ids = [], []
    try:
        for game in read_pgn(path):
            for ply, fen in enumerate(game.fens):
                last = ply == len(game.moves)
                if last and game.ended:
                    continue  # mate or stalemate: nothing to evaluate
                positions.append(game.history(ply))
                ids.append({"index": len(ids), "game": game.number, "ply": ply, "fen": fen,
                            "played": None if last else game.moves[ply]})  # fmt: skip
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return positions, ids
