"""What a compressed-activations session held, per key and in total."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .prefetch import PrefetchStats

__all__ = ["KeyRow", "SessionStats", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} GiB"


def _ratio(num: float, den: float) -> float:
    return num / den if den else (math.inf if num else 1.0)


@dataclass
class KeyRow:
    """One compressed tensor of a step (bytes unless said otherwise)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    codec: str
    target_ratio: float
    original_bytes: int
    device_bytes: int
    buddy_bytes: int
    ideal_bytes: int  # sum(k) * 32: the size with entries compacted
    predicted_overflow_bytes: int | None  # None: new key, decided from its size pass
    saves: int = 1  # how many saves autograd made of it (dedup)
    compress_seconds: float = 0.0

    @property
    def effective_capacity(self) -> float:
        return _ratio(self.original_bytes, self.device_bytes)

    @property
    def overflow_fraction(self) -> float:
        return _ratio(self.buddy_bytes, self.original_bytes) if self.original_bytes else 0.0


@dataclass
class SessionStats:
    """Totals over the unique storages a session compressed, plus per-key rows.

    ``original_bytes`` counts each storage once (what PyTorch would really
    hold), ``device_bytes`` is slots + metadata, ``buddy_bytes`` the overflow
    in host memory. Times are host wall-clock seconds spent in the pack and
    unpack hooks.
    """

    rows: list[KeyRow] = field(default_factory=list)
    original_bytes: int = 0
    device_bytes: int = 0
    buddy_bytes: int = 0
    ideal_bytes: int = 0
    saves: int = 0  # pack-hook calls
    deduplicated: int = 0  # saves that reused an already-compressed storage
    skipped: int = 0  # parameters, small or unsupported tensors, kept as they are
    skipped_bytes: int = 0  # bytes of those saves, one count per save
    kept_bytes: int = 0  # bytes of saved activations (not parameters) left uncompressed: small, unsupported, failed
    failed: int = 0  # packing raised: the original tensor was kept
    compress_seconds: float = 0.0
    decompress_seconds: float = 0.0
    decompressions: int = 0
    #: backward's look-ahead (:mod:`buddy.prefetch`): what was brought back or decompressed ahead of use
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)

    @property
    def effective_capacity(self) -> float:
        """original bytes / device bytes of what was compressed."""
        return _ratio(self.original_bytes, self.device_bytes)

    @property
    def overflow_fraction(self) -> float:
        """buddy bytes / original bytes."""
        return self.buddy_bytes / self.original_bytes if self.original_bytes else 0.0

    @property
    def ideal_ratio(self) -> float:
        """original bytes / compacted bytes: the codec's ratio with no slot rounding."""
        return _ratio(self.original_bytes, self.ideal_bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            effective_capacity=self.effective_capacity,
            overflow_fraction=self.overflow_fraction,
            ideal_ratio=self.ideal_ratio,
        )
        return d

    def __str__(self) -> str:
        header = f"{'key':<28} {'codec':<5} {'target':>6} {'original':>12} {'device':>12} {'buddy':>12} {'capacity':>8} {'overflow':>8} {'pred.ovf':>8}"
        lines = [header, "-" * len(header)]
        for r in self.rows:
            pred = (
                "new"
                if r.predicted_overflow_bytes is None
                else f"{_ratio(r.predicted_overflow_bytes, r.original_bytes):.1%}"
            )
            lines.append(
                f"{r.key[:28]:<28} {r.codec:<5} {r.target_ratio:>5.2f}x {format_bytes(r.original_bytes):>12} "
                f"{format_bytes(r.device_bytes):>12} {format_bytes(r.buddy_bytes):>12} "
                f"{r.effective_capacity:>7.2f}x {r.overflow_fraction:>8.1%} {pred:>8}"
            )
        lines.append("-" * len(header))
        lines.append(
            f"{'total (unique storages)':<28} {'':<5} {'':>6} {format_bytes(self.original_bytes):>12} "
            f"{format_bytes(self.device_bytes):>12} {format_bytes(self.buddy_bytes):>12} "
            f"{self.effective_capacity:>7.2f}x {self.overflow_fraction:>8.1%}"
        )
        lines.append(
            f"saves {self.saves}: {sum(r.codec != 'kept' for r in self.rows)} compressed, "
            f"{sum(r.codec == 'kept' for r in self.rows)} incompressible kept, {self.deduplicated} deduplicated, "
            f"{self.skipped} skipped ({format_bytes(self.kept_bytes)} of activations kept as is), {self.failed} failed; "
            f"compress {self.compress_seconds * 1e3:.1f} ms, decompress {self.decompress_seconds * 1e3:.1f} ms "
            f"({self.decompressions} unpacks); ideal ratio {self.ideal_ratio:.2f}x"
        )
        p = self.prefetch
        if p.prefetched or p.unpacked_ahead:
            lines.append(
                f"look-ahead: {p.prefetched} overflows prefetched ({format_bytes(p.prefetched_bytes)}), "
                f"{p.unpacked_ahead} tensors decompressed ahead, {p.ready} unpacks found them ready, "
                f"{p.dropped} dropped unused"
            )
        return "\n".join(lines)
