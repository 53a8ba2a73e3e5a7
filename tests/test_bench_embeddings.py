"""CPU smoke test of bench/embeddings.py in both I/O modes, and its files while a run is cut.

The script runs as a subprocess (as a user would run it) on the tiny model, a few
sentences, into a temporary directory; the test reads the JSON and the table it wrote.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from bench_helpers import ROOT, run_bench

# Each runs a benchmark in a subprocess (seconds each): in the exhaustive run.
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")

CPU_IMPLS = {"hf-eager", "hf-sdpa", "fusedenc-padded", "fusedenc", "fusedenc-pooled"}


@pytest.mark.parametrize("io", ["host", "device"])
def test_embeddings_tiny_in_both_io_modes(io, tmp_path):
    run_bench("embeddings.py", ["--device", "cpu", "--model", "tiny", "--batch-sizes", "8", "--sentences", "16",
                                "--reps", "2", "--io", io, "--out-dir", str(tmp_path), "--tag", "smoke"],
              timeout=300)  # fmt: skip
    result = json.loads((tmp_path / "embeddings_smoke.json").read_text(encoding="utf-8"))
    assert result["io"] == io and result["args"]["io"] == io and result["timing"]
    [record] = result["records"]
    assert record["io"] == io and record["complete"] is True
    assert record["lengths"]["sentences"] == 16
    rows = {r["impl"]: r for r in record["results"]}
    assert set(rows) == CPU_IMPLS
    for name, r in rows.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["min_cosine"] > 0.99999 and r["sentences_per_s"] > 0 and len(r["passes_s"]) == 2, (name, r)
    assert "automatic graphs:" in rows["fusedenc"]["note"] and "counts" in rows["fusedenc"]["auto_graphs"]
    text = (tmp_path / "embeddings_smoke.txt").read_text(encoding="utf-8")
    assert f"I/O {io}:" in text and f"tiny, batch 8, float32, io {io}:" in text
    fusedenc_line = next(line for line in text.splitlines() if line.strip().startswith("fusedenc "))
    assert "automatic graphs:" in fusedenc_line
    assert "still running" not in text
    assert not list(tmp_path.glob("*.tmp"))


def test_embeddings_files_show_a_record_still_running(tmp_path, monkeypatch):
    """The files are rewritten after every row: a record cut mid-way is marked so."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import embeddings  # bench/embeddings.py

    lengths = {"sentences": 16, "min": 3, "p10": 4, "median": 9, "mean": 10.0, "p90": 20, "p99": 30, "max": 31,
               "bins": {"1-8": 6, "9-16": 10}, "real_tokens": 160, "padded_tokens": 256, "padding_fraction": 0.375}
    row = {"impl": "hf-sdpa", "sentences_per_s": 100.0, "real_tokens_per_s": 1000.0, "min_cosine": 1.0,
           "cosine_ok": True, "setup_seconds": 0.1, "note": ""}
    record = {"model": "tiny", "batch": 8, "dtype": "float32", "io": "host", "lengths": lengths,
              "results": [row, {"impl": "compile", "error": "RuntimeError: cut"}], "complete": False}
    base = str(tmp_path / "embeddings_cut")
    embeddings.write_results(base, {"environment": {"device_name": "cpu", "torch": "2", "blaslt": None}, "io": "host",
                                    "timing": embeddings.IO_TIMING["host"], "records": [record]})
    assert json.loads((tmp_path / "embeddings_cut.json").read_text())["records"][0]["complete"] is False
    text = (tmp_path / "embeddings_cut.txt").read_text()
    assert "io host" in text and "hf-sdpa" in text and "compile          failed" in text and "still running" in text


