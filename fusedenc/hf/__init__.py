"""Hugging Face BERT-family models on fusedenc: ``patch_hf`` (patch.py), the padding-free
encoder (varlen.py), a model's plain call as one graph and ``sentence_embeddings``
(embedded.py), BERT's packed embeddings in Triton (triton_embeddings.py), the patched
classes that pickle (classes.py) and the bundled real model (real_models.py).  transformers
is imported only where a model is at hand."""

from .patch import (
    HF_ACTIVATIONS,
    SUPPORTED_ATTN_IMPLEMENTATIONS,
    SUPPORTED_MODEL_TYPES,
    HFEncoderLayer,
    convert_mask,
    patch_hf,
)
from .sentences import (
    sentence_embeddings,
)

__all__ = [
    "HF_ACTIVATIONS",
    "HFEncoderLayer",
    "SUPPORTED_ATTN_IMPLEMENTATIONS",
    "SUPPORTED_MODEL_TYPES",
    "convert_mask",
    "patch_hf",
    "sentence_embeddings",
]
