"""``--ray [ADDRESS]`` of ``python -m fusedenc embed``: the same job on a Ray cluster.

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

from ..embed import cli as embed_cli
from ..embed.texts import InputError, read_corpus
from . import embed, ray_or_exit

PROG = embed_cli.PROG


def _connect(ray: Any, address: str) -> None:
    if address == "local":
        ray.init(include_dashboard=False)
    else:
        ray.init(address=address)


def embed_main(argv: list[str]) -> int:
    ap = embed_cli.parser()
    ap.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                    help="run on a Ray cluster: alone, the one this machine is in; 'local'; or a head's HOST:PORT")
    ap.add_argument("--block-rows", type=int, default=4096, help="rows an actor takes at once (default 4096)")
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
        if args.dtype is not None and args.dtype not in embed_cli.DTYPES:
            raise InputError(f"--dtype {args.dtype}: use one of {', '.join(embed_cli.DTYPES)}")
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


def _write(result: Any, out: Path, to_dir: bool) -> tuple[int, int]:
    """Write the job's rows; (rows with an error, rows)."""
    if to_dir:
        result = result.materialize()
        result.write_parquet(str(out))
        failed = result.filter(lambda r: r["error"] is not None).count()
        return failed, result.count()
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
    """``python -m fusedenc.lc0 eval NET --epd FILE|--pgn FILE --ray [ADDRESS]``: the file's
    positions (read and checked here) evaluated on the cluster, written as the single-machine
    command writes them (JSON lines in the file's order, a summary last)."""
    import json

    from ..lc0.evalinputs import InputError as Lc0InputError
    from ..lc0.evalinputs import epd_items, eval_parser, pgn_items
    from . import evaluate_positions

    ap = eval_parser()
    ap.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                    help="run on a Ray cluster: alone, the one this machine is in; 'local'; or a head's HOST:PORT")
    ap.add_argument("--block-rows", type=int, default=4096, help="positions an actor takes at once (default 4096)")
    args = ap.parse_args(argv)
    prog = "python -m fusedenc.lc0 eval"
    try:
        if args.fen is not None:
            raise Lc0InputError("--ray evaluates files (--epd, --pgn); --fen runs on this machine")
        try:
            ray = ray_or_exit()
        except ImportError as exc:
            raise Lc0InputError(str(exc)) from None
        t0 = time.perf_counter()
        positions, ids = epd_items(args.epd) if args.epd else pgn_items(args.pgn)
        rows = []
        for i, position in enumerate(positions):
            fen, moves = position if isinstance(position, tuple) else (position, [])
            rows.append({"row": i, "fen": fen, "moves": " ".join(moves)})
        _connect(ray, args.ray)
        try:
            ds = ray.data.from_items(rows)
            top = None if args.top <= 0 else args.top
            result = evaluate_positions(ds, args.net, fen_column="fen", moves_column="moves", device=args.device,
                                        dtype=args.dtype, temperature=args.temperature, top=top,
                                        block_rows=args.block_rows)  # fmt: skip
            done = sorted(result.take_all(), key=lambda r: r["row"])
        finally:
            ray.shutdown()
    except Lc0InputError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
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
