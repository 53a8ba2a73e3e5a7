"""A file of texts to a file of embeddings, as a user runs it: ``python -m fusedenc embed``
against the script a sentence-transformers user writes (read the lines, ``encode()``, save
the array), each in its own process, on the same ``.txt`` file and the same model folder.

    python3 bench/embed_file.py [--model minilm,bert-base] [--texts 200000] [--impl command,st-plain:128,st-patched:128]

Peers: ``command`` (``python -m fusedenc embed FOLDER FILE -o OUT.npy``), ``st-plain:B`` and
``st-patched:B`` (``SentenceTransformer(FOLDER).encode(lines, batch_size=B)``, unpatched, and
after ``fusedenc.patch_hf``; half precision on a GPU as the command picks).  The file cycles
the 20,000 sentences of tests/data/real_sentences up to ``--texts`` lines; the model folder is
a sentence-transformers folder (Transformer, mean Pooling, Normalize) around ``--model``'s
weights (random for the bert-base shape; MiniLM's real ones where installed).  Two times a
peer: the whole process (what the user waits for: Python's imports, loading, graph
captures, reading and writing) and its embedding part alone.  Every peer's output is checked
against the fp32 model on a sample of rows first (cosine >= 0.9999).

The first process on a machine to run fusedenc's kernels compiles its Triton kernels (cached
on disk for later processes: Triton's cache).  So each model's peers share a fresh cache
folder (``TRITON_CACHE_DIR``), the command first runs untimed over the distinct sentences (up
to ``--texts`` of them: every length the file holds), and its time is reported apart as the
first run on a machine; the timed rows run after it, as a user's later runs do.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import common
import embeddings as eb
import numpy as np
import torch
from st_loop import COSINE, st_model

SAMPLE = 2048  # rows checked against the fp32 model
# The script a sentence-transformers user writes, run as its own process.  argv: folder, texts,
# output, batch, device, dtype, patch (0/1).  Prints the embedding part's seconds as JSON.
ST_SCRIPT = """
import json, sys, time
import numpy as np, torch
from sentence_transformers import SentenceTransformer
folder, path, out, batch, device, dtype, patch = sys.argv[1:]
st = SentenceTransformer(folder, device=device).to(getattr(torch, dtype))
if patch == "1":
    import fusedenc
    fusedenc.patch_hf(st)
with open(path, encoding="utf-8") as fh:
    texts = fh.read().splitlines()
t = time.perf_counter()
emb = st.encode(texts, batch_size=int(batch), convert_to_numpy=True)
seconds = time.perf_counter() - t
np.save(out, emb.astype(np.float32))
print(json.dumps({"embed_seconds": seconds}))
"""
# The command's last line: "... N embedded in S s: R texts/s (...); the whole command W s"
COMMAND_LINE = re.compile(r"embedded in ([0-9.]+) s: .* the whole command [0-9.]+ s")


def model_folder(name: str, root: str) -> str:
    """A sentence-transformers folder around ``name``'s fp32 weights and tokenizer: st_loop's
    ``SentenceTransformer``, saved."""
    folder = os.path.join(root, name)
    st_model(name, torch.device("cpu"), torch.float32, 0, os.path.join(root, name + "-hf")).save(folder)
    return folder


def text_file(path: str, n: int) -> list[str]:
    sentences = eb.read_sentences(None)
    texts = [sentences[i % len(sentences)] for i in range(n)]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(texts) + "\n")
    return texts


def run_peer(impl: str, folder: str, path: str, out: str, device: torch.device, dtype: str,
             env: dict | None = None) -> dict[str, Any]:  # fmt: skip
    """One peer's process (in ``env``, default this one's): its wall time and its embedding
    part's (seconds)."""
    if impl == "command":
        argv = [sys.executable, "-m", "fusedenc", "embed", folder, path, "-o", out, "--no-progress",
                "--device", str(device), "--dtype", {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[dtype]]  # fmt: skip
    else:
        kind, _, batch = impl.partition(":")
        if kind not in ("st-plain", "st-patched") or not batch.isdigit():
            raise ValueError(f"unknown peer {impl!r}: command, st-plain:B or st-patched:B")
        argv = [sys.executable, "-c", ST_SCRIPT, folder, path, out, batch, str(device), dtype,
                "1" if kind == "st-patched" else "0"]  # fmt: skip
    t = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"{impl} exited {done.returncode}: {done.stderr.strip()[-600:]}")
    if impl == "command":
        found = COMMAND_LINE.search(done.stderr)
        if found is None:
            raise RuntimeError(f"the command's last line not found in: {done.stderr.strip()[-300:]}")
        embed = float(found.group(1))
    else:
        embed = json.loads(done.stdout.strip().splitlines()[-1])["embed_seconds"]
    return {"wall_seconds": wall, "embed_seconds": embed}


