"""What Ray costs: the same texts embedded by one process (``fusedenc.embed.encode``) and by a
Ray Data job on a local cluster (``fusedenc.distributed.embed``, one actor), per block size.

    python3 bench/distributed.py [--model minilm|FOLDER] [--texts 4000] [--blocks 64,256,1024,4096]
    python3 bench/distributed.py --actor-only --random bert-base --device cuda --texts 20000   # a GPU, no Ray

The Ray job's extra time over the single process, divided by its blocks, is Ray's cost per
block (scheduling, the object store's copies of texts in and embeddings out, the block's
own smaller sorted batches); the block size from which it is a few percent of the job is the
smallest worth using.  On a GPU the per-actor work is ``encode`` itself: the cluster's rate is
about (one GPU's rate) x (GPUs), less this cost.  ``--actor-only`` measures that per-actor work
without Ray (the GPU machine has no Ray): the actor class (``distributed.actors.Embedder``)
called on blocks as Ray Data hands them over, against the corpus command's ``encode`` on the
whole input.  ``--random minilm|bert-base``: that shape with random weights and the real
tokenizer (where the real model is not installed).  Writes a table and a JSON file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--texts", type=int, default=4000)
    ap.add_argument("--blocks", default="64,256,1024,4096")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out-dir", default=os.environ.get("FUSEDENC_RESULTS_DIR", "fusedenc-results"))
    ap.add_argument("--actor-only", action="store_true", help="the actor's work per block, no Ray")
    ap.add_argument("--random", choices=("minilm", "bert-base"), default=None,
                    help="a random-weight model of this shape with the real tokenizer (instead of --model)")
    args = ap.parse_args()
    if args.random:
        args.model = random_model_folder(args.random)
    if args.actor_only:
        return actor_only(args)
    import numpy as np
    import ray
    import torch

    import fusedenc
    from fusedenc import distributed
    from fusedenc.embed import encode, load_model

    texts = _texts(args.texts)
    model = load_model(args.model, device=args.device)
    encode(model, texts[:64])  # first calls out of the timing
    single = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        want, stats = encode(model, texts)
        single.append(time.perf_counter() - t0)
    t_single = min(single)
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = []
    try:
        ds = ray.data.from_items([{"row": i, "text": t} for i, t in enumerate(texts)]).materialize()
        for block in [int(b) for b in args.blocks.split(",")]:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = distributed.embed(ds, args.model, device=args.device, block_rows=block, concurrency=1).take_all()
                times.append(time.perf_counter() - t0)
            got = np.stack([r["embedding"] for r in sorted(out, key=lambda r: r["row"])])
            err = float(np.abs(got - want).max())
            blocks = -(-len(texts) // block)
            t = min(times)
            rows.append({"block_rows": block, "blocks": blocks, "seconds": round(t, 3),
                         "rows_per_s": round(len(texts) / t, 1), "x_single": round(t_single / t, 3),
                         "ms_per_block_over_single": round((t - t_single) / blocks * 1e3, 1),
                         "max_abs_diff": err})  # fmt: skip
    finally:
        ray.shutdown()
    # t = fixed + blocks x per_block, least squares over the block sizes: the job's fixed cost
    # (actor start, model load, first calls) apart from what each block adds
    b = np.array([r["blocks"] for r in rows], dtype=float)
    t = np.array([r["seconds"] for r in rows])
    per_block, fixed = (np.polyfit(b, t, 1) if len(rows) > 1 else (0.0, float(t[0])))
    env = {"torch": torch.__version__, "ray": ray.__version__, "fusedenc": fusedenc.__version__,
           "python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
           "device": args.device, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}  # fmt: skip
    lines = [f"Ray Data job vs one process: {args.model}, {len(texts)} real sentences, {args.device}, "
             f"{stats.tokens} tokens; one process {t_single:.2f} s ({len(texts) / t_single:,.0f} rows/s); "
             f"one actor, a local cluster; best of {args.repeats}",
             f"{'block rows':>10} {'blocks':>7} {'seconds':>8} {'rows/s':>8} {'x one process':>14} "
             f"{'ms a block over':>16}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['block_rows']:>10} {r['blocks']:>7} {r['seconds']:>8.2f} {r['rows_per_s']:>8,.0f} "
                     f"{r['x_single']:>14.2f} {r['ms_per_block_over_single']:>16.1f}")  # fmt: skip
    lines.append(f"fit: the job = {fixed:.2f} s fixed (actor start, model load, first calls; one process: "
                 f"{t_single:.2f} s of work) + {per_block * 1e3:.1f} ms a block (scheduling, object-store copies, "
                 f"smaller sorted batches)")
    lines.append(f"environment: {json.dumps(env)}")
    text = "\n".join(lines)
    print(text)
    _write(args.out_dir, f"distributed_{Path(args.model).name}_{args.device}", text,
           {"rows": rows, "single_seconds": t_single, "fixed_seconds": fixed, "per_block_seconds": per_block,
            "environment": env})  # fmt: skip
    return 0 if all(r["max_abs_diff"] < 1e-4 for r in rows) else 1


def random_model_folder(shape: str) -> str:
    """A Hugging Face folder of ``shape`` with random weights and all-MiniLM-L6-v2's tokenizer."""
    import tempfile

    sys.path.insert(0, str(HERE))
    import embeddings as eb

    return eb.saved_model_folder(shape, os.path.join(tempfile.mkdtemp(prefix="distributed_"), shape))


