"""patch_hf on the GPU: a patched BERT in fp16 and bf16 against the unpatched model.

The tolerance rule of ``helpers.assert_close_rule``: ``ref`` is the unpatched
model in fp32 (TF32 off), ``same`` the unpatched model in the test's dtype;
the patched model may differ from ``ref`` by at most twice what ``same``
does, plus atol.  Models come from a small random config (no download), every
parameter redrawn so that biases and LayerNorm affines are not the identity.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close_rule

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

from fusedenc import patch_hf  # noqa: E402
from fusedenc.hf.patch import HFEncoderLayer  # noqa: E402

DEV = "cuda"
HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]

CONFIG = dict(
    vocab_size=1000,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,  # head dim 64
    intermediate_size=1024,
    max_position_embeddings=128,
    pad_token_id=0,
    hidden_act="gelu",  # exact erf GELU
)


def _fp32_bert(impl: str, gen: torch.Generator) -> torch.nn.Module:
    """The unpatched fp32 reference on the GPU, eval mode, random parameters from ``gen``."""
    config = transformers.BertConfig(attn_implementation=impl, **CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(gen.seed_value)
        model = transformers.BertModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if name.endswith("LayerNorm.weight") else noise)
    return model.eval().to(DEV)


def _inputs(gen, batch: int, seq: int, padded: bool):
    ids = torch.randint(1, CONFIG["vocab_size"], (batch, seq), generator=gen)
    if not padded:
        return ids.to(DEV), None
    mask = torch.ones(batch, seq, dtype=torch.long)
    lengths = torch.randint(seq // 4, seq, (batch,), generator=gen)
    lengths[0] = seq  # one sequence without padding
    for b, n in enumerate(lengths.tolist()):
        mask[b, n:] = 0
    ids[mask == 0] = CONFIG["pad_token_id"]
    return ids.to(DEV), mask.to(DEV)


@pytest.mark.parametrize("padded, padding_free", [(True, True), (True, False), (False, True)],
                         ids=["padded", "padded-kept", "nopad"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", HALF)
def test_bert_last_hidden_state(dtype, impl, padded, padding_free, gen):
    """Real tokens within the tolerance rule; padding positions are zeros on the padding-free
    path (documented in patch_hf) and HF's own values with ``padding_free=False``."""
    ref_model = _fp32_bert(impl, gen)
    same_model = copy.deepcopy(ref_model).to(dtype)
    fused_model = patch_hf(copy.deepcopy(ref_model).to(dtype), padding_free=padding_free)
    assert all(isinstance(layer, HFEncoderLayer) for layer in fused_model.encoder.layer)
    assert fused_model.encoder.layer[0].block.qkv_weight.dtype == dtype

    # S=50 is not a multiple of 8 (the attention pads its bias rows); S=64 is.
    ids, mask = _inputs(gen, batch=4, seq=50 if padded else 64, padded=padded)
    with torch.inference_mode():
        out = fused_model(ids, attention_mask=mask).last_hidden_state
        ref = ref_model(ids, attention_mask=mask).last_hidden_state
        same = same_model(ids, attention_mask=mask).last_hidden_state
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), f"non-finite output, seed={gen.seed_value}"
    what = f"BERT {impl} {dtype} padded={padded} padding_free={padding_free} seed={gen.seed_value}"
    if padded and padding_free:
        real = mask.bool()
        assert (~real).any(), "the inputs must contain padding"
        assert torch.equal(out[~real], torch.zeros_like(out[~real])), f"{what}: padding positions not zero"
        out, ref, same = out[real], ref[real], same[real]
    assert_close_rule(out, ref, same, dtype, what=what)
