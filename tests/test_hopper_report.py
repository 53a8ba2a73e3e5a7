"""A CUDA core without its Hopper (sm90) kernels is said loudly, with the cost, where a GPU would
run them (``python -m fusedenc``, ``capabilities()["hopper"]``), and noted elsewhere; a build that
holds them says nothing.  The states are set by hand here; the last tests check the real build."""

from __future__ import annotations

import os
import types

import pytest
import torch

import fusedenc
import fusedenc.__main__ as cli
from fusedenc import core, report

NO_CUTLASS = "not built: no CUTLASS headers (pip install --no-deps nvidia-cutlass, or set FUSEDENC_CUTLASS_INCLUDE)"
CUDA_CORE = {"vendor": "cuda", "library": "cuBLASLt 13.1.1", "library_version": 130101}


@pytest.fixture
def cuda_build(monkeypatch):
    """A CUDA core whose Hopper kernels are ``kernels``, built as ``state`` says, on ``devices``."""

    def make(kernels=(), state=NO_CUTLASS, devices=((0, "NVIDIA H100 80GB HBM3"),)):
        monkeypatch.setattr(core, "library_info", lambda module=None: dict(CUDA_CORE))
        monkeypatch.setattr(core, "sm90_gemm_kernels", lambda: list(kernels))
        monkeypatch.setattr(report, "_build_info", types.SimpleNamespace(SM90_GEMM=state))
        monkeypatch.setattr(report, "_sm90_devices", lambda: list(devices))

    return make


def test_on_an_h100_a_build_without_them_warns_with_what_is_missing_the_cost_and_the_fix(cuda_build):
    cuda_build()
    h = report.hopper()
    assert h["built"] is False and h["why_not"].startswith("no CUTLASS headers")
    warning = h["warning"]
    for says in ("NO Hopper kernels", "GPU 0 (NVIDIA H100 80GB HBM3)", "epilogue GEMMs", "LayerNorm folding",
                 "about 13%", "1.11-1.14x torch.compile without them, 1.29-1.32x with them, in one A/B run", "pip install --no-deps nvidia-cutlass"):  # fmt: skip
        assert says in warning, says
    lines = cli.report()
    assert "  WARNING: this build has NO Hopper kernels, and GPU 0 (NVIDIA H100 80GB HBM3) would run them." in lines
    assert any(line.startswith("  Cost: about 13%") for line in lines), lines


def test_the_fix_follows_the_reason(cuda_build):
    cuda_build(state="not built: 90 is not among the CUDA architectures (80;89)")
    assert "FUSEDENC_CUDA_ARCHITECTURES" in report.hopper()["warning"]


def test_without_a_hopper_gpu_it_is_a_one_line_note(cuda_build):
    cuda_build(devices=())
    assert report.hopper()["warning"] is None
    assert report.hopper_lines() == [
        "  note: no Hopper (sm90) kernels in this build (no CUTLASS headers (pip install --no-deps nvidia-cutlass, or set "
        "FUSEDENC_CUTLASS_INCLUDE)); that costs " + report.HOPPER_COST
    ]


def test_a_build_with_them_says_nothing(cuda_build):
    cuda_build(kernels=[("float16", "none"), ("float16", "swish")], state="built: CUTLASS /x/include")
    assert report.hopper() == {"built": True, "why_not": "", "sm90_devices": [(0, "NVIDIA H100 80GB HBM3")],
                               "warning": None}  # fmt: skip
    assert report.hopper_lines() == []


def test_no_cuda_core_no_hopper_lines(monkeypatch):
    monkeypatch.setattr(core, "library_info", lambda module=None: None)
    assert report.hopper() == {"built": False, "why_not": "", "sm90_devices": [], "warning": None}
    assert report.hopper_lines() == []


def test_rocm_gpus_are_not_taken_for_hopper(monkeypatch):
    """ROCm's torch reports gfx90a as compute capability 9.0: only a CUDA torch's 9.0 is Hopper."""
    monkeypatch.setattr(torch.version, "cuda", None)
    assert report._sm90_devices() == []


def test_capabilities_carry_the_hopper_state():
    assert fusedenc.capabilities()["hopper"] == report.hopper()


def test_the_built_core_reports_its_hopper_kernels_truthfully():
    """The real build: ``built`` is what the core holds; a required CUDA core (CI's CUDA build, a
    wheel under test) must hold them unless the build turned them off on purpose."""
    info = core.library_info()
    h = report.hopper()
    if info is None or info["vendor"] != "cuda":
        assert h["built"] is False and h["why_not"] == ""
        return
    assert h["built"] == bool(core.sm90_gemm_kernels())
    if os.environ.get("FUSEDENC_REQUIRE_NATIVE") == "cuda":
        assert h["built"] or "CUTLASS" not in h["why_not"], f"a CUDA core without CUTLASS: {h['why_not']}"


@pytest.mark.gpu
def test_an_h100_runs_with_its_hopper_kernels():
    """On the GPU machine's H100 the build holds them and python -m fusedenc warns of nothing."""
    if torch.cuda.get_device_capability() != (9, 0) or core.library_info()["vendor"] != "cuda":
        pytest.skip("not a Hopper GPU")
    h = report.hopper()
    assert h["built"], f"an sm90 GPU with a CUDA core without its Hopper kernels: {h['why_not']}"
    assert h["sm90_devices"] and h["warning"] is None
    assert not any("WARNING" in line for line in cli.report())


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("on", True), ("0", False), ("off", False),
                                      ("maybe", True)])  # fmt: skip
def test_the_gelu_units_are_on_unless_the_environment_says_0_or_off(value, on):
    """The GELU units' process-wide switch (measured faster than cuBLASLt + the pass, so on by
    default): ``FUSEDENC_SM90_GELU`` read once when the core loads, in a fresh process each."""
    import subprocess
    import sys

    if core.native_module() is None:
        pytest.skip("no native core in this build: the switch lives there")
    env = {k: v for k, v in os.environ.items() if k != "FUSEDENC_SM90_GELU"}
    if value is not None:
        env["FUSEDENC_SM90_GELU"] = value
    code = ("import fusedenc; from fusedenc import core; "
            "print(core.sm90_gelu_epilogue_on(), fusedenc.capabilities()['sm90_gelu_epilogue']['on'])")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(on), str(on)]
