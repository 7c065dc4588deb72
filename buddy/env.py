"""What this process runs on: printed first by every benchmark and experiment."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

import numpy
import torch

from . import spec
from .engines import native
from .deps import version_of

__all__ = ["environment", "format_environment"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it (e.g. ``580.159.04``); ``None`` without one."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = done.stdout.split()
    return first[0] if done.returncode == 0 and first else None


def _distribution(*names: str) -> str | None:
    """``name==version`` of the first of these installed distributions (wheels), else ``None``."""
    for name in names:
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def environment() -> dict[str, object]:
    """Device, library versions and machine, as a JSON-friendly dict.

    With a GPU it also holds the device's name, memory and capability and the
    driver's version; ``nvcomp_wheels`` names the nvcomp wheels installed (its
    Python API and the library it loads).
    """
    from . import __version__

    env: dict[str, object] = {
        "buddy": __version__,
        "format_version": spec.FORMAT_VERSION,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cupy": version_of("cupy"),
        "nvcomp": version_of("nvidia.nvcomp"),
        "nvcomp_wheels": [
            w
            for w in (
                _distribution("nvidia-nvcomp-cu13", "nvidia-nvcomp-cu12"),
                _distribution("nvidia-libnvcomp-cu13", "nvidia-libnvcomp-cu12"),
            )
            if w
        ],
        "zstandard": version_of("zstandard"),
        "lz4": version_of("lz4"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "native_engine": native.describe(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["driver"] = _driver_version()
    else:
        env["gpu"] = None
    return env


def format_environment(env: dict[str, object] | None = None) -> str:
    """One ``key: value`` per line."""
    env = environment() if env is None else env
    return "\n".join(f"{k:>16}: {v}" for k, v in env.items())
