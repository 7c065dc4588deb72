"""nvcomp chunk codecs: every entry one nvcomp chunk, a whole tensor in one batched nvcomp call.

``nvcomp-lz4``, ``nvcomp-ans``, ``nvcomp-bitcomp``, ``nvcomp-cascaded``,
``nvcomp-gdeflate`` and ``nvcomp-zstd`` compress each entry as one chunk of
nvcomp's batched GPU compressors (all six have a batched C API in every nvcomp
bound here), inside buddy's slot format: a fixed slot per entry on the
device, the rest of its payload in buddy memory, its sector count in the
metadata. They take entries of 4-64 KiB (nvcomp's chunk sizes: below, a
chunk's own framing costs more than it saves; GDeflate takes at most 64 KiB)
and raise ``ValueError`` for others before any work; they run on CUDA tensors
only and raise :class:`~buddy.errors.MissingDependencyError` anywhere else.

Payload of an entry (the zero and raw rules are every codec's)::

    k = 0           an all-zero entry: no payload
    k = E/32        the entry itself (nvcomp did not shrink it, or failed on it)
    0 < k < E/32    the stream's length L as a little-endian uint32, then
                    nvcomp's raw chunk stream (L bytes, no nvcomp container
                    header), then zeros up to k sectors: k = ceil((4 + L) / 32)

One metadata mode (0).

:class:`NvcompEngine` (backend ``"nvcomp"``, the default for these codecs on
CUDA tensors; see :mod:`buddy.dispatch`) runs the format operations over the
whole tensor:

* ``measure`` compresses every entry in one batched call into a device
  staging buffer (kept in :attr:`~buddy.engines.Measurement.reuse`); the
  sizes, metadata and histogram are computed on the device, and the
  histogram is the one device-to-host read of a compress.
* ``pack`` writes the payloads from the staged streams, a block of entries
  at a time, and splits them into slots and the compacted overflow on the
  device (a prefix sum and a scatter: :func:`buddy.format.scatter_overflow`).
  It reads nothing back.
* ``unpack`` gathers the payloads from slots and overflow on the device
  (:func:`buddy.format.gather_overflow`), decompresses the coded entries in
  one batched call over every entry, copies the raw entries and zeroes the
  zero entries. No host read picks the coded entries out, so every other
  chunk of the call decodes a *filler*: nvcomp's own stream of an all-zero
  entry, compressed once per algorithm, device and entry size and kept,
  decoded into that entry's unused stream row. (nvcomp's decompressors take
  no empty chunk: Zstd's reads out of bounds on one, Bitcomp reads every
  chunk's header and refuses the whole call.) Sizes, modes, the overflow's
  size, stream lengths, nvcomp's statuses and decoded sizes are checked on
  the device; the error flag is read back only with ``check=True`` (the
  public :func:`buddy.unpack` passes it), otherwise entries that failed a
  check decode to zeros.

What reaches nvcomp's decompressor on damaged buffers: only the streams of
coded entries whose length fits their ``k`` sectors, and none at all when the
metadata or the overflow's size is inconsistent (a ``k`` past the entry, a
mode this codec never writes, an overflow of another size than the metadata
needs: the positions of every stream are then suspect, so every coded entry
decodes to zeros, flagged). Damage inside a stream's bytes is beyond what the
format can see. nvcomp's LZ4 (CUDA backend) and ANS decompressors report it
in their statuses (flagged, the entry decodes to zeros); its Zstd, GDeflate,
Cascaded and Bitcomp decompressors are documented to be undefined on such
input (:data:`buddy.engines._nvcomp_capi.REPORTS_DAMAGE`), so for those codecs
only a checksum (``buddy.compress(..., checksum=True)``, checked before
anything is decoded) keeps damaged buffers from reaching them. Bitcomp
refuses a whole call whose chunks it cannot parse: its coded entries then all
decode to zeros, flagged. Bitcomp's decompression also reads every chunk's
header on the host, so it waits for the stream inside nvcomp (outside
torch's sight) in every decompress.

nvcomp is called through its batched C API (``nvcompBatched<Algo>CompressAsync``
and ``DecompressAsync``, device arrays of chunk pointers computed with torch as
``base + i * stride``), bound with ctypes for nvcomp 4.x, 5.x and 6.x -- what
``buddy[cuda12]`` / ``buddy[cuda13]`` install -- in
:mod:`buddy.engines._nvcomp_capi`. nvcomp's Python API is not used: before
nvcomp 6 it batches only a Python list of per-entry arrays, and it reads
compressed sizes back to the host. The C API keeps no state, so threads share
nothing but the loaded library and the fillers (made under a lock; a stream
that did not make one waits for it with an event, on the device). Every call
runs with the tensor's device current, on torch's current stream of that
device (passed explicitly: the legacy default stream is passed as the handle
torch reports for it), and every device buffer -- temp space, staging,
pointer and size arrays -- is a torch allocation on that stream. ``import buddy`` loads nothing of nvcomp:
the library is found on disk when asked whether it can run and loaded on first use.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import NamedTuple

import torch

from .. import format, spec
from ..codecs.base import ChunkCodec, CodecLike
from ..deps import require_cuda
from ..errors import CorruptDataError, MissingDependencyError
from ..layout import Layout
from . import ERR_K, ERR_MODE, ERR_OVERFLOW, ERR_STREAM, Engine, Implementation, Measurement, raise_for_errors
from . import _nvcomp_capi as capi

__all__ = [
    "chunk_codec",
    "NvcompEngine",
    "ALGORITHMS",
    "NAMES",
    "CODECS",
    "MIN_ENTRY_BYTES",
    "usable",
    "why_unusable",
    "rows",
    "check_entry_bytes",
    "chunk_pointers",
    "entry_sectors",
    "sector_histogram",
    "length_bytes",
    "read_lengths",
    "coded_payloads",
]

#: nvcomp algorithms (as its C API spells them) by buddy codec name
ALGORITHMS = {
    "nvcomp-lz4": "LZ4",
    "nvcomp-ans": "ANS",
    "nvcomp-bitcomp": "Bitcomp",
    "nvcomp-cascaded": "Cascaded",
    "nvcomp-gdeflate": "Gdeflate",
    "nvcomp-zstd": "Zstd",
}
NAMES = tuple(ALGORITHMS)
#: the smallest entry the nvcomp codecs take (the largest is the format's, 64 KiB)
MIN_ENTRY_BYTES = 4096
#: payload bytes built at a time by pack and unpack: bounds their temporaries
BLOCK_BYTES = 64 << 20

_LENGTH_BYTES = 4
#: what a bad stream (ERR_STREAM) means for this engine's unpack
_BAD_STREAM = (
    "a stream's length or what nvcomp decoded from it does not match the metadata (the buffers are damaged or were "
    "not written by this codec)"
)


def why_unusable() -> str | None:
    """Why the nvcomp codecs cannot run here, or ``None`` when they can."""
    if not torch.cuda.is_available():
        return "they run on CUDA tensors and PyTorch sees no CUDA device"
    return capi.why_unusable()


def rows() -> tuple[Implementation, ...]:
    """nvcomp's chunk codecs: CUDA tensors only, run by nvcomp itself (the default there; nothing else runs them)."""
    return tuple(
        Implementation(name, "cuda", "nvcomp", NvcompEngine, default=True, requires=why_unusable) for name in NAMES
    )


