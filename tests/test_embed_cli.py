"""``python -m fusedenc embed`` on the CPU with a small random BERT folder (tests/st_helpers.py):
its embeddings equal sentence-transformers' mean pooling + Normalize over the same folder,
in input order, for every input and output format, through chunks and many batches; bad
input stops it before anything is written, naming the file and row; a stopped run resumes."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (the test extra has it)")

import st_helpers  # noqa: E402

import fusedenc.embed  # noqa: E402
from fusedenc.embed import (
    cli,  # noqa: E402
    embedding,  # noqa: E402
)
from fusedenc.hf import token_batches  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return st_helpers.hf_model_dir(tmp_path_factory.mktemp("models"), "bert", seed=3)


@pytest.fixture(scope="module")
def texts():
    pool = st_helpers.sentences()
    return list(pool[:40]) + [" ".join(pool[40:60])]  # the last is longer than the model's 140 tokens


@pytest.fixture(scope="module")
def reference(folder, texts):
    model = st_helpers.sentence_model(folder, max_seq_length=140).eval()
    return model.encode(texts, convert_to_numpy=True)


def _run(args, capsys) -> tuple[int, str]:
    args = [str(a) for a in args]
    if "--device" not in args:  # on the CPU also where a GPU is (the command would take it, in fp16)
        args += ["--device", "cpu"]
    rc = cli.main(args)
    return rc, capsys.readouterr().err


def test_txt_to_npy_equals_sentence_transformers(folder, texts, reference, tmp_path, capsys):
    src = tmp_path / "corpus.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "emb.npy"
    rc, err = _run([folder, src, "-o", out, "--max-batch-tokens", "300", "--chunk", "9", "--no-progress"], capsys)
    assert rc == 0, err
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (len(texts), st_helpers.WIDTH)
    np.testing.assert_allclose(got, reference, **TOL)
    last = err.strip().splitlines()[-1]
    assert "41 texts" in last and "texts/s" in last and "the whole command" in last, last
    assert re.search(r"; \d+% of it waiting for the tokenizer\)", last), last
    assert "1 texts longer than the model's 140 tokens were truncated" in err
    assert not (tmp_path / "emb.npy.progress.json").exists() and not (tmp_path / "emb.npy.partial.npy").exists()


def test_jsonl_to_parquet_and_parquet_to_npy(folder, texts, reference, tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"doc": f"d{i}", "body": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    out = tmp_path / "emb.parquet"
    rc, err = _run([folder, src, "-o", out, "--field", "body", "--id-field", "doc", "--no-progress"], capsys)
    assert rc == 0, err
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == [f"d{i}" for i in range(len(texts))]
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist(), dtype=np.float32), reference, **TOL)
    # the Parquet file as input: its column of texts
    import pyarrow as pa

    src2 = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"passage": texts}), src2)
    rc, err = _run([folder, src2, "-o", tmp_path / "emb2.npy", "--column", "passage", "--no-progress"], capsys)
    assert rc == 0, err
    np.testing.assert_allclose(np.load(tmp_path / "emb2.npy"), reference, **TOL)
    # a missing column: the message names the option that names it
    for args, option in ((["--column", "body"], "--column"), (["--column", "passage", "--id-column", "doc"], "--id-column")):
        rc, err = _run([folder, src2, "-o", tmp_path / "emb3.npy", *args, "--no-progress"], capsys)
        assert rc == 2 and "no column" in err and "columns: passage" in err and f"{option} names it" in err, err


def test_the_python_api_gives_what_the_command_writes(folder, texts, reference):
    model = fusedenc.embed.load_model(str(folder), device="cpu")
    assert model.dtype == torch.float32 and model.max_length == 140  # a CPU picks float32
    emb, stats = fusedenc.embed.encode(model, texts, max_batch_tokens=500)
    np.testing.assert_allclose(emb, reference, **TOL)
    assert stats.texts == len(texts) and stats.truncated == 1 and stats.batches >= 3 and stats.tokens > 0
    # small chunks on two threads: the same embeddings in the same order
    small, _ = fusedenc.embed.encode(model, texts, max_batch_tokens=500, workers=2, texts_per_chunk=3)
    np.testing.assert_allclose(small, emb, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="texts_per_chunk"):
        fusedenc.embed.encode(model, texts, texts_per_chunk=0)


def test_encode_says_where_its_time_went(folder, texts, monkeypatch):
    """Waiting for tokenized texts and the model's calls are timed apart: a tokenizer made
    slow shows as waiting, and neither part exceeds the call."""
    import time

    model = fusedenc.embed.load_model(str(folder), device="cpu")
    _, quick = fusedenc.embed.encode(model, texts, max_batch_tokens=500)
    real = embedding.tokenized_chunks

    def slow(*args, **kwargs):
        for item in real(*args, **kwargs):
            time.sleep(0.1)
            yield item

    monkeypatch.setattr(embedding, "tokenized_chunks", slow)
    _, stats = fusedenc.embed.encode(model, texts, max_batch_tokens=500)
    assert stats.tokenizer_wait_s >= 0.1 > quick.tokenizer_wait_s  # one chunk of 41 texts
    for s in (quick, stats):
        assert s.model_s > 0 and s.tokenizer_wait_s > 0 and s.tokenizer_wait_s + s.model_s <= s.seconds


def test_encode_tokenizes_through_the_backend_where_a_sample_agrees(folder, texts, reference, monkeypatch):
    """41 texts (more than the sample): the Rust backend's ids, the same embeddings as the
    tokenizer's own call gives."""
    from fusedenc.hf import fast_ids

    model = fusedenc.embed.load_model(str(folder), device="cpu")
    taken, real = [], fast_ids.checked
    monkeypatch.setattr(fast_ids, "checked", lambda *a: taken.append(real(*a)) or taken[-1])
    emb, _ = fusedenc.embed.encode(model, texts, max_batch_tokens=500)
    assert taken == [fast_ids.backend_ids(model.tokenizer)] and taken[0] is not None
    np.testing.assert_allclose(emb, reference, **TOL)
    monkeypatch.setattr(fast_ids, "backend_ids", lambda tokenizer, max_length=None: None)
    taken.clear()
    called, _ = fusedenc.embed.encode(model, texts, max_batch_tokens=500)
    assert taken[0].__name__ == "tokenize"  # the call's own path
    np.testing.assert_array_equal(called, emb)


