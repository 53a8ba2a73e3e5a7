"""Sentence-embedding throughput on real text: tokenized sentences in, pooled embeddings out.

    python3 bench/embeddings.py                       # GPU: bert-base and all-MiniLM-L6-v2, every peer
    python3 bench/embeddings.py --model tiny          # CPU smoke run (the default without a GPU)
    python3 bench/embeddings.py --model minilm --batch-sizes 128 --impl hf-sdpa,fusedenc,fusedenc-graph
    python3 bench/embeddings.py --io device           # inputs on the device before timing, outputs left there
    python3 bench/embeddings.py --full-length 128     # no padding: every sequence 128 tokens
    python3 bench/embeddings.py --passages 512        # retrieval passages: runs of sentences up to 512 tokens

The sentences are ``tests/data/real_sentences`` (English prose of the Python 3.11
documentation, in a seeded random order), taken in file order and batched as a service
would: each batch padded to its longest sentence (``pad_to_multiple_of=8`` for every
implementation alike, which also bounds the shapes ``torch.compile`` sees).  Tokenization
happens once, before timing; a timed pass runs every batch through an implementation and
mean-pools the last hidden state over the attention mask (sentence-transformers' pooling
for all-MiniLM-L6-v2; the same pooling for bert-base).  The table reports sentences/s and
tokens/s (real tokens), the median of ``--reps`` passes (default 10), with the ratio to the
best peer.

``--passages N`` measures what a retrieval index embeds: the whole corpus cut into passages,
each a run of consecutive sentences of at most N tokens (a greedy chunker, as text splitters
with a token limit make them; a sentence longer than N is truncated), so batches hold nearly
full sequences with a few percent of padding; truncation is then N.

``--full-length N`` measures batches with no padding instead (where the padding-free path
must be no slower than the padded one): every sequence is exactly N tokens, its sentence cut
to N or followed by [PAD] tokens that the mask marks real (all ones), so every
implementation computes all B x N tokens.

Where the inputs and outputs live (``--io``, the same for every implementation):

  host (default)   the tokenized batches are ordinary (unpinned) CPU tensors, and every
                   timed batch is ``{k: v.to(device) ...}`` -> the implementation ->
                   embeddings ``.cpu()``, as sentence-transformers' ``encode()`` does: the
                   copy back waits for the batch's work, so every implementation drains
                   the GPU once a batch.  Timed by the wall clock around the pass (a
                   synchronize at its end).  The default because it is what a service
                   sees, and because under it the padding-free path's own host read of the
                   mask (one sync a batch) waits on an already drained queue instead of
                   stalling one the peers keep full.  fusedenc-pooled takes the host
                   tensors as they are (``sentence_embeddings`` accepts the tokenizer's
                   output and copies it over itself): its step still starts from the same
                   host batch and ends with the embeddings on the host.
  device           the batches are moved to the device before timing and the embeddings
                   stay there, so an implementation that never syncs queues a whole pass
                   ahead of the GPU; timed by CUDA events around the pass (wall clock on
                   CPU).  A measure of device-resident throughput that penalises any
                   per-batch sync (the padding-free path's mask read) which a real service
                   pays anyway.

Before timing, every implementation runs once on each distinct batch shape (warm-up:
``torch.compile``'s compilation and, in reduce-overhead mode, its first CUDA-graph step;
fusedenc's captures and plans), then once on every batch for the fp32 check below, so by
the first timed pass each shape has run at least twice.  The JSON and the text table are
rewritten after every implementation's row, so a run that is cut keeps what it measured
(a (model, batch) record still running has ``"complete": false``).

Implementations (``--impl``):

  hf-eager, hf-sdpa     the Hugging Face model, attn_implementation "eager" / "sdpa"
  compile, compile-ro   torch.compile of the HF sdpa model, default and "reduce-overhead"
                        modes (warmed up over every batch shape of the run: the timed pass
                        sees no new shape, which favours them)
  compile-pooled, compile-ro-pooled
                        torch.compile of the HF sdpa model and the mean pooling together
                        (one function: the pooling's ops join the compiled graph), both modes
  fusedenc-padded       patch_hf(model, padding_free=False): every layer on the padded batch
  fusedenc              patch_hf(model): the padding-free path (one gather, every layer on
                        the real tokens, one scatter); its note in the table gives the
                        automatic CUDA graphs' counts (held, captures, replays, evictions,
                        eager calls) over the whole run of that row
  fusedenc-pooled       fusedenc.sentence_embeddings(patch_hf(model), **host_batch): the
                        padding-free path with the mean pooling and normalization inside its
                        CUDA graph, fed the tokenizer's host tensors (the peer to compare it
                        with is compile-*-pooled)
  fusedenc-graph        HF's embeddings, then the patched layers as a
                        ``VarlenGraphRunner`` (CUDA graphs keyed by token count) on the
                        packed rows, pooled straight from them (``fusedenc.varlen.packing.mean_pool``)

``--kernels`` (GPU): after timing, one more pass of each row runs under ``torch.profiler`` and
the row also reports its GPU kernels a batch (launched, or replayed from a CUDA graph), their
summed device time a batch (the floor the call could reach with no gaps and no host cost), and
that floor's share of the timed pass: where small batches lose their time.

Before timing, every implementation's embeddings are compared with the fp32 HF model's on
the same batches: the smallest cosine over all sentences is reported (the target for fp16
is >= 0.9999) and a failure is marked in the table.  bert-base has random weights (HF's
initialisation, no download) and the MiniLM tokenizer (the same uncased WordPiece vocabulary);
all-MiniLM-L6-v2 is the trained model of the ``real-models`` extra.  Without that package
(the CPU smoke run in CI) the ``tiny`` model uses a word-level stand-in tokenizer.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import os
import re
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch._dynamo
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import peers  # noqa: E402

import fusedenc  # noqa: E402
from fusedenc.attention import varlen as varlen_attention  # noqa: E402
from fusedenc.graphs import auto as auto_graphs  # noqa: E402
from fusedenc.graphs import varlen as varlen_graphs
from fusedenc.hf import embedded as hf_embedded
from fusedenc.hf import real_models
from fusedenc.hf import varlen as hf_varlen
from fusedenc.varlen import packing as varlen

SENTENCES = Path(__file__).resolve().parent.parent / "tests" / "data" / "real_sentences" / "sentences.txt.gz"
IMPLS = ("hf-eager", "hf-sdpa", "compile", "compile-ro", "compile-pooled", "compile-ro-pooled", "fusedenc-padded",
         "fusedenc", "fusedenc-pooled", "fusedenc-graph")  # fmt: skip
CPU_IMPLS = ("hf-eager", "hf-sdpa", "fusedenc-padded", "fusedenc", "fusedenc-pooled")
MODELS = ("minilm", "bert-base", "tiny")
FP16_COSINE = 0.9999
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
#: all-MiniLM-L6-v2's shape: its random-weight stand-in where the real weights are not installed.
MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
LENGTH_BINS = (8, 16, 32, 64, 128, 256, 512)
REPS = 10
IO_MODES = ("host", "device")
IO_TIMING = {
    "host": "tokenized batches on the host; each timed batch copied to the device (.to) and its embeddings "
            "back (.cpu()); wall clock around the pass, synchronized at its end",
    "device": "tokenized batches on the device before timing, embeddings left there; CUDA events around the "
              "pass (wall clock on CPU)",
}  # fmt: skip


# ------------------------------------------------------------ inputs ----


def read_sentences(n: Optional[int]) -> list[str]:
    """The first ``n`` sentences (None: all)."""
    with gzip.open(SENTENCES, "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    return lines[:n]


def make_passages(sentences: list[str], tokenizer, max_tokens: int) -> list[str]:
    """Runs of consecutive ``sentences`` joined by spaces, each of at most ``max_tokens`` tokens
    with the two special tokens (a greedy chunker); a sentence longer than that is a passage of
    its own, truncated when tokenized."""
    if isinstance(tokenizer, WordTokenizer):
        counts = [len(tokenizer.ids(t)) - 2 for t in sentences]
    else:
        counts = [len(ids) for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"]]
    budget = max_tokens - 2
    passages: list[str] = []
    run: list[str] = []
    used = 0
    for text, count in zip(sentences, counts):
        if run and used + count > budget:
            passages.append(" ".join(run))
            run, used = [], 0
        run.append(text)
        used += count
    if run:
        passages.append(" ".join(run))
    return passages


class WordTokenizer:
    """A stand-in for the WordPiece tokenizer where the real-models extra is missing (CPU
    smoke runs): lower-cased words and punctuation hashed into the vocabulary, [CLS] ... [SEP]."""

    def __init__(self, vocab_size: int = 30522):
        self.vocab_size = vocab_size

    def ids(self, sentence: str) -> list[int]:
        words = re.findall(r"\w+|[^\w\s]", sentence.lower())
        return [101] + [1000 + zlib.crc32(w.encode()) % (self.vocab_size - 1000) for w in words] + [102]

    def __call__(self, sentences, max_length: int = 512, pad_to_multiple_of: int = 8) -> dict[str, torch.Tensor]:
        rows = [self.ids(s)[:max_length] for s in sentences]
        longest = max(len(r) for r in rows)
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def tokenizer_for(model: str):
    try:
        return real_models.load_minilm_tokenizer(), "all-MiniLM-L6-v2 WordPiece (uncased)"
    except real_models.RealModelMissing:
        if model != "tiny":
            raise
        return None, "word-level stand-in (real-models extra not installed)"


def make_batches(sentences, tokenizer, batch: int, max_length: int, device=None,
                 full_length: Optional[int] = None) -> list[dict[str, torch.Tensor]]:
    """The tokenized batches: CPU tensors, or moved to ``device`` (``--io device``);
    ``full_length``: every sequence that many tokens, none of them padding (module docstring)."""
    out = []
    for start in range(0, len(sentences) - batch + 1, batch):  # whole batches only
        chunk = sentences[start:start + batch]
        if isinstance(tokenizer, WordTokenizer):
            enc = tokenizer(chunk, max_length=max_length)
        else:
            enc = dict(tokenizer(chunk, padding=True, truncation=True, max_length=max_length, pad_to_multiple_of=8,
                                 return_tensors="pt"))  # fmt: skip
        if full_length is not None:
            enc = _full_length(enc, full_length)
        out.append(enc if device is None else {k: v.to(device) for k, v in enc.items()})
    return out


def _full_length(enc: dict, n: int) -> dict[str, torch.Tensor]:
    """``enc`` cut or padded to ``n`` tokens, the mask all ones (pad tokens count as real)."""
    out = {k: F.pad(v[:, :n], (0, n - min(n, v.shape[1]))) for k, v in enc.items()}
    out["attention_mask"] = torch.ones_like(out["attention_mask"])
    return out


def distinct_shapes(batches) -> list[dict[str, torch.Tensor]]:
    """The first batch of each shape: the warm-up (each shape once, no more)."""
    seen: dict[tuple, dict] = {}
    for b in batches:
        seen.setdefault(tuple(b["input_ids"].shape), b)
    return list(seen.values())


def length_histogram(batches) -> dict[str, Any]:
    lengths = torch.cat([b["attention_mask"].sum(1).cpu() for b in batches])
    bins, lo = {}, 0
    for hi in LENGTH_BINS:
        bins[f"{lo + 1}-{hi}"] = int(((lengths > lo) & (lengths <= hi)).sum())
        lo = hi
    real = int(lengths.sum())
    padded = sum(b["attention_mask"].numel() for b in batches)
    q = torch.quantile(lengths.float(), torch.tensor([0.1, 0.5, 0.9, 0.99])).tolist()
    return {"sentences": len(lengths), "min": int(lengths.min()), "p10": q[0], "median": q[1], "p90": q[2],
            "p99": q[3], "max": int(lengths.max()), "mean": float(lengths.float().mean()), "bins": bins,
            "real_tokens": real, "padded_tokens": padded, "padding_fraction": 1 - real / padded}  # fmt: skip


# ------------------------------------------------------------ models ----


_CPU_MODELS: dict[tuple, Any] = {}  # (name, attn implementation, seed) -> the fp32 CPU model, made once


def minilm_weights() -> bool:
    """Whether the real all-MiniLM-L6-v2 weights are here (else ``minilm`` is its shape with
    random weights: the same work per token, on the real tokenizer's counts)."""
    try:
        real_models.minilm_dir()
    except real_models.RealModelMissing:
        return False
    return True


def load_model(name: str, device, dtype, impl: str, seed: int):
    """The HF model (eval, on device, in dtype) with attn_implementation ``impl``: a copy of
    the fp32 CPU model made once per (name, impl, seed) (building bert-base takes seconds);
    ``minilm``: the real model where installed (``minilm_weights``), else its shape."""
    import transformers

    key = (name, impl, seed)
    if key not in _CPU_MODELS:
        if name == "minilm" and minilm_weights():
            _CPU_MODELS[key], _ = real_models.load_minilm("cpu", torch.float32, attn_implementation=impl)
        else:
            shape = {"bert-base": BERT_BASE, "minilm": MINILM}.get(name, TINY)
            config = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, hidden_act="gelu",
                                             layer_norm_eps=1e-12, attn_implementation=impl, **shape)  # fmt: skip
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                _CPU_MODELS[key] = transformers.BertModel(config, add_pooling_layer=False).eval()
    return copy.deepcopy(_CPU_MODELS[key]).to(device=device, dtype=dtype).eval()


