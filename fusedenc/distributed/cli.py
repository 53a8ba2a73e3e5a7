"""``--ray [ADDRESS]`` of ``python -m fusedenc embed`` and ``python -m fusedenc.lc0 eval``: the
same jobs on a Ray cluster.

``--ray`` alone joins the cluster this machine belongs to (Ray's ``address="auto"``),
``--ray local`` starts one on this machine, ``--ray HOST:PORT`` joins that head.  INPUT may
also be a Parquet directory (read by the cluster, ``--field`` its text column); OUTPUT may be
a directory (written by the cluster as Parquet: the input's columns, ``embedding`` and
``error``) besides a ``.npy`` or ``.parquet`` file (gathered here, in input order).  A file
INPUT is read and checked here first, as without ``--ray``."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..common.paths import output_file_problem
from ..embed import cli as embed_cli
from ..embed.texts import InputError, read_corpus
from . import BLOCK_ROWS, EMBED_BLOCK_ROWS, embed, ray_or_exit

PROG = embed_cli.PROG


def _connect(ray: Any, address: str) -> None:
    if address == "local":  # a new cluster on this machine, even where another one runs
        ray.init(address="local", include_dashboard=False)
    else:
        ray.init(address=address)


def embed_main(argv: list[str]) -> int:
    ap = embed_cli.parser()
    ap.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                    help="run on a Ray cluster: alone, the one this machine is in; 'local'; or a head's HOST:PORT")
    ap.add_argument("--block-rows", type=int, default=EMBED_BLOCK_ROWS,
                    help=f"texts an actor takes at once (default {EMBED_BLOCK_ROWS})")
    args = ap.parse_args(argv)
    src, out = Path(args.input), Path(args.output)
    try:
        try:
            ray = ray_or_exit()
        except ImportError as exc:
            raise InputError(str(exc)) from None
        to_dir = out.suffix == "" or out.is_dir()
        if not to_dir and out.suffix.lower() not in embed_cli.OUTPUTS:
            raise InputError(f"{out}: unknown output format {out.suffix!r}: use .npy, .parquet or a directory")
        if not to_dir and (why := output_file_problem(out)):  # a file is written here, at the end
            raise InputError(f"{out}: {why}")
        if args.dtype is not None and args.dtype not in embed_cli.DTYPES:
            raise InputError(f"--dtype {args.dtype}: use one of {', '.join(embed_cli.DTYPES)}")
        if args.block_rows < 1:
            raise InputError(f"--block-rows must be >= 1, got {args.block_rows}")
        t0 = time.perf_counter()
        corpus = None
        if not src.is_dir():  # a file: read and checked here, before the cluster starts anything
            corpus = read_corpus(src, field=args.field, id_field=args.id_field, empty=args.empty)
        _connect(ray, args.ray)
        try:
            if corpus is not None:
                rows = [{"row": i, "id": id_, "text": t} for i, (id_, t) in enumerate(zip(corpus.ids, corpus.texts))]
                ds, column = ray.data.from_items(rows), "text"
            else:
                ds, column = ray.data.read_parquet(str(src)), args.field
            result = embed(ds, args.model, text_column=column, device=args.device, dtype=args.dtype,
                           max_batch_tokens=args.max_batch_tokens, truncate=not args.no_truncate,
                           block_rows=args.block_rows)  # fmt: skip
            failed, count = _write(result, out, to_dir)
        finally:
            ray.shutdown()
    except InputError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    print(f"{PROG}: {count:,} rows -> {out} on Ray in {wall:.2f} s: {count / wall:,.0f} rows/s (the whole command)"
          + (f"; {failed} rows failed, their error column says why" if failed else ""), file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


def _write_dir(result: Any, out: Path) -> tuple[int, int]:
    """The job's rows written by the cluster as a Parquet directory; (rows with an error, rows)."""
    result = result.materialize()
    result.write_parquet(str(out))
    failed = result.filter(lambda r: r["error"] is not None).count() if "error" in result.schema().names else 0
    return failed, result.count()


def _write(result: Any, out: Path, to_dir: bool) -> tuple[int, int]:
    """Write the job's rows; (rows with an error, rows)."""
    if to_dir:
        return _write_dir(result, out)
    rows = sorted(result.take_all(), key=lambda r: r["row"])
    emb = np.stack([r["embedding"] for r in rows]).astype(np.float32)
    failed = sum(r["error"] is not None for r in rows)
    if out.suffix.lower() == ".npy":
        np.save(out, emb)
    else:
        embed_cli.write_parquet(out, {"id": [r["id"] for r in rows], "error": [r["error"] for r in rows]}, emb)
    return failed, len(rows)


def main(argv: Optional[list[str]] = None) -> int:
    return embed_main(list(sys.argv[1:] if argv is None else argv))


# ---- python -m fusedenc.lc0 eval ... --ray ------------------------------------------------------


