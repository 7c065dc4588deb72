"""``auto``: per entry, the smallest of several member codecs, or zero, or raw.

Every entry is sized by each member codec and stored by the one giving the
fewest sectors; the metadata mode says which, so the decoder needs no header.
The default ``auto`` has these modes (format version 1, :data:`buddy.spec.AUTO_MODES`)::

    0  zero  k = 0, an all-zero entry (no payload)
    1  raw   k = E/32, the entry itself
    2  zvc   the payload of :mod:`buddy.codecs.zvc`
    3  fpx   the payload of :mod:`buddy.codecs.fpx`
    4  bpc   the payload of :mod:`buddy.codecs.bpc`

For a member's mode, ``0 < k < E/32`` and the payload is exactly that
codec's payload for the entry (decoded as if it had written the entry alone).
When several members give the same ``k`` the earlier one wins (the cheaper
decoder: zvc, then fpx, then bpc). A mode that disagrees with ``k`` (zero
with ``k > 0``, raw with ``k < E/32``, a member with ``k`` of 0 or ``E/32``)
is :class:`~buddy.errors.CorruptDataError`, as are modes 5-15 (checked by
the format layer).

``auto2`` (format version 2) adds one member, ``fpe`` (mode 5), the last
to be tried: its table -- fitted to the tensor when it is measured -- is
the table the tensor carries. The other modes are ``auto``'s.

:class:`AutoCodec` composes any single-mode codecs through the codec
interface: the first member sizes every entry; each later one sizes only the
entries still above one sector (the least a non-zero entry can take), and
its analysis is kept, so the streams of the entries it wins are written
without sizing them again. Decoding sends each mode's entries to its member.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import spec
from .base import Analysis, Codec, CodecLike, Fitting
from .bpc import BPCCodec
from .fpe import FPECodec
from .fpx import FPXCodec
from .zvc import ZVCCodec

__all__ = ["AutoCodec", "AUTO_MEMBERS", "AUTO2_MEMBERS", "member_kinds", "members_of"]

#: buddy's auto codecs and the classes of their members, in the order they are tried (their modes are
#: :data:`buddy.spec.AUTO_MODES`); ``auto2`` (format version 2) is ``auto``'s members and ``fpe``, whose table
#: the tensor carries. The one list: the registry, the kernels' check
#: (:class:`buddy.engines.kernel_engine.KernelEngine`) and the default of :class:`AutoCodec` read it.
AUTO_MEMBERS: dict[str, tuple[type[Codec], ...]] = {
    "auto": (ZVCCodec, FPXCodec, BPCCodec),
    "auto2": (ZVCCodec, FPXCodec, BPCCodec, FPECodec),
}


def member_kinds(name: str) -> tuple[tuple[int, type[Codec]], ...]:
    """The members ``(mode, class)`` of buddy's auto codec ``name`` (:data:`AUTO_MEMBERS`), in order."""
    return tuple((spec.AUTO_MODES[cls.name], cls) for cls in AUTO_MEMBERS[name])


def members_of(name: str) -> tuple[tuple[int, Codec], ...]:
    """The members ``(mode, codec)`` of buddy's auto codec ``name`` (:data:`AUTO_MEMBERS`), new instances."""
    return tuple((mode, cls()) for mode, cls in member_kinds(name))


#: ``auto2``'s members (:data:`AUTO_MEMBERS`)
AUTO2_MEMBERS = members_of("auto2")


