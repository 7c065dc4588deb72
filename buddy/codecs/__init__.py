"""Codec registry.

``get_codec("zvc")`` returns the registered instance; new codecs are added
with :func:`register_codec` and are then usable by name everywhere
(``buddy.compress(t, codec=...)``, the experiments, the benchmarks).
Registering a codec also registers its torch reference implementation on
the CPU and on CUDA devices (see :mod:`buddy.dispatch`).
"""

from __future__ import annotations

import torch

from .. import dispatch
from ..engine import BlockEngine
from ..errors import MissingDependencyError
from . import nvcomp
from .auto import AUTO2_MEMBERS, AutoCodec
from .base import Analysis, Codec
from .bpc import BPCCodec
from .fpe import FPECodec
from .fpx import FPXCodec
from .raw import RawCodec
from .zvc import ZVCCodec

__all__ = [
    "Codec",
    "Analysis",
    "register_codec",
    "unregister_codec",
    "get_codec",
    "available_codecs",
    "DEFAULT_CODEC",
]

#: codec used when none is given (chosen by measurement: see docs/choosing.md)
DEFAULT_CODEC = "auto2"

_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec, *, replace: bool = False, reference: bool = True) -> Codec:
    """Make ``codec`` available by its ``name``; returns it.

    With ``reference`` (the default) its torch code becomes its reference
    implementation on the CPU and on CUDA devices, the default there; a
    codec without torch code (nvcomp's) registers its own implementations.
    """
    if not isinstance(codec, Codec):
        raise TypeError(f"register_codec expects a buddy.codecs.Codec instance, got {type(codec).__name__}")
    if not isinstance(codec.name, str) or not codec.name:
        raise ValueError("a codec needs a non-empty name")
    if codec.name in _REGISTRY and not replace:
        raise ValueError(f"codec {codec.name!r} is already registered (pass replace=True to override)")
    _REGISTRY[codec.name] = codec
    if reference:
        for device in ("cpu", "cuda"):
            dispatch.register(codec.name, device, "reference", BlockEngine, default=True, replace=True)
    return codec


def unregister_codec(name: str) -> Codec:
    """Remove a codec and every implementation of it; returns it."""
    codec = _REGISTRY.pop(name)
    dispatch.unregister(name)
    return codec


def get_codec(codec: str | Codec | None) -> Codec:
    """The codec named ``codec`` (or ``codec`` itself, or the default for ``None``).

    A registered codec with no implementation that can run here raises
    :class:`~buddy.errors.MissingDependencyError` saying why.
    """
    if codec is None:
        codec = DEFAULT_CODEC
    if isinstance(codec, Codec):
        return codec
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a name or a Codec, got {type(codec).__name__}")
    found = _REGISTRY.get(codec)
    if found is None:
        raise ValueError(f"unknown codec {codec!r}; available: {', '.join(available_codecs())}")
    impls = dispatch.implementations(codec)
    if impls and all(i.why_unusable() is not None for i in impls):
        raise MissingDependencyError(
            f"codec {codec!r} is not available here: {impls[0].why_unusable()}; "
            f"available: {', '.join(available_codecs())}"
        )
    return found


def available_codecs(device: str | torch.device | None = None) -> list[str]:
    """Names of the codecs that can run here; with ``device`` (``"cpu"``, ``"cuda"``), on that kind of device."""
    kind = None if device is None else (device.type if isinstance(device, torch.device) else str(device).split(":")[0])
    usable = {i.codec for i in dispatch.implementations(device=kind) if i.why_unusable() is None}
    return sorted(name for name in _REGISTRY if name in usable)


register_codec(RawCodec())
register_codec(ZVCCodec())
register_codec(BPCCodec())
register_codec(FPXCodec())
register_codec(AutoCodec())
register_codec(FPECodec())
register_codec(AutoCodec(AUTO2_MEMBERS, name="auto2"))
for _name in nvcomp.NAMES:  # nvcomp's chunk codecs: CUDA tensors only, run by nvcomp itself
    register_codec(nvcomp.NvcompCodec(_name), reference=False)
    dispatch.register(_name, "cuda", "nvcomp", nvcomp.NvcompEngine, default=True, requires=nvcomp.why_unusable)
