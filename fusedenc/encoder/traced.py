"""Under ``torch.compile`` an EncoderBlock or EncoderStack is one custom op,
``fusedenc::encoder_rows``, whose implementation is the module's eager forward.

Traced op by op, a layer was six custom ops, each paying the dispatcher and its
argument checks on every call, which left the compiled stack host-bound at up to 2.5x
the eager time; inductor cannot fuse across fusedenc's ops anyway,
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

from .. import core
from ..graphs import auto as auto_graphs
from .executors import NativeExecutor

__all__ = ["register"]

#: handle -> (weak reference to the module, its unbound eager forward).  Not a
#: ``weakref.WeakMethod``: its callback reaches the WeakMethod through a weak reference of its
#: own, which interpreter shutdown can clear before the module dies, and every module alive at
#: exit then printed "Exception ignored in ... WeakMethod ... '_alive'" on stderr.
_RUNS: dict[int, tuple[weakref.ref, Callable[..., torch.Tensor]]] = {}
_HANDLES = itertools.count(1)


def register(run: Callable[..., torch.Tensor]) -> int:
    """A handle for ``run``, a module's bound eager forward ``run(rows, batch, seq,
    attn_bias, key_padding_mask, executor)``; the entry goes when the module does."""
    handle = next(_HANDLES)
    # The callback holds the dict itself (not the module global), so it still works while
    # the interpreter tears this module down.
    owner = weakref.ref(run.__self__, lambda _ref, h=handle, runs=_RUNS: runs.pop(h, None))
    _RUNS[handle] = (owner, run.__func__)
    return handle


def _lookup(handle: int) -> Optional[Callable[..., torch.Tensor]]:
    """The registered module's bound forward, or None once the module is gone."""
    entry = _RUNS.get(handle)
    owner = None if entry is None else entry[0]()
    return None if owner is None else entry[1].__get__(owner)


@torch.library.custom_op("fusedenc::encoder_rows", mutates_args=())
def encoder_rows(
    rows: torch.Tensor,
    handle: int,
    batch: int,
    seq: int,
    attn_bias: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
) -> torch.Tensor:
    run = _lookup(handle)
    if run is None:
        raise RuntimeError(
            "fusedenc: this compiled graph calls an EncoderBlock/EncoderStack that no longer exists "
            "(compile the module again)"
        )
    if _replays_here(rows):
        # torch.compile's default mode runs this op eagerly at run time: the module's
        # automatic CUDA graphs replay here, so a compiled module is as fast as its plain call.
        out = auto_graphs.encoder_call(run.__self__, run, rows, batch, seq, attn_bias, key_padding_mask, native=True)
        return out.clone() if out is rows else out
    # Scratch for this call only: under torch.compile's CUDA graphs (reduce-overhead) every
    # allocation made while warming up or recording comes from the graph's pool and must be
    # freed or returned, so the per-stream workspace the eager path caches cannot be made here.
    ex = None
    if core.active_on(rows.device):
        scratch = torch.empty(core.WORKSPACE_BYTES, dtype=torch.uint8, device=rows.device)
        ex = NativeExecutor(rows.device, rows.dtype, workspace=scratch)
    out = run(rows, batch, seq, attn_bias, key_padding_mask, ex)
    return out.clone() if out is rows else out  # a custom op's output may not be its input


def _replays_here(rows: torch.Tensor) -> bool:
    """Whether the op may use automatic graphs: the native core runs on the rows' GPU and the
    op runs on the device's default stream.  torch.compile's own CUDA graphs (reduce-overhead)
    warm up on a stream of their own with every allocation sent to their pool, where a capture
    of ours does not belong; inside their capture ``auto_graphs`` runs eagerly anyway."""
    if not (rows.is_cuda and core.active_on(rows.device)):
        return False
    return torch.cuda.current_stream(rows.device) == torch.cuda.default_stream(rows.device)


@encoder_rows.register_fake
def _(rows, handle, batch, seq, attn_bias, key_padding_mask):
    return torch.empty_like(rows)
