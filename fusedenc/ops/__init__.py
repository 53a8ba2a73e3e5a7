"""The public ops (custom ops with PyTorch references): ``linear``, ``fused_qkv``,
``pack_qkv`` (gemm.py), ``layer_norm`` (norm.py) and the LayerNorm folded into GEMMs
(norm_fold.py).  They call the native core only through ``fusedenc.core``."""

from .gemm import (
    ACTIVATIONS,
    FallbackWarning,
    fused_qkv,
    linear,
    pack_qkv,
    reference_linear,
    split_qkv,
)
from .norm import (
    layer_norm,
    reference_layer_norm,
)

__all__ = [
    "ACTIVATIONS",
    "FallbackWarning",
    "fused_qkv",
    "linear",
    "pack_qkv",
    "reference_linear",
    "split_qkv",
    "layer_norm",
    "reference_layer_norm",
]
