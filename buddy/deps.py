"""Optional dependencies, imported only when a feature needs them.

``import buddy`` never imports CuPy or nvcomp. A feature that needs one calls
:func:`require`, which returns the module or raises
:class:`~buddy.errors.MissingDependencyError` saying what is missing and the
command that installs it.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from .errors import MissingDependencyError

__all__ = ["require", "require_cuda", "available", "version_of"]

_INSTALL = {
    "cupy": "pip install 'buddy[cuda12]' (CUDA 12 driver) or 'buddy[cuda13]' (CUDA 13)",
    "nvidia.nvcomp": "pip install 'buddy[cuda12]' or 'buddy[cuda13]' (nvidia-nvcomp-cu12 / -cu13 wheels)",
    "zstandard": "pip install 'buddy[experiments]'",
    "lz4": "pip install 'buddy[experiments]'",
}


_FOUND: dict[str, bool] = {}


def available(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it): looked up once per process, as an import is
    (engines ask at every compress; a lookup reads the file system)."""
    found = _FOUND.get(module)
    if found is None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        _FOUND[module] = found
    return found


def require(module: str, feature: str):
    """Import ``module`` for ``feature`` or raise a diagnosis."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = _INSTALL.get(module, f"pip install {module.split('.')[0]}")
        raise MissingDependencyError(
            f"{feature} needs {module!r}, which is not importable ({exc}). Install it: {hint}"
        ) from exc


def require_cuda(feature: str) -> None:
    """Raise a diagnosis unless PyTorch sees a CUDA device."""
    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = "this PyTorch is a CPU-only build" if built is None else f"PyTorch (CUDA {built}) sees no GPU"
        raise MissingDependencyError(
            f"{feature} needs a CUDA GPU: {why}. Install a CUDA build of PyTorch "
            f"(https://pytorch.org/get-started/locally/) on a machine with an NVIDIA GPU."
        )


def version_of(module: str) -> str | None:
    """``module.__version__`` if importable, else ``None``."""
    if not available(module):
        return None
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception:  # a broken install: report rather than crash an env printout
        return "broken"
