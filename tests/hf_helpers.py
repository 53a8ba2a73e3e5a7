"""Small Hugging Face encoders for the CPU tests of ``patch_hf``'s paths: a patched model and
its unpatched fp32 copy, with weights drawn from the test's generator (LayerNorm weights
near 1, everything else small), so that a wrong path shows in every output."""

from __future__ import annotations

import copy

import torch

import fusedenc

#: Two layers of width 64: big enough for four heads and a real FFN, small enough for the CPU.
SMALL = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=40, type_vocab_size=2)  # fmt: skip


def small_models(gen, model_type: str = "bert", *, impl: str = "sdpa", pad_token_id: int = 0, head=None,
                 padding_free: bool = True):  # fmt: skip
    """(patched, unpatched fp32 copy) of a ``SMALL`` model of ``model_type`` (its base model, or
    ``head``: an ``AutoModelFor...`` class) with attention ``impl``."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, attn_implementation=impl, pad_token_id=pad_token_id,
                                               **SMALL)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(gen.seed_value)
        model = (head or transformers.AutoModel).from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape) if name.endswith("LayerNorm.weight") else 0.2 * torch.randn(p.shape))
    ref = copy.deepcopy(model)
    return fusedenc.patch_hf(model, padding_free=padding_free), ref