def usable() -> bool:
    """Whether nvcomp and a CUDA device are both present."""
    return why_unusable() is None


def check_entry_bytes(entry_bytes: int) -> int:
    """A valid entry size of 4-64 KiB (``ValueError`` otherwise: one nvcomp chunk per entry)."""
    spec.check_entry_bytes(entry_bytes)
    if entry_bytes < MIN_ENTRY_BYTES:
        raise ValueError(
            f"nvcomp codecs take entries of 4-64 KiB (one nvcomp chunk per entry), got entry_bytes={entry_bytes}; "
            f"pass entry_bytes=4096, 8192, ... or 65536"
        )
    return entry_bytes


# ---------------------------------------------------------------------------
# the device-side pieces (torch ops: tested on CPU tensors too)
# ---------------------------------------------------------------------------
def chunk_pointers(base: int, stride: int, n: int, device, *, last: int | None = None) -> torch.Tensor:
    """``(n,)`` int64 addresses ``base + i * stride``, the last one ``last`` when given: computed on the device."""
    ptrs = torch.arange(n, dtype=torch.int64, device=device).mul_(stride).add_(base)
    if last is not None and n:
        # a fill kernel with the value as its argument (``ptrs[n - 1] = last`` would copy a host scalar into
        # CUDA memory, a blocking copy that waits for the stream)
        ptrs[n - 1 :].fill_(last)
    return ptrs


