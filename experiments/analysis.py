"""The numbers the experiments report, each computed in exactly one place.

Everything here works on tensors captured from real training steps
(:func:`experiments.workloads.capture`) and on their entry-size histograms
(:func:`buddy.size_histogram`), so a policy can be evaluated on the same
bytes without re-running the model.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

import buddy
from buddy import spec
from buddy.deps import available, require
from buddy.format import decode_meta
from buddy.layout import Layout, memory_bytes
from buddy.slots import slot_for_overflow

__all__ = [
    "entry_sectors",
    "histogram",
    "REGION_BYTES",
    "region_histograms",
    "Placed",
    "place_per_tensor",
    "place_per_region",
    "tensor_bytes",
    "data_bytes",
    "byte_entropy_bits",
    "order0_bits",
    "FLOAT_FIELDS",
    "field_entropy_bits",
    "entry_zstd_histogram",
    "compacted_bytes",
    "general_purpose_sizes",
    "Outcome",
    "simulate_policy",
    "default_policies",
]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's data."""
    return t.numel() * t.element_size()


# ---- entry sizes, measured once per tensor, codec and entry size --------------------------------
_SECTORS: dict[tuple[int, str, int], tuple[weakref.ref, torch.Tensor]] = {}


def _forget_sectors(key: tuple[int, str, int], _: object) -> None:
    """Drop a cached tensor's sizes once the tensor is gone (a weakref callback)."""
    _SECTORS.pop(key, None)


def entry_sectors(t: torch.Tensor, codec: str, entry_bytes: int) -> torch.Tensor:
    """Every entry's compressed size in sectors (``k``, int32, on the CPU), as ``buddy.measure`` finds it.

    Read from the metadata ``buddy.measure`` writes (its layout is
    documented in :mod:`buddy.spec`). Remembered while ``t`` lives, so the
    experiments size a captured tensor once per codec and entry size however
    many tables they draw from it; captured tensors are never modified, which
    this relies on.
    """
    key = (id(t), codec, entry_bytes)
    hit = _SECTORS.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    measured = buddy.measure(t, codec, entry_bytes=entry_bytes)
    k, _ = decode_meta(measured.measurement.meta, entry_bytes, measured.n_entries, check=False)
    k = k.cpu()
    _SECTORS[key] = (weakref.ref(t, functools.partial(_forget_sectors, key)), k)
    return k


def histogram(t: torch.Tensor, codec: str, entry_bytes: int) -> list[int]:
    """``h[k]``: entries of ``t`` that compress to ``k`` sectors (what :func:`buddy.size_histogram` returns)."""
    k = entry_sectors(t, codec, entry_bytes)
    return torch.bincount(k.to(torch.int64), minlength=Layout.of(t, entry_bytes).bins).tolist()


# ---- one slot per tensor against one slot per region -----------------------------------------------
#: bytes of a tensor that share one slot size in the per-region variant
REGION_BYTES = 64 << 10
#: device bytes of the region table: one slot size per region
REGION_TABLE_BYTES = 1


