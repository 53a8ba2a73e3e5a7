"""sentence-transformers' ``encode()`` loop, reproduced for every peer, and the corpus command.

    python3 bench/st_loop.py                                   # GPU: minilm and bert-base, batch 32 and 128
    python3 bench/st_loop.py --model tiny --device cpu --sentences 256 --batch-sizes 16   # CPU smoke run
    python3 bench/st_loop.py --model minilm --device cpu --check-st   # the loop against sentence-transformers

The loop is ``SentenceTransformer.encode()``'s (sentence-transformers 6): the sentences
sorted by text length, longest first; batches of ``batch_size`` in that order, each
tokenized (padded to its longest, truncated at 256 tokens), moved to the device, run through
the model, mean-pooled over the mask, L2-normalized and copied back; then put back in input
order.  It is reproduced here because sentence-transformers (SciPy, scikit-learn) cannot be
installed on the GPU machine; ``--check-st`` shows on a CPU that the reproduction gives
sentence-transformers' own embeddings for all-MiniLM-L6-v2.

Peers, in the same run: ``plain`` (the HF model, sdpa), ``compile`` (``torch.compile(dynamic=
True)`` of the model: the mode that takes changing shapes without recompiling each),
``patched`` (``patch_hf``: the model's call on fusedenc, pooled by the loop, as an unpatched
sentence-transformers would run a patched model), ``patched-pooled`` (``patch_hf`` and
``sentence_embeddings`` on the loop's device tensors: what a patched ``SentenceTransformer``'s
``encode()`` runs with mean pooling) and ``corpus`` (``fusedenc.embed.encode`` over the whole
list: its own sort, token-budget batches and host tensors; not at the loop's batch size).
Where sentence-transformers is installed, its own ``encode()`` runs too, on a
``SentenceTransformer`` built around the same weights (Transformer, mean Pooling,
Normalize): ``st-plain``, ``st-compile`` (its HF model under ``torch.compile(dynamic=True)``)
and ``st-patched`` (``fusedenc.patch_hf(st)``).  For fusedenc's peers the result gives the
model's graph-cache counts over the timed passes (captures, evictions, eager calls).
Every peer's embeddings are checked against the fp32 plain loop (cosine >= 0.9999) first.
Timed: the wall clock of whole passes (tokenization included), the median of ``--reps`` (each
pass's time in the JSON: some passes take 2-4x the others, for all peers; likely CPython's
full garbage collections),
after two warm-up passes (fusedenc captures a shape's graph at its second call, and a sorted
pass meets most shapes once); the first pass's rate is reported beside it (what a one-off
run of a small corpus sees: compiling, planning, new shapes run eagerly).  The sentences are
tests/data/real_sentences (their token histogram is in the result); the corpus command's row
also says where its last pass spent the calling thread's time, and with ``--kernels`` every
row how much of a pass the GPU spent in kernels (one more pass, under ``torch.profiler``);
with ``--host-profile`` the functions where the calling thread spent one more pass (``cProfile``:
its own time, largest first; a wait shows as the lock or sync it waits in).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import common
import embeddings as eb
import numpy as np
import torch
import torch.nn.functional as F

import fusedenc
import fusedenc.embed
from fusedenc.hf import real_models, sentences

IMPLS = ("plain", "compile", "patched", "patched-pooled", "corpus", "st-plain", "st-compile", "st-patched")
#: The peers that run sentence-transformers itself (where it is installed); the ratios take the
#: best of these and of the reproduced loop's plain and compile peers.
ST_IMPLS = ("st-plain", "st-compile", "st-patched")
PEERS = ("plain", "compile", "st-plain", "st-compile")
MAX_LENGTH = 256  # sentence-transformers' all-MiniLM-L6-v2 setting
COSINE = 0.9999


def st_order(sentences: list[str]) -> np.ndarray:
    """sentence-transformers' order: by text length, longest first (a stable sort of -len)."""
    return np.argsort([-len(s) for s in sentences], kind="stable")


