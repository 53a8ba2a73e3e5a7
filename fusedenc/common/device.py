"""Facts about the GPU a tensor lives on: architecture, capability, vendor, stream;
``parse_devices``, the device lists users write (``"cuda:0,cuda:1"``, ints, ``"cpu"``); and
``check_device`` / ``check_dtype``, the one check of every ``device=`` and ``dtype=`` argument
of the public constructors (EncoderBlock, EncoderStack, load_network, Lc0Network), so that a
wrong one is refused with fusedenc's own words before anything is allocated.

One home for what the attention backends, the tables' matching and the GEMM
tuning files need to know about a device.  Facts are read once per device.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from . import dtypes

__all__ = [
    "DeviceFacts", "DeviceSpec", "check_device", "check_dtype", "current_stream", "device_arch", "device_facts",
    "device_metadata", "parse_devices", "torch_vendor",
]


class DeviceFacts(NamedTuple):
    arch: str  # "sm90" for an H100, the gfx name ("gfx942") on ROCm, "cpu" for CPU tensors
    capability: Optional[tuple[int, int]]  # CUDA compute capability, None elsewhere
    rocm: bool


@functools.lru_cache(maxsize=None)
def _facts(device_type: str, index: int) -> DeviceFacts:
    if device_type != "cuda":
        return DeviceFacts(device_type, None, False)
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "") or "gfx-unknown"
        return DeviceFacts(arch.split(":")[0], None, True)
    return DeviceFacts(f"sm{props.major}{props.minor}", (props.major, props.minor), False)


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def device_facts(device: torch.device | str) -> DeviceFacts:
    """Architecture, compute capability and vendor of ``device`` (read once per device)."""
    device = torch.device(device)
    return _facts(device.type, _index(device))


def device_arch(device: torch.device | str) -> str:
    """'sm90' for an H100, the gfx name ('gfx942') on ROCm, 'cpu' for CPU tensors."""
    return device_facts(device).arch


def device_metadata(device: torch.device | str) -> dict[str, Any]:
    """What a measured attention table records and is matched against: device, SM count, library versions."""
    device = torch.device(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(_index(device))
        name, count = props.name, props.multi_processor_count
    else:
        name, count = device.type, os.cpu_count()
    return {
        "device_name": name,
        "multiprocessor_count": count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": cudnn,
    }


def torch_vendor() -> Optional[str]:
    """'hip' or 'cuda' for the GPU build of this torch, None for a CPU-only build."""
    return "hip" if torch.version.hip else ("cuda" if torch.version.cuda else None)


_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: torch.device) -> int:
    """The raw handle of the current stream of a GPU ``device`` (what the native core launches on)."""
    if _get_raw_stream is not None:
        return _get_raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


DeviceSpec = Union[None, str, int, torch.device, Sequence[Union[str, int, torch.device]]]

#: How the messages spell the dtypes fusedenc runs (``dtypes.SUPPORTED``).
DTYPES_ACCEPTED = "torch.float16, torch.bfloat16 or torch.float32"

#: Strings users write for a dtype -> the torch.dtype the message tells them to pass.  Strings
#: are refused, not parsed: torch's own ``dtype=`` arguments take torch.dtype objects only, and
#: every layer (the Evaluator's buffers among them) can then rely on holding one.
_DTYPE_WORDS = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}  # fmt: skip


def check_dtype(dtype: Any, *, name: str = "dtype", optional: bool = True) -> Optional[torch.dtype]:
    """``dtype`` if fusedenc runs it (torch.float16, torch.bfloat16, torch.float32); ``None``
    (where ``optional``) stands for torch's default dtype, which must be one of those too.

    TypeError otherwise, naming what was passed and what to pass: a string such as
    ``"fp16"`` is told the torch.dtype it means (``torch.float16``)."""
    if dtype is None:
        if not optional:
            raise TypeError(f"{name}=None: pass a torch.dtype ({DTYPES_ACCEPTED})")
        default = torch.get_default_dtype()
        if default not in dtypes.SUPPORTED:
            raise TypeError(f"{name}=None means torch's default dtype, {default}, which fusedenc does not run: "
                            f"pass {name}= one of {DTYPES_ACCEPTED}")  # fmt: skip
        return None
    if isinstance(dtype, str):
        meant = _DTYPE_WORDS.get(dtype.strip().lower().removeprefix("torch."))
        what = f"{name}=torch.{dtypes.name(meant)}" if meant is not None else DTYPES_ACCEPTED
        raise TypeError(f"{name}={dtype!r} is a string: pass a torch.dtype ({what})")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype ({DTYPES_ACCEPTED}), got {type(dtype).__name__} {dtype!r}")
    if dtype not in dtypes.SUPPORTED:
        raise TypeError(f"{name}={dtype} is not supported: fusedenc runs {DTYPES_ACCEPTED}")
    return dtype


def _no_gpu_reason() -> str:
    build = "this torch is a CPU-only build" if torch_vendor() is None else "no GPU is visible to this torch"
    return f"torch sees no GPU on this machine ({build})"


def _device_or_why(item: Any, name: Optional[str]) -> tuple[Optional[torch.device], str]:
    """``item`` (a str, GPU index or torch.device) as a device fusedenc runs on, or (None, why
    not) to follow ``item``'s repr; with ``name`` (the argument), a missing GPU's message says
    how to ask for the CPU instead (callers with a vocabulary of their own, like the CLIs'
    ``--device``, add theirs)."""
    try:
        d = torch.device("cuda", item) if isinstance(item, int) else torch.device(item)
    except (RuntimeError, TypeError, ValueError):
        return None, "is not a device (cuda, cuda:N or cpu)"
    if d.type == "cuda":
        if not torch.cuda.is_available():
            hint = "" if name is None else (f": pass {name}='cpu' (with dtype=torch.float32: float16 is slow on "
                                            "CPUs) to run on the CPU")  # fmt: skip
            return None, f"asks for a GPU, but {_no_gpu_reason()}{hint}"
        if d.index is not None and d.index >= torch.cuda.device_count():
            return None, f"names GPU {d.index}, but torch sees {torch.cuda.device_count()} GPU(s)"
    elif d.type != "cpu":
        return None, f"is a {d.type!r} device: fusedenc runs on cuda (NVIDIA and AMD GPUs) and cpu only"
    return d, ""


def _is_device_like(item: Any) -> bool:
    return isinstance(item, (str, int, torch.device)) and not isinstance(item, bool)


def check_device(device: Any, *, name: str = "device", optional: bool = True) -> Optional[torch.device]:
    """``device`` (a str, a GPU index or a torch.device) as a torch.device fusedenc runs on;
    ``None`` (where ``optional``) stays None: torch's default device.  TypeError for another
    type, ValueError for a device fusedenc cannot use (saying how to ask for the CPU when
    there is no GPU)."""
    if device is None:
        if not optional:
            raise ValueError(f"{name}=None: pass 'cuda', 'cuda:N' or 'cpu'")
        return None
    if not _is_device_like(device):
        raise TypeError(f"{name} must be a str ('cuda', 'cuda:N', 'cpu'), an int or a torch.device, "
                        f"got {type(device).__name__}")  # fmt: skip
    d, why = _device_or_why(device, name)
    if d is None:
        raise ValueError(f"{name}={device!r} {why}")
    return d


def parse_devices(spec: DeviceSpec) -> list[torch.device]:
    """``devices`` -> a list of distinct torch devices (CUDA devices with their index)."""
    if spec is None:
        if not torch.cuda.is_available():
            raise ValueError(f"{_no_gpu_reason()}: pass devices='cpu' (with dtype=torch.float32) to use the CPU")
        return [torch.device("cuda", torch.cuda.current_device())]
    if isinstance(spec, str):
        items: list[Any] = [s.strip() for s in spec.split(",") if s.strip()]
    elif isinstance(spec, (int, torch.device)):
        items = [spec]
    else:
        items = list(spec)
    if not items:
        raise ValueError(f"devices must name at least one device, got {spec!r}")
    out: list[torch.device] = []
    for item in items:
        d, why = _device_or_why(item, None) if _is_device_like(item) else (None, "is not a device")
        if d is None:
            raise ValueError(f"devices: {item!r} {why}")
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        if d in out:
            raise ValueError(f"devices: {d} is named twice")
        out.append(d)
    return out
