"""The codec interface: a codec codes the entries that are neither zero nor raw, and nothing else.

Everything every codec shares -- cutting a tensor into entries, the all-zero
entry (``k = 0``), the raw escape (``k = E/32``), the clamp of ``k``, the
metadata modes of the escapes and their checks, the loop over blocks of
entries -- is the format layer's (:mod:`buddy.format`). A codec supplies:

* :meth:`Codec.analyse` -- sizes of a block of entries (an :class:`Analysis`:
  per entry the coded size in sectors and the metadata mode, and the coded
  streams of whichever rows the caller asks for, without sizing again);
* :meth:`Codec.encode` -- the streams of entries already known to be coded
  with the given modes (it may re-derive the encoding; it never sizes other
  entries);
* :meth:`Codec.decode` -- coded entries back from their payloads.

All three work on ``(n, E)`` ``uint8`` blocks in batched torch ops (no
Python loop over entries), on whatever device the block lives on. A codec
plugs in with :func:`buddy.codecs.register_codec`, which also registers this torch
code as its reference implementation (see :mod:`buddy.dispatch`); the
pipeline, the experiments and the benchmarks then use it by name.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..errors import CorruptDataError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Codec", "CodecLike", "ChunkCodec", "Fitting", "Analysis", "bits_to_sectors"]


def bits_to_sectors(total_bits: torch.Tensor) -> torch.Tensor:
    """Sectors (int32) a stream of ``total_bits`` bits takes: ``ceil(T / 256)``."""
    return ((total_bits + 255) // 256).to(torch.int32)


class Analysis(abc.ABC):
    """What :meth:`Codec.analyse` found about a block of ``n`` entries.

    ``sectors``: ``(n,)`` int32, each entry's coded size in sectors before
    the raw clamp (any value ``>= E/32`` means it does not shrink; an
    all-zero entry may report anything, the format layer stores it as
    ``k = 0``). ``modes``: ``(n,)`` int32, the metadata mode a coded entry
    gets (one of the codec's :attr:`~Codec.coded_modes`).
    """

    sectors: torch.Tensor
    modes: torch.Tensor

    @abc.abstractmethod
    def streams(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Payloads ``(len(rows), E)`` of the coded entries ``rows`` (all when ``None``).

        Each is the entry's stream followed by zero bytes up to ``E``; only
        rows with ``0 < sectors < E/32`` may be asked for.
        """


class Fitting(NamedTuple):
    """How :meth:`CodecLike.fit` fits a codec's table (its arguments after the tensor's bytes and word size)."""

    prior: torch.Tensor | None = None
    read: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep: CodecLike | None = None
    counts: torch.Tensor | None = None
    #: whether the tensor's symbols are counted (its :attr:`CodecLike.statistics`) where a ``prior`` fits the table;
    #: without a prior they always are (the table is fitted to them)
    count_symbols: bool = True


class CodecLike:
    """What the registry, the pipeline and a stored tensor ask of every codec, whatever runs it.

    Its :attr:`name` (stored in every BuddyTensor), the :attr:`format_version`
    of what it writes, the :attr:`table` a tensor coded with it carries and
    the :meth:`fit` / :meth:`bind` of that table: by default none. A
    :class:`Codec` adds the per-block torch code; a :class:`ChunkCodec` has
    none (an engine runs it whole).
    """

    #: registry name, stored in every BuddyTensor
    name: str = ""
    #: the format version of what it writes: 2 for a codec that carries a table (see :meth:`fit`)
    format_version: int = 1
    #: symbol statistics of the tensor it was fitted to (for a tracker to learn from), else ``None``
    statistics: torch.Tensor | None = None

    @property
    def table(self) -> torch.Tensor | None:
        """The table a tensor coded with this codec carries (uint8, format version 2), or ``None``."""
        return None

    @property
    def table_bytes(self) -> int:
        """Bytes of :attr:`table` (0 without one): what it adds to a tensor's device bytes."""
        table = self.table
        return 0 if table is None else table.numel()

    def fit(
        self,
        flat: torch.Tensor,
        word_bytes: int,
        prior: torch.Tensor | None = None,
        read=None,
        keep=None,
        counts: torch.Tensor | None = None,
        count: bool = True,
    ) -> Self:
        """This codec fitted to a tensor's bytes ``flat`` (default: itself, nothing to fit).

        A codec with a table returns a copy holding the table fitted to the
        tensor -- or to ``prior``, symbol statistics learned over earlier
        steps -- and the tensor's own :attr:`statistics`. ``read``: how it
        brings the tensor's statistics to the host when there is no prior
        (the engine's :meth:`~buddy.engines.Engine.read`, which counts it;
        default ``Tensor.cpu``). ``keep``: the codec fitted for the same key
        before, whose table a prior may keep (see :func:`buddy.codecs.fpe.fit_table`).
        ``counts``: the tensor's statistics when an engine has counted them
        already (on the tensor's device), else they are counted here --
        unless ``count`` is false and a ``prior`` fits the table: then
        nothing is counted and :attr:`statistics` is ``None`` (a tracker that
        has learned a key counts it only every few steps:
        :attr:`buddy.Tracker.count_every`). A codec with a table implements
        :meth:`_fit`.
        """
        return self._fit(flat, word_bytes, Fitting(prior, read, keep, counts, count))

    def _fit(self, flat: torch.Tensor, word_bytes: int, how: Fitting) -> Self:
        """:meth:`fit`, its options as one :class:`Fitting`."""
        return self

    def kept_table(self, keep: CodecLike | None):
        """The table a :meth:`fit` with ``keep`` may keep instead of fitting one (while it still codes the prior
        well), or ``None``: for a codec without a table, none."""
        return None

    def with_table(self, table, statistics: torch.Tensor | None) -> Self:
        """This codec holding a ``table`` fitted elsewhere (an engine fits it on the tensor's device) and the
        tensor's ``statistics``; only for a codec that carries a table."""
        raise ValueError(f"codec {self.name!r} carries no table")

    def bind(self, table: torch.Tensor | None, word_bytes: int) -> Self:
        """This codec with a stored ``table`` (what decoding a tensor needs); default: no table taken."""
        if table is not None and table.numel():
            raise CorruptDataError(f"codec {self.name!r} takes no table, got one of {table.numel()} bytes")
        return self

    def __repr__(self) -> str:
        return f"<buddy codec {self.name!r}>"


@dataclass(frozen=True, repr=False)
class ChunkCodec(CodecLike):
    """A codec an engine runs whole, a chunk per entry (nvcomp's): its name and the algorithm that name stands for.

    It has no per-block torch code, hence no reference implementation: it is
    registered with ``register_codec(..., reference=False)`` and its engine
    (:mod:`buddy.engines.nvcomp`) implements its payload rules.
    """

    name: str = ""
    algorithm: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name and isinstance(self.algorithm, str) and self.algorithm):
            raise ValueError(f"a chunk codec needs a name and an algorithm, got {self.name!r} and {self.algorithm!r}")


