"""Codec registry.

``get_codec("zvc")`` returns the registered instance; new codecs are added
with :func:`register_codec` and are then usable by name everywhere
(``buddy.compress(t, codec=...)``, the experiments, the benchmarks).
Registering a codec also registers its torch reference implementation on
the CPU and on CUDA devices (see :mod:`buddy.dispatch`).

The registry knows codecs by name and nothing of how they run: the
implementation table (:mod:`buddy.dispatch`, which imports this module, never
the other way round) attaches itself with :func:`attach` and hears of every
codec registered and removed; :func:`get_codec` and
:func:`available_codecs` ask it which implementations can run here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import MissingDependencyError
from .auto import AutoCodec, members_of
from .base import Analysis, ChunkCodec, Codec, CodecLike
from .bpc import BPCCodec
from .fpe import FPECodec
from .fpx import FPXCodec
from .raw import RawCodec
from .zvc import ZVCCodec

__all__ = [
    "Codec",
    "CodecLike",
    "ChunkCodec",
    "Analysis",
    "register_codec",
    "unregister_codec",
    "get_codec",
    "available_codecs",
    "DEFAULT_CODEC",
    "attach",
]

#: codec used when none is given (chosen by measurement: see docs/choosing.md)
DEFAULT_CODEC = "auto2"

_REGISTRY: dict[str, CodecLike] = {}
#: the codecs registered with ``reference=True``: their torch code is their reference implementation
_REFERENCE: set[str] = set()


@dataclass(frozen=True)
class _Table:
    """What the registry asks of the implementation table (see :func:`attach`)."""

    added: Callable[[CodecLike, bool], None]
    removed: Callable[[str], None]
    reasons: Callable[[str, str | None], list[str | None]]


_table: _Table | None = None


def attach(
    added: Callable[[CodecLike, bool], None],
    removed: Callable[[str], None],
    reasons: Callable[[str, str | None], list[str | None]],
) -> None:
    """Connect the implementation table (:mod:`buddy.dispatch` does, when it is imported).

    ``added(codec, reference)`` hears of every codec registered so far and
    from now on (``reference``: its torch code is its reference
    implementation), ``removed(name)`` of every codec removed;
    ``reasons(name, device type or None)`` is, per implementation of the
    codec, ``None`` when it can run here, else why not.
    """
    global _table
    _table = _Table(added, removed, reasons)
    for name, codec in _REGISTRY.items():
        added(codec, name in _REFERENCE)


def _reasons(name: str, device: str | None = None) -> list[str | None]:
    return [] if _table is None else _table.reasons(name, device)


def register_codec(codec: CodecLike, *, replace: bool = False, reference: bool = True) -> CodecLike:
    """Make ``codec`` available by its ``name``; returns it.

    With ``reference`` (the default) its torch code becomes its reference
    implementation on the CPU and on CUDA devices, the default there; a
    :class:`ChunkCodec` (nvcomp's), which has no torch code, is registered
    with ``reference=False`` and its engine registers its own implementations.
    """
    if not isinstance(codec, (Codec, ChunkCodec)):
        raise TypeError(
            f"register_codec expects a buddy.codecs.Codec (or ChunkCodec) instance, got {type(codec).__name__}"
        )
    if reference and not isinstance(codec, Codec):
        raise ValueError(f"codec {codec.name!r} has no torch code to be its reference: pass reference=False")
    if not isinstance(codec.name, str) or not codec.name:
        raise ValueError("a codec needs a non-empty name")
    if codec.name in _REGISTRY and not replace:
        raise ValueError(f"codec {codec.name!r} is already registered (pass replace=True to override)")
    _REGISTRY[codec.name] = codec
    forget_usable()
    if reference:
        _REFERENCE.add(codec.name)
    else:
        _REFERENCE.discard(codec.name)
    if _table is not None:
        _table.added(codec, reference)
    return codec


def unregister_codec(name: str) -> CodecLike:
    """Remove a codec and every implementation of it; returns it."""
    codec = _REGISTRY.pop(name)
    forget_usable()
    _REFERENCE.discard(name)
    if _table is not None:
        _table.removed(name)
    return codec


def get_codec(codec: str | CodecLike | None) -> CodecLike:
    """The codec named ``codec`` (or ``codec`` itself, or the default for ``None``).

    A registered codec with no implementation that can run here raises
    :class:`~buddy.errors.MissingDependencyError` saying why.
    """
    if codec is None:
        codec = DEFAULT_CODEC
    if isinstance(codec, (Codec, ChunkCodec)):
        return codec
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a name or a Codec, got {type(codec).__name__}")
    found = _REGISTRY.get(codec)
    if found is None:
        raise ValueError(f"unknown codec {codec!r}; available: {', '.join(available_codecs())}")
    if codec in _usable:  # (every compress asks: the table is scanned once per codec, not once a tensor)
        return found
    reasons = _reasons(codec)
    if reasons and all(why is not None for why in reasons):
        raise MissingDependencyError(
            f"codec {codec!r} is not available here: {reasons[0]}; "
            f"available: {', '.join(available_codecs())}"
        )
    _usable.add(codec)
    return found


#: the codecs :func:`get_codec` found an implementation of that can run here, until the table changes
#: (:func:`forget_usable`). An implementation that stops working later is the engine's error to raise.
_usable: set[str] = set()


def forget_usable() -> None:
    """The implementation table changed: :func:`get_codec` asks it again."""
    _usable.clear()


def available_codecs(device: str | torch.device | None = None) -> list[str]:
    """Names of the codecs that can run here; with ``device`` (``"cpu"``, ``"cuda"``), on that kind of device."""
    kind = None if device is None else (device.type if isinstance(device, torch.device) else str(device).split(":")[0])
    return sorted(name for name in _REGISTRY if any(why is None for why in _reasons(name, kind)))


register_codec(RawCodec())
register_codec(ZVCCodec())
register_codec(BPCCodec())
register_codec(FPXCodec())
register_codec(AutoCodec(members_of("auto"), name="auto"))
register_codec(FPECodec())
register_codec(AutoCodec(members_of("auto2"), name="auto2"))
# nvcomp's chunk codecs (CUDA tensors only, run by nvcomp itself) are registered with the table: buddy.dispatch
