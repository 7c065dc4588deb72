"""``auto``: per entry, the smallest of zero, ``zvc``, ``fpx``, ``bpc`` and raw.

Every entry is sized by each sub-codec and stored by the one giving the
fewest sectors; the metadata ``mode`` says which, so the decoder needs no
header. Modes::

    0  MODE_ZERO  k = 0, an all-zero entry (no payload)
    1  MODE_RAW   k = E/32, the entry itself
    2  MODE_ZVC   the payload of :mod:`buddy.codecs.zvc`
    3  MODE_FPX   the payload of :mod:`buddy.codecs.fpx`
    4  MODE_BPC   the payload of :mod:`buddy.codecs.bpc`

For modes 2-4, ``0 < k < E/32`` and the payload is exactly that codec's
payload for the entry (the sub-codec is decoded as if it had written the
entry alone, with its own mode 0). When several codecs give the same ``k``
the cheaper decoder wins: zvc, then fpx, then bpc. A mode that disagrees
with ``k`` (zero with ``k > 0``, raw with ``k < E/32``, a codec with ``k`` of
0 or ``E/32``) is :class:`CorruptDataError`, as are modes 5-15.

Implementation: per block of entries, zvc sizes everything, then fpx and bpc
size only the entries still above one sector (the least a non-zero entry
can take), keeping their analyses so that the streams of the entries they
win are written without sizing them again. Encoding costs about the sum of
sizing with all three codecs; decoding dispatches each mode's entries to
its decoder (``index_select`` / ``index_copy_``, no loop over entries).
"""

from __future__ import annotations

import torch

from ..errors import CorruptDataError
from . import bpc, fpx
from ._bitstream import blocks, copy_rows
from .base import Codec, Encoded
from .bpc import BPCCodec
from .fpx import FPXCodec
from .zvc import ZVCCodec

__all__ = ["AutoCodec", "MODE_ZERO", "MODE_RAW", "MODE_ZVC", "MODE_FPX", "MODE_BPC"]

MODE_ZERO, MODE_RAW, MODE_ZVC, MODE_FPX, MODE_BPC = 0, 1, 2, 3, 4

_ZVC = ZVCCodec()
#: sub-codecs in order of preference on equal sizes, with their modes
_SUBCODECS: tuple[tuple[int, Codec], ...] = ((MODE_ZVC, _ZVC), (MODE_FPX, FPXCodec()), (MODE_BPC, BPCCodec()))
#: the sub-codecs after zvc, with their block analyses (sizes first, streams on demand)
_ANALYSED = ((MODE_FPX, fpx.Analysis), (MODE_BPC, bpc.Analysis))


def _choose_block(entries: torch.Tensor, word_bytes: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``(sectors, mode, analyses)`` of a contiguous block; ``analyses`` lists ``(mode, analysis, rows)``.

    zvc sizes every entry (it is cheap); fpx and then bpc only size the
    entries that could still shrink: one sector is the least a non-zero entry
    takes, so entries already at 0 or 1 sector are not sized again. A later
    codec wins only when strictly smaller. ``rows`` are the block rows an
    analysis covers (``None``: all of them).
    """
    raw_k = entries.shape[1] // 32
    k = _ZVC.sizes(entries, word_bytes).to(torch.int32)
    mode = torch.full_like(k, MODE_ZVC)
    analyses = []
    for code, analyse in _ANALYSED:
        open_rows = k > 1
        count = int(open_rows.sum())
        if count == 0:
            break
        if count == k.numel():
            analysis = analyse(entries, word_bytes)
            mine = analysis.sectors
            better = mine < k
            k = torch.where(better, mine, k)
            mode = torch.where(better, code, mode)
            analyses.append((code, analysis, None))
        else:
            rows = open_rows.nonzero().view(-1)
            analysis = analyse(entries.index_select(0, rows), word_bytes)
            mine = analysis.sectors
            better = mine < k.index_select(0, rows)
            won = rows[better]
            k.index_copy_(0, won, mine[better])
            mode.index_fill_(0, won, code)
            analyses.append((code, analysis, rows))
    mode = torch.where(k == 0, MODE_ZERO, torch.where(k == raw_k, MODE_RAW, mode)).to(torch.int32)
    return k, mode, analyses


class AutoCodec(Codec):
    """Picks zero / zvc / fpx / bpc / raw per entry, whichever is smallest."""

    name = "auto"
    modes = frozenset({MODE_ZERO, MODE_RAW, MODE_ZVC, MODE_FPX, MODE_BPC})

    def sizes(self, entries: torch.Tensor, word_bytes: int) -> torch.Tensor:
        n, entry_bytes = entries.shape
        entries = entries.contiguous()
        out = torch.empty(n, dtype=torch.int32, device=entries.device)
        for a, z in blocks(n, entry_bytes):
            out[a:z] = _choose_block(entries[a:z], word_bytes)[0]
        return out

    def encode(self, entries: torch.Tensor, word_bytes: int) -> Encoded:
        n, entry_bytes = entries.shape
        entries = entries.contiguous()
        payload = torch.zeros(n, entry_bytes, dtype=torch.uint8, device=entries.device)
        sectors = torch.empty(n, dtype=torch.int32, device=entries.device)
        modes = torch.empty(n, dtype=torch.int32, device=entries.device)
        for a, z in blocks(n, entry_bytes):
            block, out = entries[a:z], payload[a:z]
            k, mode, analyses = _choose_block(block, word_bytes)
            sectors[a:z], modes[a:z] = k, mode
            copy_rows(out, mode == MODE_RAW, block)
            rows = (mode == MODE_ZVC).nonzero().view(-1)
            if rows.numel():
                out.index_copy_(0, rows, _ZVC.encode(block.index_select(0, rows), word_bytes).payload)
            for code, analysis, covered in analyses:
                rows = (mode == code).nonzero().view(-1)
                if rows.numel():
                    # the analysis covers the block rows `covered`: find ours among them
                    mine = rows if covered is None else torch.searchsorted(covered, rows)
                    out.index_copy_(0, rows, analysis.streams(mine))
        return Encoded(payload, sectors, modes)

    def decode(self, payload, sectors, modes, word_bytes):
        self.check_modes(modes)
        n, entry_bytes = payload.shape
        raw_k = entry_bytes // 32
        sectors = sectors.to(torch.int32)
        modes = modes.to(torch.int32)
        coded = (sectors > 0) & (sectors < raw_k)
        consistent = torch.where(
            modes == MODE_ZERO, sectors == 0, torch.where(modes == MODE_RAW, sectors == raw_k, coded)
        )
        if not bool(consistent.all()):
            raise CorruptDataError("auto: a metadata mode disagrees with the entry's size")
        out = torch.zeros(n, entry_bytes, dtype=torch.uint8, device=payload.device)
        copy_rows(out, modes == MODE_RAW, payload)
        for code, codec in _SUBCODECS:
            index = (modes == code).nonzero().view(-1)
            if index.numel():
                k = sectors.index_select(0, index)
                sub = codec.decode(payload.index_select(0, index), k, torch.zeros_like(k), word_bytes)
                out.index_copy_(0, index, sub)
        return out
