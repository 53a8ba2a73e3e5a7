"""The public ops (custom ops with PyTorch references): ``linear``, ``fused_qkv``,
``pack_qkv`` (gemm.py), ``layer_norm`` (norm.py) and the LayerNorm folded into GEMMs
(norm_fold.py).  They call the native core only through ``fusedenc.core``."""

from . import gemm, norm
from .gemm import *  # noqa: F401,F403 - the names of gemm.__all__ and norm.__all__
from .norm import *  # noqa: F401,F403

__all__ = gemm.__all__ + norm.__all__
