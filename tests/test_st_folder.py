"""Sentence-transformers folders run without sentence-transformers (fusedenc.embed.st_folder):
``load_model`` of a saved folder, in the spelling of sentence-transformers 6 (``save()`` here)
and in the one before it (written by hand, as the Hub's older models are), pools and normalizes
as the folder says, equal to sentence-transformers' own ``encode()`` for every pooling mode the
graph computes; in a process where sentence-transformers cannot be imported, a CLS-pooled folder
still embeds by CLS (it was mean-pooled before) and nothing imports sentence-transformers; a
layout only sentence-transformers computes loads through it, or is refused without it, saying
why.  ``sentence_embeddings(hf_model, ..., pooling=)`` is the same pooling on an HF model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (the test extra has it)")

import st_helpers  # noqa: E402

import fusedenc  # noqa: E402
from fusedenc.embed import InputError, encode, load_model  # noqa: E402
from fusedenc.embed.st_folder import Unsupported, read_sentence_folder  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)
MODES = ["mean", "cls", "max", "mean_sqrt_len_tokens"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return st_helpers.hf_model_dir(tmp_path_factory.mktemp("models"), "bert", seed=5)


@pytest.fixture(scope="module")
def texts():
    pool = st_helpers.sentences()
    return list(pool[100:130]) + [" ".join(pool[130:150])]  # the last is longer than the model's 120 tokens


def _saved(hf_folder, root, pooling, normalize):
    """A sentence-transformers 6 folder (its own save()) and the model that saved it."""
    model = st_helpers.sentence_model(hf_folder, pooling=pooling, normalize=normalize, max_seq_length=120).eval()
    path = root / f"st-{pooling}-{int(normalize)}"
    model.save(str(path))
    return path, model


def _legacy(hf_folder, root, pooling, normalize, extra_modules=(), settings=None):
    """A folder as sentence-transformers < 6 wrote them: the HF model in 0_Transformer, the
    ``pooling_mode_*`` flags, ``max_seq_length`` in sentence_bert_config.json."""
    import shutil

    path = root / f"legacy-{pooling}-{int(normalize)}-{len(extra_modules)}"
    shutil.copytree(hf_folder, path / "0_Transformer")
    (path / "0_Transformer" / "sentence_bert_config.json").write_text(
        json.dumps(settings or {"max_seq_length": 120, "do_lower_case": False}))
    chosen = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens"}.get(pooling, pooling)
    flags = {f"pooling_mode_{k}": k == chosen for k in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")}
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": st_helpers.WIDTH, **flags}))
    modules = [("0_Transformer", "Transformer"), ("1_Pooling", "Pooling")]
    modules += [("2_Normalize", "Normalize")] if normalize else []
    modules += list(extra_modules)
    (path / "modules.json").write_text(json.dumps([{"idx": i, "name": str(i), "path": p,
                                                    "type": t if "." in t else f"sentence_transformers.models.{t}"}
                                                   for i, (p, t) in enumerate(modules)]))  # fmt: skip
    return path


@pytest.mark.parametrize("pooling", MODES)
@pytest.mark.parametrize("normalize", [True, False])
def test_saved_folder_embeds_as_sentence_transformers_does(hf_folder, tmp_path, texts, pooling, normalize):
    path, model = _saved(hf_folder, tmp_path, pooling, normalize)
    want = model.encode(texts, convert_to_numpy=True)
    loaded = load_model(str(path), device="cpu")
    assert (loaded.pooling, loaded.normalize, loaded.max_length) == (pooling, normalize, 120)
    assert not type(loaded.module).__name__.endswith("SentenceTransformer"), "loaded by sentence-transformers"
    got, stats = encode(loaded, texts)
    assert stats.truncated == 1
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("pooling", MODES)
def test_a_folder_of_earlier_releases_reads_the_same(hf_folder, tmp_path, texts, pooling):
    from sentence_transformers import SentenceTransformer

    path = _legacy(hf_folder, tmp_path, pooling, normalize=True)
    assert read_sentence_folder(path).pooling == pooling
    want = SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_numpy=True)
    got, _ = encode(load_model(str(path), device="cpu"), texts)
    np.testing.assert_allclose(got, want, **TOL)


_NO_ST = """
import sys
sys.modules["sentence_transformers"] = None  # as if not installed: importing it raises ImportError
import numpy as np
from fusedenc.embed import encode, load_model
folder, texts, out = sys.argv[1], sys.argv[2].split("\\n"), sys.argv[3]
try:
    model = load_model(folder, device="cpu")
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
    raise SystemExit(0)
