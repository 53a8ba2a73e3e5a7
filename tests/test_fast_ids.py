"""Token ids from a fast tokenizer's Rust backend (``fusedenc.hf.fast_ids``): the tokenizer's
own call's ids, truncation on either side, the tokenizer's backend left alone, the sample
check that keeps the caller's path where they differ, threads."""

from __future__ import annotations

import copy
import functools
import threading
import types

import numpy as np
import pytest
import st_helpers
import torch

from fusedenc.hf import fast_ids


@functools.lru_cache(maxsize=1)
def _byte_level_tokenizer():
    """A RoBERTa-style byte-level BPE tokenizer trained on the test sentences."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.train_from_iterator(st_helpers.sentences()[:3000], trainers.BpeTrainer(vocab_size=500, special_tokens=specials))
    tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    return transformers.RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                             cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")  # fmt: skip


def _tokenizer(kind: str):
    # A copy: tests change truncation sides and add tokens.
    return copy.deepcopy(st_helpers._tokenizer() if kind == "wordpiece" else _byte_level_tokenizer())


def _texts(gen, n: int = 60) -> list[str]:
    pool = st_helpers.sentences()
    picks = torch.randint(0, len(pool), (n,), generator=gen).tolist()
    return [pool[i] for i in picks] + ["", "  Spaces AND Capitals  ", "naïve café, émigré", " ".join(pool[:12])]


def _call(tok, texts, max_length=None) -> list:
    kw = {"truncation": False} if max_length is None else {"truncation": True, "max_length": max_length}
    return tok(list(texts), add_special_tokens=True, return_attention_mask=False, return_token_type_ids=False,
               verbose=False, **kw)["input_ids"]  # fmt: skip


@pytest.mark.parametrize("kind", ["wordpiece", "byte-level"])
def test_backend_ids_are_the_tokenizers_own(kind, gen):
    tok, texts = _tokenizer(kind), _texts(gen)
    ids = fast_ids.backend_ids(tok)
    want = _call(tok, texts)
    assert ids(texts) == want, f"seed {gen.seed_value}"
    assert max(map(len, want)) > 40  # the long text is there, not truncated
    for side in ("right", "left"):
        tok.truncation_side = side
        fast_ids._copies.pop(tok, None)  # the side is read when the copy is made
        assert fast_ids.backend_ids(tok, 16)(texts) == _call(tok, texts, 16), side


def test_the_tokenizers_backend_is_left_as_it_was(gen):
    tok, texts = _tokenizer("wordpiece"), _texts(gen)
    _call(tok, texts, 8)  # the call leaves its backend truncating at 8
    assert max(map(len, fast_ids.backend_ids(tok)(texts))) > 8
    assert tok.backend_tokenizer.truncation["max_length"] == 8
    assert max(map(len, fast_ids.backend_ids(tok, 12)(texts))) == 12


def test_a_copy_is_made_once_and_again_after_added_tokens():
    tok = _tokenizer("wordpiece")
    first = fast_ids.backend_ids(tok)
    assert fast_ids.backend_ids(tok) is first and fast_ids.backend_ids(tok, 16) is not first
    tok.add_tokens(["zzqxword"])
    again = fast_ids.backend_ids(tok)
    assert again is not first
    text = ["a zzqxword b"]
    assert again(text) == _call(tok, text) and first(text) != _call(tok, text)


def test_no_backend_ids_without_a_fast_tokenizer():
    assert fast_ids.backend_ids(types.SimpleNamespace(is_fast=False)) is None
    assert fast_ids.backend_ids(types.SimpleNamespace(is_fast=True, backend_tokenizer=object())) is None


def test_checked_takes_the_backend_only_where_a_sample_agrees(gen):
    tok, texts = _tokenizer("wordpiece"), _texts(gen)
    fast = fast_ids.backend_ids(tok)
    reference = functools.partial(_call, tok)
    assert fast_ids.checked(texts, fast, reference, 32) is fast
    assert fast_ids.checked(texts[:10], fast, reference, 32) is reference  # a short call: the sample would be the call
    assert fast_ids.checked(texts, None, reference, 32) is reference

    def prefixed(chunk):  # a caller whose tokenizing does more than the backend
        return reference(["note: " + t for t in chunk])

    assert fast_ids.checked(texts, fast, prefixed, 32) is prefixed

    def refuses(chunk):
        raise ValueError("no")

    assert fast_ids.checked(texts, refuses, reference, 32) is reference
    truncating = fast_ids.backend_ids(tok, 32)  # differs from the reference on the long probe only
    assert fast_ids.checked(texts, truncating, reference, 32) is reference


def test_the_sample_holds_both_ends_and_the_probes(gen):
    tok, texts = _tokenizer("wordpiece"), _texts(gen)
    probe = fast_ids.sample(texts, fast_ids.backend_ids(tok), 32)
    each = fast_ids.SAMPLE_EACH
    lengths = sorted(len(t) for t in texts)
    assert len(probe) == 3 * each + 2 and set(probe[:3 * each]) <= set(texts)
    # The longest and the shortest texts by length (texts of equal length may stand for each
    # other: which of them the stable sort takes is no part of the contract).
    assert sorted(len(t) for t in probe[:each]) == lengths[-each:]
    assert sorted(len(t) for t in probe[2 * each:3 * each]) == lengths[:each]
    assert len(_call(tok, [probe[-2]])[0]) > 32  # past max_length
    assert probe[-1] != probe[-1].strip() and any(c.isupper() for c in probe[-1])


def test_threads_share_a_copy(gen):
    tok, texts = _tokenizer("byte-level"), _texts(gen, 400)
    ids = fast_ids.backend_ids(tok)
    want = ids(texts)
    got, errors = {}, []

    def work(i):
        try:
            for _ in range(5):
                got[i] = ids(texts[i::4])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(4):
        assert got[i] == want[i::4]
    assert all(isinstance(x, list) and all(isinstance(v, int) for v in x) for x in want[:3])
    assert np.array_equal(np.fromiter((len(x) for x in want), dtype=np.int64), [len(x) for x in _call(tok, texts)])
