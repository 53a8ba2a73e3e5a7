"""``python -m fusedenc embed MODEL INPUT -o OUTPUT``: embeddings of every text of a file.

INPUT: ``.txt`` (one text a line), ``.jsonl`` (``--field``) or ``.parquet`` (``--column``).
OUTPUT: ``.npy`` (float32 ``[N, D]`` in input order) or ``.parquet`` (``id`` and ``embedding``).
The corpus is embedded in chunks of ``--chunk`` texts, each sorted by length and cut into
batches by ``--max-batch-tokens``; after each chunk the output so far and a progress file
(``OUTPUT.progress.json``) are written, so a run that is stopped resumes where it was when
started again with the same input, model and output.  Bad input (a missing file, text that
is not UTF-8, a missing field, an empty text) stops the command before anything is embedded,
naming the file and row; exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..common.dtypes import CLI_NAMES as DTYPES
from ..common.paths import output_file_problem
from .embedding import DEFAULT_MAX_BATCH_TOKENS, encode, load_model
from .texts import InputError, read_corpus

PROG = "python -m fusedenc embed"
OUTPUTS = (".npy", ".parquet")


def parser() -> argparse.ArgumentParser:
    """The command's arguments (fusedenc.distributed adds --ray to them)."""
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                 epilog="Resume: run the same command again.  On a Ray cluster: add --ray [ADDRESS] "
                                        '(pip install "fusedenc[ray]"; Parquet directories in and out too).')  # fmt: skip
    ap.add_argument("model", help="'minilm' (the real-models extra), or a Hugging Face or sentence-transformers folder")
    ap.add_argument("input", help="a .txt, .jsonl or .parquet file")
    ap.add_argument("-o", "--output", required=True, help="a .npy or .parquet file")
    ap.add_argument("--field", "--column", dest="field", default="text", help="the JSON field or Parquet column (text)")
    ap.add_argument("--id-field", "--id-column", dest="id_field", default=None,
                    help="a field or column holding each row's id (default: the line or row number)")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: the GPU if there is one)")
    ap.add_argument("--dtype", default=None, help="fp16, bf16 or fp32 (default: fp16 on a GPU, fp32 on a CPU)")
    ap.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                    help=f"padded tokens a batch may hold (default {DEFAULT_MAX_BATCH_TOKENS})")
    ap.add_argument("--no-truncate", action="store_true", help="refuse texts longer than the model takes")
    ap.add_argument("--empty", choices=("error", "skip"), default="error", help="what an empty text does")
    ap.add_argument("--chunk", type=int, default=65536, help="texts embedded between two saves (default 65536)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _signature(args, corpus) -> dict:
    """What a resumed run must share with the stopped one."""
    stat = Path(args.input).stat()
    return {"input": str(Path(args.input).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "texts": len(corpus.texts), "model": args.model, "field": args.field, "chunk": args.chunk,
            "dtype": args.dtype or "", "no_truncate": args.no_truncate, "empty": args.empty}  # fmt: skip


def main(argv: Optional[list[str]] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.max_batch_tokens < 1 or args.chunk < 1:
        ap.error("--max-batch-tokens and --chunk must be >= 1")
    out = Path(args.output)
    try:
        if out.suffix.lower() not in OUTPUTS:
            raise InputError(f"{out}: unknown output format {out.suffix or '(no suffix)'!r}: use .npy or .parquet")
        if out.suffix.lower() == ".parquet":
            _need_pyarrow(out)
        if why := output_file_problem(out):  # before the model loads
            raise InputError(f"{out}: {why}")
        dtype = None
        if args.dtype is not None:
            if args.dtype not in DTYPES:
                raise InputError(f"--dtype {args.dtype}: use one of {', '.join(DTYPES)}")
            dtype = DTYPES[args.dtype]
        t_start = time.perf_counter()
        corpus = read_corpus(args.input, field=args.field, id_field=args.id_field, empty=args.empty)  # input first
        for note in corpus.notes:
            print(f"{PROG}: {note}", file=sys.stderr)
        model = load_model(args.model, device=args.device, dtype=dtype)
        return _run(args, corpus, model, out, t_start)
    except InputError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2


def _need_pyarrow(path: Path) -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise InputError(f"{path}: writing Parquet needs pyarrow: pip install pyarrow") from None


def _run(args, corpus, model, out: Path, t_start: float) -> int:
    progress_file = out.with_name(out.name + ".progress.json")
    partial = out.with_name(out.name + ".partial.npy")
    signature = _signature(args, corpus)
    n = len(corpus.texts)
    chunks = [(s, min(s + args.chunk, n)) for s in range(0, n, args.chunk)]
    done: list[int] = []
    if progress_file.exists() and partial.exists():
        saved = json.loads(progress_file.read_text())
        if saved.get("signature") == signature:
            done = saved["done"]
            print(f"{PROG}: resuming: {len(done)} of {len(chunks)} chunks already embedded", file=sys.stderr)
    bar = None
    if not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=n, unit="text", desc="embedding", file=sys.stderr,
                       initial=sum(chunks[i][1] - chunks[i][0] for i in done))  # fmt: skip
        except ImportError:
            bar = None
    store = np.load(partial, mmap_mode="r+") if done else None
    totals = {"tokens": 0, "truncated": 0, "batches": 0, "seconds": 0.0, "texts": 0, "tokenizer_wait_s": 0.0}
    for index, (start, end) in enumerate(chunks):
        if index in done:
            continue
        emb, stats = encode(model, corpus.texts[start:end], max_batch_tokens=args.max_batch_tokens,
                            truncate=not args.no_truncate, row_name=lambda i, s=start: _row(corpus, s + i),
                            progress=bar.update if bar is not None else None)  # fmt: skip
        if store is None:
            store = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(n, emb.shape[1]))
        store[start:end] = emb
        store.flush()
        done.append(index)
        progress_file.write_text(json.dumps({"signature": signature, "done": done}))
        for key in totals:
            totals[key] += getattr(stats, key)
    if bar is not None:
        bar.close()
    _write(out, partial, corpus)
    progress_file.unlink()
    wall = time.perf_counter() - t_start
    rate = totals["texts"] / totals["seconds"] if totals["seconds"] > 0 else float("inf")
    waiting = totals["tokenizer_wait_s"] / totals["seconds"] if totals["seconds"] > 0 else 0.0
    if totals["truncated"]:
        print(f"{PROG}: {totals['truncated']} texts longer than the model's {model.max_length} tokens were "
              f"truncated (--no-truncate refuses them)", file=sys.stderr)  # fmt: skip
    print(f"{PROG}: {n:,} texts -> {out} ({store.shape[1]} dims, float32); {totals['texts']:,} embedded in "
          f"{totals['seconds']:.2f} s: {rate:,.0f} texts/s ({totals['tokens']:,} tokens, {totals['batches']} batches, "
          f"{model.device}, {str(model.dtype).replace('torch.', '')}; {waiting:.0%} of it waiting for the tokenizer); "
          f"the whole command {wall:.2f} s",
          file=sys.stderr)  # fmt: skip
    return 0


def _row(corpus, i: int) -> str:
    where = "row" if corpus.path.suffix.lower() == ".parquet" else "line"
    return f"{corpus.path}: {where} {corpus.ids[i]}"


def _write(out: Path, partial: Path, corpus) -> None:
    """The finished output: the partial ``.npy`` renamed, or a Parquet file of ids and rows."""
    if out.suffix.lower() == ".npy":
        partial.replace(out)
        return
    emb = np.load(partial, mmap_mode="r")
    write_parquet(out, {"id": corpus.ids}, emb)
    del emb
    partial.unlink()


def write_parquet(out: Path, columns: dict, emb: np.ndarray) -> None:
    """A Parquet file of ``columns`` (lists a row) and ``embedding``, ``emb``'s rows as
    fixed-size lists of float32."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = pa.array(np.ascontiguousarray(emb, dtype=np.float32).reshape(-1))
    pq.write_table(pa.table({**columns, "embedding": pa.FixedSizeListArray.from_arrays(flat, emb.shape[1])}), out)


if __name__ == "__main__":
    sys.exit(main())
