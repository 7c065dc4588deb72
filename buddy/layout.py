"""How a tensor's bytes are laid out: in memory order, and cut into entries.

* In memory order (:func:`memory_bytes`, :func:`as_tensor`,
  :func:`dense_strides`): a dense tensor (contiguous, transposed,
  channels-last ...) is read as the flat bytes it occupies and comes back
  with the same strides; anything else is copied to contiguous first.
* In entries (:class:`Layout`): everything the format derives from a
  tensor's size -- the number of entries, the partial last one, the metadata
  bytes, the sectors of an entry, and the bytes of slots, metadata, the
  compacted form and the overflow of a slot choice. A layout is built once,
  where a tensor is measured (:func:`buddy.measure`), validated then, and
  handed to the engines, the kernels, the tracker and the experiments, which
  read these numbers from it instead of deriving them again.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import spec
from .slots import overflow_sectors

__all__ = ["Layout", "LaidOut", "WORD_SIZES", "dense_strides", "memory_bytes", "as_tensor"]

#: word sizes a layout can have (bytes): see :func:`buddy.spec.word_bytes`
WORD_SIZES = (1, 2, 4, 8)


def _whole(what: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{what} must be at least {low}, got {value}")
    return value


@dataclass(frozen=True)
class Layout:
    """A tensor's ``nbytes`` bytes cut into entries of ``entry_bytes``, coded as words of ``word_bytes``.

    Validated when built: ``entry_bytes`` a power of two in
    [:data:`~buddy.spec.MIN_ENTRY_BYTES`, :data:`~buddy.spec.MAX_ENTRY_BYTES`]
    (``ValueError``; ``TypeError`` for a non-int), ``nbytes`` a non-negative
    int, ``word_bytes`` one of :data:`WORD_SIZES` (``ValueError``).
    ``word_bytes`` only matters to what codes the entries; the byte counts
    below do not depend on it (a tracker's layouts leave it at 1).
    """

    entry_bytes: int
    nbytes: int
    word_bytes: int = 1

    def __post_init__(self) -> None:
        spec.check_entry_bytes(self.entry_bytes)
        _whole("nbytes", self.nbytes)
        word = self.word_bytes
        if isinstance(word, bool) or not isinstance(word, int) or word not in WORD_SIZES:
            raise ValueError(f"word_bytes must be 1, 2, 4 or 8, got {self.word_bytes!r}")

    @classmethod
    def of(cls, tensor: torch.Tensor, entry_bytes: int) -> Layout:
        """The layout of ``tensor``'s data (its dtype's word size, :func:`buddy.spec.word_bytes`)."""
        return cls(entry_bytes, tensor.numel() * tensor.element_size(), spec.word_bytes(tensor.dtype))

    # ---- entries ------------------------------------------------------------------
    @property
    def n_entries(self) -> int:
        """Entries, the last one zero-padded: ``ceil(nbytes / E)``."""
        return -(-self.nbytes // self.entry_bytes)

    @property
    def n_full(self) -> int:
        """Whole entries (the last one is partial when :attr:`tail_bytes` is not 0)."""
        return self.nbytes // self.entry_bytes

    @property
    def tail_bytes(self) -> int:
        """Bytes of data in the partial last entry (0: every entry is whole)."""
        return self.nbytes - self.n_full * self.entry_bytes

    @property
    def sectors_per_entry(self) -> int:
        """Sectors of a raw entry: the largest ``k`` and the largest slot."""
        return self.entry_bytes // spec.SECTOR_BYTES

    @property
    def bins(self) -> int:
        """Bins of a size histogram: ``k = 0 .. E/32``."""
        return self.sectors_per_entry + 1

    # ---- metadata ------------------------------------------------------------------
    @property
    def meta_fields(self) -> tuple[int, int, int]:
        """``(bytes, k_bits, mode_bits)`` of one entry's metadata word (:func:`buddy.spec.meta_fields`)."""
        return spec.meta_fields(self.entry_bytes)

    @property
    def entry_meta_bytes(self) -> int:
        """Metadata bytes per entry."""
        return self.meta_fields[0]

    @property
    def meta_bytes(self) -> int:
        """Metadata bytes of the whole tensor."""
        return self.n_entries * self.entry_meta_bytes

    # ---- a slot choice -----------------------------------------------------------------
    def check_slot(self, slot) -> int:
        """``slot`` (sectors per entry) validated: an int in ``[0, E/32]`` (``ValueError`` otherwise)."""
        spe = self.sectors_per_entry
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot <= spe:
            raise ValueError(
                f"slot must be an int in [0, {spe}] sectors for {self.entry_bytes}-byte entries, got {slot!r}"
            )
        return slot

    def slots_bytes(self, slot: int) -> int:
        """Bytes of the slots with ``slot`` sectors per entry."""
        return self.n_entries * slot * spec.SECTOR_BYTES

    def device_bytes(self, slot: int, table_bytes: int = 0) -> int:
        """What the tensor holds on its device with that slot: slots, metadata and a codec table."""
        return self.slots_bytes(slot) + self.meta_bytes + table_bytes

    def ratio(self, slot: int) -> float:
        """Target ratio ``E / (32 s)`` of a slot (``inf`` for the zero slot)."""
        return spec.ratio_for_slot(slot, self.entry_bytes)

    # ---- a size histogram --------------------------------------------------------------
    @staticmethod
    def compacted_bytes(histogram: Sequence[int]) -> int:
        """Bytes of the entries compacted (``sum(k * h[k]) * 32``): the ideal size of the compressed tensor."""
        return sum(map(operator.mul, range(len(histogram)), histogram)) * spec.SECTOR_BYTES

    @staticmethod
    def overflow_bytes(histogram: Sequence[float], slot: int) -> int:
        """Buddy bytes with slots of ``slot`` sectors: every entry's sectors past its slot (whole sectors of a
        predicted, float histogram)."""
        return int(overflow_sectors(histogram, slot)) * spec.SECTOR_BYTES


class LaidOut:
    """A value that holds a :class:`Layout` as ``layout``, its sizes read as the value's own attributes."""

    layout: Layout

    @property
    def entry_bytes(self) -> int:
        return self.layout.entry_bytes

    @property
    def word_bytes(self) -> int:
        return self.layout.word_bytes

    @property
    def n_entries(self) -> int:
        return self.layout.n_entries

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def original_bytes(self) -> int:
        """The tensor's bytes (:attr:`nbytes`), as the tracker names them."""
        return self.layout.nbytes


# ---------------------------------------------------------------------------
# a tensor's bytes in memory order
# ---------------------------------------------------------------------------
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


def memory_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
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


def as_tensor(
    flat: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, stride: Sequence[int] | None
) -> torch.Tensor:
    """Decoded bytes as the tensor: ``dtype`` and ``shape``, laid out in memory order with ``stride`` (or contiguous)."""
    values = flat.view(dtype)
    return values.reshape(shape) if stride is None else values.as_strided(shape, stride)


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