def saved_model_folder(name: str, folder: str, seed: int = 0) -> str:
    """``folder`` holding ``load_model(name)``'s fp32 weights and ``tokenizer_for(name)``'s
    tokenizer (written once): a model folder for the scripts that load one from disk."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        load_model(name, "cpu", torch.float32, "sdpa", seed).save_pretrained(folder)
        tokenizer_for(name)[0].save_pretrained(folder)
    return folder


def pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' mean pooling (fp32) and L2 normalization."""
    return F.normalize(varlen.masked_mean_pool(hidden, mask), dim=1)


def hf_runner(model) -> Callable[[dict], torch.Tensor]:
    def run(batch):
        out = model(**batch)
        return pooled(out.last_hidden_state, batch["attention_mask"])

    return run


def graph_runner(model, batches, max_sequences: int) -> tuple[Callable[[dict], torch.Tensor], Any]:
    """HF embeddings -> pack -> VarlenGraphRunner over the patched layers -> pooled from packed rows."""
    encoder = model.encoder
    stack = fusedenc.EncoderStack([layer.block for layer in encoder.layer])
    max_seqlen = max(b["input_ids"].shape[1] for b in batches)
    most = max(int(b["attention_mask"].sum()) for b in batches)
    buckets = varlen_graphs.default_token_buckets(most)
    runner = stack.varlen_graph_runner(buckets, max_sequences=max_sequences, max_seqlen=max_seqlen)

    def run(batch):
        x = model.embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"))
        packing = varlen.packing_from_mask(batch["attention_mask"] == 0)
        rows = runner(varlen.pack(x, packing), varlen_offsets(packing))
        return F.normalize(varlen.mean_pool(rows, packing), dim=1)

    return run, runner


