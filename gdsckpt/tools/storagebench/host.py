"""Targets and the host: free space, filesystem, memory, package versions, the device to run on.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from typing import Any

from ...errors import InsufficientSpaceError
from ...format import align_up
from .results import MIB, BenchSettings, human_size

# ---------------------------------------------------------------------------------------------
# targets and the host

def space_needed(settings: BenchSettings) -> int:
    """Bytes a target must have free: one file of ``size`` at a time (uncompressed gdsckpt,
    torch.save and safetensors files are the largest, slightly above the logical size) plus
    headroom, and the 256 MiB storage probe that ``codec="auto"`` on the GPU writes once."""
    need = align_up(settings.size_bytes) + settings.size_bytes // 20 + 64 * MIB
    if settings.device == "cuda" and "auto" in settings.codecs and settings.config.storage_gbps is None:
        from ...pipeline.autotune import PROBE_BYTES

        need += PROBE_BYTES
    return need


def check_target(path: str | os.PathLike[str], need_bytes: int) -> int:
    """Check ``path`` is a writable directory with ``need_bytes`` free; return its free bytes.

    Raises ``FileNotFoundError`` / ``NotADirectoryError`` / ``PermissionError`` for a bad path and
    ``InsufficientSpaceError`` when it lacks room."""
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"target {str(target)!r} does not exist")
    if not target.is_dir():
        raise NotADirectoryError(f"target {str(target)!r} is not a directory")
    if not os.access(target, os.W_OK | os.X_OK):
        raise PermissionError(f"target {str(target)!r} is not writable by this user")
    free = shutil.disk_usage(target).free
    if free < need_bytes:
        raise InsufficientSpaceError(
            f"target {str(target)!r} has {human_size(free)} free but the benchmark needs "
            f"{human_size(need_bytes)} there (one file of the data size at a time, plus headroom): "
            f"choose a smaller --size or another target")
    return free


def filesystem_of(directory: str | os.PathLike[str]) -> dict[str, str]:
    """Mount point, filesystem type and device holding ``directory`` (from /proc/mounts; the
    longest mount point containing it wins)."""
    real = os.path.realpath(directory)
    found = {"mount_point": "?", "type": "?", "device": "?"}
    try:
        with open("/proc/mounts") as handle:
            mounts = [line.split()[:3] for line in handle if len(line.split()) >= 3]
    except OSError:
        return found
    for device, mount_point, fstype in mounts:
        mount_point = mount_point.replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and (found["mount_point"] == "?" or len(mount_point) >= len(found["mount_point"])):
            found = {"mount_point": mount_point, "type": fstype, "device": device}
    return found


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def host_info(device: str) -> dict[str, Any]:
    """Host, CPU, memory and package versions (without importing the GPU packages)."""
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as handle:
            cpu_model = next((line.split(":", 1)[1].strip() for line in handle
                              if line.startswith("model name")), None)
    except OSError:
        pass
    packages = ("torch", "numpy", "zstandard", "lz4", "safetensors", "matplotlib", "cupy-cuda13x",
                "cupy-cuda12x", "kvikio-cu13", "kvikio-cu12", "nvidia-nvcomp-cu13", "nvidia-nvcomp-cu12")
    info: dict[str, Any] = {
        "hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpu_model": cpu_model, "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_available_bytes": available_memory(),
        "versions": {name: v for name in packages if (v := _package_version(name)) is not None},
        "gpu": None,
    }
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def resolve_device(requested: str) -> str:
    """``cpu``, or ``cuda`` when asked for (``auto``: when a CUDA GPU with CuPy, nvCOMP and kvikio
    is usable). Raises ``ValueError`` when ``cuda`` is asked for and not usable."""
    if requested == "cpu":
        return "cpu"
    if requested not in ("auto", "cuda"):
        raise ValueError(f"device {requested!r} is invalid (expected one of: cpu, cuda, auto)")
    usable, why = _cuda_usable()
    if usable:
        return "cuda"
    if requested == "cuda":
        raise ValueError(f"device 'cuda' requested but {why}")
    return "cpu"


def _cuda_usable() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    from ...codecs.nvcomp import gpu_available

    if not gpu_available():
        return False, "CuPy or nVCOMP is not usable (pip install 'gdsckpt[cu13]' or '[cu12]')"
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return False, "kvikio is not installed (pip install 'gdsckpt[cu13]' or '[cu12]')"
    return True, ""
