#!/usr/bin/env python3
"""Set up what is missing on this machine, then run fusedenc's main job or its tests.

    python3 bootstrap.py nps  [bench/nps.py options]   # the nps comparison (tiny preset without a GPU)
    python3 bootstrap.py test [pytest options]         # the tests (--exhaustive: the full sweeps too)
    python3 bootstrap.py setup                         # only the set-up
    python3 bootstrap.py cutlass-headers               # print CUTLASS's include directory (fetched once)

The set-up, each step skipped when already done (a second run reuses everything):
1. an environment: the active virtual or conda environment; else this checkout's ``.venv``
   (made here the first time), unless this Python already has a usable PyTorch;
2. PyTorch for this machine, unless a usable one is installed: the CUDA build where an NVIDIA
   GPU is found, the ROCm build where an AMD GPU is, the CPU-only build otherwise;
3. the build tools, CUTLASS's headers on NVIDIA machines (unpacked from the nvidia-cutlass
   wheel, not installed: only the headers are used), fusedenc itself (editable, with the
   native core this PyTorch can use) with its test and bench extras; Triton for the tests
   on a CPU-only PyTorch (its kernels' tests run in Triton's CPU interpreter).
It prints each step it takes.  Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
CACHE = ROOT / ".cache"
MIN_TORCH = (2, 5)
CUTLASS = "nvidia-cutlass==4.2.0.0"
TORCH_INDEX = "https://download.pytorch.org/whl"
ROCM = "rocm6.4"


def say(message: str) -> None:
    # stderr: stdout is the job's own output (and cutlass-headers' path, for $(...))
    print(f"[bootstrap] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    say("$ " + " ".join(cmd))
    sys.stdout.flush()
    subprocess.run(cmd, check=True, stdout=kw.pop("stdout", sys.stderr), **kw)  # pip's chatter: stderr too


def pip(*args: str, env: dict | None = None) -> None:
    # --disable-pip-version-check: the set-up's output is about fusedenc, not pip's age.
    run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args], env=env)


# ---- the machine ----------------------------------------------------------------------------

def gpu_vendor() -> str:
    """'cuda', 'rocm' or 'cpu': which GPU this machine has, from its drivers' files and tools."""
    if glob.glob("/proc/driver/nvidia/gpus/*") or glob.glob("/dev/nvidia[0-9]*"):
        return "cuda"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if out.returncode == 0 and "GPU" in out.stdout:
            return "cuda"
    if os.path.exists("/dev/kfd"):
        for props in glob.glob("/sys/class/kfd/kfd/topology/nodes/*/properties"):
            with open(props) as f:  # a GPU node has a gfx target; the CPU node's is 0
                if any(line.split()[:1] == ["gfx_target_version"] and line.split()[1] != "0" for line in f):
                    return "rocm"
    return "cpu"


def torch_state() -> tuple[str, str] | None:
    """(version, build) of the PyTorch this Python imports, build 'cuda', 'rocm' or 'cpu'; None if none."""
    probe = "import torch;print(torch.__version__);print('rocm' if getattr(torch.version,'hip',None) " \
            "else 'cuda' if torch.version.cuda else 'cpu')"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    version, build = out.stdout.split()[-2:]
    return version, build


def torch_usable(state: tuple[str, str] | None, vendor: str) -> str | None:
    """Why the installed PyTorch will not do, or None when it will."""
    if state is None:
        return "no PyTorch installed"
    version, build = state
    numbers = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if numbers < MIN_TORCH:
        return f"PyTorch {version} is older than {'.'.join(map(str, MIN_TORCH))}"
    if vendor != "cpu" and build != vendor:
        return f"PyTorch {version} is a {build} build and this machine has a {vendor.upper()} GPU"
    return None


# ---- the environment ------------------------------------------------------------------------

def in_managed_env() -> bool:
    return sys.prefix != sys.base_prefix or bool(os.environ.get("CONDA_PREFIX"))