def varlen_offsets(packing) -> list[int]:
    out = [0]
    for n in packing.lengths:
        out.append(out[-1] + n)
    return out


def with_io(run, device, io: str) -> Callable[[dict], torch.Tensor]:
    """One batch as ``--io`` times it: ``device``: ``run`` itself (batches already on the
    device, embeddings left there); ``host``: the batch copied to the device, the embeddings
    brought back (both blocking, as sentence-transformers' ``encode()``); a ``run`` marked
    ``takes_host_batch`` gets the host batch itself."""
    if io == "device":
        return run
    if getattr(run, "takes_host_batch", False):
        return lambda batch: run(batch).cpu()

    def step(batch):
        return run({k: v.to(device) for k, v in batch.items()}).cpu()

    return step


def build(impl: str, name: str, device, dtype, seed: int, batches, batch: int, io: str):
    """(runner, one-time seconds, note) for one implementation, warmed up over every batch shape."""
    start = time.perf_counter()
    note = ""
    hf_impl = "eager" if impl == "hf-eager" else "sdpa"
    model = load_model(name, device, dtype, hf_impl, seed)
    if impl in ("hf-eager", "hf-sdpa"):
        run = hf_runner(model)
    elif impl in ("compile", "compile-ro"):
        # A fresh dynamo cache per row, with room for every padded length: models of one class
        # (MiniLM and bert-base are both BertModel) share its entries and its recompile limit,
        # and past the limit a compiled model silently runs eagerly.
        torch._dynamo.reset()
        peers.raise_recompile_limits()
        mode = "reduce-overhead" if impl == "compile-ro" else None
        run = hf_runner(torch.compile(model, mode=mode))
    elif impl in ("compile-pooled", "compile-ro-pooled"):
        torch._dynamo.reset()
        peers.raise_recompile_limits()
        # hf_runner's function (the model, then the pooling) compiled whole.
        run = torch.compile(hf_runner(model), mode="reduce-overhead" if impl == "compile-ro-pooled" else None)
    elif impl == "fusedenc-padded":
        run = hf_runner(fusedenc.patch_hf(model, padding_free=False))
    elif impl == "fusedenc":
        patched = fusedenc.patch_hf(model)
        run = hf_runner(patched)
        # A BertModel's embeddings and encoder share one graph, held by the model (hf_embedded).
        run.graph_stats = lambda: (auto_graphs.cache_of(patched) if isinstance(patched, hf_embedded.EmbeddedModel)
                                   else hf_varlen.stack_of(patched.encoder).auto_graphs).stats()
    elif impl == "fusedenc-pooled":
        patched = fusedenc.patch_hf(model)

        def run(batch):
            return fusedenc.sentence_embeddings(patched, **batch)

        run.takes_host_batch = True  # the tokenizer's tensors, as they are (with_io)
        run.graph_stats = lambda: auto_graphs.cache_of(patched).stats()
    elif impl == "fusedenc-graph":
        run, runner = graph_runner(fusedenc.patch_hf(model), batches, batch)
        note = f"{len(runner.token_buckets)} token buckets"
    else:
        raise ValueError(impl)
    step = with_io(run, device, io)
    with torch.inference_mode():
        for b in distinct_shapes(batches):  # every shape once: compilation, captures, plans
            step(b)
    common_sync(device)
    return run, time.perf_counter() - start, note


