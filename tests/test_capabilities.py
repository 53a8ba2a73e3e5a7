"""backend() and capabilities() describe the install truthfully."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedenc
from fusedenc import core

ROOT = Path(__file__).resolve().parent.parent


def test_backend_reports_a_reason():
    b = fusedenc.backend()
    assert b.name in ("cuda", "hip", "reference")
    assert b.reason
    assert str(b).startswith(b.name)
    if not torch.cuda.is_available():
        assert b.name == "reference"


def test_capability_table_shape():
    caps = fusedenc.capabilities()
    assert caps["backend"] == fusedenc.backend().name
    assert set(caps["activations"]) == {"float16", "bfloat16", "float32"}
    for dtype, table in caps["activations"].items():
        assert set(table) == set(fusedenc.ACTIVATIONS)
        for act, entry in table.items():
            assert entry["fusion"] in ("native", "fallback", "reference"), (dtype, act)
        assert caps["residual"][dtype]["fusion"] in ("native", "reference")


def test_capabilities_of_the_built_core():
    """What each vendor's library fuses natively (docs/ARCHITECTURE.md), as the core reports it."""
    module = core.native_module()
    if module is None:
        caps = fusedenc.capabilities()
        assert all(e["fusion"] == "reference" for e in caps["activations"]["float16"].values())
        return
    table = fusedenc.capabilities()["activations"]["float16"]
    assert table["relu"] == {"fusion": "native", "epilogue": "RELU_BIAS", "kernel": None}
    assert table["gelu_tanh"] == {"fusion": "native", "epilogue": "GELU_BIAS", "kernel": None}
    assert table["none"]["epilogue"] == "BIAS"
    sm90 = set(core.sm90_gemm_kernels())
    units = set(core.sm90_gelu_epilogue_kernels()) if core.sm90_gelu_epilogue_on() else set()
    for act in ("gelu", "mish", "relu2", "selu", "tanh", "sigmoid"):
        entry = dict(table[act])
        # Where the build holds the Hopper epilogue GEMM (or the switched-on GELU unit) for it,
        # the report says so beside the fallback.
        assert (entry.pop("sm90", None) is not None) == (("float16", act) in sm90 | units), act
        assert entry == {"fusion": "fallback", "epilogue": "BIAS", "kernel": "bias_activation"}, act
    assert fusedenc.capabilities()["sm90_epilogue_gemm"] == [f"{d}:{a}" for d, a in sorted(sm90)]
    if module.VENDOR == "cuda":
        assert table["swish"]["fusion"] == "fallback"  # cuBLASLt has no swish epilogue
    elif module.HAS_SWISH_EPILOGUE:
        assert table["swish"]["epilogue"] == "SWISH_BIAS_EXT"
    assert fusedenc.capabilities()["library"].startswith(module.LIBRARY)


def test_native_core_was_built_when_required():
    """CI sets FUSEDENC_REQUIRE_NATIVE=cuda: a broken native build must fail the run."""
    required = os.environ.get("FUSEDENC_REQUIRE_NATIVE")
    if not required:
        pytest.skip("FUSEDENC_REQUIRE_NATIVE not set")
    module = core.native_module()
    assert module is not None, f"native core missing: {fusedenc.backend()}"
    assert module.VENDOR == required
    assert module.library_version() > 0


@pytest.mark.parametrize(
    ("require", "marks", "code", "says"),
    [
        ("1", "gpu", 4, "FUSEDENC_REQUIRE_GPU=1, but the 1 selected GPU tests cannot run: no GPU visible"),
        ("", "gpu", 0, "1 skipped"),
        ("1", "not gpu", 5, "1 deselected"),  # nothing selected to require a GPU for
    ],
    ids=["required-fails", "not-required-skips", "deselected-is-not-required"],
)
@pytest.mark.slow
def test_a_required_gpu_that_is_missing_stops_the_run(require, marks, code, says):
    """With FUSEDENC_REQUIRE_GPU=1 a GPU run without a GPU (here: none visible) must not exit 0."""
    node = "tests/test_layer_norm_gpu.py::test_matches_reference[1-8-dtype0]"
    env = dict(os.environ, FUSEDENC_REQUIRE_GPU=require, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, node],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert says in proc.stdout + proc.stderr


def test_fallback_events_and_plan_cache_without_gpu():
    assert isinstance(fusedenc.fallback_events(), list)
    info = fusedenc.plan_cache_info()
    assert set(info) == {"size", "limit", "hits", "misses", "evictions"}


def test_python_m_fusedenc_says_what_was_built_and_whether_it_runs():
    """The README's set-up ends with `python3 -m fusedenc`: it must name the build and say why
    the core is not active where it is not (here: no GPU, or no core)."""
    proc = subprocess.run([sys.executable, "-m", "fusedenc"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"fusedenc {fusedenc.__version__}: ") and f"torch {torch.__version__}" in lines[0]
    b = fusedenc.backend()
    if b.name == "reference":
        assert any(line.startswith("  not active: ") and b.reason in line for line in lines), proc.stdout
    else:
        assert any(line.startswith("  active: ") for line in lines), proc.stdout
    if core.native_module() is None:
        assert "no native core" in lines[0] and any("to build it:" in line for line in lines), proc.stdout
    else:
        assert core.library_info()["library"] in lines[0], proc.stdout


def test_the_fp8_section_says_what_this_build_holds():
    fp8 = fusedenc.capabilities()["fp8"]
    compiled = core.fp8_compiled()
    assert (fp8["gemm"] is not None) == compiled and (fp8["quantize"] is not None) == compiled
    assert fp8["sm90_epilogue_gemm"] == (core.sm90_fp8_gemm_kernels() if compiled else [])
    assert fp8["sm90_e4m3_output"] == (core.fp8.sm90_fp8_e4m3_output_kernels() if compiled else [])
    # The e4m3-output form is a form of the epilogue GEMM: never listed without it.
    assert set(fp8["sm90_e4m3_output"]) <= set(fp8["sm90_epilogue_gemm"])
    assert fp8["sm90_e4m3_output_gelu"] == (core.fp8.sm90_fp8_e4m3_gelu_kernels() if compiled else [])
    assert set(fp8["sm90_e4m3_output_gelu"]) <= set(fp8["sm90_e4m3_output"])
    folded = [n for n in ("float16", "bfloat16") if compiled and core.fp8.sm90_fp8_residual_compiled(getattr(torch, n))]
    assert fp8["sm90_folded_layer_norm"] == folded and set(folded) <= set(fp8["sm90_e4m3_output"])
    if not torch.cuda.is_available():
        assert fp8["runs_here"] is False and "no GPU" in fp8["reason"]