def _write(out_dir: str, name: str, text: str, payload: dict) -> None:
    """The table and the JSON of a run, as ``out_dir/name.txt`` and ``.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")


def _texts(n: int) -> list:
    with gzip.open(HERE.parent / "tests" / "data" / "real_sentences" / "sentences.txt.gz", "rt", encoding="utf-8") as f:
        pool = f.read().splitlines()
    return [pool[i % len(pool)] for i in range(n)]


def actor_only(args) -> int:
    """The actor's work (``Embedder`` on blocks of each size) against ``encode`` on the whole input."""
    import numpy as np
    import torch

    from fusedenc.distributed.actors import Embedder
    from fusedenc.embed import encode, load_model

    texts = _texts(args.texts)
    model = load_model(args.model, device=args.device)
    encode(model, texts[:256])
    encode(model, texts)  # warm-up pass: the graphs of every shape this input makes

    def timed(run) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            t0 = time.perf_counter()
            run()
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            best = min(best, time.perf_counter() - t0)
        return best

    want = encode(model, texts)[0]
    t_single = timed(lambda: encode(model, texts))
    actor = Embedder(args.model, device=args.device)
    rows = []
    for block in [int(b) for b in args.blocks.split(",")]:
        blocks = [{"row": np.arange(i, min(i + block, len(texts))), "text": np.array(texts[i:i + block], dtype=object)}
                  for i in range(0, len(texts), block)]  # fmt: skip
        for b in blocks:  # warm-up: this block size's shapes
            actor(dict(b))
        got = np.concatenate([np.stack(actor(dict(b))["embedding"]) for b in blocks])
        t = timed(lambda: [actor(dict(b)) for b in blocks])
        rows.append({"block_rows": block, "blocks": len(blocks), "seconds": round(t, 4),
                     "rows_per_s": round(len(texts) / t, 1), "x_corpus": round(t_single / t, 3),
                     "max_abs_diff": float(np.abs(got - want).max())})  # fmt: skip
    import common  # bench/common.py: the device, driver, library versions and commit

    env = common.environment(model.device)
    lines = [f"the Ray actor's work without Ray: {Path(args.model).name}, {len(texts)} real sentences, "
             f"{env['device_name']}, {model.dtype}; the corpus command's encode on all of them "
             f"{t_single:.3f} s ({len(texts) / t_single:,.0f} rows/s); best of {args.repeats}",
             f"{'block rows':>10} {'blocks':>7} {'seconds':>8} {'rows/s':>9} {'x corpus':>9} {'max |diff|':>11}"]
    for r in rows:
        lines.append(f"{r['block_rows']:>10} {r['blocks']:>7} {r['seconds']:>8.3f} {r['rows_per_s']:>9,.0f} "
                     f"{r['x_corpus']:>9.2f} {r['max_abs_diff']:>11.2e}")  # fmt: skip
    lines.append(f"{common.describe_environment(env)}; fusedenc {env['fusedenc']} at {env.get('git_commit') or '?'}, "
                 f"{env['date_utc']}")
    text = "\n".join(lines)
    print(text)
    _write(args.out_dir, f"distributed_actor_{Path(args.model).name}_{env['device_name'].replace(' ', '-').lower()}",
           text, {"rows": rows, "corpus_seconds": t_single, "environment": env})
    tol = 2e-2 if model.dtype != torch.float32 else 1e-4  # fp16: batches of other shapes round differently
    return 0 if all(r["max_abs_diff"] < tol for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