def common_sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def embed_all(run, batches) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([run(b).float().cpu() for b in batches])


def time_passes(step, batches, device, reps: int, io: str) -> list[float]:
    """Seconds per pass of ``step`` (``with_io``) over every batch: ``--io host``: wall clock,
    synchronized at the end; ``device``: device events on a GPU, wall clock on CPU."""
    out = []
    with torch.inference_mode():
        for _ in range(reps):
            if io == "device" and device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for b in batches:
                    step(b)
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                for b in batches:
                    step(b)
                common_sync(device)
                out.append(time.perf_counter() - t0)
    return out


# ------------------------------------------------------------ main ----


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=f"comma list of {', '.join(MODELS)} "
                    "(default minilm,bert-base on a GPU, tiny on CPU)")  # fmt: skip
    ap.add_argument("--batch-sizes", default=None, help="comma list (default 32,128,512 on a GPU; 8,32 on CPU)")
    ap.add_argument("--impl", default=None, help=f"comma list of {', '.join(IMPLS)} (default all on a GPU; "
                    f"{', '.join(CPU_IMPLS)} on CPU)")  # fmt: skip
    ap.add_argument("--io", choices=IO_MODES, default="host",
                    help="host (default): batches copied in and embeddings copied out inside the timed pass, "
                         "as sentence-transformers does; device: both stay on the device")  # fmt: skip
    ap.add_argument("--sentences", type=int, default=None, help="sentences per pass (default 4096 on a GPU, 64 on CPU)")
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                    help="default float16 on a GPU, float32 on CPU")  # fmt: skip
    ap.add_argument("--max-length", type=int, default=None,
                    help="truncation (default sentence-transformers' 256; with --passages N, N)")
    ap.add_argument("--passages", type=int, default=None, metavar="N",
                    help="the corpus as passages of up to N tokens (see above); --sentences then counts passages")
    ap.add_argument("--full-length", type=int, default=None, metavar="N",
                    help="batches with no padding: every sequence exactly N tokens (see above)")
    ap.add_argument("--reps", type=int, default=REPS, help=f"timed passes, median taken (default {REPS})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out-dir", default=os.environ.get(common.RESULTS_DIR_ENV) or common.DEFAULT_RESULTS_DIR)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--kernels", action="store_true",
                    help="GPU: profile one more pass per row: kernels a batch and their device time (see above)")
    args = ap.parse_args(argv)

    device = common.resolve_device(args.device)
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.set_device(device)
    models = common.comma_list(args.model or ("minilm,bert-base" if gpu else "tiny"))
    impls = common.comma_list(args.impl or ",".join(IMPLS if gpu else CPU_IMPLS))
    sizes = [int(b) for b in common.comma_list(args.batch_sizes or ("32,128,512" if gpu else "8,32"))]
    for m in models:
        if m not in MODELS:
            ap.error(f"--model {m!r} is not one of {MODELS}")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"--impl {i!r} is not one of {IMPLS}")
    if not gpu and "fusedenc-graph" in impls:
        ap.error("fusedenc-graph needs a GPU (CUDA graphs)")
    if not gpu and args.kernels:
        ap.error("--kernels needs a GPU (it counts CUDA kernels)")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    if args.passages is not None and (args.passages < 3 or args.full_length is not None):
        ap.error("--passages takes N >= 3 (two special tokens and text) and not --full-length")
    args.max_length = args.max_length or args.passages or 256
    if args.passages is not None and args.passages > args.max_length:
        ap.error(f"--passages {args.passages} is longer than --max-length {args.max_length}")
    if args.full_length is not None and not 1 <= args.full_length <= args.max_length:
        ap.error(f"--full-length must be in [1, --max-length={args.max_length}], got {args.full_length}")
    io = args.io
    dtype = getattr(torch, args.dtype or ("float16" if gpu else "float32"))
    dtype_name = str(dtype).replace("torch.", "")
    n = args.sentences or (4096 if gpu else 64)
    sentences = read_sentences(None if args.passages else n)
    env = common.environment(device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        print("bench/embeddings.py needs transformers", file=sys.stderr)
        return 2
    env["varlen_attention"] = varlen_attention.choose(dtype, 64, device)

    shape = [f"full{args.full_length}"] if args.full_length else [f"passages{args.passages}"] if args.passages else []
    tag = args.tag or "_".join(("-".join(models), *shape, dtype_name, common.slug(env["device_name"])))
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"embeddings_{tag}")
    records: list[dict] = []

    def save() -> None:  # after every row: a run cut by a time limit keeps what it measured
        write_results(base, {"environment": env, "args": vars(args), "io": io, "timing": IO_TIMING[io],
                             "records": records})  # fmt: skip

    for name in models:
        tokenizer, tok_note = tokenizer_for(name)
        tokenizer = tokenizer or WordTokenizer()
        ref_model = load_model(name, device, torch.float32, "sdpa", args.seed)
        for batch in sizes:
            texts = make_passages(sentences, tokenizer, args.passages)[:args.sentences] if args.passages else sentences
            batches = make_batches(texts, tokenizer, batch, args.max_length, device if io == "device" else None,
                                   args.full_length)  # fmt: skip
            if not batches:
                print(f"skip {name} batch {batch}: fewer than {batch} sentences", file=sys.stderr)
                continue
            hist = length_histogram(batches)
            ref = embed_all(with_io(hf_runner(ref_model), device, io), batches)
            record = {"model": name, "batch": batch, "dtype": dtype_name, "io": io, "tokenizer": tok_note,
                      "full_length": args.full_length, "passages": args.passages,
                      "lengths": hist, "results": [], "complete": False}  # fmt: skip
            records.append(record)
            for impl in impls:
                print(f"[{name} b{batch} io={io}] {impl} ...", file=sys.stderr, flush=True)
                try:
                    row = measure(impl, name, device, dtype, args.seed, batches, batch, io, ref, hist, args.reps,
                                  args.kernels)  # fmt: skip
                except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others
                    row = {"impl": impl, "error": f"{type(e).__name__}: {e}"}
                record["results"].append(row)
                save()
                if gpu:
                    torch.cuda.empty_cache()
            record["complete"] = True
            save()
            print("\n".join(table(record)), flush=True)
        del ref_model

    print(f"wrote {base}.json and {base}.txt")
    failed = [(r["model"], r["batch"], x["impl"]) for r in records for x in r["results"] if not x.get("cosine_ok", True)]
    if failed:
        print(f"embeddings below cosine {FP16_COSINE} against fp32: {failed}", file=sys.stderr)
    return 0


