"""CUDA graphs: the explicit ``GraphRunner`` and capture helpers (runner.py), the automatic
graphs behind a module's plain call (auto.py), how a call's inputs reach a graph's static
buffers (feeds.py) and graphs of packed rows per token count (varlen.py)."""

from .runner import *  # noqa: F401,F403 - the names of runner.__all__
from .runner import __all__  # noqa: F401
