"""An fpe table's device form: the bytes the kernels read it as (``BuddyFpeTable``, csrc/codec_fpe.h).

The codec's own: laid out from its :class:`~buddy.codecs.fpe.Table`, kept
with it, copied to each device once, and the sizes of what the kernels' fit
writes and needs. Every engine that runs the kernels (the CUDA loader, the
native build, the emulator in the tests) takes it from here: which table a
codec's kernels code with (:func:`codec_table`: ``fpe``'s, or an auto codec's
fpe member's), its copy on a device (:func:`kernel_table`), and the copy of
the bytes a tensor coded with it carries (:func:`stored_table`).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .auto import AutoCodec
from .base import CodecLike
from .fpe import MAX_CODE_BITS, MAX_CODED, FPECodec, Table, default_table, n_symbols

__all__ = [
    "DECODE_ROWS_BYTES", "DEVICE_TABLE_BYTES", "FIELDS_BYTES", "FIT_SERIAL_BYTES", "FIT_WORK_BYTES", "device_table",
    "remember_device_table", "fpe_member", "codec_table", "kernel_table", "stored_table",
]  # fmt: skip

#: bytes of a device table's decode rows (``BuddyFpe::ROWS_BYTES``), its first: a decode row and a multi row per
#: value of the next MAX_CODE_BITS stream bits (uint32 each), which unpack copies into each block's shared memory
#: (the rest, the encode entries read by a decoder only to check an escape, stays in global memory)
DECODE_ROWS_BYTES = 8 * (1 << MAX_CODE_BITS)
#: bytes of a device table (``sizeof(BuddyFpeTable)``): its decode rows, an encode entry per symbol of the widest
#: symbols (uint16: 12 bits, ZERO and ESC), the bits of a word a symbol is, the layout and the span model (uint32
#: each)
DEVICE_TABLE_BYTES = DECODE_ROWS_BYTES + 2 * n_symbols(8) + 12
#: bytes of pack's table of whole fields in a block's shared memory (``BuddyFpe::FIELDS_BYTES``): a 32-bit field
#: for each of the 2^12 symbols of the fit's b and for a zero word, to 16 bytes
FIELDS_BYTES = 16400
#: bytes of the serialized table a fit writes: the longest :meth:`Table.to_bytes` (``BUDDY_FPE_SERIAL_BYTES``)
FIT_SERIAL_BYTES = 4 + 3 * (MAX_CODED + 2)
#: scratch bytes of a fit (``sizeof(BuddyFpeFitWork)``, csrc/codec_fpe_fit.h)
FIT_WORK_BYTES = 93496
_lock = threading.Lock()
_HOST_TABLES: dict[tuple, torch.Tensor] = {}  # by (word bytes, code lengths), oldest first
_HOST_TABLES_KEPT = 64


def device_table(table: Table) -> torch.Tensor:
    """An fpe ``table`` laid out as the kernels read it: :data:`DEVICE_TABLE_BYTES` uint8 on the host.

    ``BuddyFpeTable`` (csrc/codec_fpe.h): ``dec[v]`` = symbol | code length << 16 for
    the next 12 stream bits ``v``, ``multi[v]`` (:attr:`Table.multi_rows`), then
    ``enc[symbol]`` = stream code | code length << 12 (0: no code), from
    :meth:`Table.lookups`, then the table's :attr:`~Table.symbol_bits`, whether its
    payloads have the split layout (:attr:`~Table.split`; both from its format) and
    its :attr:`~Table.span_model` (``zero | head << 8``), little-endian. Pinned when CUDA
    is present (its copy to the device is then asynchronous); kept with the table
    (:attr:`Table.laid_out`: a tensor's table is laid out once, however many
    tables a step decompresses) and for the last 64 tables seen (an equal table read
    back from bytes), and never written again.
    """
    if table.laid_out is not None:
        return table.laid_out
    key = table.key
    with _lock:
        found = _HOST_TABLES.pop(key, None)
        if found is not None:
            _HOST_TABLES[key] = found  # the newest again
            table.laid_out = found
            return found
    enc_len, enc_code, dec_sym, dec_len = (t.numpy() for t in table.lookups("cpu"))
    enc = np.zeros(n_symbols(8), dtype="<u2")  # the layout has room for the widest words' symbols
    enc[: len(enc_code)] = enc_code | enc_len << 12
    dec = (dec_sym | dec_len << 16).astype("<u4")
    multi = table.multi_rows.numpy().astype("<u4")
    zero, head = table.span_model
    tail = np.array([table.symbol_bits, int(table.split), zero | head << 8], dtype="<u4")
    raw = b"".join(part.tobytes() for part in (dec, multi, enc, tail))
    return remember_device_table(table, torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def remember_device_table(table: Table, laid_out: torch.Tensor) -> torch.Tensor:
    """Keeps ``laid_out`` (on the host: :func:`device_table`'s bytes of ``table``, e.g. as a fit kernel of the
    native engine wrote them) as :func:`device_table` of ``table`` from now on, pinned when CUDA is present;
    returns what is kept. Nothing may write ``laid_out`` after."""
    if torch.cuda.is_available():
        laid_out = laid_out.pin_memory()
    table.laid_out = laid_out
    with _lock:
        _HOST_TABLES[table.key] = laid_out
        while len(_HOST_TABLES) > _HOST_TABLES_KEPT:
            del _HOST_TABLES[next(iter(_HOST_TABLES))]
    return laid_out


def fpe_member(codec: CodecLike | None) -> FPECodec | None:
    """``codec`` itself if it is fpe, else its fpe member (an auto codec's), else ``None``."""
    if isinstance(codec, AutoCodec):
        return next((member for _, member in codec.members if isinstance(member, FPECodec)), None)
    return codec if isinstance(codec, FPECodec) else None


def codec_table(codec: CodecLike, word_bytes: int) -> Table | None:
    """The fpe table the kernels of ``codec`` code with, ``None`` for a codec without one.

    ``fpe``'s own, or ``auto2``'s fpe member's: the table it was fitted to or bound
    to, else (an unfitted codec, as the reference) the word size's default table.
    """
    fpe = fpe_member(codec)
    if fpe is None:
        return None
    table = fpe.fitted
    if table is None:
        return default_table(word_bytes)
    if table.word_bytes != word_bytes:
        raise ValueError(f"this fpe table is for {table.word_bytes}-byte words, got {word_bytes}-byte words")
    return table


def kernel_table(codec: CodecLike, word_bytes: int, device: torch.device) -> torch.Tensor | None:
    """The kernels' ``table`` argument for ``codec`` on ``device``: :func:`device_table` of its
    :func:`codec_table`, copied there once per table (:attr:`Table.on_device`) and never written, so a key's table
    kept from step to step, and every decompress of a tensor coded with it, reads the same copy; ``None`` for a
    codec without one."""
    table = codec_table(codec, word_bytes)
    return None if table is None else _copy_once(table.on_device, device, lambda: device_table(table))


def stored_table(codec: CodecLike, device: torch.device) -> torch.Tensor | None:
    """The serialized table a tensor coded with ``codec`` carries (:attr:`CodecLike.table`) on ``device``: one copy
    per table and device (:attr:`Table.stored_on`), shared by every tensor coded with it (none writes it); ``None``
    for a codec not fitted to one."""
    fpe = fpe_member(codec)
    table = None if fpe is None else fpe.fitted
    return None if table is None else _copy_once(table.stored_on, device, table.to_bytes)


def _copy_once(copies: dict[torch.device, torch.Tensor], device: torch.device, host) -> torch.Tensor:
    """``copies[device]``, made the first time from ``host()`` (host bytes nothing writes): on a GPU from pinned
    memory, without waiting (the kernels that read it follow on the current stream)."""
    found = copies.get(device)
    if found is None:
        made = host()
        if made.device != device:
            made = (made.pin_memory() if device.type == "cuda" else made).to(device, non_blocking=True)
        found = copies[device] = made
    return found