def measure(impl: str, name: str, device, dtype, seed: int, batches, batch: int, io: str, ref: torch.Tensor,
            hist: dict, reps: int, kernels: bool = False) -> dict:
    """One implementation's row: built and warmed up, checked against ``ref``, timed (and, with
    ``kernels``, one more pass profiled: ``common.kernel_profile``)."""
    run, setup_s, note = build(impl, name, device, dtype, seed, batches, batch, io)
    step = with_io(run, device, io)
    emb = embed_all(step, batches)
    cos = F.cosine_similarity(emb.double(), ref.double(), dim=1)
    passes = time_passes(step, batches, device, reps, io)
    sec = statistics.median(passes)
    row = {"impl": impl, "seconds_per_pass": sec, "sentences_per_s": hist["sentences"] / sec,
           "real_tokens_per_s": hist["real_tokens"] / sec, "min_cosine": float(cos.min()),
           "mean_cosine": float(cos.mean()), "cosine_ok": bool(cos.min() >= FP16_COSINE) or dtype != torch.float16,
           "setup_seconds": setup_s, "note": note, "passes_s": passes}  # fmt: skip
    if kernels:
        try:
            row["kernels"] = common.kernel_profile(step, batches, sec)
        except Exception as e:  # noqa: BLE001 - a profiler that cannot run here must not lose the row
            row["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    stats = getattr(run, "graph_stats", None)
    if stats is not None:
        try:
            st = stats()
        except AttributeError:  # no stack made (the CPU smoke run without graphs)
            st = None
        if st is not None:
            c = st["counts"]
            row["auto_graphs"] = st
            row["note"] = (note + "; " if note else "") + (
                f"automatic graphs: {st['graphs']} held, {c.get('captures', 0)} captures, "
                f"{c.get('replays', 0)} replays, {c.get('evictions', 0)} evictions, "
                f"{sum(v for k, v in c.items() if k.startswith('eager'))} eager calls")
    return row


def write_results(base: str, result: dict) -> None:
    """``base``.json and ``base``.txt (the environment and every record's table so far), each
    replaced whole."""
    common.write_json(base + ".json", result)
    lines = [common.describe_environment(result["environment"]), f"I/O {result['io']}: {result['timing']}", ""]
    for record in result["records"]:
        lines += table(record)
    tmp = base + ".txt.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(tmp, base + ".txt")


def table(record: dict) -> list[str]:
    h = record["lengths"]
    full = f", every sequence {record['full_length']} tokens (no padding)" if record.get("full_length") else ""
    if record.get("passages"):
        full = f", passages of up to {record['passages']} tokens (runs of consecutive sentences)"
    out = [f"{record['model']}, batch {record['batch']}, {record['dtype']}, io {record['io']}{full}: {h['sentences']} sentences, "
           f"tokens per sentence min {h['min']} / p10 {h['p10']:.0f} / median {h['median']:.0f} / mean {h['mean']:.1f} / "
           f"p90 {h['p90']:.0f} / p99 {h['p99']:.0f} / max {h['max']}; {100 * h['padding_fraction']:.0f}% of the "
           f"padded batches' tokens are padding",
           "  length histogram: " + ", ".join(f"{k}: {v}" for k, v in h["bins"].items() if v),
           f"  {'implementation':<16} {'sentences/s':>12} {'tokens/s':>12} {'x best peer':>11} {'min cosine':>11}  setup"]  # fmt: skip
    ok = [r for r in record["results"] if "error" not in r]
    peers = [r["sentences_per_s"] for r in ok if not r["impl"].startswith("fusedenc")]
    best = max(peers) if peers else None
    for r in record["results"]:
        if "error" in r:
            out.append(f"  {r['impl']:<16} failed: {r['error'][:150]}")
            continue
        ratio = f"{r['sentences_per_s'] / best:.2f}x" if best else "-"
        flag = "" if r["cosine_ok"] else "  BELOW 0.9999"
        out.append(f"  {r['impl']:<16} {r['sentences_per_s']:>12.0f} {r['real_tokens_per_s']:>12.0f} {ratio:>11} "
                   f"{r['min_cosine']:>11.6f}  {r['setup_seconds']:.1f}s {r['note']}{flag}".rstrip())  # fmt: skip
        if "kernels" in r:
            out.append(f"  {'':<16} {common.kernel_note(r['kernels'])}")
            for k in r["kernels"].get("top_kernels", [])[:4]:  # the rest in the JSON
                out.append(f"  {'':<16}   {k['us_per_batch']:7.1f} us, {k['per_batch']:4.0f}x  {k['kernel'][:90]}")
    if not record.get("complete", True):
        out.append("  (still running: the rows above are those measured so far)")
    return out + [""]


if __name__ == "__main__":
    sys.exit(main())
