"""CMakeLists.txt's decisions, by configuring (not building) it in a scratch directory:
a CPU-only PyTorch gets no native core and says why; FUSEDENC_GPU=cuda without cuBLASLt stops
naming the pip package; a CUDA core for sm90 without CUTLASS's headers warns loudly with the
cost, and a wheel build of it stops.  The CUDA cases need nvcc (CI has it) and take ~30 s each."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CMAKE = shutil.which("cmake")
NVCC = next((p for p in (os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", "nvcc"),
                         "/usr/local/cuda/bin/nvcc", shutil.which("nvcc") or "") if p and os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(CMAKE is None, reason="no cmake on the PATH")


def _configure(build: Path, *defines: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    import pybind11

    cmd = [CMAKE, "-S", str(ROOT), "-B", str(build), f"-DPython_EXECUTABLE={python}",
           f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", *defines]  # fmt: skip
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDENC_") and k != "CMAKE_ARGS"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)


def _build_info(build: Path) -> dict[str, str]:
    text = (build / "_build_info.py").read_text()
    return dict(re.findall(r'^([A-Z_0-9]+) = "(.*)"$', text, flags=re.M))


def test_an_unknown_sm90_gemm_option_is_refused(tmp_path):
    proc = _configure(tmp_path / "b", "-DFUSEDENC_GPU=none", "-DFUSEDENC_SM90_GEMM=yes")
    assert proc.returncode != 0 and "FUSEDENC_SM90_GEMM (pip: FUSEDENC_SM90_BUILD) must be auto, on or off" in " ".join(proc.stderr.split())


@pytest.mark.skipif(torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None,
                    reason="needs a CPU-only PyTorch")
def test_auto_with_a_cpu_only_torch_builds_no_core_and_says_why(tmp_path):
    """The README's set-up on a CPU machine: no CUDA core compiled (nvcc or not), one line saying so."""
    proc = _configure(tmp_path / "b", "-DFUSEDENC_GPU=auto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = _build_info(tmp_path / "b")
    assert info["CORE"] == "none" and info["TORCH_KIND"] == "cpu" and info["TORCH"] == torch.__version__
    assert f"PyTorch {torch.__version__} is CPU-only" in info["CORE_REASON"]
    assert "FUSEDENC_GPU=cuda" in info["CORE_REASON"]  # how to build the core anyway
    assert "no native core" in proc.stdout and "Check for working CUDA compiler" not in proc.stdout


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_cuda_without_cublaslt_stops_naming_the_package(tmp_path):
    """FUSEDENC_GPU=cuda in a Python without nvidia-cublas (a fresh venv): an error naming it."""
    cuda_include = Path(NVCC).resolve().parent.parent / "include" / "cublasLt.h"
    if cuda_include.exists():
        pytest.skip(f"the CUDA toolkit has cuBLASLt itself ({cuda_include})")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    proc = _configure(tmp_path / "b", "-DFUSEDENC_GPU=cuda", "-DFUSEDENC_CUBLASLT_ROOT=/nonexistent",
                      f"-DCMAKE_CUDA_COMPILER={NVCC}", python=str(env_dir / "bin" / "python"))
    said = " ".join(proc.stderr.split())  # CMake wraps its messages
    assert proc.returncode != 0
    assert "FUSEDENC_GPU=cuda: nvcc" in said and "found but not cuBLASLt: pip install nvidia-cublas" in said, said


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
def test_a_cuda_core_without_cutlass_warns_with_the_cost_and_a_wheel_refuses(tmp_path):
    pytest.importorskip("nvidia", reason="needs nvidia-cublas (cuBLASLt) in this Python")
    build = tmp_path / "b"
    defines = ["-DFUSEDENC_GPU=cuda", "-DFUSEDENC_CUDA_ARCHITECTURES=90", "-DFUSEDENC_CUTLASS_INCLUDE=/nonexistent",
               f"-DCMAKE_CUDA_COMPILER={NVCC}"]  # fmt: skip
    proc = _configure(build, *defines)
    if proc.returncode != 0 and "not cuBLASLt" in proc.stderr:
        pytest.skip("no cuBLASLt for this Python (pip install nvidia-cublas)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warning = proc.stderr
    assert "CMake Warning" in warning and "NO CUTLASS HEADERS FOUND" in warning, warning
    flat = " ".join(warning.split())
    for says in ("without the Hopper (sm90) kernels", "LayerNorm folding", "about 13%",
                 "1.11-1.14x torch.compile without them, 1.29-1.32x with them, in one A/B run", "pip install --no-deps nvidia-cutlass",
                 "FUSEDENC_CUTLASS_INCLUDE", "FUSEDENC_SM90_BUILD=off"):  # fmt: skip
        assert says in flat, says
    info = _build_info(build)
    assert info["CORE"] == "cuda" and info["SM90_GEMM"].startswith("not built: no CUTLASS headers")

    wheel = _configure(build, *defines, "-DSKBUILD_STATE=wheel")
    assert wheel.returncode != 0
    assert "a wheel of the CUDA core for sm90 without CUTLASS's headers" in " ".join(wheel.stderr.split())

    # Asked for (tools/build_core.sh on the GPU machine): an error, not a warning.
    on = _configure(build, *defines, "-DFUSEDENC_SM90_GEMM=on")
    assert on.returncode != 0
    assert "the Hopper kernels were asked for (FUSEDENC_SM90_BUILD=on) but not built: no CUTLASS headers" in " ".join(
        on.stderr.split())

    # Turned off explicitly, no warning and a wheel builds without them.
    off = _configure(build, *defines, "-DSKBUILD_STATE=wheel", "-DFUSEDENC_SM90_GEMM=off")
    assert off.returncode == 0 and "NO CUTLASS" not in off.stderr, off.stderr
    assert _build_info(build)["SM90_GEMM"] == "not built: asked off (FUSEDENC_SM90_BUILD=off)"