def reference(folder: str, texts: list[str], rows: np.ndarray, device: torch.device) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(folder, device=str(device)).float()
    return np.asarray(st.encode([texts[i] for i in rows], batch_size=64, convert_to_numpy=True), dtype=np.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm,bert-base", help="comma list of minilm, bert-base, tiny")
    ap.add_argument("--texts", type=int, default=200000)
    ap.add_argument("--impl", default="command,st-plain:128,st-patched:128")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out-dir", default=os.environ.get("FUSEDENC_RESULTS_DIR", "fusedenc-results"))
    args = ap.parse_args(argv)
    if args.texts < 1:
        ap.error("--texts must be >= 1")
    if importlib.util.find_spec("sentence_transformers") is None:  # the model folder and two peers
        ap.error("needs sentence-transformers: pip install sentence-transformers")
    device = common.resolve_device(args.device)
    dtype = "float16" if device.type == "cuda" else "float32"
    env = common.environment(device)
    names = common.comma_list(args.model)
    result: dict[str, Any] = {"schema": "fusedenc.bench.embed_file/1", "environment": env, "texts": args.texts,
                              "dtype": dtype, "records": []}  # fmt: skip
    root = tempfile.mkdtemp(prefix="embed_file_")
    path = os.path.join(root, "texts.txt")
    texts = text_file(path, args.texts)
    rows = np.unique(np.linspace(0, args.texts - 1, min(SAMPLE, args.texts)).astype(np.int64))
    for name in names:
        folder = model_folder(name, root)
        want = reference(folder, texts, rows, device)
        record = {"model": name, "weights": "real" if name == "minilm" and eb.minilm_weights() else "random",
                  "results": []}  # fmt: skip
        result["records"].append(record)
        child_env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton_", dir=root)}
        first = text_file(os.path.join(root, "first.txt"), min(args.texts, len(eb.read_sentences(None))))
        first_out = os.path.join(root, f"{name}-first.npy")
        record["first_run"] = {"texts": len(first), **run_peer("command", folder, os.path.join(root, "first.txt"),
                                                               first_out, device, dtype, child_env)}  # fmt: skip
        os.unlink(first_out)
        for impl in common.comma_list(args.impl):
            out = os.path.join(root, f"{name}-{impl.replace(':', '-')}.npy")
            try:
                row = {"impl": impl, **run_peer(impl, folder, path, out, device, dtype, child_env)}
                got = np.load(out, mmap_mode="r")
                if got.shape[0] != args.texts:
                    raise RuntimeError(f"{got.shape[0]} rows written for {args.texts} texts")
                sample = np.asarray(got[rows], dtype=np.float32)
                cos = np.sum(sample * want, 1) / np.linalg.norm(sample, axis=1) / np.linalg.norm(want, axis=1)
                row.update(min_cosine=float(cos.min()), cosine_ok=bool(cos.min() >= COSINE))
                os.unlink(out)
            except Exception as exc:  # noqa: BLE001 - a peer that fails is a row saying so
                row = {"impl": impl, "error": f"{type(exc).__name__}: {exc}"}
            record["results"].append(row)
            print("\n".join(table(record, args.texts)), flush=True)
    base = write(args.out_dir, names, env, result)
    print(f"wrote {base}.json, {base}.txt")
    bad = [r for rec in result["records"] for r in rec["results"] if "error" in r or not r["cosine_ok"]]
    return 1 if bad else 0


def table(record: dict, n: int) -> list[str]:
    ok = [r for r in record["results"] if "error" not in r]
    plain = [r for r in ok if r["impl"].startswith("st-plain")]
    base = min(r["wall_seconds"] for r in plain) if plain else None
    base_embed = min(r["embed_seconds"] for r in plain) if plain else None
    out = [f"{record['model']} ({record['weights']} weights), {n:,} texts from a .txt file to a .npy file",
           f"  {'implementation':<16} {'texts/s, whole':>15} {'x st-plain':>10} {'texts/s, embedding':>19} "
           f"{'x st-plain':>10} {'process s':>10} {'min cosine':>11}"]  # fmt: skip
    for r in record["results"]:
        if "error" in r:
            out.append(f"  {r['impl']:<16} {r['error']}")
            continue
        ratio = f"{base / r['wall_seconds']:.2f}x" if base else "-"
        ratio_embed = f"{base_embed / r['embed_seconds']:.2f}x" if base_embed else "-"
        out.append(f"  {r['impl']:<16} {n / r['wall_seconds']:>15,.0f} {ratio:>10} {n / r['embed_seconds']:>19,.0f} "
                   f"{ratio_embed:>10} {r['wall_seconds']:>10.1f} {r['min_cosine']:>11.6f}")  # fmt: skip
    first = record.get("first_run")
    if first:
        out.append(f"  first run on a machine (Triton's kernel cache empty), the command over {first['texts']:,} "
                   f"lines: {first['wall_seconds']:.1f} s whole, {first['embed_seconds']:.2f} s embedding; "
                   f"the rows above ran after it")  # fmt: skip
    return out


def write(out_dir: str, names: list, env: dict, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"embed_file_{common.slug('-'.join(names))}_{common.slug(env['device_name'] or 'cpu')}")
    common.write_json(base + ".json", result)
    with open(base + ".txt", "w", encoding="utf-8") as fh:
        lines = [x for r in result["records"] for x in table(r, result["texts"]) + [""]]
        fh.write("\n".join([common.describe_environment(env), ""] + lines))
    return base


if __name__ == "__main__":
    sys.exit(main())
