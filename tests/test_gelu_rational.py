"""The exact-GELU epilogue's constants (csrc/kernels/activations.cuh, ``activate_fast<gelu>``):
read from the source and run through the kernel's float32 steps (tools/gelu_rational_fit.py),
every fp16 and bf16 value in [-40, 40] stays within half an output ulp + 1e-5 relative of the
fp64 GELU, and the fitted rational matches a fresh fit.  The GPU tests
(tests/test_sm90_gelu_gpu.py, tests/test_ops_gpu.py) check the compiled kernels the same way;
this catches an edited constant on any machine."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fit_tool():
    spec = importlib.util.spec_from_file_location("gelu_rational_fit", ROOT / "tools" / "gelu_rational_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source_coefficients() -> tuple[np.ndarray, np.ndarray]:
    """P and Q (lowest degree first, Q without its 2^24 scale) from the kernel's Horner steps."""
    text = (ROOT / "csrc" / "kernels" / "activations.cuh").read_text()
    body = text[text.index("float activate_fast<Activation::gelu>(float x) {"):]
    body = body[: body.index("\n}\n")]
    number = r"(-?[0-9.]+(?:e-?[0-9]+)?)f"
    p_first = re.search(rf"float p = fmaf\({number}, a, {number}\);", body)
    p_rest = re.findall(rf"p = fmaf\(p, a, {number}\);", body)
    q_first = re.search(rf"float q = fmaf\({number} \* kScale, a, {number} \* kScale\);", body)
    q_rest = re.findall(rf"q = fmaf\(q, a, {number} \* kScale\);", body)
    assert p_first and q_first and len(p_rest) == 2 and len(q_rest) == 2 and "q = fmaf(q, a, kScale);" in body, body
    p = [float(v) for v in p_rest[::-1]] + [float(p_first[2]), float(p_first[1])]
    q = [1.0] + [float(v) for v in q_rest[::-1]] + [float(q_first[2]), float(q_first[1])]
    return np.array(p), np.array(q)


def test_the_kernel_constants_keep_every_16_bit_value_within_rounding(fit_tool):
    p, q = _source_coefficients()
    assert fit_tool.check(p, q) == {"torch.float16": 0, "torch.bfloat16": 0}


def test_the_kernel_constants_are_the_fit(fit_tool):
    worst, p, q = fit_tool.fit(3)
    assert worst < 5e-7
    p_src, q_src = _source_coefficients()
    np.testing.assert_allclose(p_src, p, rtol=1e-7)
    np.testing.assert_allclose(q_src, q, rtol=1e-7)


def test_a_wrong_constant_is_caught(fit_tool):
    """The check can fail: one coefficient off by 1e-3 puts values outside."""
    p, q = _source_coefficients()
    p[1] *= 1.001
    assert sum(fit_tool.check(p, q).values()) > 0
