"""``fusedenc.embed.encode`` and ``python -m fusedenc embed`` on the GPU, in fp16: a small random
BERT's embeddings against the fp32 reference on the CPU (sentence-transformers' mean pooling and
Normalize over the same folder) by the tolerance rule, the unpatched model in fp16 on the GPU
giving the rule's base; every text in input order (a text longer than the model takes
truncated as sentence-transformers truncates it), through many batches whose copies back are in
flight together, and again on a second pass (the graphs captured on the first replayed)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import assert_close_rule

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (the test extra has it)")

import st_helpers  # noqa: E402

import fusedenc.embed  # noqa: E402
from fusedenc.embed import cli, embedding  # noqa: E402

pytestmark = pytest.mark.gpu
MAX_LENGTH = 140  # the small models' position table (st_helpers)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return st_helpers.hf_model_dir(tmp_path_factory.mktemp("models"), "bert", seed=11)


def _texts(gen: torch.Generator, n: int) -> list[str]:
    pool = st_helpers.sentences()
    texts = [pool[i] for i in torch.randint(0, len(pool), (n,), generator=gen).tolist()]
    texts[n // 2] = " ".join(pool[:30])  # longer than the model's 140 tokens: truncated
    return texts


def _references(folder, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(fp32 on the CPU, the unpatched model in fp16 on the GPU): sentence-transformers' own."""
    ref = st_helpers.sentence_model(folder, max_seq_length=MAX_LENGTH).eval()
    want = ref.encode(texts, convert_to_numpy=True)
    same = copy.deepcopy(ref).to("cuda", torch.float16).encode(texts, convert_to_numpy=True)
    return want, same


@pytest.mark.parametrize("budget, in_flight", [(16384, None), (96, 3)])
def test_encode_fp16_against_fp32(folder, budget, in_flight, gen, monkeypatch):
    """A large budget (a few batches) and a small one (~one batch a text or two) with at most
    3 copies back in flight, so the oldest is waited for mid-pass."""
    if in_flight is not None:
        monkeypatch.setattr(embedding, "_COPIES_IN_FLIGHT", in_flight)
    texts = _texts(gen, 160)
    want, same = _references(folder, texts)
    model = fusedenc.embed.load_model(str(folder), device="cuda")
    assert model.dtype == torch.float16 and model.max_length == MAX_LENGTH
    long = sum(len(ids) > MAX_LENGTH for ids in model.tokenizer(texts)["input_ids"])
    assert long >= 1  # the joined text at least
    for attempt in range(2):
        emb, stats = fusedenc.embed.encode(model, texts, max_batch_tokens=budget)
        assert emb.dtype == np.float32 and emb.shape == want.shape
        what = f"budget {budget}, pass {attempt + 1}, seed {gen.seed_value}"
        assert_close_rule(torch.from_numpy(emb), torch.from_numpy(want), torch.from_numpy(same), torch.float16, what)
        assert stats.texts == len(texts) and stats.truncated == long, stats
        if in_flight is not None:
            assert stats.batches > 4 * in_flight, stats  # the bound was met many times
        assert 0 < stats.model_s <= stats.seconds


def test_the_command_on_the_gpu_writes_what_encode_gives(folder, gen, tmp_path, capsys):
    texts = _texts(gen, 90)
    src = tmp_path / "corpus.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "emb.npy"
    rc = cli.main([str(folder), str(src), "-o", str(out), "--device", "cuda", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    want, same = _references(folder, texts)
    assert_close_rule(torch.from_numpy(np.load(out)), torch.from_numpy(want), torch.from_numpy(same), torch.float16,
                      f"the command, seed {gen.seed_value}")  # fmt: skip


@pytest.mark.parametrize("pooling", ["cls", "max", "mean_sqrt_len_tokens"])
def test_a_sentence_transformers_folder_pools_in_the_graph_as_it_says(folder, gen, tmp_path, pooling):
    """A saved sentence-transformers folder of another pooling mode, read without
    sentence-transformers (``embed.st_folder``): the graph pools as the folder says, by the rule
    against its fp32 ``encode()`` on the CPU (the unpatched model in fp16 on the GPU the base)."""
    ref = st_helpers.sentence_model(folder, pooling=pooling, max_seq_length=MAX_LENGTH).eval()
    path = tmp_path / pooling
    ref.save(str(path))
    texts = _texts(gen, 120)
    want = ref.encode(texts, convert_to_numpy=True)
    same = copy.deepcopy(ref).to("cuda", torch.float16).encode(texts, convert_to_numpy=True)
    model = fusedenc.embed.load_model(str(path), device="cuda")
    assert (model.pooling, model.normalize) == (pooling, True)
    emb, _ = fusedenc.embed.encode(model, texts)
    assert_close_rule(torch.from_numpy(emb), torch.from_numpy(want), torch.from_numpy(same), torch.float16,
                      f"{pooling}, seed {gen.seed_value}")  # fmt: skip
