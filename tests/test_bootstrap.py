"""bootstrap.py's decisions, without installing anything: which PyTorch will do on which
machine, how the machine's GPU is recognized, CUTLASS's headers unpacked whole or not at all,
and what makes a second set-up reuse the first.  CI runs the two commands themselves on a
clean machine (.ci/run)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bootstrap", ROOT / "bootstrap.py")
bootstrap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bootstrap)


@pytest.mark.parametrize(
    "state, vendor, usable",
    [
        (None, "cpu", False),
        (("2.13.0+cpu", "cpu"), "cpu", True),
        (("2.4.1", "cpu"), "cpu", False),  # older than 2.5
        (("2.13.0+cpu", "cpu"), "cuda", False),  # a CPU build on an NVIDIA machine
        (("2.11.0+cu130", "cuda"), "cuda", True),
        (("2.11.0+cu130", "cuda"), "cpu", True),  # a CUDA build runs on a CPU machine too
        (("2.9.0+rocm6.4", "rocm"), "cuda", False),
        (("2.9.0+rocm6.4", "rocm"), "rocm", True),
        (("2.10.0a0+git1234", "cuda"), "cuda", True),
    ],
)
def test_which_pytorch_will_do(state, vendor, usable):
    why = bootstrap.torch_usable(state, vendor)
    assert (why is None) == usable, why
    if not usable:
        assert why  # says why, for the set-up's line


def test_the_gpu_is_found_from_the_drivers_files(monkeypatch, tmp_path):
    monkeypatch.setattr(bootstrap.shutil, "which", lambda name: None)
    files: dict[str, list[str]] = {}
    monkeypatch.setattr(bootstrap.glob, "glob", lambda pattern: files.get(pattern, []))
    monkeypatch.setattr(bootstrap.os.path, "exists", lambda p: p in files)
    assert bootstrap.gpu_vendor() == "cpu"
    files["/proc/driver/nvidia/gpus/*"] = ["/proc/driver/nvidia/gpus/0000:01:00.0"]
    assert bootstrap.gpu_vendor() == "cuda"
    files.clear()
    node = tmp_path / "properties"
    node.write_text("cpu_cores_count 8\ngfx_target_version 90402\n")
    files["/dev/kfd"] = []
    files["/sys/class/kfd/kfd/topology/nodes/*/properties"] = [str(node)]
    assert bootstrap.gpu_vendor() == "rocm"
    node.write_text("cpu_cores_count 8\ngfx_target_version 0\n")  # the CPU's node only
    assert bootstrap.gpu_vendor() == "cpu"


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("cutlass_library/source/include/cutlass/cutlass.h", "// cutlass")
        z.writestr("cutlass_library/source/include/cute/tensor.hpp", "// cute")
        z.writestr("cutlass_library/__init__.py", "")
    return path


def test_cutlass_headers_are_unpacked_once_and_whole(monkeypatch, tmp_path):
    monkeypatch.setattr(bootstrap, "CACHE", tmp_path / ".cache")
    version = bootstrap.CUTLASS.split("==")[1]
    wheels = tmp_path / ".cache" / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels / f"nvidia_cutlass-{version}-py3-none-any.whl")
    monkeypatch.setattr(bootstrap, "run", lambda *a, **k: pytest.fail("downloaded although the wheel is there"))
    include = bootstrap.cutlass_headers()
    assert (include / "cutlass" / "cutlass.h").read_text() == "// cutlass"
    assert (include / "cute" / "tensor.hpp").exists() and not (include.parent / "include.partial").exists()
    assert not (include / "cutlass_library").exists()  # only the headers
    (wheels / f"nvidia_cutlass-{version}-py3-none-any.whl").unlink()
    assert bootstrap.cutlass_headers() == include  # a second call reuses the unpacked headers


def test_the_install_stamp_follows_the_build_inputs(monkeypatch, tmp_path):
    env = {"PATH": "/usr/bin"}
    a = bootstrap.build_inputs_digest("bench,test", "2.13.0+cpu", env)
    assert a == bootstrap.build_inputs_digest("bench,test", "2.13.0+cpu", dict(env, HOME="/elsewhere"))
    assert a != bootstrap.build_inputs_digest("bench,test", "2.14.0+cpu", env)  # another PyTorch: rebuilt
    assert a != bootstrap.build_inputs_digest("test", "2.13.0+cpu", env)
    assert a != bootstrap.build_inputs_digest("bench,test", "2.13.0+cpu", dict(env, FUSEDENC_GPU="cuda"))


def test_an_unknown_job_prints_the_usage(capsys):
    assert bootstrap.main(["deploy"]) == 2
    assert "bootstrap.py nps" in capsys.readouterr().err