def eval_main(argv: list[str]) -> int:
    """``python -m fusedenc.lc0 eval NET --epd FILE|--pgn FILE|--parquet DIR|--frames FILE... --ray
    [ADDRESS]``: the positions evaluated on the cluster.  An EPD or PGN file is read and checked
    here first and written as the single-machine command writes it (JSON lines in the file's
    order, a summary last), or as a Parquet directory when ``--out`` names one.  A Parquet
    directory of positions (``--fen-column``, ``--moves-column``) and lc0 training data
    (``--frames``: relabelled, ``fusedenc.distributed.relabel``) are read by the cluster and
    written as a Parquet directory (``--out DIR``)."""
    from ..lc0.evalinputs import InputError as Lc0InputError
    from ..lc0.evalinputs import epd_items, eval_parser, pgn_items

    ap = eval_parser()
    ap.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                    help="run on a Ray cluster: alone, the one this machine is in; 'local'; or a head's HOST:PORT")
    ap.add_argument("--block-rows", type=int, default=BLOCK_ROWS,
                    help=f"positions an actor takes at once (default {BLOCK_ROWS})")
    args = ap.parse_args(argv)
    prog = "python -m fusedenc.lc0 eval"
    out_dir = args.out is not None and (Path(args.out).suffix == "" or Path(args.out).is_dir())
    try:
        if args.fen is not None:
            raise Lc0InputError("--ray evaluates files (--epd, --pgn, --parquet, --frames); --fen runs on this machine")
        source = "--parquet" if args.parquet else "--frames" if args.frames else None
        if source and not out_dir:
            raise Lc0InputError(f"{source} writes a Parquet directory: give --out DIR (a path without a suffix)")
        if args.block_rows < 1:
            raise Lc0InputError(f"--block-rows must be >= 1, got {args.block_rows}")
        if args.out is not None and not out_dir and (why := output_file_problem(args.out)):
            raise Lc0InputError(f"--out {args.out}: {why}")
        try:
            ray = ray_or_exit()
        except ImportError as exc:
            raise Lc0InputError(str(exc)) from None
        t0 = time.perf_counter()
        if not Path(args.net).is_file():  # the cluster reads it on every node: this one at least
            raise Lc0InputError(f"{args.net}: no such net file")
        rows = ids = None
        if args.parquet and not Path(args.parquet).is_dir():
            raise Lc0InputError(f"--parquet {args.parquet}: not a directory")
        for frame_file in args.frames or ():
            if not Path(frame_file).is_file():
                raise Lc0InputError(f"--frames {frame_file}: no such file")
        if source is None:
            positions, ids = epd_items(args.epd) if args.epd else pgn_items(args.pgn)
            rows = []
            for i, position in enumerate(positions):
                fen, moves = position if isinstance(position, tuple) else (position, [])
                rows.append({"row": i, "fen": fen, "moves": " ".join(moves)})
        _connect(ray, args.ray)
        try:
            result = _eval_job(ray, args, rows, Lc0InputError)
            if out_dir:
                failed, count = _write_dir(result, Path(args.out))
            else:
                done = sorted(result.take_all(), key=lambda r: r["row"])
        finally:
            ray.shutdown()
    except Lc0InputError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if out_dir:
        wall = time.perf_counter() - t0
        print(f"{prog}: {count:,} rows -> {args.out} on Ray in {wall:.2f} s: {count / wall:,.0f} rows/s (the whole "
              f"command)" + (f"; {failed} rows failed, their error column says why" if failed else ""),
              file=sys.stderr)  # fmt: skip
        return 1 if failed else 0
    return _write_lines(args, done, ids, t0, prog)


def _eval_job(ray: Any, args: Any, rows: Optional[list], input_error: type) -> Any:
    """The cluster's dataset of evaluated positions or relabelled frames for ``eval_main``."""
    from . import evaluate_positions, relabel, training_frames

    if args.frames:
        return relabel(training_frames(args.frames), args.net, device=args.device, dtype=args.dtype,
                       block_rows=args.block_rows)  # fmt: skip
    if args.parquet:
        ds = ray.data.read_parquet(str(args.parquet))
        fen_column, moves_column = args.fen_column, args.moves_column
        missing = [c for c in (fen_column, moves_column) if c is not None and c not in ds.schema().names]
        if missing:
            raise input_error(f"--parquet {args.parquet}: no column {', '.join(map(repr, missing))} (it has "
                              f"{', '.join(ds.schema().names)}; --fen-column / --moves-column name others)")  # fmt: skip
    else:
        ds, fen_column, moves_column = ray.data.from_items(rows), "fen", "moves"
    top = None if args.top <= 0 else args.top
    return evaluate_positions(ds, args.net, fen_column=fen_column, moves_column=moves_column, device=args.device,
                              dtype=args.dtype, temperature=args.temperature, top=top,
                              block_rows=args.block_rows)  # fmt: skip


def _write_lines(args: Any, done: list, ids: list, t0: float, prog: str) -> int:
    """The single-machine command's JSON lines (in the file's order, a summary last)."""
    import json

    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115 - closed below
    failed = 0
    try:
        for r in done:
            record = dict(ids[r["row"]])
            if r["error"] is not None:
                failed += 1
                record["error"] = r["error"]
            else:
                record.update(best_move=r["best_move"], moves=list(r["moves"]),
                              probs=[round(float(p), 6) for p in r["probs"]], q=round(float(r["q"]), 6))  # fmt: skip
                if not np.isnan(r["wdl"]).any():
                    record["wdl"] = [round(float(x), 6) for x in r["wdl"]]
                if not np.isnan(r["moves_left"]):
                    record["moves_left"] = round(float(r["moves_left"]), 3)
            out.write(json.dumps(record) + "\n")
        seconds = time.perf_counter() - t0
        out.write(json.dumps({"summary": {"positions": len(done) - failed, "failed": failed,
                                          "seconds": round(seconds, 4), "ray": True}}) + "\n")  # fmt: skip
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"{prog}: {len(done) - failed:,} positions on Ray in {seconds:.2f} s (the whole command): "
          f"{(len(done) - failed) / seconds:,.0f} positions/s" + (f"; {failed} failed" if failed else ""),
          file=sys.stderr)  # fmt: skip
    return 1 if failed else 0
