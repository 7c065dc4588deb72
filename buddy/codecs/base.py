"""The codec interface.

A codec turns a batch of entries (an ``(n, E)`` ``uint8`` tensor) into
per-entry payloads and sizes, and back. It never loops over entries in Python
and runs on whatever device its input lives on. Everything about where the
payload sectors then go (slots, overflow, metadata) is :mod:`buddy.layout`'s
business, so a new codec plugs in by subclassing :class:`Codec` and calling
:func:`buddy.codecs.register_codec`; callers do not change.
"""

from __future__ import annotations

import abc
from typing import NamedTuple

import torch

from .. import spec
from ..errors import CorruptDataError

__all__ = ["Codec", "Encoded"]


class Encoded(NamedTuple):
    """Result of :meth:`Codec.encode`.

    payload: ``(n, E)`` uint8; bytes past ``sectors[i] * 32`` are zero.
    sectors: ``(n,)`` int32, ``k`` of each entry (see :mod:`buddy.spec`).
    modes:   ``(n,)`` int32, codec-specific mode stored in the metadata.
    """

    payload: torch.Tensor
    sectors: torch.Tensor
    modes: torch.Tensor


class Codec(abc.ABC):
    """A lossless, batched entry codec.

    Contract (checked by the shared round-trip suite for every codec):

    * ``decode(*encode(x)) == x`` byte for byte, for every ``word_bytes``;
    * ``sectors == 0`` only for all-zero entries, and ``sectors == E/32``
      means the payload is the entry itself (raw escape);
    * payload bytes past ``sectors * 32`` are zero, so layouts are
      deterministic;
    * ``sizes(x)`` equals ``encode(x).sectors``.
    """

    #: registry name, stored in every BuddyTensor
    name: str = ""
    #: metadata modes this codec writes and accepts
    modes: frozenset[int] = frozenset({0})
    #: device types whose tensors it codes (see :func:`buddy.available_codecs`)
    devices: frozenset[str] = frozenset({"cpu", "cuda"})

    def sizes(self, entries: torch.Tensor, word_bytes: int) -> torch.Tensor:
        """Per-entry sectors ``k`` (int32) without building payloads.

        Codecs override this when sizing is cheaper than encoding.
        """
        return self.encode(entries, word_bytes).sectors

    @abc.abstractmethod
    def encode(self, entries: torch.Tensor, word_bytes: int) -> Encoded:
        """Encode ``(n, E)`` uint8 entries whose words are ``word_bytes`` wide."""

    @abc.abstractmethod
    def decode(
        self, payload: torch.Tensor, sectors: torch.Tensor, modes: torch.Tensor, word_bytes: int
    ) -> torch.Tensor:
        """Decode ``(n, E)`` payloads back into ``(n, E)`` uint8 entries."""

    def check_modes(self, modes: torch.Tensor) -> None:
        """Raise :class:`CorruptDataError` for modes this codec never writes."""
        if modes.numel() == 0:
            return
        allowed = torch.tensor(sorted(self.modes), dtype=modes.dtype, device=modes.device)
        if not bool(torch.isin(modes, allowed).all()):
            raise CorruptDataError(f"metadata holds modes that codec {self.name!r} never writes")

    @staticmethod
    def raw_sectors(entries: torch.Tensor) -> int:
        """``E / 32`` for a batch of entries: the raw-escape size."""
        return spec.sectors_per_entry(entries.shape[1])

    def __repr__(self) -> str:
        return f"<buddy codec {self.name!r}>"