def region_histograms(sectors: torch.Tensor, entry_bytes: int, region_bytes: int = REGION_BYTES) -> torch.Tensor:
    """``(regions, E/32 + 1)`` int64: the entry-size histogram of every ``region_bytes`` piece of a tensor.

    ``sectors`` are the tensor's per-entry sizes (:func:`entry_sectors`), in
    memory order; the last region holds what is left.
    """
    if region_bytes % entry_bytes:
        raise ValueError(f"region_bytes ({region_bytes}) must be a multiple of entry_bytes ({entry_bytes})")
    per = region_bytes // entry_bytes
    bins = spec.sectors_per_entry(entry_bytes) + 1
    region = torch.arange(sectors.numel()) // per
    n_regions = -(-sectors.numel() // per)
    flat = torch.bincount(region * bins + sectors.to(torch.int64), minlength=n_regions * bins)
    return flat.view(n_regions, bins)


@dataclass(frozen=True)
class Placed:
    """Where a tensor's bytes go under one slot choice (bytes)."""

    original_bytes: int
    device_bytes: int  # slots + metadata (+ the region table), or the original bytes when kept as it is
    buddy_bytes: int


def place_per_tensor(sectors: torch.Tensor, nbytes: int, entry_bytes: int, max_overflow: float) -> Placed:
    """One slot for the whole tensor: ``BuddyThreshold(max_overflow)`` on its own histogram."""
    layout = Layout(entry_bytes, nbytes)
    hist = torch.bincount(sectors.to(torch.int64), minlength=layout.bins).tolist()
    slot = slot_for_overflow(hist, max_overflow, nbytes)
    buddy_bytes = layout.overflow_bytes(hist, slot)
    if slot == layout.sectors_per_entry:
        return Placed(nbytes, nbytes, buddy_bytes)  # kept as it is
    return Placed(nbytes, layout.device_bytes(slot), buddy_bytes)


def _tail_counts(hists: torch.Tensor) -> torch.Tensor:
    """``tail[r, s]``: entries of region ``r`` larger than ``s`` sectors, for ``s = 0 .. E/32 - 1``."""
    return hists.flip(1).cumsum(1).flip(1)[:, 1:]


def place_per_region(
    sectors: torch.Tensor,
    nbytes: int,
    entry_bytes: int,
    max_overflow: float | None = None,
    region_bytes: int = REGION_BYTES,
    *,
    budget_bytes: int | None = None,
) -> Placed:
    """One slot per ``region_bytes`` region of a tensor; give ``max_overflow`` or ``budget_bytes``.

    ``max_overflow``: each region's slot is ``BuddyThreshold(max_overflow)``
    on the region's own histogram (each region's overflow within that
    fraction of its bytes). ``budget_bytes``: the regions share one overflow
    budget -- the slots with the fewest device bytes whose overflow together
    stays within ``budget_bytes`` (pass what one slot per tensor spilled to
    compare the two at the same traffic). They are found greedily: a step up
    of a region's slot saves ``tail / entries`` overflow sectors per device
    sector (``tail``: its entries larger than the slot), which only falls as
    the slot grows, so taking steps best first is optimal up to the last one.

    Device bytes are the regions' slots, every entry's metadata and
    :data:`REGION_TABLE_BYTES` per region; a tensor whose regions all take
    the raw slot is kept as it is, as with one slot per tensor.
    """
    if (max_overflow is None) == (budget_bytes is None):
        raise ValueError("give exactly one of max_overflow and budget_bytes")
    hists = region_histograms(sectors, entry_bytes, region_bytes).double()
    layout = Layout(entry_bytes, nbytes)
    spe = layout.sectors_per_entry
    entries = hists.sum(1)
    tail = _tail_counts(hists)  # overflow saved by the step from slot s to s + 1, in sectors
    if budget_bytes is not None:
        limit = budget_bytes / spec.SECTOR_BYTES
        order = torch.sort(-(tail / entries[:, None]).flatten(), stable=True).indices
        left = float(tail.sum()) - torch.cumsum(tail.flatten()[order], 0)  # overflow after each step
        fits = (left <= limit + 1e-9).nonzero()
        taken = order[: int(fits[0]) + 1] if float(tail.sum()) > limit else order[:0]
        slots = torch.bincount(taken // spe, minlength=len(entries)).double()
    else:
        assert max_overflow is not None  # exactly one of the two was given
        region_size = torch.full_like(entries, float(region_bytes))
        region_size[-1] = nbytes - region_bytes * (len(entries) - 1)
        # overflow with slot s = sum of the steps above it
        overflow = torch.cat([tail.flip(1).cumsum(1).flip(1), torch.zeros_like(entries)[:, None]], 1)
        fits = overflow * spec.SECTOR_BYTES <= max_overflow * region_size[:, None]
        slots = fits.double().argmax(1).double()  # the smallest slot that fits (the raw slot always does)
    steps = torch.arange(spe, dtype=torch.float64)
    buddy_bytes = int(round(float((tail * (steps[None, :] >= slots[:, None])).sum()))) * spec.SECTOR_BYTES
    if bool((slots == spe).all()):
        return Placed(nbytes, nbytes, buddy_bytes)
    slot_bytes = int(round(float((entries * slots).sum()))) * spec.SECTOR_BYTES
    device = slot_bytes + layout.meta_bytes + len(entries) * REGION_TABLE_BYTES
    return Placed(nbytes, device, buddy_bytes)


def data_bytes(t: torch.Tensor, device="cpu") -> torch.Tensor:
    """The bytes buddy compresses of ``t``, as a flat ``uint8`` tensor on ``device``.

    A dense layout (contiguous, transposed, channels-last ...) is read in
    memory order, as :func:`buddy.compress` reads it; anything else in C
    order. The baselines compress these very bytes, so every method sees the
    same input.
    """
    return memory_bytes(t)[0].to(device)


def byte_entropy_bits(t: torch.Tensor) -> float:
    """Order-0 entropy of the tensor's bytes, in bits per byte (0..8).

    ``8 / H`` is the ratio an ideal coder of independent bytes would reach:
    the "byte-entropy bound" the experiments print next to the codecs.
    """
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() == 0:
        return 0.0
    p = torch.bincount(data.to(torch.int64), minlength=256).double() / data.numel()
    p = p[p > 0]
    return float(-(p * torch.log2(p)).sum())


def order0_bits(symbols: torch.Tensor, n_symbols: int) -> float:
    """Total order-0 entropy, in bits, of a flat tensor of symbols in ``[0, n_symbols)``."""
    if symbols.numel() == 0:
        return 0.0
    counts = torch.bincount(symbols.reshape(-1).to(torch.int64), minlength=n_symbols).double()
    p = counts[counts > 0] / symbols.numel()
    return float(-(p * torch.log2(p)).sum()) * symbols.numel()


#: (exponent bits, mantissa bits) of the float dtypes the field bound splits
FLOAT_FIELDS = {
    torch.float16: (5, 10),
    torch.bfloat16: (8, 7),
    torch.float32: (8, 23),
    torch.float64: (11, 52),
}


def field_entropy_bits(t: torch.Tensor) -> float:
    """Order-0 entropy of a float tensor's fields, in bits per value.

    Sign and exponent are one symbol (their joint order-0 entropy); the
    mantissa is cut into pieces of at most 16 bits from the top, each coded
    on its own. ``bits / H`` is the ratio of an ideal coder that codes every
    value alone with fixed tables per field: the "field-entropy bound" for
    float-aware, entry-local codecs like ``fpx``. It is not a bound for
    coders that exploit repetition across values (LZ matches, as zstd does).
    Integer and bool tensors fall back to the byte bound (per value).
    """
    t = t.detach().contiguous().reshape(-1)
    if t.dtype not in FLOAT_FIELDS:
        return byte_entropy_bits(t) * t.element_size()
    if t.numel() == 0:
        return 0.0
    exp_bits, man_bits = FLOAT_FIELDS[t.dtype]
    word = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    w = t.view(word).to(torch.int64)
    total = order0_bits((w >> man_bits) & ((1 << (exp_bits + 1)) - 1), 1 << (exp_bits + 1))
    top = man_bits
    while top > 0:
        width = min(16, top)
        total += order0_bits((w >> (top - width)) & ((1 << width) - 1), 1 << width)
        top -= width
    return total / t.numel()


def entry_zstd_histogram(t: torch.Tensor, entry_bytes: int, level: int = 3) -> list[int]:
    """Sector histogram of zstd run on every ``entry_bytes`` entry alone, in buddy's slot format.

    What a general-purpose coder reaches with the random access a slot
    format needs: each entry is a magicless zstd frame (no checksum, no
    content size), rounded up to 32-byte sectors; an all-zero entry takes 0
    sectors and one that does not shrink is stored raw, as buddy's codecs do.
    """
    zstd = require("zstandard", "the per-entry zstd baseline")
    params = zstd.ZstdCompressionParameters.from_level(
        level, format=zstd.FORMAT_ZSTD1_MAGICLESS, write_checksum=False, write_content_size=False, write_dict_id=False
    )
    cctx = zstd.ZstdCompressor(compression_params=params)
    data, layout = data_bytes(t), Layout.of(t, entry_bytes)
    if layout.tail_bytes:  # the partial last entry, zero-padded
        data = torch.cat([data, data.new_zeros(entry_bytes - layout.tail_bytes)])
    entries = data.view(-1, entry_bytes)
    spe = layout.sectors_per_entry
    hist = [0] * layout.bins
    nonzero = (entries != 0).any(dim=1)
    hist[0] = int((~nonzero).sum())
    view = data.numpy().data  # a memoryview of the bytes
    for i in nonzero.nonzero().view(-1).tolist():
        k = -(-len(cctx.compress(view[i * entry_bytes : (i + 1) * entry_bytes])) // spec.SECTOR_BYTES)
        hist[min(k, spe)] += 1
    return hist


def compacted_bytes(histogram: Sequence[int]) -> float:
    """``sum(k * h[k]) * 32``: the size with every entry's sectors compacted (no slots)."""
    return Layout.compacted_bytes(histogram)


def general_purpose_sizes(t: torch.Tensor) -> dict[str, int]:
    """Compressed sizes of the tensor's bytes under zstd level 3 and lz4 (CPU), when installed."""
    data = data_bytes(t).numpy()
    sizes = {}
    if available("zstandard"):
        sizes["zstd-3"] = len(require("zstandard", "the zstd baseline").ZstdCompressor(level=3).compress(data))
    if available("lz4"):
        sizes["lz4"] = len(require("lz4.frame", "the lz4 baseline").compress(data))
    return sizes


@dataclass
class Outcome:
    """What a policy did to one tensor at one training point (bytes)."""

    point: int
    key: str
    slot: int
    original_bytes: int
    device_bytes: int  # slots + metadata, or the original bytes when the tensor is kept as it is (raw slot)
    buddy_bytes: int
    predicted_overflow_bytes: int | None


def simulate_policy(
    points: Iterable[tuple[int, Sequence[tuple[str, Sequence[int], int]]]],
    policy: buddy.Policy,
    entry_bytes: int,
    *,
    decay: float = 0.5,
) -> list[Outcome]:
    """Run a fresh tracker with ``policy`` over captured training points, in order.

    ``points`` yields ``(point, [(key, histogram, original_bytes), ...])``:
    one training step's unique saved tensors each. Every tensor takes the
    tracker step a training session takes (:meth:`buddy.Tracker.plan`, then
    :meth:`buddy.Tracker.record`): the first time a key is seen its slot
    comes from its own histogram, afterwards from the tracker's prediction.
    Within a point every tensor's device bytes are held at once on the
    tracker's own ledger (as during a forward pass, which is what
    ``DeviceBudget`` sees) and released at the end of the point, as backward
    frees the step's activations.
    """
    tracker = buddy.Tracker(policy, decay=decay, ledger=buddy.ledger.DeviceLedger())
    outcomes = []
    for point, tensors in points:
        tracker.begin_step(policy)
        holds = []
        for key, hist, nbytes in tensors:
            layout = Layout(entry_bytes, nbytes)
            place = tracker.plan(key, hist, layout=layout, policy=policy)
            holds.append(tracker.ledger.hold(place.device_bytes))
            observed = tracker.record(
                key, hist, slot=place.slot, layout=layout, predicted_overflow_bytes=place.predicted_overflow_bytes
            )
            outcomes.append(
                Outcome(
                    point,
                    key,
                    place.slot,
                    nbytes,
                    place.device_bytes,
                    observed.overflow_bytes,
                    place.predicted_overflow_bytes,
                )
            )
        for hold in holds:  # backward frees the step's activations
            hold.release()
    return outcomes


def default_policies(entry_bytes: int, activation_bytes: float) -> list[tuple[str, str, buddy.Policy]]:
    """``(family, label, policy)`` for the capacity-vs-traffic sweep.

    ``activation_bytes`` (a step's unique saved bytes) scales the DeviceBudget
    points: budgets of 90 % down to 40 % of it.
    """
    sectors = spec.sectors_per_entry(entry_bytes)
    fixed: list[tuple[str, str, buddy.Policy]] = [
        (
            "FixedRatio",
            f"{spec.ratio_for_slot(s, entry_bytes):.2f}x",
            buddy.FixedRatio(spec.ratio_for_slot(s, entry_bytes)),
        )
        for s in range(sectors, 0, -1)
    ]
    threshold: list[tuple[str, str, buddy.Policy]] = [
        ("BuddyThreshold", f"{t:.0%}", buddy.BuddyThreshold(t)) for t in (0.0, 0.01, 0.02, 0.05, 0.10, 0.20, 0.30)
    ]
    threshold += [("OverflowBudget", f"{t:.0%}", buddy.OverflowBudget(t)) for t in (0.02, 0.05, 0.10, 0.20)]
    budget: list[tuple[str, str, buddy.Policy]] = [
        ("DeviceBudget", f"{f:.0%}", buddy.DeviceBudget(int(f * activation_bytes)))
        for f in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
    ]
    return fixed + threshold + budget


def ratio(num: float, den: float) -> float:
    """``num / den``, ``inf`` for a zero denominator."""
    return num / den if den else math.inf
