"""Facts about the GPU a tensor lives on: architecture, capability, vendor, stream.

One home for what the attention backends, the tables' matching and the GEMM
tuning files need to know about a device.  Facts are read once per device.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple, Optional

import torch

__all__ = ["DeviceFacts", "current_stream", "device_arch", "device_facts", "device_metadata", "torch_vendor"]


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
