"""The two ways an Lc0 network file can be refused.

Kept in a module of their own so that every layer of the file reader (wire format,
weights, the net file) raises them without importing the layers above it.
"""

from __future__ import annotations

__all__ = ["Lc0FileError", "Lc0FormatError", "Lc0NonFiniteError", "Lc0ValueWarning", "reason"]


class Lc0FileError(ValueError):
    """The file is not a well-formed Lc0 network: not gzip, truncated, broken protobuf,
    wrong magic, or a weight layer whose bytes do not decode.  The message names the
    field (as a path such as ``weights.encoder[3].mha.q_w``) and what was wrong."""


class Lc0FormatError(ValueError):
    """The file is well formed, but describes a network fusedenc does not run (a residual
    body, a position-encoding table we do not ship, relative position encodings, a
    missing or mis-sized weight).  The message names every such field."""


class Lc0ValueWarning(UserWarning):
    """A net fusedenc runs holds weights so large that a forward likely overflows (values
    beyond float16's range in a wider dtype): the warning names the layers."""


class Lc0NonFiniteError(FloatingPointError):
    """A forward's heads are not finite (``Lc0Network(..., check_finite=True)``): the message
    names each head with NaN or infinite values."""


def reason(exc: Exception, path: str) -> str:
    """An error's text without the file name a caller's message already gives (lc0's file
    and format errors start with it, and say what fusedenc cannot do; an OSError's strerror
    has no name)."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc).removeprefix(f"{path}: ")