def test_batches_by_tokens_respect_the_budget():
    lengths = np.array([5, 100, 7, 7, 300, 64, 1, 64])
    batches = token_batches.batches_by_tokens(lengths, 200)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * lengths[b].max() <= 200, b
        assert (np.diff(lengths[b]) <= 0).all()  # longest first
    assert [len(b) for b in batches][0] == 1  # 300 > budget: a batch of its own
    packed = token_batches.PackedIds.pack([list(range(14, 19)), [9, 9], list(range(12, 15))])
    ids, mask = token_batches.padded_batch(packed.take(np.array([0, 2])), pad=-1)  # a batch leaves texts out
    assert ids.tolist() == [[14, 15, 16, 17, 18], [12, 13, 14, -1, -1]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    ids, mask = token_batches.padded_batch(packed.take(np.array([2, 1])), pad=0)  # and takes them in any order
    assert ids.tolist() == [[12, 13, 14], [9, 9, 0]] and mask.sum() == 5
    # sentence-transformers' preprocess path: the real tokens of a padded batch
    real = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]) != 0
    rows = token_batches.PackedIds.from_padded(np.array([[3, 4, 5, 6, 7, 8], [1, 2, 0, 0, 0, 0]]), real)
    ids, mask = token_batches.padded_batch(rows, pad=0)
    assert ids.tolist() == [[3, 4, 5, 6, 7, 8], [1, 2, 0, 0, 0, 0]] and mask.sum() == 8
    joined = token_batches.PackedIds.join([packed.take(np.array([1])), rows])
    assert [r.tolist() for r in joined] == [[9, 9], [3, 4, 5, 6, 7, 8], [1, 2]]
    ids, mask = token_batches.padded_batch(token_batches.PackedIds.pack([]), pad=0)
    assert ids.shape == mask.shape == (0, 0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        token_batches.batches_by_tokens(lengths, 0)


@pytest.mark.parametrize("chunk", [1, 7, 50, 1000])
def test_stream_batches_cut_full_batches_across_chunks(chunk, gen):
    """Chunks of a corpus in the tokenizer's order (longest by characters first, so token
    counts only roughly descend): every text once, with its own ids and types, each batch
    within the budget and the sequence cap, and only the very last batch short of full, so
    the chunking makes no batch shapes of its own."""
    n, budget, cap = 300, 256, 20
    lengths = (torch.randint(1, 60, (n,), generator=gen) ** 1.3).long().numpy().clip(1, 300)
    noisy = lengths + torch.randint(-3, 4, (n,), generator=gen).numpy()  # characters order tokens roughly
    order = np.argsort(-noisy, kind="stable")
    ids = {int(r): [int(r)] * int(lengths[r]) for r in order}
    pack = token_batches.PackedIds.pack
    chunks = [(order[i:i + chunk], pack([ids[int(r)] for r in order[i:i + chunk]]),
               pack([[7 + int(r)] * len(ids[int(r)]) for r in order[i:i + chunk]])) for i in range(0, n, chunk)]  # fmt: skip
    seen, shapes = [], []
    for rows, got_ids, got_types, got_lengths in token_batches.stream_batches(iter(chunks), budget, cap):
        assert len(rows) == len(got_ids) == len(got_types) == len(got_lengths) > 0
        assert all(i.tolist() == [int(r)] * int(lengths[r]) for r, i in zip(rows, got_ids))
        assert all(t.tolist() == [7 + int(r)] * int(lengths[r]) for r, t in zip(rows, got_types))
        assert got_lengths.tolist() == lengths[rows].tolist()
        assert len(rows) <= cap and (len(rows) == 1 or len(rows) * got_lengths.max() <= budget)
        seen += rows.tolist()
        shapes.append(len(rows) == max(1, min(cap, budget // int(got_lengths.max()))))
    assert sorted(seen) == list(range(n))
    assert all(shapes[:-1]), f"short batches before the last: {shapes.count(False)}"
    one = list(token_batches.stream_batches(iter([(order, pack([ids[int(r)] for r in order]), None)]), budget, cap))
    want = token_batches.batches_by_tokens(lengths[order], budget, cap)
    assert [b[0].tolist() for b in one] == [order[w].tolist() for w in want] and one[0][2] is None
    assert list(token_batches.stream_batches(iter([]), budget, cap)) == []


@pytest.mark.parametrize(
    "content, args, words",
    [
        (b"one\n\xff\xfe bad\n", [], ["line 2", "not UTF-8"]),
        (b"one\n\nthree\n", [], ["line 2", "empty text", "--empty skip"]),
        (b'{"text": "a"}\n{"body": "b"}\n', ["--suffix", ".jsonl"], ["line 2", "no field 'text'"]),
        (b'{"text": "a"}\n{"text": 3}\n', ["--suffix", ".jsonl"], ["line 2", "int, not a string"]),
        (b'{"text": "a"}\nnot json\n', ["--suffix", ".jsonl"], ["line 2", "not JSON"]),
        (b"one\n", ["--suffix", ".csv"], ["unknown input format '.csv'"]),
        (b"one\n", ["--out-suffix", ".txt"], ["unknown output format '.txt'"]),
        (b"one\n", ["--model", "/nonexistent"], ["/nonexistent: not a model folder"]),
        (b"one\n", ["--dtype", "half"], ["--dtype half"]),
        (b"word " * 300 + b"\n", ["--no-truncate"], ["line 1", "more than the model's 140"]),
    ],
)
def test_bad_input_exits_2_naming_the_row_and_writes_nothing(folder, tmp_path, capsys, content, args, words):
    suffix = args[args.index("--suffix") + 1] if "--suffix" in args else ".txt"
    out_suffix = args[args.index("--out-suffix") + 1] if "--out-suffix" in args else ".npy"
    model = args[args.index("--model") + 1] if "--model" in args else folder
    extra = [a for a in args if a.startswith("--no-") or a == "--dtype" or a == "half"]
    src = tmp_path / f"corpus{suffix}"
    src.write_bytes(content)
    out = tmp_path / f"out{out_suffix}"
    rc, err = _run([model, src, "-o", out, "--no-progress", *extra], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err
    assert list(tmp_path.glob("out*")) == []


@pytest.mark.parametrize("where, words", [("missing/out.npy", ["no folder", "missing"]),
                                          ("taken.npy", ["is a folder", "name the output file"])])
def test_an_output_that_cannot_be_written_exits_2_before_the_model_loads(folder, tmp_path, capsys, monkeypatch,
                                                                          where, words):
    (tmp_path / "taken.npy").mkdir()
    src = tmp_path / "c.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model loaded before the output was checked"))
    rc, err = _run([folder, src, "-o", tmp_path / where, "--no-progress"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "taken.npy"]


def test_empty_texts_skipped_on_request_are_counted(folder, tmp_path, capsys):
    src = tmp_path / "c.txt"
    src.write_text("one\n\ntwo\n   \nthree\n", encoding="utf-8")
    rc, err = _run([folder, src, "-o", tmp_path / "e.npy", "--empty", "skip", "--no-progress"], capsys)
    assert rc == 0 and "2 empty texts left out (the first: line 2)" in err, err
    assert np.load(tmp_path / "e.npy").shape == (3, st_helpers.WIDTH)


def test_a_model_that_is_not_bert_family_is_refused(tmp_path, capsys):
    import transformers

    path = tmp_path / "distil"
    config = transformers.DistilBertConfig(vocab_size=50, dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    transformers.DistilBertModel(config).save_pretrained(path)
    st_helpers._tokenizer().save_pretrained(path)
    src = tmp_path / "c.txt"
    src.write_text("one\n", encoding="utf-8")
    rc, err = _run([path, src, "-o", tmp_path / "e.npy", "--no-progress"], capsys)
    assert rc == 2 and "fusedenc embeds BERT-family models" in err and "DistilBertModel" in err, err


def test_a_stopped_run_resumes_where_it_was(folder, texts, reference, tmp_path, capsys, monkeypatch):
    src = tmp_path / "corpus.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "emb.npy"
    real = cli.encode
    calls = []

    def stopping(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user stops the run during the third chunk
        return real(*a, **kw)

    monkeypatch.setattr(cli, "encode", stopping)
    with pytest.raises(KeyboardInterrupt):
        _run([folder, src, "-o", out, "--chunk", "10", "--no-progress"], capsys)
    assert not out.exists() and json.loads((tmp_path / "emb.npy.progress.json").read_text())["done"] == [0, 1]
    calls.clear()
    monkeypatch.setattr(cli, "encode", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    rc, err = _run([folder, src, "-o", out, "--chunk", "10", "--no-progress"], capsys)
    assert rc == 0 and "resuming: 2 of 5 chunks already embedded" in err, err
    assert len(calls) == 3  # only the chunks not yet done
    np.testing.assert_allclose(np.load(out), reference, **TOL)


@pytest.mark.parametrize("setting,threads", [(None, 1), ("true", 1), ("1", 1), ("false", None), ("0", None),
                                             ("OFF", None), ("", None)])  # fmt: skip
def test_one_tokenizer_thread_where_the_tokenizer_spreads_over_the_cores(setting, threads, monkeypatch):
    """A fast tokenizer parallel by itself (``TOKENIZERS_PARALLELISM`` unset or true, as the
    tokenizers library reads it) gets one thread that hands chunks out one by one; a serial one
    gets up to 4 (one a core)."""
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    if setting is not None:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", setting)
    monkeypatch.setattr(token_batches.os, "cpu_count", lambda: 16)
    assert token_batches.tokenizer_threads() == (4 if threads is None else threads)
    monkeypatch.setattr(token_batches.os, "cpu_count", lambda: 2)
    assert token_batches.tokenizer_threads() == (2 if threads is None else threads)


@pytest.mark.parametrize("workers", [None, 1, 3])
def test_tokenized_chunks_come_in_length_order_whatever_the_threads(workers):
    """Every text once, longest first (by characters), chunk by chunk, each tokenized as given."""
    rng = np.random.default_rng()
    texts = ["x" * int(n) for n in rng.integers(0, 60, size=int(rng.integers(1, 3000)))]
    chunk = int(rng.integers(1, 40)) if rng.random() < 0.5 else int(rng.integers(300, 3000))
    got = list(token_batches.tokenized_chunks(texts, lambda batch: [len(t) for t in batch], chunk, workers))
    rows = np.concatenate([r for r, _ in got])
    assert sorted(rows.tolist()) == list(range(len(texts)))
    sizes = [len(r) for r, _ in got]
    assert sizes == token_batches.chunk_sizes(len(texts), chunk)
    assert all(n <= chunk for n in sizes) and sizes[0] <= token_batches.FIRST_CHUNK
    assert sizes[:-1] == sorted(sizes[:-1])  # growing, the last what is left
    lengths = [n for _, ns in got for n in ns]
    assert lengths == [len(texts[r]) for r in rows] and lengths == sorted(lengths, reverse=True)
    assert list(token_batches.tokenized_chunks([], len, chunk, workers)) == []