def enter_environment(argv: list[str]) -> bool:
    """Re-run this script in the environment it sets up; True when this process is that one
    and owns it (our .venv: PyTorch may be replaced there)."""
    venv_python = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == VENV.resolve():
        return True
    if in_managed_env():
        say(f"environment: the active one ({sys.prefix})")
        return False
    if not venv_python.exists():
        if torch_usable(torch_state(), gpu_vendor()) is None:
            say(f"environment: {sys.executable} (its PyTorch is usable)")
            return False
        say(f"environment: making {VENV} (this Python has no usable PyTorch and no active environment)")
        try:
            run([sys.executable, "-m", "venv", str(VENV)])
        except subprocess.CalledProcessError:
            shutil.rmtree(VENV, ignore_errors=True)
            sys.exit("[bootstrap] could not make a virtual environment: install your Python's venv module "
                     "(Debian/Ubuntu: apt install python3-venv) or activate an environment of your own")
    else:
        say(f"environment: {VENV} (made by an earlier run)")
    os.execv(str(venv_python), [str(venv_python), str(Path(__file__).resolve()), *argv])
    return True  # not reached


# ---- PyTorch --------------------------------------------------------------------------------

def reachable(host: str) -> bool:
    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


def ensure_torch(vendor: str, own_env: bool) -> tuple[str, str]:
    state = torch_state()
    why = torch_usable(state, vendor)
    if why is None:
        say(f"PyTorch: {state[0]} ({state[1]} build), already installed")
        return state
    if state is not None and not own_env:
        # Someone else's environment: never replace their PyTorch behind their back.
        say(f"PyTorch: keeping {state[0]} ({state[1]} build) in this environment, but {why}; "
            f"fusedenc will run its PyTorch reference ops. To use the GPU, install the {vendor} build "
            f"(see the README's 'Managing your own environment') and run again")
        return state
    say(f"PyTorch: installing the {vendor.upper() if vendor != 'cpu' else 'CPU-only'} build ({why})")
    if vendor == "cuda":
        pip("torch")  # PyPI's Linux wheels are CUDA builds and bring cuBLASLt
    else:
        index = f"{TORCH_INDEX}/{'cpu' if vendor == 'cpu' else ROCM}"
        args = ["torch", "--index-url", index]
        if not reachable("download.pytorch.org"):
            # Offline or behind a mirror: pip's own configured sources (find-links, extra
            # indexes) may hold the build; fail fast on the unreachable index instead of retrying.
            say(f"download.pytorch.org is unreachable: looking for the build in pip's other configured sources")
            args += ["--retries", "0", "--timeout", "10"]
        try:
            pip(*args)
        except subprocess.CalledProcessError:
            sys.exit(f"[bootstrap] no {vendor} PyTorch could be installed from {index} or pip's configured "
                     f"sources: install one yourself (pip install torch ...) and run again")
    state = torch_state()
    if state is None:
        sys.exit("[bootstrap] PyTorch was installed but does not import; see pip's output above")
    say(f"PyTorch: {state[0]} ({state[1]} build) installed")
    return state


# ---- CUTLASS's headers ----------------------------------------------------------------------

