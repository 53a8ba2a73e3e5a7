"""Padding-free batches: packing (cu_seqlens), pack / unpack, pooling (packing.py), and the
packed-row calls of blocks and stacks, ``forward_packed`` / ``forward_unpadded`` (calls.py)."""

from .packing import *  # noqa: F401,F403 - the names of packing.__all__
from .packing import __all__  # noqa: F401
