"""sentence-transformers models on fusedenc (CPU): ``patch_hf`` takes a ``SentenceTransformer``,
and its ``encode()`` then gives what the unpatched model's gives, in every pooling mode and
with its options (prompts, ``normalize_embeddings``, ``convert_to_tensor`` /
``convert_to_numpy``, ``batch_size``, token embeddings); ``sentence_embeddings`` takes the
model and what its ``tokenize()`` returns.  The models are small random BERT, RoBERTa and
XLM-R ones (tests/st_helpers.py); on a GPU, tests/test_sentence_transformers_gpu.py checks
the in-graph pooling against fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (the test extra has it)")

import st_helpers  # noqa: E402

import fusedenc  # noqa: E402
from fusedenc.hf import embedded, sentences  # noqa: E402

MODEL_TYPES = ["bert", "roberta", "xlm-roberta"]
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32 on the CPU: the same math, reassociated


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("st-models")
    return {t: st_helpers.hf_model_dir(root, t, seed=11 + i) for i, t in enumerate(MODEL_TYPES)}


def _texts(gen, n: int = 23) -> list[str]:
    """``n`` real sentences of mixed lengths (a few longer than the model's 32-token limit below)."""
    pool = st_helpers.sentences()
    picks = torch.randint(0, len(pool), (n,), generator=gen).tolist()
    return [pool[i] for i in picks] + ["A", " ".join(pool[:6])]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "mean_sqrt_len_tokens"])
@pytest.mark.parametrize("normalize", [True, False], ids=["Normalize", "no-Normalize"])
def test_encode_gives_the_unpatched_models_embeddings(model_dirs, model_type, pooling, normalize, gen):
    patched, ref = st_helpers.patched_pair(model_dirs[model_type], pooling=pooling, normalize=normalize,
                                           max_seq_length=32)  # fmt: skip
    texts = _texts(gen)
    for kw in ({}, {"batch_size": 5}, {"normalize_embeddings": True}, {"prompt": "query: "},
               {"convert_to_tensor": True}, {"batch_size": 1, "convert_to_numpy": True}):  # fmt: skip
        got, want = patched.encode(texts, **kw), ref.encode(texts, **kw)
        assert type(got) is type(want), kw
        got_t, want_t = (torch.as_tensor(x) for x in (got, want))
        assert got_t.dtype == want_t.dtype and got_t.shape == want_t.shape == (len(texts), st_helpers.WIDTH), kw
        torch.testing.assert_close(got_t, want_t, **TOL, msg=f"{model_type} {pooling} {kw} seed {gen.seed_value}")
    # token embeddings (every real token of each text) and a single text
    for g, w in zip(patched.encode(texts[:4], output_value="token_embeddings"),
                    ref.encode(texts[:4], output_value="token_embeddings")):  # fmt: skip
        torch.testing.assert_close(g, w, **TOL)
    torch.testing.assert_close(torch.as_tensor(patched.encode(texts[0])), torch.as_tensor(ref.encode(texts[0])), **TOL)


def test_patch_hf_takes_a_freshly_built_sentence_transformer(model_dirs):
    model = st_helpers.sentence_model(model_dirs["bert"])
    assert model.training  # as SentenceTransformer(modules=...) leaves it
    hf_model = model[0].auto_model
    assert fusedenc.patch_hf(model) is model
    assert not model.training and type(model).__name__ == "FusedencSentenceTransformer"
    assert isinstance(model, sentences.SentenceModel) and isinstance(hf_model, embedded.EmbeddedModel)
    assert fusedenc.patch_hf(model) is model  # a second call changes nothing
    copy_ = fusedenc.patch_hf(st_helpers.sentence_model(model_dirs["roberta"]), inplace=False)
    assert isinstance(copy_, sentences.SentenceModel)


