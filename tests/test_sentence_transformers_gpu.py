"""sentence-transformers models on the GPU: a patched ``SentenceTransformer``'s ``encode()`` in
fp16 against the unpatched model in fp32 (cosine >= 0.9999 for every sentence), pooled inside
the model's CUDA graph (mean, CLS, max, mean-sqrt-length: every batch pooled there, nothing
else asked of HF's forward)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed (the test extra has it)")

import st_helpers  # noqa: E402

import fusedenc  # noqa: E402
from fusedenc.hf import embedded  # noqa: E402

pytestmark = pytest.mark.gpu
COSINE = 0.9999


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("st-models")
    return {t: st_helpers.hf_model_dir(root, t, seed=5 + i) for i, t in enumerate(("bert", "roberta", "xlm-roberta"))}


@pytest.mark.sweep
@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "max", "mean_sqrt_len_tokens"])
@pytest.mark.parametrize("batch_size", [1, 7, 32])
def test_encode_fp16_against_fp32(model_dirs, model_type, pooling, batch_size, gen, monkeypatch):
    ref = st_helpers.sentence_model(model_dirs[model_type], pooling=pooling).eval()
    model = copy.deepcopy(ref).to("cuda", torch.float16)
    fusedenc.patch_hf(model)
    pooled = []
    real_call = embedded.EmbeddedModel._fusedenc_pooled_call

    def counted(self, *args):
        out = real_call(self, *args)
        pooled.append(out is not None)
        return out

    monkeypatch.setattr(embedded.EmbeddedModel, "_fusedenc_pooled_call", counted)
    pool = st_helpers.sentences()
    texts = [pool[i] for i in torch.randint(0, len(pool), (67,), generator=gen).tolist()]
    want = ref.encode(texts, batch_size=batch_size, convert_to_tensor=True).double()
    for _ in range(2):  # the second pass replays the graphs the first captured
        got = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
        assert got.dtype == torch.float16 and got.device.type == "cuda"
        cos = torch.nn.functional.cosine_similarity(got.double().cpu(), want.cpu(), dim=1)
        assert cos.min() >= COSINE, f"{model_type} {pooling} b={batch_size}: worst cosine {cos.min():.6f}"
    # every batch pooled in the graph (batches by a token budget where sentence-transformers has
    # the _inference loop the patch replaces, else its own batches of batch_size)
    assert pooled and all(pooled), pooled
