"""The network from lc0's compact encoding to its heads in one call: ``EncodedRunner``.

The ``Evaluator``'s host workers hand each batch over as ``encoding.encode_masks``' arrays
(a 64-bit mask and a value per plane, and the canonical turn).  Run through the plain graph
runner, a batch costs its launching thread about twenty torch calls (three copies in, the
expansion, the replay, three copies out), and each call lets go of the GIL and must take it
back from the threads that decode and set futures: measured on an H100 with a T82-shaped net
at 256 positions, 3.5-4.3 ms of launching per batch against 7.5 ms of GPU work.

Here the batch travels as one row of bytes per position (``ROW_BYTES``: masks, values,
turn), and one CUDA graph per bucket holds the expansion, the network and the packing of
every head into one ``[B, width]`` tensor.  A batch is then one copy in (into the graph's
own input), one replay, one copy out, and an event: three calls that release the GIL.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import torch

from ..graphs.runner import BucketedGraphs
from .encoding import PLANES, expand_planes
from .network import Lc0GraphRunner, Lc0Network

__all__ = ["ROW_BYTES", "EncodedRunner", "head_layout", "input_views"]

_MASKS, _VALUES, _TURN = 8 * PLANES, 4 * PLANES, 8
#: Bytes per position of the packed input: 112 int64 masks, 112 float32 values, the int64 turn.
ROW_BYTES = _MASKS + _VALUES + _TURN


def head_layout(net: Lc0Network) -> dict[str, tuple[int, int]]:
    """Where each head lies in the packed output: ``{name: (first column, width)}``."""
    widths = {"policy": 1858, ("wdl" if net.wdl else "value"): 3 if net.wdl else 1}
    if net.has_moves_left:
        widths["moves_left"] = 1
    layout, col = {}, 0
    for name, w in widths.items():
        layout[name] = (col, w)
        col += w
    return layout


def input_views(packed):
    """``(masks, values, turns)`` viewing a packed input ``[B, ROW_BYTES]`` (uint8; a numpy
    array or a tensor): uint64 (numpy) or int64 (torch) ``[B, 112]``, float32 ``[B, 112]``, int64 ``[B]``.  Every
    field starts at a multiple of its size and the row length is a multiple of 8, so the
    views need no copy."""
    if isinstance(packed, np.ndarray):
        masks = packed[:, :_MASKS].view(np.uint64)
        values = packed[:, _MASKS:_MASKS + _VALUES].view(np.float32)
        turns = packed[:, _MASKS + _VALUES:].view(np.int64)[:, 0]
    else:
        masks = packed[:, :_MASKS].view(torch.int64)
        values = packed[:, _MASKS:_MASKS + _VALUES].view(torch.float32)
        turns = packed[:, _MASKS + _VALUES:].view(torch.int64)[:, 0]
    return masks, values, turns


def _encoded_heads(net: Lc0Network, names: Sequence[str], packed: torch.Tensor) -> torch.Tensor:
    """The net's heads (columns in ``names``' order) for packed encodings on its device."""
    masks, values, turns = input_views(packed)
    planes = expand_planes(masks, values, turns, dtype=net.preproc.weight.dtype)
    heads = net._forward_heads(planes)
    return torch.cat([heads[name] for name in names], dim=1)


class EncodedRunner(Lc0GraphRunner):
    """``Lc0GraphRunner`` whose graphs start from packed encodings and end in packed heads.

    ``launch(host_in, host_out, n)`` copies the first ``n`` rows of ``host_in`` (pinned
    uint8 ``[rows, ROW_BYTES]``) into the bucket's static input, replays its graph and queues
    the copy of its packed heads into ``host_out`` (pinned float32 ``[rows, width]``;
    ``layout`` says which columns hold which head), all on the current stream and without
    waiting for the GPU.  With ``graphs=False`` the same runs eagerly (on a GPU or the CPU, where ``host_out`` is written before ``launch`` returns)."""

    def __init__(self, net: Lc0Network, batch_sizes: Sequence[int], *, graphs: bool = True):
        p = net.preproc.weight
        self.graphs = graphs and p.device.type == "cuda"
        if self.graphs:
            super().__init__(net, batch_sizes)
        else:  # no graphs: nothing of the runner but the net (and the same check of the sizes)
            BucketedGraphs.__init__(self, net, batch_sizes, p.device)
            self.net = net
        self.layout = head_layout(net)
        # The graphs' function holds the net and layout, not this runner: a bound method kept
        # on the runner would make a reference cycle, left (graphs and all) to the cycle
        # collector, whose collection inside another capture breaks that capture.
        self._run = functools.partial(_encoded_heads, net, tuple(self.layout))
        self.width = sum(w for _, w in self.layout.values())
        self._device_in: Optional[torch.Tensor] = None

    def _static_inputs(self, bucket: int) -> tuple[Optional[torch.Tensor], ...]:
        return (torch.zeros((bucket, ROW_BYTES), dtype=torch.uint8, device=self.device),)

    def launch(self, host_in: torch.Tensor, host_out: torch.Tensor, n: int) -> None:
        if self.graphs:
            if n > self.batch_sizes[-1]:
                raise ValueError(f"a batch of {n} is larger than the largest bucket, {self.batch_sizes[-1]}")
            g = self._graph(n)
            g.inputs[0][:n].copy_(host_in[:n], non_blocking=True)
            g.graph.replay()
            host_out[:n].copy_(g.out[:n], non_blocking=True)
            return
        if self.device.type == "cpu":
            masks, values, turns = input_views(host_in[:n].numpy())
            planes = expand_planes(masks, values, turns, dtype=self.net.preproc.weight.dtype)
            heads = self.net._forward_heads(planes)
            host_out[:n].copy_(torch.cat([heads[name] for name in self.layout], dim=1))
            return
        if self._device_in is None or self._device_in.shape[0] < n:
            self._device_in = torch.empty((max(n, self.batch_sizes[-1]), ROW_BYTES), dtype=torch.uint8,
                                          device=self.device)
        device_in = self._device_in[:n]
        device_in.copy_(host_in[:n], non_blocking=True)
        host_out[:n].copy_(self._run(device_in), non_blocking=True)
