"""FP8 (e4m3): row-wise quantization, the FP8 GEMM and their reference math (rowwise.py),
the one-pass static-scale coding (triton_e4m3.py) and the range check of calibrated models
(range_check.py).  The FP8 mode of a stack with its LayerNorms folded is an executor:
``fusedenc.encoder.fp8_fold``."""

from .rowwise import *  # noqa: F401,F403 - the names of rowwise.__all__
from .rowwise import __all__  # noqa: F401