class _Best(Analysis):
    """Per entry the smallest member; ``parts`` holds ``(mode, member analysis, block rows it covers or None)``."""

    def __init__(self, members: Sequence[tuple[int, Codec]], entries: torch.Tensor, word_bytes: int):
        raw = entries.shape[1] // spec.SECTOR_BYTES
        n = entries.shape[0]
        self.parts: list[tuple[int, Analysis, torch.Tensor | None]] = []
        (code, first), *rest = members
        analysis = first.analyse(entries, word_bytes)
        k = torch.clamp(analysis.sectors, max=raw)
        mode = torch.full_like(k, code)
        self.parts.append((code, analysis, None))
        for code, member in rest:
            open_rows = k > 1  # one sector is the least a non-zero entry takes: those cannot shrink
            count = int(open_rows.sum())
            if count == 0:
                break
            rows = None if count == n else open_rows.nonzero().view(-1)
            analysis = member.analyse(entries if rows is None else entries.index_select(0, rows), word_bytes)
            mine = torch.clamp(analysis.sectors, max=raw)
            if rows is None:
                better = mine < k  # strictly: on equal sizes the earlier member keeps the entry
                k = torch.where(better, mine, k)
                mode = torch.where(better, code, mode)
            else:
                better = mine < k.index_select(0, rows)
                won = rows[better]
                k.index_copy_(0, won, mine[better])
                mode.index_fill_(0, won, code)
            self.parts.append((code, analysis, rows))
        self.entry_bytes = entries.shape[1]
        self.sectors, self.modes = k, mode

    def streams(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        modes = self.modes if rows is None else self.modes.index_select(0, rows)
        out = torch.zeros(modes.numel(), self.entry_bytes, dtype=torch.uint8, device=modes.device)
        for code, analysis, covered in self.parts:
            mine = (modes == code).nonzero().view(-1)  # positions among the rows asked for
            if mine.numel() == 0:
                continue
            block_rows = mine if rows is None else rows.index_select(0, mine)
            # the member's analysis covers the block rows `covered`: find ours among them
            at = block_rows if covered is None else torch.searchsorted(covered, block_rows)
            out.index_copy_(0, mine, analysis.streams(at))
        return out


class AutoCodec(Codec):
    """Picks, per entry, the smallest of its members (default: zvc, fpx, bpc), or zero, or raw."""

    zero_mode = spec.AUTO_MODES["zero"]
    raw_mode = spec.AUTO_MODES["raw"]

    def __init__(self, members: Sequence[tuple[int, Codec]] | None = None, *, name: str = "auto"):
        if members is None:
            members = members_of("auto")
        members = tuple(members)
        codes = [code for code, _ in members]
        if not members or len(set(codes)) != len(codes) or {self.zero_mode, self.raw_mode} & set(codes):
            raise ValueError(f"auto needs members with distinct modes other than zero and raw, got {codes}")
        for _, member in members:
            if member.coded_modes != frozenset({0}) or not member.zero_escape:
                raise ValueError(f"auto composes single-mode codecs with the zero escape; {member!r} is not one")
        if sum(member.format_version >= 2 for _, member in members) > 1:
            raise ValueError("auto composes at most one codec that carries a table")
        self.name = name
        self.members = members
        self.coded_modes = frozenset(codes)
        # (a member's format version is fixed when it is made -- fpe's by its table -- and asked at every compress)
        self._version = max(member.format_version for _, member in members)
        self._tabled_member = next((member for _, member in members if member.format_version >= 2), None)

    @property
    def format_version(self) -> int:  # type: ignore[override]  # a class attribute of Codec; here the members
        return self._version

    @property
    def _tabled(self) -> Codec | None:
        """The member that carries a table (at most one does), or ``None``."""
        return self._tabled_member

    @property
    def table(self) -> torch.Tensor | None:
        member = self._tabled
        return None if member is None else member.table

    @property
    def table_bytes(self) -> int:
        member = self._tabled
        return 0 if member is None else member.table_bytes

    @property
    def statistics(self) -> torch.Tensor | None:  # type: ignore[override]  # an attribute of Codec; here the member's
        member = self._tabled
        return None if member is None else member.statistics

    def _with(self, member: Codec) -> AutoCodec:
        """A copy with the tabled member replaced by ``member`` (fitted or bound)."""
        tabled = self._tabled
        return AutoCodec([(code, member if m is tabled else m) for code, m in self.members], name=self.name)

    def _fit(self, flat: torch.Tensor, word_bytes: int, how: Fitting) -> AutoCodec:
        tabled = self._tabled
        if tabled is None:
            return self
        return self._with(tabled._fit(flat, word_bytes, how._replace(keep=self._member_keep(how.keep))))

    @staticmethod
    def _member_keep(keep: CodecLike | None) -> CodecLike | None:
        """What the tabled member keeps from ``keep``: an auto codec's tabled member, else ``keep`` itself."""
        return keep._tabled if isinstance(keep, AutoCodec) else keep

    def kept_table(self, keep: CodecLike | None):
        tabled = self._tabled
        return None if tabled is None else tabled.kept_table(self._member_keep(keep))

    def with_table(self, table, statistics: torch.Tensor | None) -> AutoCodec:
        tabled = self._tabled
        if tabled is None:
            return super().with_table(table, statistics)
        return self._with(tabled.with_table(table, statistics))

    def bind(self, table: torch.Tensor | None, word_bytes: int) -> AutoCodec:
        tabled = self._tabled
        return super().bind(table, word_bytes) if tabled is None else self._with(tabled.bind(table, word_bytes))

    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        return _Best(self.members, entries, word_bytes)

    def _by_member(self, modes: torch.Tensor):
        """``(member, rows)`` for each member that has entries among ``modes``."""
        for code, member in self.members:
            rows = (modes == code).nonzero().view(-1)
            if rows.numel():
                yield member, rows

    def encode(self, entries: torch.Tensor, word_bytes: int, modes: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(entries)
        for member, rows in self._by_member(modes):
            sub = entries.index_select(0, rows)
            out.index_copy_(0, rows, member.encode(sub, word_bytes, torch.zeros_like(rows, dtype=torch.int32)))
        return out

    def decode(self, payload, sectors, modes, word_bytes):
        out = torch.zeros_like(payload)
        for member, rows in self._by_member(modes):
            k = sectors.index_select(0, rows)
            out.index_copy_(0, rows, member.decode(payload.index_select(0, rows), k, torch.zeros_like(k), word_bytes))
        return out
