"""``fusedenc.auto_graphs``, the name earlier releases documented: the automatic CUDA graphs'
switches and reports now live in ``fusedenc.graphs.auto``, which this module re-exports."""

from .graphs.auto import *  # noqa: F401,F403
from .graphs.auto import __all__  # noqa: F401