def test_prompt_excluded_from_pooling_and_encode_query(model_dirs, gen):
    patched, ref = st_helpers.patched_pair(model_dirs["bert"], include_prompt=False)
    patched.prompts = ref.prompts = {"query": "query: ", "document": ""}
    texts = _texts(gen, 7)
    torch.testing.assert_close(torch.as_tensor(patched.encode(texts, prompt_name="query")),
                               torch.as_tensor(ref.encode(texts, prompt_name="query")), **TOL)  # fmt: skip
    torch.testing.assert_close(torch.as_tensor(patched.encode_query(texts)), torch.as_tensor(ref.encode_query(texts)),
                               **TOL)  # fmt: skip


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sentence_embeddings_take_the_model_and_its_tokenize_output(model_dirs, model_type, gen):
    patched, ref = st_helpers.patched_pair(model_dirs[model_type], max_seq_length=32)
    texts = _texts(gen, 9)
    features = ref.tokenize(texts)
    assert "modality" in features or len(features) == 3  # sentence-transformers 6 adds the modality
    for model in (patched, ref):
        got = fusedenc.sentence_embeddings(model, **features)
        assert got.dtype == torch.float32 and got.shape == (len(texts), st_helpers.WIDTH)
        torch.testing.assert_close(got, ref.encode(texts, convert_to_tensor=True), **TOL)
    no_norm_patched, no_norm_ref = st_helpers.patched_pair(model_dirs[model_type], normalize=False, max_seq_length=32)
    want = no_norm_ref.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(fusedenc.sentence_embeddings(no_norm_patched, **features), want, **TOL)
    torch.testing.assert_close(fusedenc.sentence_embeddings(no_norm_patched, **features, normalize=True),
                               torch.nn.functional.normalize(want, dim=1), **TOL)  # fmt: skip


def test_sentence_embeddings_refuse_what_a_sentence_transformer_cannot_take(model_dirs, gen):
    patched, _ = st_helpers.patched_pair(model_dirs["bert"])
    features = patched.tokenize(_texts(gen, 3))
    with pytest.raises(ValueError, match="normalize=False, but .* ends in a Normalize module"):
        fusedenc.sentence_embeddings(patched, **features, normalize=False)
    with pytest.raises(TypeError, match=r"unexpected arguments \['pixel_values'\]"):
        fusedenc.sentence_embeddings(patched, **features, pixel_values=torch.zeros(1))
    with pytest.raises(TypeError, match="input_ids must be a 2-D integer tensor"):
        fusedenc.sentence_embeddings(patched, features["input_ids"].float(), features["attention_mask"])
    bad = dict(features, input_ids=features["input_ids"].clone())
    bad["input_ids"][0, 1] = 10_000
    with pytest.raises(IndexError, match="input_ids holds 10000, outside the model's vocabulary"):
        fusedenc.sentence_embeddings(patched, **bad)