def test_embeddings_warm_up_runs_each_batch_shape_once(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import embeddings  # bench/embeddings.py

    batches = [{"input_ids": torch.zeros(8, s, dtype=torch.long)} for s in (16, 24, 16, 32, 24)]
    assert [b["input_ids"].shape[1] for b in embeddings.distinct_shapes(batches)] == [16, 24, 32]


def test_passages_are_runs_of_consecutive_sentences_within_the_budget(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import embeddings  # bench/embeddings.py

    tok = embeddings.WordTokenizer()
    sentences = embeddings.read_sentences(400)
    passages = embeddings.make_passages(sentences, tok, 64)
    assert " ".join(passages) == " ".join(sentences)  # every sentence, in order, none twice
    sizes = [len(tok.ids(p)) for p in passages]
    # within the budget unless one sentence alone is longer; nearly full otherwise (greedy)
    assert all(n <= 64 or p in sentences for p, n in zip(passages, sizes))
    assert sorted(sizes)[len(sizes) // 2] > 48
    assert len(embeddings.make_passages(["one two three"] * 3, tok, 4)) == 3  # each alone over the budget


def test_passages_run(tmp_path):
    run_bench("embeddings.py", ["--device", "cpu", "--model", "tiny", "--batch-sizes", "4", "--passages", "96",
                                "--sentences", "8", "--reps", "1", "--impl", "hf-sdpa,fusedenc", "--out-dir",
                                str(tmp_path), "--tag", "psg"], timeout=300)  # fmt: skip
    [record] = json.loads((tmp_path / "embeddings_psg.json").read_text(encoding="utf-8"))["records"]
    assert record["passages"] == 96 and record["lengths"]["sentences"] == 8 and record["lengths"]["max"] <= 96
    assert record["lengths"]["median"] > 60  # passages, not single sentences
    assert "passages of up to 96 tokens" in (tmp_path / "embeddings_psg.txt").read_text(encoding="utf-8")



@pytest.mark.parametrize("bad", [["--passages", "2"], ["--passages", "64", "--full-length", "32"],
                                 ["--passages", "600", "--max-length", "512"]])
def test_passages_refuse_bad_arguments(bad, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import embeddings  # bench/embeddings.py

    with pytest.raises(SystemExit) as exit_:
        embeddings.main(["--device", "cpu", "--model", "tiny", *bad, "--out-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "--passages" in capsys.readouterr().err


def test_st_loop_tiny_and_the_loop_is_sentence_transformers(tmp_path):
    """bench/st_loop.py end to end on the CPU (every peer checked against the fp32 loop, a
    positive rate), and, where the real model and sentence-transformers are installed, the
    reproduced ``encode()`` loop against sentence-transformers' own embeddings."""
    import importlib.util

    from fusedenc.hf import real_models

    check = importlib.util.find_spec("sentence_transformers") is not None
    try:
        real_models.minilm_dir()
    except real_models.RealModelMissing:
        check = False
    args = ["--device", "cpu", "--model", "tiny", "--batch-sizes", "8", "--sentences", "48", "--reps", "1", "--host-profile",
            "--impl", "plain,patched,patched-pooled" + (",corpus,corpus:2048,corpus:w2:c16,st-plain,st-patched" if check else ""),
            "--out-dir", str(tmp_path)]  # fmt: skip
    run_bench("st_loop.py", args + (["--check-st"] if check else []), timeout=600)
    [path] = list(tmp_path.glob("st_loop_tiny_*.json"))
    result = json.loads(path.read_text(encoding="utf-8"))
    [record] = result["records"]
    for r in record["results"]:
        assert "error" not in r and r["cosine_ok"] and r["sentences_per_s"] > 0, r
        shares = [f["share"] for f in r["host_profile"]]  # the calling thread's functions, largest first
        assert shares and shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9, r["host_profile"]
    if check:
        assert result["st_check"]["max_abs_diff"] < 1e-5, result["st_check"]
        assert {r["impl"] for r in record["results"]} >= {"corpus:2048", "corpus:w2:c16", "st-plain", "st-patched"}


def test_st_loop_corpus_names_read_as_encode_keywords(monkeypatch):
    """A corpus peer's name gives encode()'s keywords; a part that is not a number refuses."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import st_loop  # bench/st_loop.py

    from fusedenc.embed import DEFAULT_MAX_BATCH_TOKENS

    assert st_loop.corpus_options("corpus") == {"max_batch_tokens": DEFAULT_MAX_BATCH_TOKENS}
    assert st_loop.corpus_options("corpus:4096:w2:c1024") == {"max_batch_tokens": 4096, "workers": 2,
                                                               "texts_per_chunk": 1024}  # fmt: skip
    with pytest.raises(ValueError, match="wx"):
        st_loop.corpus_options("corpus:wx")


def test_distributed_actor_only_tiny(tmp_path):
    """bench/distributed.py --actor-only (the Ray actor's work without Ray) on a tiny random
    BERT on the CPU: every block size's embeddings equal the corpus command's."""
    import st_helpers

    folder = st_helpers.hf_model_dir(tmp_path, "bert", seed=4)
    run_bench("distributed.py", ["--actor-only", "--model", str(folder), "--device", "cpu", "--texts", "60",
                                 "--blocks", "16,64", "--repeats", "1", "--out-dir", str(tmp_path)], timeout=600)  # fmt: skip
    [path] = list(tmp_path.glob("distributed_actor_*.json"))
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    assert [r["block_rows"] for r in rows] == [16, 64]
    assert all(r["max_abs_diff"] < 1e-4 and r["rows_per_s"] > 0 for r in rows), rows


def test_embed_file_tiny_every_peer(tmp_path):
    """bench/embed_file.py end to end on the CPU: the command and sentence-transformers' script
    (plain and patched) each in its own process on one .txt file, every output checked against
    the fp32 model, and an unknown peer a row saying so (and a non-zero exit)."""
    pytest.importorskip("sentence_transformers")
    from fusedenc.hf import real_models

    try:
        real_models.load_minilm_tokenizer()
    except real_models.RealModelMissing as exc:
        pytest.skip(f"the tiny model's folder needs the MiniLM tokenizer: {exc}")
    args = ["--device", "cpu", "--model", "tiny", "--texts", "40", "--out-dir", str(tmp_path),
            "--impl", "command,st-plain:8,st-patched:8"]  # fmt: skip
    run_bench("embed_file.py", args, timeout=600)
    [path] = list(tmp_path.glob("embed_file_tiny_*.json"))
    result = json.loads(path.read_text(encoding="utf-8"))
    assert result["texts"] == 40 and result["dtype"] == "float32"
    [record] = result["records"]
    assert [r["impl"] for r in record["results"]] == ["command", "st-plain:8", "st-patched:8"]
    for r in record["results"]:
        assert "error" not in r and r["cosine_ok"], r
        assert 0 < r["embed_seconds"] < r["wall_seconds"], r  # the embedding is a part of the process
    first = record["first_run"]  # the untimed first run, over the distinct sentences (all 40 here)
    assert first["texts"] == 40 and 0 < first["embed_seconds"] < first["wall_seconds"], first
    text = path.with_suffix(".txt").read_text(encoding="utf-8")
    assert "x st-plain" in text and "first run on a machine" in text

    import subprocess
    import sys

    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "embed_file.py"), *args[:-1], "st-fast:8"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 1 and "unknown peer 'st-fast:8'" in bad.stdout, bad.stdout[-2000:] + bad.stderr[-2000:]
