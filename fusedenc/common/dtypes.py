"""The dtype vocabulary: which dtypes fusedenc serves, their names, the core's codes.

Every module that names, parses or checks a dtype takes it from here: the
ops' argument checks, the native core's dtype codes, the tuning files and
attention tables (which spell dtypes as names), the tune and benchmark CLIs'
``--dtype``, and the tolerance rule of the tests, the tuner and the benchmarks.
"""

from __future__ import annotations

import torch

__all__ = ["ATOL", "BY_NAME", "CLI_NAMES", "SUPPORTED", "code", "from_code", "name"]

#: Dtypes the ops accept, in the core's code order (``fusedenc::DType`` in
#: csrc/common.h): fp16/bf16 are the fast path; fp32 accumulates in fp32
#: without TF32, like torch's default.
SUPPORTED: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

#: Name (as tuning files, tables and CLIs spell it) -> dtype.
BY_NAME: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: What the commands' ``--dtype`` takes (the Lc0 CLI, the embedding command): short names too.
CLI_NAMES: dict[str, torch.dtype] = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
                                     "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}  # fmt: skip

_NAMES = {dtype: n for n, dtype in BY_NAME.items()}
_CODES = {dtype: i for i, dtype in enumerate(SUPPORTED)}

#: The absolute term of the tolerance rule ``|out - ref32| <= 2 * |same_dtype - ref32| + atol``
#: (tests, ``tune``'s accuracy gate and the benchmarks' output checks).
ATOL: dict[torch.dtype, float] = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}


def name(dtype: torch.dtype) -> str:
    """'float16', 'bfloat16' or 'float32'; KeyError for other dtypes."""
    return _NAMES[dtype]


def code(dtype: torch.dtype) -> int:
    """The native core's code of a supported dtype."""
    return _CODES[dtype]


def from_code(value: int) -> torch.dtype:
    return SUPPORTED[value]