class Codec(CodecLike, abc.ABC):
    """A lossless entry codec (see the module doc for what it supplies and what it may assume).

    Contract, checked for every codec by the shared suites:

    * ``decode(encode(x)) == x`` byte for byte, for every word size;
    * streams are zero past their sectors, so layouts are deterministic;
    * ``encode`` of entries gives the very streams ``analyse(...).streams``
      gives, and their length agrees with ``analyse(...).sectors``;
    * ``decode`` raises :class:`~buddy.errors.CorruptDataError` for payloads
      it could not have written (it is given exactly ``k`` sectors, zeros
      after).
    """

    #: metadata modes of an all-zero entry, of a raw entry, and of coded entries
    zero_mode: int = 0
    raw_mode: int = 0
    coded_modes: frozenset[int] = frozenset({0})
    #: whether all-zero entries are stored as ``k = 0`` (``raw`` stores every entry whole)
    zero_escape: bool = True

    @property
    def modes(self) -> frozenset[int]:
        """Every metadata mode this codec writes."""
        return self.coded_modes | {self.zero_mode, self.raw_mode}

    @abc.abstractmethod
    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        """Sizes (and what it takes to write the streams) of contiguous ``(n, E)`` entries."""

    def encode(self, entries: torch.Tensor, word_bytes: int, modes: torch.Tensor) -> torch.Tensor:
        """Payloads ``(n, E)`` of entries known to be coded with these ``modes``.

        Default: analyse them and write every stream; codecs override this
        where writing a stream needs less than sizing it.
        """
        return self.analyse(entries, word_bytes).streams()

    @abc.abstractmethod
    def decode(
        self, payload: torch.Tensor, sectors: torch.Tensor, modes: torch.Tensor, word_bytes: int
    ) -> torch.Tensor:
        """Coded entries ``(n, E)`` from their payloads (``0 < sectors < E/32``; modes already checked)."""