np.save(out, encode(model, texts)[0])
print("OK", model.pooling)
"""


def _without_st(folder, texts, out):
    done = subprocess.run([sys.executable, "-c", _NO_ST, str(folder), "\n".join(texts), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_without_sentence_transformers_a_cls_folder_embeds_by_cls(hf_folder, tmp_path, texts):
    path, model = _saved(hf_folder, tmp_path, "cls", True)
    assert _without_st(path, texts, tmp_path / "cls.npy") == "OK cls"
    np.testing.assert_allclose(np.load(tmp_path / "cls.npy"), model.encode(texts, convert_to_numpy=True), **TOL)


def test_a_standard_folder_never_imports_sentence_transformers(hf_folder, tmp_path):
    path, _ = _saved(hf_folder, tmp_path, "mean", True)
    code = ("import sys; from fusedenc.embed import load_model; load_model(sys.argv[1], device='cpu'); "
            "print('sentence_transformers' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]


def test_a_layout_only_sentence_transformers_runs_loads_through_it_or_is_refused(hf_folder, tmp_path, texts):
    """A Dense module after the pooling: sentence-transformers' own modules run it where it is
    installed (equal to its encode()); where it is not, the command says what the folder holds
    and what to install."""
    from sentence_transformers import SentenceTransformer, models

    model = st_helpers.sentence_model(hf_folder, max_seq_length=120, normalize=False)
    dense = models.Dense(st_helpers.WIDTH, 16)
    model = SentenceTransformer(modules=[*model._modules.values(), dense], device="cpu").eval()
    path = tmp_path / "dense"
    model.save(str(path))
    with pytest.raises(Unsupported, match="Dense"):
        read_sentence_folder(path)
    loaded = load_model(str(path), device="cpu")
    assert loaded.pooling is None and type(loaded.module).__name__.endswith("SentenceTransformer")
    np.testing.assert_allclose(encode(loaded, texts)[0], model.encode(texts, convert_to_numpy=True), **TOL)
    line = _without_st(path, texts, tmp_path / "x.npy")
    assert line.startswith("ERROR InputError") and "Dense" in line and "pip install sentence-transformers" in line, line


@pytest.mark.parametrize("change, words", [
    (lambda p: _pool(p, {"pooling_mode": "weightedmean"}), ["weightedmean", "fusedenc pools"]),
    (lambda p: _pool(p, {"pooling_mode": "lasttoken"}), ["lasttoken"]),
    (lambda p: _pool(p, {"pooling_mode": ["mean", "max"]}), ["concatenates", "mean", "max"]),
    (lambda p: _pool(p, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}), ["concatenates"]),
    (lambda p: (p / "1_Pooling" / "config.json").write_text("{not json"), ["config.json", "not JSON"]),
    (lambda p: (p / "1_Pooling" / "config.json").unlink(), ["config.json is missing"]),
    (lambda p: _settings(p, {"do_lower_case": True}), ["do_lower_case=True"]),
    (lambda p: _settings(p, {"max_seq_length": 120, "tokenizer_args": {"x": 1}}), ["tokenizer_args"]),
    (lambda p: _settings(p, {"max_seq_length": "long"}), ["max_seq_length 'long'"]),
    (lambda p: _options(p, {"default_prompt_name": "query", "prompts": {"query": "query: "}}), ["default prompt 'query'"]),
    (lambda p: (p / "modules.json").write_text('{"idx": 0}'), ["modules.json is not a list"]),
    (lambda p: _modules(p, lambda m: [m[1], m[0], *m[2:]]), ["Pooling", "Transformer"]),
    (lambda p: _modules(p, lambda m: [{**m[0], "type": "my_package.Encoder"}, *m[1:]]), ["my_package.Encoder"]),
    (lambda p: _modules(p, lambda m: [{**m[0], "path": "nowhere"}, *m[1:]]), ["nowhere", "no config.json"]),
])  # fmt: skip
def test_what_the_reader_refuses_it_names(hf_folder, tmp_path, change, words):
    path, _ = _saved(hf_folder, tmp_path, "mean", True)
    read_sentence_folder(path)  # as saved: read
    change(path)
    with pytest.raises(Unsupported) as err:
        read_sentence_folder(path)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_an_empty_default_prompt_is_no_prompt(hf_folder, tmp_path):
    path, _ = _saved(hf_folder, tmp_path, "cls", False)
    _options(path, {"default_prompt_name": "document", "prompts": {"document": ""}})
    assert read_sentence_folder(path).pooling == "cls"


def _pool(path, config):
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))


def _settings(path, settings):
    (path / "sentence_bert_config.json").write_text(json.dumps(settings))


def _options(path, options):
    (path / "config_sentence_transformers.json").write_text(json.dumps(options))


def _modules(path, edit):
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps(edit(modules)))


@pytest.mark.parametrize("pooling", MODES)
def test_sentence_embeddings_pools_an_hf_model_as_asked(hf_folder, texts, pooling):
    """``pooling=`` on an HF model, patched and not, equals the same mode of sentence-transformers'
    Pooling over the same model (normalized or not)."""
    import transformers

    model = transformers.AutoModel.from_pretrained(str(hf_folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    batch = tokenizer(texts[:12], padding=True, truncation=True, max_length=120, return_tensors="pt")
    patched = fusedenc.patch_hf(transformers.AutoModel.from_pretrained(str(hf_folder)).eval())
    for normalize in (True, False):
        want = st_helpers.sentence_model(hf_folder, pooling=pooling, normalize=normalize, max_seq_length=120).eval()
        want = want.encode(texts[:12], convert_to_tensor=True)
        for m in (model, patched):
            got = fusedenc.sentence_embeddings(m, **batch, pooling=pooling, normalize=normalize)
            torch.testing.assert_close(got, want, **TOL, msg=f"{type(m).__name__} normalize={normalize}")


def test_a_wrong_pooling_is_refused_before_anything_runs(hf_folder):
    import transformers

    model = transformers.AutoModel.from_pretrained(str(hf_folder)).eval()
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="pooling='weightedmean': one of mean, cls"):
        fusedenc.sentence_embeddings(model, ids, pooling="weightedmean")
    st = st_helpers.sentence_model(hf_folder).eval()
    with pytest.raises(ValueError, match="its own Pooling module pools"):
        fusedenc.sentence_embeddings(st, ids, pooling="cls")
    with pytest.raises(InputError, match="not a model folder"):
        load_model(str(hf_folder / "missing"), device="cpu")