def entry_sectors(nonzero: torch.Tensor, lengths: torch.Tensor, ok: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    """Every entry's ``k`` (int32) from nvcomp's stream lengths: ``ceil((4 + L) / 32)``, by the format's rules.

    All-zero entries (``~nonzero``) are ``k = 0``; entries whose stream does
    not shrink them, is empty or failed (``~ok``) are stored raw, ``k = E/32``.
    """
    spe = spec.sectors_per_entry(entry_bytes)
    coded = torch.div(
        lengths.to(torch.int64) + (_LENGTH_BYTES + spec.SECTOR_BYTES - 1), spec.SECTOR_BYTES, rounding_mode="floor"
    )
    k = torch.where(ok & (lengths > 0), coded.clamp(max=spe), spe)
    return torch.where(nonzero, k, 0).to(torch.int32)


def sector_histogram(sectors: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    """``(E/32 + 1,)`` int64: how many entries have each ``k`` -- a sort and a search, no host read (bincount syncs)."""
    bins = torch.arange(spec.sectors_per_entry(entry_bytes) + 2, dtype=torch.int64, device=sectors.device)
    return torch.searchsorted(torch.sort(sectors.to(torch.int64)).values, bins).diff()


def length_bytes(lengths: torch.Tensor) -> torch.Tensor:
    """``(n, 4)`` uint8: stream lengths as little-endian uint32 (the payload's header)."""
    shifts = torch.arange(0, 8 * _LENGTH_BYTES, 8, dtype=torch.int64, device=lengths.device)
    return ((lengths.to(torch.int64).unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8)


def read_lengths(payload: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64: the little-endian uint32 at the start of each payload row."""
    shifts = torch.arange(0, 8 * _LENGTH_BYTES, 8, dtype=torch.int64, device=payload.device)
    return (payload[:, :_LENGTH_BYTES].to(torch.int64) << shifts).sum(1)


def coded_payloads(streams: torch.Tensor, lengths: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    """``(n, E)`` payloads of coded entries: the length, the stream (``streams``' rows, cut at ``L``), zeros."""
    body = torch.cat([length_bytes(lengths), streams[:, : entry_bytes - _LENGTH_BYTES]], dim=1)
    used = torch.arange(entry_bytes, device=streams.device).unsqueeze(0) < (lengths + _LENGTH_BYTES).unsqueeze(1)
    return torch.where(used, body, 0)


def _ranges(n: int, entry_bytes: int) -> list[tuple[int, int]]:
    step = max(1, BLOCK_BYTES // entry_bytes)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _flag(bad: torch.Tensor, bit: int) -> torch.Tensor:
    """``bit`` if any of ``bad`` is set, as a 0-dim int32 tensor on its device."""
    return bad.any().to(torch.int32) * bit


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ---------------------------------------------------------------------------
# the codecs and their engine
# ---------------------------------------------------------------------------
def chunk_codec(name: str) -> ChunkCodec:
    """nvcomp's chunk codec ``name`` (entry = chunk): CUDA tensors only, run by :class:`NvcompEngine`."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown nvcomp codec {name!r}; one of {', '.join(NAMES)}")
    return ChunkCodec(name, ALGORITHMS[name])


#: the chunk codecs, one per algorithm (registered by name in :mod:`buddy.dispatch`)
CODECS = tuple(chunk_codec(name) for name in NAMES)


def _refuse_host(name: str, t: torch.Tensor) -> None:
    """:class:`~buddy.errors.MissingDependencyError` for a tensor not on a CUDA device, with a diagnosis."""
    require_cuda(f"codec {name!r}")  # a clear diagnosis on a machine without a GPU
    raise MissingDependencyError(
        f"codec {name!r} runs nvcomp on the GPU: move the tensor to CUDA first "
        f"(got a {t.device.type} tensor), or use a reference codec such as 'auto' on the CPU"
    )


class _Filler(NamedTuple):
    """nvcomp's stream of one all-zero entry: what every chunk of a decompress that is not a coded entry decodes."""

    stream: torch.Tensor  # (stride,) uint8, the stream at its start
    length: torch.Tensor  # (1,) int64: the stream's length, on the device
    stream_of: object  # the CUDA stream that wrote it (None on the CPU)
    ready: object  # a torch.cuda.Event recorded after it was written (None on the CPU)


#: fillers by the object that runs nvcomp's batched calls, then by (device, entry size)
_FILLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FILLERS_LOCK = threading.Lock()


class _Staged(NamedTuple):
    """What measure leaves for pack: nvcomp's streams ``(n, stride)``, their lengths, every entry's ``k``."""

    streams: torch.Tensor
    lengths: torch.Tensor
    sectors: torch.Tensor


class NvcompEngine(Engine):
    """The format operations over a whole tensor with one batched nvcomp call each way (see the module doc).

    ``batch``: what runs nvcomp's batched calls (default: nvcomp's library,
    :class:`buddy.engines._nvcomp_capi.Batched`); ``device_type``: the device
    the tensors must live on. Tests run the same glue on CPU tensors by
    passing both. :attr:`readbacks` counts the device-to-host reads (one per
    compress: the histogram; none per decompress unless ``check=True``).
    """

    backend = "nvcomp"
    codec: ChunkCodec

    def __init__(self, codec: CodecLike, *, batch=None, device_type: str = "cuda"):
        if not (isinstance(codec, ChunkCodec) and ALGORITHMS.get(codec.name) == codec.algorithm):
            raise ValueError(f"the nvcomp engine runs nvcomp codecs, not {codec!r}")
        super().__init__(codec)
        self._batch = batch
        self.device_type = device_type

    # -- plumbing ----------------------------------------------------------------
    def _batched(self):
        return self._batch if self._batch is not None else capi.library().algorithm(self.codec.algorithm)

    def _check(self, t: torch.Tensor, layout: Layout) -> None:
        check_entry_bytes(layout.entry_bytes)
        if t.device.type != self.device_type:
            if self.device_type == "cuda":
                _refuse_host(self.codec.name, t)
            raise ValueError(f"this nvcomp engine takes {self.device_type} tensors, got one on {t.device}")

    @staticmethod
    def _on(device: torch.device):
        """The device current for nvcomp (it runs on the CUDA runtime's current device)."""
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @staticmethod
    def _stream(device: torch.device) -> int:
        """torch's current stream of ``device`` as nvcomp takes it (the legacy default stream is what torch reports)."""
        return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0

    @staticmethod
    def _entries(flat: torch.Tensor, layout: Layout, align: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, tail)``: the whole entries in place (aligned for nvcomp), the last one zero-padded."""
        whole = layout.n_full * layout.entry_bytes
        if flat.numel() and flat.data_ptr() % align:
            flat = flat.clone()  # a view at an odd offset: nvcomp needs its chunks aligned
        tail = torch.zeros(layout.entry_bytes, dtype=torch.uint8, device=flat.device)
        if layout.tail_bytes:
            tail[: layout.tail_bytes] = flat[whole:]
        return flat[:whole], tail

    # -- compress ----------------------------------------------------------------
    def _stage(self, flat: torch.Tensor, layout: Layout) -> _Staged:
        """Every entry compressed in one batched call into a staging buffer; sizes on the device."""
        batch, device = self._batched(), flat.device
        entry_bytes, n_full, n = layout.entry_bytes, layout.n_full, layout.n_entries
        data, tail = self._entries(flat, layout, batch.alignment())
        stride = _round_up(max(batch.max_compressed_bytes(entry_bytes), entry_bytes), max(64, batch.alignment()))
        streams = torch.empty(n * stride, dtype=torch.uint8, device=device)
        lengths = torch.zeros(n, dtype=torch.int64, device=device)
        statuses = torch.zeros(n, dtype=torch.int32, device=device)  # nvcomp 4.x reports none: success
        with self._on(device):
            batch.compress(
                device=device, stream=self._stream(device),
                in_ptrs=chunk_pointers(data.data_ptr(), entry_bytes, n, device, last=tail.data_ptr() if n > n_full else None),
                in_bytes=torch.full((n,), entry_bytes, dtype=torch.int64, device=device), chunk_bytes=entry_bytes,
                out_ptrs=chunk_pointers(streams.data_ptr(), stride, n, device), out_bytes=lengths, statuses=statuses,
            )  # fmt: skip
        nonzero = torch.cat([data.view(n_full, entry_bytes).amax(1), tail.amax().view(1)[: n - n_full]]) != 0
        k = entry_sectors(nonzero, lengths, (statuses == 0) & (lengths <= stride), entry_bytes)
        return _Staged(streams.view(n, stride), lengths, k)

    def measure(self, flat, layout):
        self._check(flat, layout)
        if layout.n_entries == 0:
            return Measurement(torch.empty(0, dtype=torch.uint8, device=flat.device), (0,) * layout.bins, None)
        staged = self._stage(flat, layout)
        meta = format.encode_meta(staged.sectors, torch.zeros_like(staged.sectors), layout.entry_bytes)
        histogram = self.read(sector_histogram(staged.sectors, layout.entry_bytes)).tolist()
        return Measurement(meta, tuple(histogram), staged)

    @staticmethod
    def _payloads(flat: torch.Tensor, staged: _Staged, a: int, b: int, layout: Layout) -> torch.Tensor:
        """``(b - a, E)`` payloads of entries ``[a, b)``: zeros, the entries themselves (raw), length + stream."""
        entry_bytes, spe = layout.entry_bytes, layout.sectors_per_entry
        k = staged.sectors[a:b].unsqueeze(1)
        coded = coded_payloads(staged.streams[a:b], staged.lengths[a:b], entry_bytes)
        payload = torch.where((k > 0) & (k < spe), coded, 0)
        return torch.where(k == spe, format.entry_rows(flat, a, b, entry_bytes), payload)

    def pack(self, flat, measured, slot, layout, into=None):
        self._refuse_into(into, "where the tensor is")
        self._check(flat, layout)
        n, slot_bytes = layout.n_entries, slot * spec.SECTOR_BYTES
        spilled = layout.overflow_bytes(measured.histogram, slot)  # known on the host: no read
        slots = torch.empty(layout.slots_bytes(slot), dtype=torch.uint8, device=flat.device)
        overflow = torch.empty(spilled + spec.SECTOR_BYTES, dtype=torch.uint8, device=flat.device)  # + a spare sector
        if n:
            staged = measured.reuse if isinstance(measured.reuse, _Staged) else self._stage(flat, layout)
            starts, _ = format.overflow_starts(staged.sectors, slot)
            for a, b in _ranges(n, layout.entry_bytes):
                payload = self._payloads(flat, staged, a, b, layout)
                slots[a * slot_bytes : b * slot_bytes].view(b - a, slot_bytes).copy_(payload[:, :slot_bytes])
                format.scatter_overflow(payload, staged.sectors[a:b], slot, starts[a:b], overflow)
        return slots, overflow[:spilled]

    # -- decompress --------------------------------------------------------------
    def unpack(self, meta, slots, overflow, slot, layout, *, check=True, error_flag=None):
        self._check(slots, layout)
        if meta.numel() != layout.meta_bytes:
            raise CorruptDataError(f"metadata holds {meta.numel()} bytes, expected {layout.meta_bytes}")
        if slots.numel() != layout.slots_bytes(slot):
            raise CorruptDataError(f"slots hold {slots.numel()} bytes, expected {layout.slots_bytes(slot)}")
        if overflow.numel() % spec.SECTOR_BYTES:
            raise CorruptDataError(f"overflow holds {overflow.numel()} bytes, not a whole number of sectors")
        out = torch.empty(layout.n_entries * layout.entry_bytes, dtype=torch.uint8, device=slots.device)
        if layout.n_entries:
            flat = (meta.reshape(-1), slots.reshape(-1), overflow.reshape(-1))
            error = self._decode(*flat, slot, layout, out)
            if error_flag is not None:
                error_flag.bitwise_or_(error.view(1))
            if check:
                raise_for_errors(self.codec.name, int(self.read(error)), _BAD_STREAM)
        return out[: layout.nbytes]

    def _decode(self, meta, slots, overflow, slot, layout: Layout, out) -> torch.Tensor:
        """Decode into ``out`` (``n * E`` bytes); the error bits as a 0-dim int32 tensor on the device."""
        batch, device = self._batched(), out.device
        n, spe, entry_bytes = layout.n_entries, layout.sectors_per_entry, layout.entry_bytes
        m = overflow.numel() // spec.SECTOR_BYTES
        spared = torch.empty((m + 1) * spec.SECTOR_BYTES, dtype=torch.uint8, device=device)
        spared[: m * spec.SECTOR_BYTES].copy_(overflow, non_blocking=True)  # H2D from pinned memory, this stream
        spared[m * spec.SECTOR_BYTES :].zero_()  # the spare sector: what sectors past k read
        k, modes = format.decode_meta(meta, entry_bytes, n, check=False)
        bad = (k > spe) | (modes != 0)  # such entries decode to zeros (flagged)
        error = _flag(k > spe, ERR_K) | _flag(modes != 0, ERR_MODE)
        k = k.clamp(max=spe)
        starts, total = format.overflow_starts(k, slot)
        error = error | ((total != m).to(torch.int32) * ERR_OVERFLOW)
        raw = (k == spe) & ~bad
        streams, lengths = self._gather(slots, spared, k, raw, starts, slot, entry_bytes, out)
        coded = (k > 0) & (k < spe) & ~bad
        # inconsistent metadata or overflow: where every stream lies is suspect, so none is handed to nvcomp
        consistent = error == 0
        return error | self._decompress(batch, streams, lengths, k, coded, consistent, entry_bytes, out)

    @staticmethod
    def _gather(slots, spared, k, raw, starts, slot, entry_bytes, out):
        """Payloads from slots and overflow, a block at a time: raw and zero entries into ``out``, streams aligned."""
        n, slot_bytes, device = k.numel(), slot * spec.SECTOR_BYTES, out.device
        streams = torch.empty(n, entry_bytes, dtype=torch.uint8, device=device)
        lengths = torch.empty(n, dtype=torch.int64, device=device)
        rows = out.view(n, entry_bytes)
        for a, b in _ranges(n, entry_bytes):
            payload = torch.empty(b - a, entry_bytes, dtype=torch.uint8, device=device)
            payload[:, :slot_bytes] = slots[a * slot_bytes : b * slot_bytes].view(b - a, slot_bytes)
            payload[:, slot_bytes:] = format.gather_overflow(spared, k[a:b], slot, starts[a:b], entry_bytes)
            lengths[a:b] = read_lengths(payload)
            streams[a:b, : entry_bytes - _LENGTH_BYTES] = payload[:, _LENGTH_BYTES:]  # nvcomp wants streams aligned
            streams[a:b, entry_bytes - _LENGTH_BYTES :] = 0
            rows[a:b] = torch.where(raw[a:b].unsqueeze(1), payload, 0)  # coded rows: written by nvcomp next
        return streams, lengths

    def _decompress(self, batch, streams, lengths, k, coded, consistent, entry_bytes, out) -> torch.Tensor:
        """The coded entries decompressed into their rows of ``out`` in one call; the error bit of those that failed.

        A chunk is an entry's stream only where the entry is coded, ``consistent`` (a 0-dim bool: the metadata
        and overflow passed their checks) holds and the stream's length fits its sectors; every other chunk is
        the filler, decoded into that entry's own row of ``streams`` (a row no other chunk reads or writes).
        """
        n, device = k.numel(), out.device
        fits = coded & consistent & (lengths > 0) & (lengths + _LENGTH_BYTES <= k.to(torch.int64) * spec.SECTOR_BYTES)
        filler = self._filler(batch, device, entry_bytes)
        stream_rows = chunk_pointers(streams.data_ptr(), entry_bytes, n, device)
        decoded = torch.zeros(n, dtype=torch.int64, device=device)
        statuses = torch.full((n,), -1, dtype=torch.int32, device=device)
        with self._on(device):
            try:
                batch.decompress(
                    device=device, stream=self._stream(device),
                    in_ptrs=torch.where(fits, stream_rows, filler.stream.data_ptr()),
                    in_bytes=torch.where(fits, lengths, filler.length),
                    out_capacity=torch.full((n,), entry_bytes, dtype=torch.int64, device=device), out_bytes=decoded,
                    out_ptrs=torch.where(fits, chunk_pointers(out.data_ptr(), entry_bytes, n, device), stream_rows),
                    statuses=statuses, chunk_bytes=entry_bytes,
                )  # fmt: skip
            except capi.NvcompError as exc:
                if exc.status != capi.CANNOT_DECOMPRESS:
                    raise
                # the call refused the batch as a whole (Bitcomp parses every chunk first): nothing was decoded,
                # the statuses stay failed
        failed = coded & ~(fits & (statuses == 0) & (decoded == entry_bytes))
        out.view(n, entry_bytes).masked_fill_(failed.unsqueeze(1), 0)
        return _flag(failed, ERR_STREAM)

    def _filler(self, batch, device: torch.device, entry_bytes: int) -> _Filler:
        """The filler of ``batch`` for ``entry_bytes`` on ``device``, made on first use; ordered before this stream."""
        with _FILLERS_LOCK:
            try:
                per_batch = _FILLERS.setdefault(batch, {})
            except TypeError:  # an object that cannot be weakly referenced: a filler for this call alone
                per_batch = {}
            found = per_batch.get((device, entry_bytes))
            if found is None:
                found = per_batch[device, entry_bytes] = self._make_filler(batch, device, entry_bytes)
        if found.ready is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(found.ready)  # on the device: the host does not wait
            if current != found.stream_of:
                found.stream.record_stream(current)
                found.length.record_stream(current)
        return found

    def _make_filler(self, batch, device: torch.device, entry_bytes: int) -> _Filler:
        """nvcomp's stream of one all-zero entry, compressed on this stream (nothing is read back)."""
        zero = torch.zeros(entry_bytes, dtype=torch.uint8, device=device)
        stride = _round_up(max(batch.max_compressed_bytes(entry_bytes), entry_bytes), max(64, batch.alignment()))
        stream = torch.zeros(stride, dtype=torch.uint8, device=device)
        length = torch.zeros(1, dtype=torch.int64, device=device)
        with self._on(device):
            batch.compress(
                device=device, stream=self._stream(device),
                in_ptrs=chunk_pointers(zero.data_ptr(), entry_bytes, 1, device),
                in_bytes=torch.full((1,), entry_bytes, dtype=torch.int64, device=device), chunk_bytes=entry_bytes,
                out_ptrs=chunk_pointers(stream.data_ptr(), stride, 1, device), out_bytes=length,
                statuses=torch.zeros(1, dtype=torch.int32, device=device),
            )  # fmt: skip
            if device.type != "cuda":
                return _Filler(stream, length, None, None)
            stream_of = torch.cuda.current_stream(device)
            ready = torch.cuda.Event()
            ready.record(stream_of)
        return _Filler(stream, length, stream_of, ready)