def tokenize(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    if tokenizer is None or isinstance(tokenizer, eb.WordTokenizer):
        return (tokenizer or eb.WordTokenizer())(texts, max_length=MAX_LENGTH, pad_to_multiple_of=1)
    return dict(tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt"))


def st_loop(step: Callable[[dict], torch.Tensor], tokenizer, sentences: list[str], batch: int,
            device: torch.device) -> np.ndarray:  # fmt: skip
    """``encode()``'s loop with ``step(features on the device) -> [B, D]`` as the model + pooling."""
    order = st_order(sentences)
    out: list[np.ndarray] = []
    with torch.inference_mode():
        for start in range(0, len(sentences), batch):
            features = tokenize(tokenizer, [sentences[i] for i in order[start:start + batch]])
            features = {k: v.to(device) for k, v in features.items()}
            out.append(F.normalize(step(features).float(), dim=1).cpu().numpy())
    emb = np.concatenate(out)
    return emb[np.argsort(order)]


def st_model(name: str, device: torch.device, dtype: torch.dtype, seed: int, folder: str):
    """A ``SentenceTransformer`` (Transformer, mean Pooling, Normalize) around ``load_model``'s
    weights, saved with the tokenizer under ``folder``."""
    from sentence_transformers import SentenceTransformer, models

    eb.saved_model_folder(name, folder, seed)
    word = models.Transformer(folder, max_seq_length=MAX_LENGTH, model_args={"attn_implementation": "sdpa"})
    pooling = models.Pooling(word.get_word_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[word, pooling, models.Normalize()], device=str(device)).to(dtype).eval()


def peer(impl: str, name: str, device: torch.device, dtype: torch.dtype, seed: int, tokenizer, folder: str):
    """``(run(sentences, batch) -> [N, D] numpy, note, the patched HF model or None)`` of one peer."""
    if impl in ST_IMPLS:
        st = st_model(name, device, dtype, seed, folder)
        hf = sentences.sentence_parts(st).hf_model
        note = "sentence-transformers' encode()"
        if impl == "st-compile":
            holder = st[0]
            # sentence-transformers >= 6 holds the model as ``model`` (``auto_model`` is a read-only
            # property there); earlier releases as ``auto_model``.
            attr = "model" if "model" in holder._modules else "auto_model"
            setattr(holder, attr, torch.compile(getattr(holder, attr), dynamic=True))
            note += ", torch.compile(dynamic=True)"
            hf = None
        elif impl == "st-patched":
            fusedenc.patch_hf(st)
            note += ", patch_hf"
        else:
            hf = None

        def run_st(sentences, batch):
            return np.asarray(st.encode(sentences, batch_size=batch, convert_to_numpy=True), dtype=np.float32)

        return run_st, note, hf
    if impl.startswith("corpus"):
        if tokenizer is None:
            raise RuntimeError("needs the real-models extra's fast tokenizer")
        options = corpus_options(impl)
        model = fusedenc.patch_hf(eb.load_model(name, device, dtype, "sdpa", seed))
        wrapped = fusedenc.embed.Model(model, tokenizer, MAX_LENGTH, name, device, dtype)
        def run_corpus(sentences, batch):
            emb, run_corpus.last_stats = fusedenc.embed.encode(wrapped, sentences, **options)
            return emb

        return run_corpus, "fusedenc.embed.encode, " + ", ".join(f"{k} {v}" for k, v in options.items()), model
    model = eb.load_model(name, device, dtype, "sdpa", seed)
    note = ""
    if impl == "compile":
        model = torch.compile(model, dynamic=True)
        note = "torch.compile(dynamic=True)"
    elif impl.startswith("patched"):
        fusedenc.patch_hf(model)
    if impl == "patched-pooled":
        def step(f):
            return fusedenc.sentence_embeddings(model, f["input_ids"], f["attention_mask"], f.get("token_type_ids"))
        note = "sentence_embeddings on the loop's device tensors"
    else:
        def step(f):
            return eb.pooled(model(**f).last_hidden_state, f["attention_mask"])
    patched = model if impl.startswith("patched") else None
    return (lambda sentences, batch: st_loop(step, tokenizer, sentences, batch, device)), note, patched


def corpus_options(impl: str) -> dict[str, int]:
    """``fusedenc.embed.encode``'s keywords of a corpus peer's name: ``corpus`` with optional
    ``:<N>`` (padded tokens a batch), ``:w<N>`` (tokenizing threads), ``:c<N>`` (texts a
    tokenized chunk), e.g. ``corpus:w2:c1024`` - the A/B rows of the command's defaults."""
    keys = {"w": "workers", "c": "texts_per_chunk"}
    options = {"max_batch_tokens": fusedenc.embed.DEFAULT_MAX_BATCH_TOKENS}
    for part in impl.split(":")[1:]:
        key = keys.get(part[:1], "max_batch_tokens")
        value = part[1:] if key != "max_batch_tokens" else part
        if not value.isdigit():
            raise ValueError(f"{impl!r}: {part!r} is not <N>, w<N> or c<N>")
        options[key] = int(value)
    return options


def graph_counts(model) -> dict:
    """The patched model's graph-cache counts (captures, replays, evictions, eager calls by why)."""
    if model is None:
        return {}
    from fusedenc.graphs import auto as auto_graphs

    stats = auto_graphs.cache_of(model).stats()
    return {**stats["counts"], "graphs held": stats["graphs"]}


def counts_since(before: dict, after: dict) -> dict:
    """Counts since ``before``; "graphs held" as it is after."""
    return {k: v if k == "graphs held" else v - before.get(k, 0)
            for k, v in after.items() if k == "graphs held" or v - before.get(k, 0)}  # fmt: skip


def timed(run, sentences, batch, device, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run(sentences, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def reference(name: str, device: torch.device, seed: int, tokenizer, sentences: list[str],
              batches: list[int]) -> dict[int, np.ndarray]:  # fmt: skip
    """The fp32 plain loop's embeddings at each batch size: what every peer is checked against."""
    model = eb.load_model(name, device, torch.float32, "sdpa", seed)
    return {b: st_loop(lambda f: eb.pooled(model(**f).last_hidden_state, f["attention_mask"]), tokenizer, sentences, b,
                       device) for b in batches}  # fmt: skip


def check_sentence_transformers(sentences: list[str], batch: int) -> dict[str, Any]:
    """The reproduced loop (fp32, CPU, the real model) against sentence-transformers' encode()."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(real_models.minilm_dir()), device="cpu")
    want = st.encode(sentences, batch_size=batch, convert_to_numpy=True)
    model, tokenizer = real_models.load_minilm("cpu", torch.float32)
    got = st_loop(lambda f: eb.pooled(model(**f).last_hidden_state, f["attention_mask"]), tokenizer, sentences, batch,
                  torch.device("cpu"))  # fmt: skip
    return {"sentences": len(sentences), "batch": batch, "max_abs_diff": float(np.abs(got - want).max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="comma list of minilm, bert-base, tiny (default minilm,bert-base)")
    ap.add_argument("--batch-sizes", default="32,128")
    ap.add_argument("--impl", default=",".join(IMPLS),
                    help="comma list of peers; corpus[:N][:wN][:cN] runs the corpus command's encode at N padded "
                         "tokens a batch, N tokenizing threads, N texts a chunk")
    ap.add_argument("--sentences", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", action="store_true",
                    help="GPU: one more pass per row under torch.profiler: the GPU's kernel time in the pass")
    ap.add_argument("--host-profile", action="store_true",
                    help="one more pass per row under cProfile: the calling thread's functions by their own time")
    ap.add_argument("--check-st", action="store_true", help="the loop against sentence-transformers (CPU, minilm)")
    ap.add_argument("--out-dir", default=os.environ.get(common.RESULTS_DIR_ENV) or common.DEFAULT_RESULTS_DIR)
    args = ap.parse_args(argv)
    device = common.resolve_device(args.device)
    if args.kernels and device.type != "cuda":
        ap.error("--kernels needs a GPU (it counts CUDA kernels)")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    names = common.comma_list(args.model or "minilm,bert-base")
    batches = [int(b) for b in common.comma_list(args.batch_sizes)]
    sentences = eb.read_sentences(args.sentences)
    env = common.environment(device)
    has_st = importlib.util.find_spec("sentence_transformers") is not None
    if has_st:
        import sentence_transformers

        env["sentence_transformers"] = sentence_transformers.__version__
    result: dict[str, Any] = {"schema": "fusedenc.bench.st_loop/1", "environment": env, "records": []}
    if args.check_st:
        result["st_check"] = check_sentence_transformers(sentences[:512], batches[0])
        print(f"the reproduced loop against sentence-transformers' encode(): {result['st_check']}")
    for name in names:
        tokenizer, tok_note = eb.tokenizer_for(name)
        lengths = eb.length_histogram([tokenize(tokenizer, sentences[i:i + 512]) for i in range(0, len(sentences), 512)])
        ref = reference(name, device, args.seed, tokenizer, sentences, batches)
        folder = os.path.join(tempfile.mkdtemp(prefix="st_loop_"), name)  # the ST peers' saved model
        for b in batches:
            record = {"model": name, "batch": b, "dtype": str(dtype).replace("torch.", ""), "tokenizer": tok_note,
                      "reps": args.reps, "weights": "real" if name == "minilm" and eb.minilm_weights() else "random",
                      "lengths": lengths, "results": []}  # fmt: skip
            result["records"].append(record)
            for impl in common.comma_list(args.impl):
                if impl in ST_IMPLS and not has_st:
                    continue
                try:
                    t0 = time.perf_counter()
                    run, note, patched = peer(impl, name, device, dtype, args.seed, tokenizer, folder)
                    t1 = time.perf_counter()
                    got = run(sentences, b)  # the first pass: compiles, plans, runs new shapes eagerly
                    first = time.perf_counter() - t1
                    # A second warm-up pass: a shape met once a pass is captured at its second call,
                    # which must not fall into a timed pass (the first pass is reported apart).
                    run(sentences, b)
                    setup = t1 - t0 + first
                    warm = graph_counts(patched)
                    cos = np.sum(got * ref[b], 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref[b], axis=1)
                    passes = timed(run, sentences, b, device, args.reps)
                    t = statistics.median(passes)
                    record["results"].append({"impl": impl, "sentences_per_s": len(sentences) / t, "seconds": t,
                                              "pass_seconds": passes,
                                              "min_cosine": float(cos.min()), "cosine_ok": bool(cos.min() >= COSINE),
                                              "setup_seconds": setup, "first_pass_seconds": first,
                                              "note": note,
                                              "warm_up_graphs": warm,
                                              "timed_graphs": counts_since(warm, graph_counts(patched)),
                                              "host_phases": _phases(getattr(run, "last_stats", None))})  # fmt: skip
                    if args.host_profile:
                        record["results"][-1]["host_profile"] = host_profile(lambda: run(sentences, b))
                    if args.kernels:  # how much of a pass the GPU works: the host's share is the rest
                        profile = common.kernel_profile(lambda _: run(sentences, b), [None], t)
                        record["results"][-1]["kernels"] = {k: profile[k] for k in ("kernel_us_per_batch",
                                                                                   "busy_fraction", "top_kernels")}
                except Exception as exc:  # noqa: BLE001 - a peer that fails is a row saying so
                    record["results"].append({"impl": impl, "error": f"{type(exc).__name__}: {exc}"})
                print("\n".join(table(record)), flush=True)
                write(args.out_dir, names, env, result)  # after every peer: a run cut short keeps what it measured
    base = write(args.out_dir, names, env, result)
    print(f"wrote {base}.json, {base}.txt")
    bad = [r for rec in result["records"] for r in rec["results"] if "error" in r or not r["cosine_ok"]]
    return 1 if bad else 0


def write(out_dir: str, names: list, env: dict, result: dict) -> str:
    """The result as JSON and as the printed tables; returns the files' path without suffix."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"st_loop_{common.slug('-'.join(names))}_{common.slug(env['device_name'] or 'cpu')}")
    common.write_json(base + ".json", result)
    with open(base + ".txt", "w", encoding="utf-8") as fh:
        fh.write("\n".join([common.describe_environment(env), ""] + [x for r in result["records"] for x in table(r)]) + "\n")
    return base


def table(record: dict) -> list[str]:
    h = record["lengths"]
    out = [f"{record['model']}, sentence-transformers' encode() loop at batch {record['batch']}, {record['dtype']}: "
           f"{h['sentences']} sentences, tokens median {h['median']:.0f} / p90 {h['p90']:.0f} / max {h['max']}",
           "  length histogram: " + ", ".join(f"{k}: {v}" for k, v in h["bins"].items() if v),
           f"  {'implementation':<16} {'sentences/s':>12} {'x best peer':>11} {'first pass/s':>12} {'min cosine':>11}  setup"]  # fmt: skip
    ok = [r for r in record["results"] if "error" not in r]
    peers = [r["sentences_per_s"] for r in ok if r["impl"] in PEERS]
    best = max(peers) if peers else None
    for r in record["results"]:
        if "error" in r:
            out.append(f"  {r['impl']:<16} failed: {r['error'][:150]}")
            continue
        ratio = f"{r['sentences_per_s'] / best:.2f}x" if best else "-"
        first = f"{record['lengths']['sentences'] / r['first_pass_seconds']:>12.0f}" \
            if r.get("first_pass_seconds") else f"{'-':>12}"  # older results have no first pass
        out.append(f"  {r['impl']:<16} {r['sentences_per_s']:>12.0f} {ratio:>11} {first} {r['min_cosine']:>11.6f}  "
                   f"{r['setup_seconds']:.1f}s {r['note']}" + ("" if r["cosine_ok"] else "  BELOW 0.9999"))  # fmt: skip
        if r.get("timed_graphs"):
            out.append(f"  {'':<16} graphs, 2 warm-up passes: {_counts(r['warm_up_graphs'])}; "
                       f"{record.get('reps', '')} timed passes: {_counts(r['timed_graphs'])}")
        if r.get("kernels"):
            k = r["kernels"]
            out.append(f"  {'':<16} GPU kernels, one more pass: {k['kernel_us_per_batch'] / 1e3:.1f} ms "
                       f"({100 * k['busy_fraction']:.0f}% of the timed pass); longest: "
                       + "; ".join(f"{x['us_per_batch'] / 1e3:.1f} ms {x['kernel'][:40]}" for x in k["top_kernels"][:2]))
        if r.get("host_profile"):
            out.append(f"  {'':<16} the calling thread, one more pass under cProfile (own time): "
                       + "; ".join(f"{100 * f['share']:.0f}% {f['function'][:50]} x{f['calls']}"
                                   for f in r["host_profile"][:5]))  # fmt: skip
        if r.get("host_phases"):
            p = r["host_phases"]
            out.append(f"  {'':<16} the last pass on the calling thread: {p['seconds']:.3f} s, waiting for the "
                       f"tokenizer {p['tokenizer_wait_s']:.3f}, the model's calls and copies back {p['model_s']:.3f}, "
                       f"batching {p['seconds'] - p['tokenizer_wait_s'] - p['model_s']:.3f}")  # fmt: skip
    return out + [""]


#: Functions listed by their own time in ``--host-profile``'s record (the table shows 5).
TOP_FUNCTIONS = 15


def host_profile(one_pass: Callable[[], Any]) -> list[dict]:
    """The calling thread's ``TOP_FUNCTIONS`` functions by their own time over one pass of
    ``one_pass`` under ``cProfile`` (which slows Python calls: the shares, not the seconds,
    are what it says)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(one_pass)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, callers)
    total = sum(v[2] for v in stats.values()) or 1.0
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:TOP_FUNCTIONS]
    return [{"function": f"{os.path.basename(f)}:{line}({name})" if line else name, "calls": v[0],
             "own_s": v[2], "share": v[2] / total} for (f, line, name), v in top]  # fmt: skip


def _phases(stats) -> Optional[dict]:
    """Where the corpus command's last pass spent its time (``EncodeStats``), or None."""
    if stats is None:
        return None
    return {"seconds": stats.seconds, "tokenizer_wait_s": stats.tokenizer_wait_s, "model_s": stats.model_s}


def _counts(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


if __name__ == "__main__":
    sys.exit(main())