def cutlass_headers() -> Path:
    """CUTLASS's include directory, unpacked once from the nvidia-cutlass wheel into .cache/.
    Installing the wheel would pull cuda-python, scipy and more (or, with --no-deps, leave pip
    reporting broken requirements on every later install); only its headers are needed."""
    name, version = CUTLASS.split("==")
    include = CACHE / f"cutlass-{version}" / "include"
    if (include / "cutlass" / "cutlass.h").exists() and (include / "cute" / "tensor.hpp").exists():
        return include
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"nvidia_cutlass-{version}-*.whl"))
    if not found:
        run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
             "-d", str(wheels), CUTLASS])
        found = sorted(wheels.glob(f"nvidia_cutlass-{version}-*.whl"))
    prefix = "cutlass_library/source/include/"
    partial = include.with_name("include.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        for member in wheel.namelist():
            if member.startswith(prefix) and not member.endswith("/"):
                target = partial / member[len(prefix):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(member))
    shutil.rmtree(include, ignore_errors=True)
    partial.rename(include)  # whole or absent: an interrupted unpack is never taken for headers
    return include


# ---- fusedenc -------------------------------------------------------------------------------

def build_inputs_digest(extras: str, torch_version: str, env: dict) -> str:
    """What an installed fusedenc was built from: the build files, the native sources, the
    PyTorch it was built against, the extras and the build's environment switches."""
    h = hashlib.sha256(f"{extras}|{torch_version}|{Path(sys.prefix).resolve()}".encode())
    for key in sorted(k for k in env if k.startswith("FUSEDENC_") or k in ("CUDACXX", "CUDA_HOME", "HIPCXX")):
        h.update(f"{key}={env[key]}".encode())
    files = [ROOT / "pyproject.toml", ROOT / "CMakeLists.txt", *sorted((ROOT / "csrc").rglob("*"))]
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def installed_here() -> bool:
    """Whether this environment's fusedenc is this checkout, installed editable."""
    probe = "import importlib.metadata as m;print(m.distribution('fusedenc').read_text('direct_url.json') or '')"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        return False
    url = json.loads(out.stdout)
    return url.get("dir_info", {}).get("editable") and url.get("url", "").rstrip("/").endswith(ROOT.as_posix())


def ensure_fusedenc(vendor: str, torch_version: str, extras: list[str]) -> None:
    env = dict(os.environ)
    if vendor == "cuda" and "FUSEDENC_CUTLASS_INCLUDE" not in env:
        env["FUSEDENC_CUTLASS_INCLUDE"] = str(cutlass_headers())
    extras_spec = ",".join(sorted(extras))
    stamp_file = Path(sys.prefix) / "fusedenc-bootstrap.json"
    digest = build_inputs_digest(extras_spec, torch_version, env)
    try:
        stamp = json.loads(stamp_file.read_text())
    except (OSError, ValueError):
        stamp = {}
    if stamp.get("digest") == digest and installed_here():
        say(f"fusedenc: installed from this checkout with [{extras_spec}], nothing changed since")
        return
    say("fusedenc: installing the build tools, then fusedenc from this checkout (editable)")
    pip("-q", "scikit-build-core>=0.10", "pybind11>=2.12", "ninja", "cmake")
    pip("-q", "--no-build-isolation", "-e", f"{ROOT}[{extras_spec}]", env=env)
    stamp_file.write_text(json.dumps({"digest": digest}))


def ensure_triton_for_tests(build: str) -> None:
    """PyTorch's CUDA and ROCm builds bring their own Triton; a CPU-only one does not, and
    without it the Triton kernels' tests (run in its CPU interpreter) would skip."""
    if build != "cpu":
        return
    if subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode == 0:
        say("Triton: already installed (the Triton kernels' tests run in its CPU interpreter)")
        return
    say("Triton: installing it for the Triton kernels' tests (they run in its CPU interpreter)")
    pip("-q", "triton")


def set_up(job: str) -> str:
    vendor = gpu_vendor()
    say({"cuda": "machine: an NVIDIA GPU", "rocm": "machine: an AMD GPU",
         "cpu": "machine: no GPU found (CPU only)"}[vendor])
    own_env = Path(sys.prefix).resolve() == VENV.resolve()
    version, build = ensure_torch(vendor, own_env)
    ensure_fusedenc(vendor, version, ["bench", "test"])  # both jobs' extras: the second job reuses the install
    ensure_triton_for_tests(build)
    run([sys.executable, "-m", "fusedenc"], stdout=None)  # what was built, and whether GPU tensors will use it
    return build


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("nps", "test", "setup", "cutlass-headers"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    job, rest = argv[0], argv[1:]
    if job == "cutlass-headers":
        print(cutlass_headers())
        return 0
    enter_environment(argv)
    set_up(job)
    python = sys.executable
    if job == "setup":
        say(f"set up; this environment's Python: {python}")
        return 0
    cmd = [python, str(ROOT / "bench" / "nps.py"), *rest] if job == "nps" else [python, "-m", "pytest", *rest]
    say(f"running: {' '.join(cmd)}")
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
