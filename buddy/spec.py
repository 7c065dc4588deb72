"""The Buddy format, defined once.

Every constant and field width of the compressed format lives here. The
reference codecs, the layout code, the C header ``csrc/buddy_format.h`` (which
receives these values as ``-D`` defines and ``static_assert``s its own derived
widths against them) and the tests all read this module; nothing restates a
number by hand.

Layout of one compressed tensor, format version 1
-------------------------------------------------

A tensor's raw bytes (``nbytes``, C order) are cut into ``N = ceil(nbytes / E)``
**entries** of ``E`` bytes; the last entry is zero-padded. ``E`` is a power of
two between :data:`MIN_ENTRY_BYTES` and :data:`MAX_ENTRY_BYTES`.

Each entry is encoded by a codec into a **payload** of ``k`` **sectors**
(``SECTOR_BYTES`` = 32 B each), ``0 <= k <= E / 32``:

* ``k == 0``       -- the entry is all zero bytes; no payload.
* ``k == E / 32``  -- the entry is stored raw (incompressible escape); the
  payload is the entry itself.
* otherwise        -- the codec's encoding, zero-padded to ``k * 32`` bytes.

Device side (GPU memory, or host memory for a CPU tensor):

* **slots**: ``N * s * 32`` bytes. Entry ``i``'s slot starts at byte
  ``i * s * 32`` and holds the first ``min(k_i, s)`` sectors of its payload;
  the rest of the slot is unspecified padding (written as zeros).
* **metadata**: ``N * META_BYTES(E)`` bytes, one little-endian word per entry::

      E <= 256  (1 byte):  bits 0-3  k      bits 4-7   mode
      E >= 512  (2 bytes): bits 0-11 k      bits 12-15 mode

  ``mode`` is codec-specific (0 for ``raw`` and ``zvc``); a codec rejects
  modes it does not define.

Buddy side (host memory, pinned when CUDA is present):

* **overflow**: the ``max(k_i - s, 0)`` sectors of every entry that do not fit
  its slot, compacted in entry order: entry ``i``'s overflow starts at sector
  ``sum_{j < i} max(k_j - s, 0)``. Its size is exactly what is reported as the
  tensor's buddy bytes.

Format version 2: codec tables
------------------------------
Version 2 adds one buffer: a codec may fit a **table** to the tensor
(``fpe``'s prefix code for signs and exponents; ``auto2``, which has ``fpe``
among its members). The table is the tensor's fourth buffer, on its device
beside the metadata (a few hundred bytes); its layout is the codec's
(:mod:`buddy.codecs.fpe`), and a tensor decodes with nothing but its four
buffers. Everything above is unchanged: tensors of the codecs without a
table (``zvc``, ``fpx``, ``bpc``, ``auto``, ``raw``, nvcomp's) are version 1
tensors, byte for byte, and decode as before.

Format version 3: lane-parallel codes
-------------------------------------
Version 3 changes one codec layout: ``fpe`` (and ``auto2``'s ``fpe`` mode)
with a table of format 3 puts an entry's codes first and its mantissa tails
at the payload's end (the **split layout**, :mod:`buddy.codecs.fpe`), so a
GPU warp decodes an entry with all 32 lanes. Its ``k`` is exactly version
2's: the same bits, placed differently. Everything else is version 2's; a
tensor whose ``fpe`` table is of format 1 or 2 is a version 2 tensor and
decodes as before, and tensors of the codecs without a table are version 1
tensors.

Integrity (optional)
--------------------
With ``checksum=True`` a tensor also carries one 64-bit checksum per buffer,
defined in :mod:`buddy.integrity`. It is kept beside the buffers (in the
:class:`~buddy.BuddyTensor`), not inside them, so the layout above is the same
with or without it.

Word size
---------
Codecs that look at words (``zvc``) use :func:`word_bytes` of the dtype:
1 byte for bool/int8/uint8/float8, 2 for 16-bit types, 4 for 32-bit types,
8 for 64-bit types; a complex number is two words of half its size.

Target ratios
-------------
A tensor's slot is ``s`` sectors, the same for every entry;
``target_ratio = E / (32 * s)``, ``inf`` when ``s == 0``. With E = 128 the
targets are 1x (s=4), 1.33x (s=3), 2x (s=2), 4x (s=1) and "zero" (s=0).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FORMAT_VERSION",
    "SECTOR_BYTES",
    "DEFAULT_ENTRY_BYTES",
    "MIN_ENTRY_BYTES",
    "MAX_ENTRY_BYTES",
    "check_entry_bytes",
    "sectors_per_entry",
    "meta_bytes",
    "meta_fields",
    "slot_for_ratio",
    "ratio_for_slot",
    "word_bytes",
    "AUTO_MODES",
    "c_defines",
]

#: the newest format version buddy reads and writes (a tensor is version 1 unless its codec carries a table;
#: version 3 when that table is of the split layout)
FORMAT_VERSION = 3
SECTOR_BYTES = 32
DEFAULT_ENTRY_BYTES = 4096
MIN_ENTRY_BYTES = 32
MAX_ENTRY_BYTES = 65536

# Metadata words: (bytes per entry, bits of k, bits of mode), by entry size.
_META_SMALL = (1, 4, 4)  # E <= 256: k <= 8 fits 4 bits
_META_LARGE = (2, 12, 4)  # E <= 65536: k <= 2048 fits 12 bits
_META_SMALL_MAX_ENTRY = 256


def check_entry_bytes(entry_bytes: int) -> int:
    """Validate an entry size (bytes) and return it as an int."""
    if isinstance(entry_bytes, bool) or not isinstance(entry_bytes, int):
        raise TypeError(f"entry_bytes must be an int, got {type(entry_bytes).__name__}")
    if not (MIN_ENTRY_BYTES <= entry_bytes <= MAX_ENTRY_BYTES) or entry_bytes & (entry_bytes - 1):
        raise ValueError(
            f"entry_bytes must be a power of two between {MIN_ENTRY_BYTES} and "
            f"{MAX_ENTRY_BYTES} bytes, got {entry_bytes}"
        )
    return entry_bytes


def sectors_per_entry(entry_bytes: int) -> int:
    """Sectors in one raw entry: the largest ``k`` and the largest slot."""
    return check_entry_bytes(entry_bytes) // SECTOR_BYTES


def meta_fields(entry_bytes: int) -> tuple[int, int, int]:
    """``(bytes, k_bits, mode_bits)`` of one metadata word for this entry size."""
    check_entry_bytes(entry_bytes)
    return _META_SMALL if entry_bytes <= _META_SMALL_MAX_ENTRY else _META_LARGE


def meta_bytes(entry_bytes: int) -> int:
    """Bytes of metadata per entry."""
    return meta_fields(entry_bytes)[0]


def slot_for_ratio(target_ratio: float, entry_bytes: int) -> int:
    """Slot size in sectors for a target compression ratio.

    ``inf`` gives the zero slot. A ratio the sector grid cannot give exactly
    takes the nearest slot when that slot is within 1 % of the exact one (so
    ``1.33`` means 4/3 at E = 128; the ratio used is then within about 1 % of
    the one asked for, above or below), otherwise the next larger slot, whose
    ratio is lower than the one asked for (3.0 at E = 4096: 43 sectors,
    2.977x). A finite ratio never gives the zero slot.
    """
    if isinstance(target_ratio, bool) or not isinstance(target_ratio, (int, float)):
        raise TypeError(f"target_ratio must be a number, got {type(target_ratio).__name__}")
    if not target_ratio >= 1.0:  # NaN fails the comparison too; no float() of a huge int
        raise ValueError(f"target_ratio must be >= 1 (1 = stored raw, inf = zero slot), got {target_ratio}")
    if target_ratio == math.inf:
        return 0
    exact = entry_bytes / (SECTOR_BYTES * target_ratio)
    nearest = round(exact)
    if nearest >= 1 and abs(exact - nearest) <= 0.01 * exact:
        return int(nearest)
    # a finite ratio never gives the zero slot, however large (only inf does)
    return max(1, int(math.ceil(exact)))


def ratio_for_slot(slot_sectors: int, entry_bytes: int) -> float:
    """Target ratio ``E / (32 * s)`` of a slot; ``inf`` for the zero slot."""
    return math.inf if slot_sectors == 0 else entry_bytes / (SECTOR_BYTES * slot_sectors)


#: metadata modes of the ``auto`` codecs: the escapes, then one per member codec (``fpe`` in ``auto2`` only)
AUTO_MODES = {"zero": 0, "raw": 1, "zvc": 2, "fpx": 3, "bpc": 4, "fpe": 5}

_COMPLEX_WORD = {torch.complex32: 2, torch.complex64: 4, torch.complex128: 8}
_QUANTIZED = frozenset(
    getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, name)
)


def word_bytes(dtype: torch.dtype) -> int:
    """Word size (bytes) that word-oriented codecs use for this dtype.

    Every dtype PyTorch stores densely has one -- floats (float8 and float4
    included), ints of every width (the sub-byte ``int1``..``uint7`` take a
    byte each), bool, complex and the ``bits*`` types -- except the quantized
    dtypes, whose values mean nothing without their scale and zero point:
    ``ValueError`` for those, ``TypeError`` for anything that is not a dtype.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if dtype in _QUANTIZED:
        raise ValueError(f"{dtype} is a quantized dtype; compress tensor.int_repr() and keep the scale and zero point")
    size = _WORD_BYTES.get(dtype)
    if size is not None:
        return size
    if dtype in _COMPLEX_WORD:
        return _COMPLEX_WORD[dtype]
    size = torch.empty((), dtype=dtype).element_size()
    if size not in (1, 2, 4, 8):
        raise ValueError(f"no word size for dtype {dtype} ({size}-byte elements)")
    _WORD_BYTES[dtype] = size
    return size


_WORD_BYTES: dict[torch.dtype, int] = {}  # word_bytes of the dtypes seen (asked at every compress)


def c_defines(entry_bytes: int = DEFAULT_ENTRY_BYTES) -> dict[str, int]:
    """The constants the CUDA/C sources receive as ``-D`` defines."""
    mb, k_bits, mode_bits = meta_fields(entry_bytes)
    return {
        "BUDDY_FORMAT_VERSION": FORMAT_VERSION,
        "BUDDY_SECTOR_BYTES": SECTOR_BYTES,
        "BUDDY_ENTRY_BYTES": entry_bytes,
        "BUDDY_META_BYTES": mb,
        "BUDDY_META_K_BITS": k_bits,
        "BUDDY_META_MODE_BITS": mode_bits,
        **{f"BUDDY_AUTO_MODE_{name.upper()}": mode for name, mode in AUTO_MODES.items()},
    }
