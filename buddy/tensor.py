"""BuddyTensor: a tensor held as fixed-size slots on its device plus overflow in buddy memory."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import torch

from . import backends, config, integrity, layout, spec
from .codecs import Codec, get_codec
from .errors import CorruptDataError, FreedTensorError, HostStoreFull, UnsupportedTensorError
from .integrity import Checksum
from .slots import DEFAULT_MAX_OVERFLOW, check_max_overflow, overflow_sectors, slot_for_overflow, tightest_slot
from .store import BuddyAllocation, BuddyStore, default_store

__all__ = ["BuddyTensor", "compress", "pack", "unpack", "size_histogram", "CHUNK_BYTES"]

#: entries are processed in chunks of this many input bytes, bounding the
#: temporaries of the reference codecs (a few times the chunk) on any device
CHUNK_BYTES = 8 << 20

_ON_FULL = ("raise", "device")

#: byte alignment of the entries handed to a codec (the widest word a codec views them as, with room)
_ALIGN = 16


def check_tensor(tensor) -> None:
    """Raise a specific error for anything :func:`compress` cannot take."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"buddy.compress expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_nested:
        raise UnsupportedTensorError("nested tensors are not supported; compress each component tensor")
    if tensor.layout != torch.strided:
        raise UnsupportedTensorError(
            f"{tensor.layout} tensors are not supported; call .to_dense() first (or compress the "
            f"index and value tensors separately)"
        )
    if tensor.is_quantized:
        raise UnsupportedTensorError(
            "quantized tensors are not supported; compress tensor.int_repr() and keep the scale/zero point"
        )
    if tensor.device.type == "meta":
        raise UnsupportedTensorError("meta tensors hold no data to compress")
    wrapper = _wrapper_kind(tensor)
    if wrapper is not None:
        raise UnsupportedTensorError(wrapper)
    try:
        spec.word_bytes(tensor.dtype)
    except ValueError as exc:
        raise UnsupportedTensorError(f"dtype {tensor.dtype} is not supported: {exc}") from None


