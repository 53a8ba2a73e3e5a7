"""fusedenc: fast transformer-encoder inference on AMD and NVIDIA GPUs.

GEMM + bias + activation (and residual) fused in hipBLASLt/cuBLASLt epilogues,
one GEMM for Q, K and V, a flash-attention call on the packed QKV buffer, a
fused residual + LayerNorm kernel, ``EncoderBlock`` / ``EncoderStack`` built
from them, and PyTorch references for every op.  docs/ARCHITECTURE.md maps the
code: which module owns what, and the one seam to the native core (``core``).
"""

from .common.activations import ACTIVATIONS
from .core import (
    Backend,
    FallbackWarning,
    backend,
    clear_plan_cache,
    fallback_events,
    gemm_choices,
    plan_cache_info,
    set_plan_cache_limit,
)
from .encoder.blocks import EncoderBlock, EncoderStack
from .graphs.runner import GraphRunner
from .graphs.varlen import VarlenGraphRunner
from .hf.patch import patch_hf
from .hf.sentences import sentence_embeddings
from .ops.gemm import fused_qkv, linear, pack_qkv, reference_linear
from .ops.norm import layer_norm
from .report import capabilities

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "Backend",
    "EncoderBlock",
    "EncoderStack",
    "GraphRunner",
    "FallbackWarning",
    "backend",
    "capabilities",
    "clear_plan_cache",
    "fallback_events",
    "fused_qkv",
    "gemm_choices",
    "layer_norm",
    "linear",
    "pack_qkv",
    "patch_hf",
    "plan_cache_info",
    "reference_linear",
    "sentence_embeddings",
    "set_plan_cache_limit",
    "VarlenGraphRunner",
]
