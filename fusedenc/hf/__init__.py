"""Hugging Face BERT-family models on fusedenc: ``patch_hf`` (patch.py), the padding-free
encoder (varlen.py), a model's plain call as one graph and ``sentence_embeddings``
(embedded.py), BERT's packed embeddings in Triton (triton_embeddings.py), the patched
classes that pickle (classes.py) and the bundled real model (real_models.py).  transformers
is imported only where a model is at hand."""

from . import patch
from .patch import *  # noqa: F401,F403 - the names of patch.__all__
from .sentences import sentence_embeddings

__all__ = patch.__all__ + ["sentence_embeddings"]
