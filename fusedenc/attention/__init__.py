"""The attention call on fused-QKV views, and the table that picks its kernel.

``attention(q, k, v, attn_bias, key_padding_mask)`` takes q, k, v as the
``[B, S, H, Dh]`` views that ``fused_qkv`` returns (strided views of one packed
``[B, S, 3D]`` buffer) and returns ``[B*S, H*Dh]``, the rows the output
projection reads.  Several kernels can serve a call ("backends"); a table
keyed by GPU architecture, dtype, head dim, sequence-length bucket, batch*heads
bucket and bias/mask presence says which to prefer, and the first preferred
backend that supports the call wins.

Backends
--------
``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``
    PyTorch's SDPA kernels, called as the aten ops that
    ``F.scaled_dot_product_attention`` dispatches to
    (``aten._scaled_dot_product_flash_attention`` and friends).  Calling them
    directly skips SDPA's selector and touches no global state, where
    ``sdpa_kernel([...])`` flips process-wide flags (not thread-safe, and about
    as costly as the kernel launch on the host).  The preparation SDPA would do
    (bool mask to additive bias, bias alignment padding) is done here instead.
    flash, efficient and cuDNN write their output in ``[B, S, H, Dh]`` memory
    order, so the ``[B*S, H*Dh]`` result is a view: no copy.  math writes
    ``[B, H, S, Dh]`` and its result is copied once.
``flash_attn``
    The flash-attn package (``flash_attn_qkvpacked_func`` when q, k and v are
    views of one packed ``[B, S, 3, H, Dh]`` buffer, else ``flash_attn_func``).
    No bias and no padding mask (its varlen interface would need the tokens
    unpadded first: not implemented).
``aiter``
    AMD AITER's ``flash_attn_func`` on ROCm.  No bias, no mask.  Not tested:
    no AMD GPU was available.
``triton_short``
    fusedenc's own Triton kernel for short sequences (``attention/triton_short.py``,
    S <= 128): all keys of a sequence in one tile, q, k, v read from the packed
    views, the bias read as given (any strides, q's dtype or float32) and the
    bool mask read in-kernel, output written as ``[B*S, H*Dh]`` rows.  Needs the
    triton package; CUDA and ROCm.  The shipped sm90 table puts it first where
    it measured fastest on an H100 (up to 64 tokens from 4096 batch*heads up,
    and up to 128 tokens with a bias or padding mask); elsewhere it runs where
    a measured user table puts it, or when forced.  The first call with a new
    head dim, tile size, dtype or bias/mask combination compiles the kernel
    (seconds; once per process, then from Triton's disk cache).

Key padding and fully masked rows
---------------------------------
``key_padding_mask[b, j] = True`` removes key ``j`` of sequence ``b`` (the
``nn.MultiheadAttention`` convention).  It becomes ``-inf`` in an additive
bias.  A query row whose keys are all removed (a sequence that is all
padding, or ``-inf`` across a whole row of ``attn_bias``) yields **zeros**, as
``nn.TransformerEncoderLayer`` gives on its SDPA path.  Only backends that
produce those zeros natively accept masks (sdpa_efficient, sdpa_cudnn,
sdpa_math and triton_short: checked by the GPU tests), so the result never
depends on which backend ran.

Choosing, caching, forcing
--------------------------
The first call with a new signature (shapes, strides, dtypes, devices,
alignment, scale, forced backend) validates the arguments, reads the tables
(once per architecture) and makes a plan; later calls with that signature do a
dict lookup and launch.  ``FUSEDENC_ATTENTION_BACKEND=<name>`` or
``backend=<name>`` forces a backend and raises ``ValueError`` if it cannot
serve the call.  The variable is read when a plan is made: after changing it
in a running process, call ``clear_cache()``.  ``explain()`` says what would
run and why.

Tables: ``fusedenc/configs/attention_<arch>.json`` ships with the package
(else ``attention_default.json``); ``python -m fusedenc.tune attention``
writes a measured user table to ``$FUSEDENC_CONFIG_DIR/attention_<arch>.json``
(default ``~/.cache/fusedenc``), whose rules are tried before the shipped ones.
A user table measured on another device or library version, or one that does
not parse, is ignored with one ``AttentionTableWarning`` per file and process.

Where things live: ``call`` (validation, the table key), ``backends``,
``tables`` (shipped and user tables), ``plans`` (the choice and the cached
plan of a call signature), ``op`` (the public functions and the custom op),
``triton_short`` (the Triton kernel), ``varlen`` (attention over packed variable-length
sequences, ``cu_seqlens`` offsets: the padding-free path's).

Inference only: no autograd.
"""

from ..common.device import device_arch, device_metadata
from ..common.table_files import CONFIG_DIR_ENV
from .backends import BACKENDS, FALLBACK_ORDER, AttentionBackend
from .call import (
    BATCH_HEADS_BUCKETS,
    EXTRAS,
    SEQ_BUCKETS,
    AttentionCall,
    batch_heads_bucket,
    describe_call,
    seq_bucket,
    table_key,
)
from .op import attention, explain
from .plans import BACKEND_ENV, Candidate, Explanation, cache_info, clear_cache, plan_for
from .tables import METADATA_KEYS, TABLE_SCHEMA, AttentionTableWarning, parse_table, user_table_path
from .varlen import VARLEN_BACKENDS, VarlenPlan, reference_varlen_attention, varlen_attention

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "BATCH_HEADS_BUCKETS",
    "CONFIG_DIR_ENV",
    "EXTRAS",
    "FALLBACK_ORDER",
    "METADATA_KEYS",
    "SEQ_BUCKETS",
    "TABLE_SCHEMA",
    "VARLEN_BACKENDS",
    "AttentionBackend",
    "AttentionCall",
    "AttentionTableWarning",
    "VarlenPlan",
    "Candidate",
    "Explanation",
    "attention",
    "batch_heads_bucket",
    "cache_info",
    "clear_cache",
    "describe_call",
    "device_arch",
    "device_metadata",
    "explain",
    "parse_table",
    "plan_for",
    "reference_varlen_attention",
    "seq_bucket",
    "table_key",
    "user_table_path",
    "varlen_attention",
]