def test_encode_pools_in_the_graph_where_the_short_path_runs(model_dirs, gen, monkeypatch):
    """Where the patched model's graph can pool (mean, CLS, max, mean-sqrt-length; text),
    ``encode()`` takes the graph's ``[B, D]`` and runs no Pooling module; token embeddings and
    other pooling modes never ask for it.  The graph's pooled call is counted (on the CPU it
    runs its function eagerly)."""
    calls = []
    real_call = embedded.EmbeddedModel._fusedenc_pooled_call

    def pooled_call(self, ids, mask, types, normalize, mode="mean"):
        calls.append((tuple(ids.shape), normalize, mode))
        out = real_call(self, ids, mask, types, normalize, mode)
        assert out is not None, "the short path refused a plain batch"
        return out

    monkeypatch.setattr(embedded.EmbeddedModel, "_fusedenc_pooled_call", pooled_call)
    texts = _texts(gen, 11)
    for normalize in (True, False):
        patched, ref = st_helpers.patched_pair(model_dirs["bert"], normalize=normalize)
        pooling_runs = []
        patched[1].register_forward_hook(lambda *a: pooling_runs.append(1))
        calls.clear()
        got = patched.encode(texts, batch_size=4)
        # 13 texts by a budget of 4 x max_seq_length padded tokens: fewer, larger batches than 4 a batch
        budget = 4 * patched.max_seq_length
        assert sum(shape[0] for shape, *_ in calls) == len(texts) and 1 <= len(calls) < 4, calls
        assert all(b * s <= budget for (b, s), *_ in calls), (calls, budget)
        assert [c[1:] for c in calls] == [(normalize, "mean")] * len(calls) and pooling_runs == []
        np.testing.assert_allclose(got, ref.encode(texts, batch_size=4), rtol=1e-4, atol=1e-5)
        calls.clear()
        patched.encode(texts[:3], output_value="token_embeddings")
        patched.encode(texts[:3], output_value=None)
        assert calls == [] and len(pooling_runs) == 2
    for mode in ("cls", "max", "mean_sqrt_len_tokens"):
        model, ref = st_helpers.patched_pair(model_dirs["bert"], pooling=mode)
        calls.clear()
        np.testing.assert_allclose(model.encode(texts, batch_size=4), ref.encode(texts, batch_size=4), rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
        assert calls and [c[2] for c in calls] == [mode] * len(calls)
    model, _ = st_helpers.patched_pair(model_dirs["bert"], pooling="weightedmean")
    calls.clear()
    model.encode(texts[:3])
    assert calls == []


def test_encode_keeps_the_patched_models_graphs_between_calls(model_dirs, gen, monkeypatch):
    """sentence-transformers' ``encode()`` (6.0; later releases skip it when the model is
    already there) moves the model to its device on every call: a ``.to()`` that replaces no
    tensor must keep the patched model's graphs and its encoder's stack (dropping them
    recaptured every graph every call: 0.7x the patched loop on an H200)."""
    from fusedenc.graphs import auto as auto_graphs
    from fusedenc.hf import varlen as hf_varlen

    patched, _ = st_helpers.patched_pair(model_dirs["bert"], pooling="mean", normalize=True, max_seq_length=32)
    hf_model = sentences.sentence_parts(patched).hf_model
    cleared = []
    original_clear = auto_graphs.AutoGraphs.clear
    monkeypatch.setattr(auto_graphs.AutoGraphs, "clear", lambda self: (cleared.append(self), original_clear(self))[1])
    texts = _texts(gen)
    patched.encode(texts)
    stack = hf_varlen.stack_of(hf_model.encoder)
    assert stack is not None
    patched.to(patched.device)  # what encode() does first in sentence-transformers 6.0
    patched.encode(texts, batch_size=4)
    assert hf_varlen.stack_of(hf_model.encoder) is stack, "encode() rebuilt the encoder's stack"
    assert not any(c is auto_graphs.cache_of(hf_model) or c is stack.auto_graphs for c in cleared)
    patched.to(torch.float64)  # a real conversion still drops them
    assert hf_varlen.stack_of(hf_model.encoder) is None
    assert any(c is auto_graphs.cache_of(hf_model) for c in cleared)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_encode_tokenizes_in_chunks_on_threads_and_keeps_input_order(model_dirs, model_type, gen, monkeypatch):
    """The patched encode()'s own loop: texts tokenized in many chunks on threads, batches by
    a token budget, results back in input order, equal to sentence-transformers' loop; and a
    batch the short path declines (a hook on the embeddings) runs sentence-transformers' forward."""
    monkeypatch.setattr(sentences, "TOKENIZE_CHUNK", 3)  # 25 texts: 9 chunks on the threads
    patched, ref = st_helpers.patched_pair(model_dirs[model_type], pooling="mean", normalize=True, max_seq_length=32)
    texts = _texts(gen)
    for kw in ({}, {"batch_size": 2}, {"convert_to_tensor": True}, {"convert_to_numpy": False}):
        got, want = patched.encode(texts, **kw), ref.encode(texts, **kw)
        if isinstance(want, list):
            got, want = torch.stack(got), torch.stack(want)
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), **TOL, msg=f"{model_type} {kw}")
    assert not patched.encode(texts, convert_to_tensor=True).requires_grad  # no autograd history
    # left padding: sentence-transformers' own loop (HF's BERT numbers positions from the padding)
    patched.tokenizer.padding_side = ref.tokenizer.padding_side = "left"
    got, want = patched.encode(texts, batch_size=4), ref.encode(texts, batch_size=4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    patched.tokenizer.padding_side = ref.tokenizer.padding_side = "right"
    hf_model = sentences.sentence_parts(patched).hf_model
    hooked = []
    # On the embeddings (sentence-transformers >= 6.1 calls the HF model's forward directly,
    # so a hook on the model itself never runs, patched or not)
    hf_model.embeddings.register_forward_hook(lambda *a: hooked.append(1))
    got = patched.encode(texts, batch_size=8)
    np.testing.assert_allclose(got, ref.encode(texts, batch_size=8), rtol=1e-4, atol=1e-5)
    assert hooked, "the hooked model never ran its own forward"


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_encode_without_an_inference_step_runs_the_same_loop(model_dirs, model_type, gen, monkeypatch):
    """sentence-transformers before 6.1 loops inside encode() itself: the patched encode() then
    runs the corpus loop for plain calls and returns what 6.0's encode() returns (a tensor, an
    array, a list of rows, a single text's row); other calls are sentence-transformers' own."""
    monkeypatch.setattr(sentences, "_has_inference_step", lambda model: False)
    runs = []
    real_loop = sentences._encode_texts
    monkeypatch.setattr(sentences, "_encode_texts", lambda *a: (runs.append(len(a[2])), real_loop(*a))[1])
    patched, ref = st_helpers.patched_pair(model_dirs[model_type], pooling="cls", normalize=False, max_seq_length=32)
    texts = _texts(gen)
    for args, kw in (((texts,), {}), ((texts, None, None, 5), {}), ((texts,), {"normalize_embeddings": True}),
                     ((texts,), {"convert_to_tensor": True}), ((texts,), {"convert_to_numpy": False}),
                     ((texts[3],), {}), ((texts,), {"prompt": "query: "}),
                     ((texts[:4],), {"output_value": "token_embeddings"})):  # fmt: skip
        runs.clear()
        got, want = patched.encode(*args, **kw), ref.encode(*args, **kw)
        plain = "prompt" not in kw and "output_value" not in kw
        assert runs == ([len(texts) if isinstance(args[0], list) else 1] if plain else []), (kw, runs)
        assert type(got) is type(want), kw
        if isinstance(want, list):
            assert len(got) == len(want)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, **TOL)
        else:
            assert got.shape == want.shape and got.dtype == want.dtype, kw
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), **TOL, msg=str(kw))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_encode_tokenizes_fast_only_where_a_sample_shows_the_models_own_ids(model_dirs, model_type, gen, monkeypatch):
    """The patched encode() tokenizes with the fast tokenizer (ids only) where a sample of the
    call, truncation included, gives the ids of the model's own preprocess: then preprocess
    runs once, on the sample.  A preprocess that refuses the check's long probe, or gives other
    ids (here: one that prepends a word), is used for every chunk instead, and encode() equals
    the unpatched model's with it."""
    from fusedenc.hf import fast_ids, st_tokens

    monkeypatch.setattr(sentences, "TOKENIZE_CHUNK", 8)
    patched, ref = st_helpers.patched_pair(model_dirs[model_type], pooling="mean", normalize=True, max_seq_length=32)
    texts = _texts(gen, 60)
    own = type(patched).preprocess if hasattr(type(patched), "preprocess") else type(patched).tokenize
    name = own.__name__
    calls = []

    def counted(self, chunk, *a, **kw):
        calls.append(len(chunk))
        return own(self, chunk, *a, **kw)

    monkeypatch.setattr(type(patched), name, counted)
    torch.testing.assert_close(torch.as_tensor(patched.encode(texts)), torch.as_tensor(ref.encode(texts)), **TOL)
    assert len(calls) == 1 and calls[0] == 3 * fast_ids.SAMPLE_EACH + 2, calls  # the sample and its two probes
    # The fast ids equal preprocess's real tokens on every text, not just the sample
    fast = st_tokens.chunk_tokenizer(patched, texts)
    slow = st_tokens.chunk_tokenizer(patched, texts[:5])  # a short call: preprocess itself
    (quick_ids, fast_types), (slow_ids, _) = fast(texts), slow(texts)
    assert fast_types is None and [list(map(int, s)) for s in slow_ids] == [list(map(int, f)) for f in quick_ids]
    assert max(map(len, quick_ids)) == 32  # some texts truncated

    longest = max(map(len, texts))

    def refuses_long(self, chunk, *a, **kw):  # refuses the sample's long probe, and only that
        calls.append(len(chunk))
        if any(len(t) > longest + 2 for t in chunk):
            raise ValueError("too long")
        return own(self, chunk, *a, **kw)

    monkeypatch.setattr(type(patched), name, refuses_long)
    calls.clear()
    torch.testing.assert_close(torch.as_tensor(patched.encode(texts)), torch.as_tensor(ref.encode(texts)), **TOL)
    assert sum(calls) == 3 * fast_ids.SAMPLE_EACH + 2 + len(texts), calls  # a failed check: preprocess throughout

    def prefixed(self, chunk, *a, **kw):
        calls.append(len(chunk))
        return own(self, ["note: " + t for t in chunk], *a, **kw)

    monkeypatch.setattr(type(patched), name, prefixed)
    monkeypatch.setattr(type(ref), name, lambda self, chunk, *a, **kw: own(self, ["note: " + t for t in chunk], *a, **kw))
    calls.clear()
    torch.testing.assert_close(torch.as_tensor(patched.encode(texts)), torch.as_tensor(ref.encode(texts)), **TOL)
    assert sum(calls) == 3 * fast_ids.SAMPLE_EACH + 2 + len(texts), calls  # the sample, then every chunk
