"""The two ways an Lc0 network file can be refused.

Kept in a module of their own so that every layer of the file reader (wire format,
weights, the net file) raises them without importing the layers above it.
"""

from __future__ import annotations

__all__ = ["Lc0FileError", "Lc0FormatError"]


class Lc0FileError(ValueError):
    """The file is not a well-formed Lc0 network: not gzip, truncated, broken protobuf,
    wrong magic, or a weight layer whose bytes do not decode.  The message names the
    field (as a path such as ``weights.encoder[3].mha.q_w``) and what was wrong."""


class Lc0FormatError(ValueError):
    """The file is well formed, but describes a network fusedenc does not run (a residual
    body, a position-encoding table we do not ship, relative position encodings, a
    missing or mis-sized weight).  The message names every such field."""
