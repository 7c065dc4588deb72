"""Codec registry.

``get_codec("zvc")`` returns the registered instance; new codecs are added
with :func:`register_codec` and are then usable by name everywhere
(``buddy.compress(t, codec=...)``, the experiments, the benchmark).
"""

from __future__ import annotations

import torch

from ..errors import MissingDependencyError
from . import nvcomp
from .auto import AutoCodec
from .base import Codec, Encoded
from .bpc import BPCCodec
from .fpx import FPXCodec
from .raw import RawCodec
from .zvc import ZVCCodec

__all__ = ["Codec", "Encoded", "register_codec", "get_codec", "available_codecs", "DEFAULT_CODEC"]

#: codec used when none is given (see README, "Choosing the codec")
DEFAULT_CODEC = "auto"

_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec, *, replace: bool = False) -> Codec:
    """Make ``codec`` available by its ``name``; returns it."""
    if not isinstance(codec, Codec):
        raise TypeError(f"register_codec expects a buddy.codecs.Codec instance, got {type(codec).__name__}")
    if not codec.name:
        raise ValueError("a codec needs a non-empty name")
    if codec.name in _REGISTRY and not replace:
        raise ValueError(f"codec {codec.name!r} is already registered (pass replace=True to override)")
    _REGISTRY[codec.name] = codec
    return codec


def get_codec(codec: str | Codec | None) -> Codec:
    """The codec named ``codec`` (or ``codec`` itself, or the default for ``None``)."""
    if codec is None:
        codec = DEFAULT_CODEC
    if isinstance(codec, Codec):
        return codec
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a name or a Codec, got {type(codec).__name__}")
    try:
        return _REGISTRY[codec]
    except KeyError:
        pass
    if codec in nvcomp.NAMES:
        raise MissingDependencyError(
            f"codec {codec!r} is not available here: {nvcomp.why_unusable()}; "
            f"available: {', '.join(available_codecs())}"
        )
    raise ValueError(f"unknown codec {codec!r}; available: {', '.join(available_codecs())}")


def available_codecs(device: str | None = None) -> list[str]:
    """Names of the registered codecs; with ``device`` (``"cpu"``, ``"cuda"``), those that run there."""
    if device is None:
        return sorted(_REGISTRY)
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return sorted(name for name, codec in _REGISTRY.items() if kind in codec.devices)


register_codec(RawCodec())
register_codec(ZVCCodec())
register_codec(BPCCodec())
register_codec(FPXCodec())
register_codec(AutoCodec())
if nvcomp.usable():  # nvcomp's chunk codecs only where they can run (a CUDA device and nvcomp)
    for _name in nvcomp.NAMES:
        register_codec(nvcomp.NvcompCodec(_name))
