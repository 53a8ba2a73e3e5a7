"""Facts about the GPU a tensor lives on: architecture, capability, vendor, stream; and
``parse_devices``, the device lists users write (``"cuda:0,cuda:1"``, ints, ``"cpu"``).

One home for what the attention backends, the tables' matching and the GEMM
tuning files need to know about a device.  Facts are read once per device.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

__all__ = [
    "DeviceFacts", "DeviceSpec", "current_stream", "device_arch", "device_facts", "device_metadata", "parse_devices",
    "torch_vendor",
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


def parse_devices(spec: DeviceSpec) -> list[torch.device]:
    """``devices`` -> a list of distinct torch devices (CUDA devices with their index)."""
    if spec is None:
        if not torch.cuda.is_available():
            raise ValueError("no GPU is visible to torch: pass devices='cpu' (with dtype=torch.float32) to use the CPU")
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
        try:
            is_index = isinstance(item, int) and not isinstance(item, bool)
            d = torch.device("cuda", item) if is_index else torch.device(item)
        except (RuntimeError, TypeError):
            raise ValueError(f"devices: {item!r} is not a device (cuda, cuda:N or cpu)") from None
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"devices: {item!r} asks for a GPU, but torch sees no GPU on this machine")
            d = torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)
            if d.index >= torch.cuda.device_count():
                raise ValueError(f"devices: {item!r}: torch sees {torch.cuda.device_count()} GPU(s)")
        elif d.type != "cpu":
            raise ValueError(f"devices: {item!r}: only cuda and cpu devices are supported")
        if d in out:
            raise ValueError(f"devices: {d} is named twice")
        out.append(d)
    return out
