"""Under ``torch.compile`` an EncoderBlock or EncoderStack is one custom op,
``fusedenc::encoder_rows``, whose implementation is the module's eager forward.

Traced op by op, a layer was six custom ops, each paying the dispatcher and its
argument checks on every call, which left the compiled stack host-bound at up to 2.5x
the eager time (issue 20, lever 3); inductor cannot fuse across fusedenc's ops anyway,
so one op per module loses no fusion.  A graph holds ints, not modules: each module
registers its eager forward under a handle at construction (and again when copied or
unpickled), held weakly, and the op finds it there.  Shapes and arguments are validated
while tracing (on fake tensors); the eager forward inside the op validates once per
signature.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Optional

import torch

from . import core
from .executors import NativeExecutor

__all__ = ["register"]

_RUNS: dict[int, weakref.WeakMethod] = {}
_HANDLES = itertools.count(1)


def register(run: Callable[..., torch.Tensor]) -> int:
    """A handle for ``run``, a module's bound eager forward ``run(rows, batch, seq,
    attn_bias, key_padding_mask, executor)``; the entry goes when the module does."""
    handle = next(_HANDLES)
    _RUNS[handle] = weakref.WeakMethod(run, lambda _ref, h=handle: _RUNS.pop(h, None))
    return handle


@torch.library.custom_op("fusedenc::encoder_rows", mutates_args=())
def encoder_rows(
    rows: torch.Tensor,
    handle: int,
    batch: int,
    seq: int,
    attn_bias: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
) -> torch.Tensor:
    ref = _RUNS.get(handle)
    run = None if ref is None else ref()
    if run is None:
        raise RuntimeError(
            "fusedenc: this compiled graph calls an EncoderBlock/EncoderStack that no longer exists "
            "(compile the module again)"
        )
    # Scratch for this call only: under torch.compile's CUDA graphs (reduce-overhead) every
    # allocation made while warming up or recording comes from the graph's pool and must be
    # freed or returned, so the per-stream workspace the eager path caches cannot be made here.
    ex = None
    if core.active_on(rows.device):
        scratch = torch.empty(core.WORKSPACE_BYTES, dtype=torch.uint8, device=rows.device)
        ex = NativeExecutor(rows.device, rows.dtype, workspace=scratch)
    out = run(rows, batch, seq, attn_bias, key_padding_mask, ex)
    return out.clone() if out is rows else out  # a custom op's output may not be its input


@encoder_rows.register_fake
def _(rows, handle, batch, seq, attn_bias, key_padding_mask):
    return torch.empty_like(rows)
