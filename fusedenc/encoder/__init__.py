"""``EncoderBlock`` and ``EncoderStack`` (blocks.py) and how their math runs: the executors
(ops, native, FP8, FP8 with folded LayerNorms) and the one custom op they are under
``torch.compile`` (traced.py)."""

from .blocks import (
    EncoderBlock,
    EncoderStack,
)

__all__ = [
    "EncoderBlock",
    "EncoderStack",
]
