"""``fusedenc.fp8_range``, the name earlier releases documented: ``check_range`` now lives in
``fusedenc.fp8.range_check``, which this module re-exports."""

from .fp8.range_check import *  # noqa: F401,F403
from .fp8.range_check import __all__  # noqa: F401