def _wrapper_kind(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s storage is not its data (a vmap batch, a FakeTensor, a wrapper subclass), or ``None``."""
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None and functorch.is_batchedtensor(tensor):
        return (
            "tensors batched by torch.func.vmap are not supported: compress outside vmap, or the whole "
            "batch before vmap"
        )
    try:
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    except ImportError:  # pragma: no cover - older torch: nothing more to detect
        return None
    if is_fake(tensor):
        return "FakeTensors (torch.compile tracing, FakeTensorMode) hold no data to compress"
    if is_traceable_wrapper_subclass(tensor):
        return (
            f"{type(tensor).__name__} is a tensor subclass that wraps other tensors; compress its inner "
            f"tensors, or a plain tensor made from it"
        )
    return None


def _entries(flat: torch.Tensor, start: int, stop: int, entry_bytes: int) -> torch.Tensor:
    """Entries ``[start, stop)`` of a flat byte tensor as ``(n, E)``; pads the last one."""
    lo, hi = start * entry_bytes, stop * entry_bytes
    if hi <= flat.numel():
        entries = flat[lo:hi].view(stop - start, entry_bytes)
        # Codecs view entries as wider words (up to 8 bytes), which needs a storage offset
        # aligned to them; a view such as x[1:] is not: copy the chunk then.
        return entries if entries.storage_offset() % _ALIGN == 0 else entries.clone()
    padded = torch.zeros(hi - lo, dtype=torch.uint8, device=flat.device)
    padded[: flat.numel() - lo] = flat[lo:]
    return padded.view(stop - start, entry_bytes)


def _chunks(n_entries: int, entry_bytes: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // entry_bytes)
    return [(a, min(a + step, n_entries)) for a in range(0, n_entries, step)]


def dense_strides(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a layout covers a contiguous span of memory exactly once (any dimension order).

    Such a tensor (contiguous, transposed, channels-last ...) is compressed in
    memory order and decompressed with the same strides.
    """
    if 0 in shape:
        return True  # no elements, no memory: any strides will do
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(shape, strides) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _memory_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor's values as flat bytes, and the strides to restore them with.

    A dense layout is read in memory order, so decompression gives back the
    same strides -- which matters: kernels may round differently on another
    layout. Anything else (gaps, overlaps) is copied to contiguous first.
    Lazy conjugate/negative views are resolved.
    """
    t = tensor.detach().resolve_conj().resolve_neg()
    if not dense_strides(t.shape, t.stride()):
        t = _contiguous(t)
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8), t.stride()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t``'s elements, bit for bit.

    Copies through a same-size integer view: dtypes without a copy kernel of
    their own (``uint4``, ``int3`` ...) work, and no float copy can touch a NaN.
    """
    as_int = _SAME_SIZE_INT.get(t.element_size())
    if as_int is None or t.dtype == as_int:
        return t.contiguous()  # complex128 (16 bytes) has no integer twin
    return t.view(as_int).contiguous().view(t.dtype)


def _size_pass(flat: torch.Tensor, codec: Codec, word: int, entry_bytes: int) -> list[int]:
    """Histogram of entry sizes: ``h[k]`` entries compress to ``k`` sectors."""
    spe = spec.sectors_per_entry(entry_bytes)
    histogram = torch.zeros(spe + 1, dtype=torch.int64, device=flat.device)
    for a, b in _chunks(-(-flat.numel() // entry_bytes), entry_bytes):
        sizes = codec.sizes(_entries(flat, a, b, entry_bytes), word)
        histogram += torch.bincount(sizes.to(torch.int64), minlength=spe + 1)
    return histogram.tolist()


def size_histogram(
    tensor: torch.Tensor, codec: str | Codec | None = None, *, entry_bytes: int | None = None
) -> list[int]:
    """How compressible ``tensor`` is: ``h[k]`` of its entries compress to ``k`` sectors.

    Runs only the size pass (nothing is stored). ``sum(k * h[k]) * 32`` is the
    compacted size; :func:`buddy.slots.overflow_sectors` gives the overflow
    of any slot. Defaults as in :func:`compress`.
    """
    check_tensor(tensor)
    codec = get_codec(config.defaults().codec if codec is None else codec)
    entry_bytes = spec.check_entry_bytes(config.defaults().entry_bytes if entry_bytes is None else entry_bytes)
    return _size_pass(_memory_bytes(tensor)[0], codec, spec.word_bytes(tensor.dtype), entry_bytes)


def _release(store: BuddyStore, alloc: BuddyAllocation, device_bytes: int, on_free: list) -> None:
    store.release(alloc)
    store._account(-device_bytes, -1)
    for callback in on_free:
        callback()


class BuddyTensor:
    """A compressed tensor: slots and metadata on its device, overflow in buddy memory.

    Made by :func:`compress`; not constructed directly. The original tensor can
    be dropped once this exists. :meth:`decompress` returns a bit-identical
    tensor (same dtype, shape, device and, for dense layouts, strides). :meth:`free` returns the
    slots and the buddy memory at once; a BuddyTensor that is garbage-collected
    frees itself, and ``with compress(t) as bt:`` frees at the end of the block.

    Attributes (bytes unless said otherwise):
        original_bytes: bytes of the tensor's data.
        device_bytes: slots + metadata on the device.
        buddy_bytes: overflow held in buddy memory.
        compressed_bytes: ``sum(k) * 32``, the size if entries were compacted.
        target_ratio: ``E / (32 * slot_sectors)``; ``inf`` for the zero slot.
        codec: codec name.
        backend: ``"reference"`` or ``"cuda"``: what ran the codec at compress
            time (see :mod:`buddy.backends`), and what :meth:`decompress` uses
            unless told otherwise.
        checksum: a :class:`~buddy.integrity.Checksum` -- one 64-bit checksum
            per buffer (metadata, slots, overflow) -- when compressed with
            ``checksum=True``, else ``None``. :meth:`decompress` checks it
            before decoding and :meth:`verify` checks it on demand; a buffer
            changed since compression raises
            :class:`~buddy.errors.CorruptDataError` naming the buffer.
    """

    def __init__(
        self,
        *,
        shape: torch.Size,
        stride: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        codec: Codec,
        entry_bytes: int,
        slot_sectors: int,
        original_bytes: int,
        histogram: Sequence[int],
        slots: torch.Tensor,
        meta: torch.Tensor,
        overflow: BuddyAllocation,
        store: BuddyStore,
        backend: str = "reference",
        checksum: Checksum | None = None,
    ):
        self.shape = torch.Size(shape)
        #: strides the decompressed tensor gets (the original's when it was dense, else contiguous)
        self.stride = tuple(stride)
        self.dtype = dtype
        self.device = device
        self._codec = codec
        self.backend = backend
        self.entry_bytes = entry_bytes
        self.slot_sectors = slot_sectors
        self.original_bytes = original_bytes
        self.n_entries = -(-original_bytes // entry_bytes)
        #: entries per size: ``histogram[k]`` entries compress to ``k`` sectors
        self.histogram = tuple(int(n) for n in histogram)
        self.format_version = spec.FORMAT_VERSION
        #: per-buffer checksums taken at compress time, or ``None`` (see :mod:`buddy.integrity`)
        self.checksum = checksum
        self._slots = slots
        self._meta = meta
        self._overflow = overflow
        self.store = store
        self.device_bytes = slots.numel() + meta.numel()
        self.buddy_bytes = overflow.nbytes
        #: called once when the tensor is freed (owners such as the tracker count held bytes)
        self._on_free: list[Callable[[], None]] = []
        store._account(self.device_bytes, 1)
        self._finalizer = weakref.finalize(self, _release, store, overflow, self.device_bytes, self._on_free)

    # ---- properties -------------------------------------------------------
    @property
    def codec(self) -> str:
        return self._codec.name

    @property
    def target_ratio(self) -> float:
        return spec.ratio_for_slot(self.slot_sectors, self.entry_bytes)

    @property
    def compressed_bytes(self) -> int:
        return sum(k * n for k, n in enumerate(self.histogram)) * spec.SECTOR_BYTES

    @property
    def effective_ratio(self) -> float:
        """original bytes / device bytes (``inf`` when nothing stays on the device)."""
        return self.original_bytes / self.device_bytes if self.device_bytes else math.inf

    @property
    def word_bytes(self) -> int:
        return spec.word_bytes(self.dtype)

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(metadata, slots, overflow)``: the three buffers of the format, exactly sized.

        They are the tensor's own memory, not copies: do not write to them.
        """
        self._check_alive("read the buffers of")
        return self._meta, self._slots, self._overflow.data

    def verify(self) -> None:
        """Check the three buffers against :attr:`checksum` without decoding anything.

        Raises :class:`~buddy.errors.CorruptDataError` naming the buffer(s) whose
        bytes changed since compression, and ``ValueError`` for a tensor
        compressed without a checksum (there is nothing to check it against).
        Costs one read of every buffer (the overflow is read where it lives,
        in host memory).
        """
        self._check_alive("verify")
        if self.checksum is None:
            raise ValueError(
                "this BuddyTensor was compressed without a checksum; pass checksum=True to buddy.compress "
                "(or call buddy.set_defaults(checksum=True)) to be able to verify it"
            )
        self._overflow_ready_on_host()
        integrity.verify(self._meta, self._slots, self._overflow.data, self.checksum)

    def _overflow_ready_on_host(self) -> None:
        # the checksum reads the overflow on the host: its copy there must have landed
        if self._overflow.event is not None:
            self._overflow.event.synchronize()

    # ---- lifecycle ----------------------------------------------------------
    def decompress(self, *, backend: str | None = None) -> torch.Tensor:
        """A new tensor bit-identical to the one compressed (same device; same strides if it was dense).

        ``backend``: see :mod:`buddy.backends`; default: :attr:`backend`, the
        one that compressed it. With a :attr:`checksum`, the buffers are
        checked first: :class:`~buddy.errors.CorruptDataError` if any changed
        (see :meth:`verify`), and nothing is decoded.
        """
        self._check_alive("decompress")
        if self.checksum is not None:
            self._overflow_ready_on_host()
        if self._overflow.event is not None:
            self._overflow.wait()  # the overflow's copy to host may still be in flight
        return unpack(
            self._meta,
            self._slots,
            self._overflow.data,
            codec=self._codec,
            entry_bytes=self.entry_bytes,
            slot_sectors=self.slot_sectors,
            shape=self.shape,
            stride=self.stride,
            dtype=self.dtype,
            backend=self.backend if backend is None else backend,
            checksum=self.checksum,
        )

    def free(self) -> None:
        """Return the slots and buddy memory now. A second call raises."""
        self._check_alive("free")
        self._finalizer()
        self._slots = self._meta = None

    def _check_alive(self, action: str) -> None:
        if self.freed:
            raise FreedTensorError(f"cannot {action} a BuddyTensor that was already freed")

    def __enter__(self) -> BuddyTensor:
        return self

    def __exit__(self, *exc) -> None:
        if not self.freed:
            self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"device_bytes={self.device_bytes:,}, buddy_bytes={self.buddy_bytes:,}"
        return (
            f"BuddyTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
            f"codec={self.codec!r}, entry_bytes={self.entry_bytes}, target_ratio={self.target_ratio:.2f}, "
            f"original_bytes={self.original_bytes:,}, {state})"
        )


def unpack(
    meta: torch.Tensor,
    slots: torch.Tensor,
    overflow: torch.Tensor,
    *,
    codec: str | Codec,
    entry_bytes: int,
    slot_sectors: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    stride: Sequence[int] | None = None,
    backend: str | None = None,
    checksum: Checksum | None = None,
) -> torch.Tensor:
    """Decode the three buffers of the format into a tensor on ``slots``' device.

    The bytes are laid out in memory order with ``stride`` (a dense layout;
    default contiguous). ``meta`` and ``slots`` live on the same device;
    ``overflow`` may live on any device (host buddy memory). All three are
    ``uint8`` tensors (any shape; read in C order).

    Damaged or hostile buffers never crash the process, read or write out of
    bounds or hang: every buffer must be exactly as large as the format says,
    and anything inconsistent raises :class:`~buddy.errors.CorruptDataError`.
    Without a ``checksum``, damage the format cannot see (a changed
    mantissa bit) decodes to a tensor of the right shape and dtype with wrong
    values; with one (a :class:`~buddy.integrity.Checksum`, as
    :attr:`BuddyTensor.checksum`), the buffers are checked before anything is
    decoded. ``backend``: who runs the codec (see :mod:`buddy.backends`;
    default ``"auto"``).
    """
    codec = get_codec(codec)
    spe = spec.sectors_per_entry(entry_bytes)
    if isinstance(slot_sectors, bool) or not isinstance(slot_sectors, int) or not 0 <= slot_sectors <= spe:
        raise ValueError(
            f"slot_sectors must be an int in [0, {spe}] for {entry_bytes}-byte entries, got {slot_sectors!r}"
        )
    shape = _check_shape(shape)
    if stride is not None:
        stride = _check_stride(stride, shape)
    spec.word_bytes(dtype)  # TypeError / ValueError for anything that is not a dtype buddy stores
    element = torch.empty((), dtype=dtype).element_size()
    meta, slots, overflow = (_byte_buffer(n, b) for n, b in (("meta", meta), ("slots", slots), ("overflow", overflow)))
    if meta.device != slots.device:
        raise ValueError(f"meta and slots must be on the same device, got {meta.device} and {slots.device}")
    if checksum is not None:
        integrity.verify(meta, slots, overflow, checksum)  # before anything is decoded
    device = slots.device
    impl = backends.implementation(codec, device, backend)
    nbytes = math.prod(shape) * element
    n_entries = -(-nbytes // entry_bytes)
    k_all, modes_all = layout.decode_meta(meta, entry_bytes, n_entries)
    slot_bytes = slot_sectors * spec.SECTOR_BYTES
    if slots.numel() != n_entries * slot_bytes:
        raise CorruptDataError(f"slots hold {slots.numel()} bytes, expected {n_entries * slot_bytes}")
    chunks = _chunks(n_entries, entry_bytes)
    # Where each chunk's overflow starts, in one host transfer.
    spill = torch.clamp(k_all - slot_sectors, min=0).to(torch.int64)
    ends = torch.cumsum(spill, 0)[[b - 1 for _, b in chunks]].tolist() if chunks else []
    if (ends[-1] if ends else 0) * spec.SECTOR_BYTES != overflow.numel():
        raise CorruptDataError(
            f"overflow holds {overflow.numel()} bytes but the metadata needs "
            f"{(ends[-1] if ends else 0) * spec.SECTOR_BYTES}"
        )
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    word = spec.word_bytes(dtype)
    start_sector = 0
    for (a, b), end_sector in zip(chunks, ends):
        ov = overflow[start_sector * spec.SECTOR_BYTES : end_sector * spec.SECTOR_BYTES]
        ov = ov.to(device, non_blocking=True)  # H2D from pinned memory, ordered on the current stream
        try:
            payload = layout.join_payload(
                slots[a * slot_bytes : b * slot_bytes], ov, k_all[a:b], slot_sectors, entry_bytes
            )
            entries = impl.decode(payload, k_all[a:b], modes_all[a:b], word)
        except torch.cuda.OutOfMemoryError:  # a RuntimeError, but not the data's fault
            raise
        except (IndexError, RuntimeError) as exc:
            # The sizes agreed, so the codec met bytes it never writes. Codecs validate what
            # they read; this is the net under them, so hostile bytes stay a CorruptDataError.
            raise CorruptDataError(
                f"codec {codec.name!r} could not decode entries {a}..{b - 1}: the buffers are damaged or "
                f"were not written by this codec ({type(exc).__name__}: {exc})"
            ) from exc
        lo = a * entry_bytes
        hi = min(b * entry_bytes, nbytes)
        out[lo:hi] = entries.view(-1)[: hi - lo]
        start_sector = end_sector
    values = out.view(dtype)
    if stride is None:
        return values.reshape(shape)
    return values.as_strided(shape, stride)


def _byte_buffer(name: str, buffer) -> torch.Tensor:
    """A buffer given to :func:`unpack`, checked and flattened."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of uint8 bytes, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8:
        raise CorruptDataError(f"{name} must be a buffer of uint8 bytes, got a tensor of {buffer.dtype}")
    if buffer.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it holds no bytes to decode")
    return buffer.reshape(-1)


def _check_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints (``TypeError``/``ValueError`` otherwise)."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape must be a sequence of ints (a torch.Size), got {type(shape).__name__}")
    if any(isinstance(n, bool) or not isinstance(n, int) for n in shape):
        raise TypeError(f"shape must hold ints, got {tuple(shape)!r}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape must not have negative sizes, got {tuple(shape)}")
    return tuple(shape)


def _check_stride(stride, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``stride`` as a tuple of ints forming a dense layout of ``shape`` (``ValueError`` otherwise)."""
    if isinstance(stride, (str, bytes)) or not isinstance(stride, Sequence):
        raise TypeError(f"stride must be a sequence of ints, got {type(stride).__name__}")
    stride = tuple(stride)
    if len(stride) != len(shape) or any(isinstance(n, bool) or not isinstance(n, int) for n in stride):
        raise ValueError(f"stride {stride!r} does not fit shape {shape}: one int per dimension")
    if not dense_strides(shape, stride):
        raise ValueError(f"stride {stride} is not a dense layout of shape {shape}")
    return stride


def compress(
    tensor: torch.Tensor,
    target_ratio: float | None = None,
    codec: str | Codec | None = None,
    *,
    entry_bytes: int | None = None,
    max_overflow: float = DEFAULT_MAX_OVERFLOW,
    store: BuddyStore | None = None,
    on_full: str = "raise",
    backend: str | None = None,
    checksum: bool | None = None,
) -> BuddyTensor:
    """Compress ``tensor`` into slots on its device and overflow in buddy memory.

    Args:
        tensor: any dense (strided) tensor on any device; non-contiguous
            tensors are copied to contiguous first. Its data is not modified
            and the caller may drop it afterwards. A tensor that requires
            grad is compressed as its detached data: the BuddyTensor keeps
            no autograd history and :meth:`BuddyTensor.decompress` returns a
            tensor with ``requires_grad=False`` (to compress what autograd
            saves for backward, use :func:`buddy.compressed_activations`).
            Sparse, quantized, nested, meta, fake and vmap-batched tensors
            raise :class:`~buddy.errors.UnsupportedTensorError`; anything
            that is not a tensor, ``TypeError``.
        target_ratio: ``E / slot bytes``, ``E / (32 s)`` for a slot of ``s``
            sectors: for E = 512 one of 16/16 ... 16/1 and ``inf`` (other
            values round to the nearest slot within 1 %, else to the larger
            slot). Default ``None``: the most aggressive slot
            whose overflow stays within ``max_overflow`` of the tensor's bytes,
            read from this tensor's own size pass.
        codec: codec name or instance (default ``"auto"``, or what
            :func:`buddy.set_defaults` set; see :func:`buddy.available_codecs`).
        entry_bytes: entry size ``E``, a power of two in [32, 65536]
            (default 512, or what :func:`buddy.set_defaults` set).
        max_overflow: see ``target_ratio``; a number in [0, 1], checked even
            when ``target_ratio`` is given (and then unused).
        store: where overflow goes (default :func:`buddy.default_store`).
        on_full: when the store cannot take the overflow: ``"raise"``
            :class:`~buddy.errors.HostStoreFull` (default), or ``"device"``:
            use the smallest slot with no overflow, so the tensor stays
            whole on the device.
        backend: who runs the codec: ``"reference"`` (torch ops),
            ``"cuda"`` (the codec's CUDA kernels; off by default) or
            ``"auto"``/``None`` (the process default); see :mod:`buddy.backends`.
        checksum: ``True`` to store a 64-bit checksum of each buffer in
            :attr:`BuddyTensor.checksum`, checked by
            :meth:`BuddyTensor.decompress` before decoding (damage raises
            :class:`~buddy.errors.CorruptDataError`); ``None`` (default):
            the process default, off unless
            ``buddy.set_defaults(checksum=True)``. Costs one more read of the
            buffers at compress and at decompress, and a device-to-host sync
            (see :mod:`buddy.integrity`).

    Every argument is checked before anything is allocated: wrong types raise
    ``TypeError``, wrong values ``ValueError``, each saying what is accepted.

    Returns:
        A :class:`BuddyTensor`. The size pass needs one device-to-host sync.
    """
    check_tensor(tensor)
    if target_ratio is None:
        choose = None
    else:
        e = spec.check_entry_bytes(config.defaults().entry_bytes if entry_bytes is None else entry_bytes)
        slot = spec.slot_for_ratio(target_ratio, e)
        choose = lambda hist: slot  # noqa: E731 - a fixed choice
    return pack(
        tensor,
        codec=codec,
        entry_bytes=entry_bytes,
        choose_slot=choose,
        max_overflow=max_overflow,
        store=store,
        on_full=on_full,
        backend=backend,
        checksum=checksum,
    )


def pack(
    tensor: torch.Tensor,
    *,
    codec: str | Codec | None = None,
    entry_bytes: int | None = None,
    choose_slot: Callable[[Sequence[int]], int] | None = None,
    max_overflow: float = DEFAULT_MAX_OVERFLOW,
    store: BuddyStore | None = None,
    on_full: str = "raise",
    backend: str | None = None,
    checksum: bool | None = None,
) -> BuddyTensor:
    """The compress pipeline with the slot choice as a callback.

    ``choose_slot(histogram) -> slot_sectors`` sees this tensor's entry-size
    histogram after the size pass (the seam the tracker plugs into); ``None``
    picks by ``max_overflow``. The other arguments are those of
    :func:`compress`.
    """
    check_tensor(tensor)
    codec = get_codec(config.defaults().codec if codec is None else codec)
    entry_bytes = spec.check_entry_bytes(config.defaults().entry_bytes if entry_bytes is None else entry_bytes)
    impl = backends.implementation(codec, tensor.device, backend)
    if not isinstance(on_full, str) or on_full not in _ON_FULL:
        raise ValueError(f"on_full must be one of {_ON_FULL}, got {on_full!r}")
    max_overflow = check_max_overflow(max_overflow)
    if choose_slot is not None and not callable(choose_slot):
        raise TypeError(
            f"choose_slot must be a function histogram -> slot sectors (or None), got {type(choose_slot).__name__}"
        )
    if store is not None and not isinstance(store, BuddyStore):
        raise TypeError(f"store must be a buddy.BuddyStore (or None for the default), got {type(store).__name__}")
    checksum = config.defaults().checksum if checksum is None else config.check_checksum(checksum)
    store = store if store is not None else default_store()
    spe = spec.sectors_per_entry(entry_bytes)
    word = spec.word_bytes(tensor.dtype)

    flat, strides = _memory_bytes(tensor)
    nbytes = flat.numel()
    n_entries = -(-nbytes // entry_bytes)
    chunks = _chunks(n_entries, entry_bytes)

    # 1. size pass (a single chunk is encoded right away and kept)
    encoded = None
    if len(chunks) == 1:
        encoded = impl.encode(_entries(flat, 0, n_entries, entry_bytes), word)
        histogram = torch.bincount(encoded.sectors.to(torch.int64), minlength=spe + 1).tolist()
    else:
        histogram = _size_pass(flat, impl, word, entry_bytes)

    # 2. the slot
    if choose_slot is None:
        slot = slot_for_overflow(histogram, max_overflow, nbytes)
    else:
        slot = choose_slot(histogram)
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot <= spe:
            raise ValueError(f"slot choice must be an int in [0, {spe}], got {slot!r}")

    # 3. buddy memory for the overflow, before anything is written
    try:
        overflow = store.allocate(overflow_sectors(histogram, slot) * spec.SECTOR_BYTES)
    except HostStoreFull:
        if on_full == "raise":
            raise
        slot = tightest_slot(histogram)
        overflow = store.allocate(0)

    # 4. pack pass
    try:
        slot_bytes = slot * spec.SECTOR_BYTES
        mb = spec.meta_bytes(entry_bytes)
        slots = torch.empty(n_entries * slot_bytes, dtype=torch.uint8, device=tensor.device)
        meta = torch.empty(n_entries * mb, dtype=torch.uint8, device=tensor.device)
        overflow_sum = integrity.Accumulator() if checksum else None
        written = 0
        for a, b in chunks:
            chunk = encoded if encoded is not None else impl.encode(_entries(flat, a, b, entry_bytes), word)
            slot_part, ov = layout.split_payload(chunk.payload, chunk.sectors, slot, entry_bytes)
            slots[a * slot_bytes : b * slot_bytes].view(b - a, slot_bytes).copy_(slot_part)
            meta[a * mb : b * mb] = layout.encode_meta(chunk.sectors, chunk.modes, entry_bytes)
            if written + ov.numel() > overflow.nbytes:
                raise RuntimeError(f"codec {codec.name!r}: encode() disagrees with sizes()")
            # D2H into pinned memory; ordered on the current stream, see record() below
            overflow.data[written : written + ov.numel()].copy_(ov.view(-1), non_blocking=True)
            if overflow_sum is not None:
                overflow_sum.add(ov)  # summed on the device, before its copy to the host lands
            written += ov.numel()
        if written != overflow.nbytes:
            raise RuntimeError(f"codec {codec.name!r}: encode() disagrees with sizes()")
        if tensor.is_cuda:
            overflow.record()  # the store must not reuse the range before the copy lands
        sums = None
        if overflow_sum is not None:
            sums = Checksum(integrity.buffer_checksum(meta), integrity.buffer_checksum(slots), overflow_sum.value())
        # built inside the try: an interrupt as the tensor counts itself in must not strand its overflow
        return BuddyTensor(
            shape=tensor.shape,
            stride=strides,
            dtype=tensor.dtype,
            device=tensor.device,
            codec=codec,
            entry_bytes=entry_bytes,
            slot_sectors=slot,
            original_bytes=nbytes,
            histogram=histogram,
            slots=slots,
            meta=meta,
            overflow=overflow,
            store=store,
            backend=backends.backend_name(impl),
            checksum=sums,
        )
    except BaseException:
        store.release(overflow)  # nothing half-written survives, KeyboardInterrupt included
        raise
