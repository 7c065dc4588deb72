"""What compressing a saved tensor costs in time: a model per device, codec and dtype, measured where it runs.

A tensor of ``n`` bytes costs ``host + n / compress + n / decompress`` seconds
to compress for the forward pass and decompress for backward
(:meth:`Rates.seconds`): ``host`` is what a tensor costs whatever its size
(argument checks, launches, its share of the step's reads), ``compress`` and
``decompress`` are bytes a second of the original.

:func:`rates` measures them the first time a (device, codec, dtype) is asked
for, and keeps them for the process: the engine that a session would run
compresses and decompresses an activation-like tensor (a ReLU of normal
values: about half zeros) at two sizes, each a few times, synchronised with
the device; the faster run of each size is kept; a line through the two gives
the cost per byte (its slope) and per tensor (where it meets zero bytes). It
takes milliseconds on a GPU, a fraction of a second on the CPU.

The figures are a model: real activations compress faster or slower than the
calibration's, and on a GPU a step's kernels overlap the host's work. A
session reports the modeled time beside the measured one
(``session.stats()``), and the budget policies (:mod:`buddy.budget`) spend
the modeled time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

__all__ = ["Rates", "rates", "set_rates", "forget_rates", "CALIBRATION_BYTES"]


@dataclass(frozen=True)
class Rates:
    """The modeled cost of compressing and decompressing a tensor on one device with one codec and dtype."""

    compress: float  # bytes of the original a second
    decompress: float  # likewise
    host: float = 0.0  # seconds a tensor, whatever its size (both ways together)

    def __post_init__(self) -> None:
        for name in ("compress", "decompress"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Rates.{name} is bytes a second, a positive number, got {value!r}")
        if not isinstance(self.host, (int, float)) or self.host < 0:
            raise ValueError(f"Rates.host is seconds a tensor, zero or more, got {self.host!r}")

    def seconds(self, nbytes: int) -> float:
        """Modeled seconds to compress a tensor of ``nbytes`` and decompress it again."""
        return self.host + nbytes / self.compress + nbytes / self.decompress


#: the two sizes the calibration times, per device type (bytes): large enough that the per-byte cost dominates
#: the larger, small enough that the calibration takes milliseconds on a GPU and a fraction of a second on a CPU
CALIBRATION_BYTES = {"cuda": (4 << 20, 64 << 20), "cpu": (1 << 20, 8 << 20)}
_REPEATS = 3

_lock = threading.Lock()
_known: dict[tuple[str, str, torch.dtype], Rates] = {}


def _where(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def rates(device: torch.device | str, codec: str, dtype: torch.dtype) -> Rates:
    """The rates of ``codec`` on ``device`` for tensors of ``dtype``: measured at the first call, then kept."""
    key = (_where(device), codec, dtype)
    with _lock:
        found = _known.get(key)
    if found is None:
        found = _calibrate(torch.device(key[0]), codec, dtype)
        with _lock:
            found = _known.setdefault(key, found)
    return found


def set_rates(device: torch.device | str, codec: str, dtype: torch.dtype, value: Rates | None) -> None:
    """Use ``value`` for (``device``, ``codec``, ``dtype``) from now on instead of measuring (``None``: measure
    again at the next use)."""
    if value is not None and not isinstance(value, Rates):
        raise TypeError(f"value must be buddy.cost.Rates or None, got {type(value).__name__}")
    key = (_where(device), codec, dtype)
    with _lock:
        if value is None:
            _known.pop(key, None)
        else:
            _known[key] = value


def forget_rates() -> None:
    """Forget every rate measured or set: the next use measures again."""
    with _lock:
        _known.clear()


def _sample(nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An activation-like tensor of about ``nbytes``: a ReLU of normal values (about half of them zero)."""
    element = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(max(1, nbytes // element), generator=gen, dtype=torch.float32).relu_()
    return values.to(dtype=dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _round_trip(t: torch.Tensor, codec: str) -> tuple[float, float]:
    """The fastest of a few compress and decompress times of ``t`` (seconds), each synchronised; the first run
    (compiles, allocates) not counted. Compressed into a store and ledger of its own: the process's are not
    touched."""
    from .ledger import DeviceLedger
    from .pipeline import compress
    from .store import BuddyStore
    from .tensor import BuddyTensor

    store, ledger = BuddyStore(), DeviceLedger()
    best_c = best_d = float("inf")
    for i in range(_REPEATS + 1):
        seconds_c, bt = _timed(lambda: compress(t, codec=codec, store=store, ledger=ledger), t.device)
        assert isinstance(bt, BuddyTensor)
        seconds_d, _ = _timed(bt.decompress, t.device)
        if i:
            best_c, best_d = min(best_c, seconds_c), min(best_d, seconds_d)
        bt.free()
    return best_c, best_d


def _calibrate(device: torch.device, codec: str, dtype: torch.dtype) -> Rates:
    small, large = CALIBRATION_BYTES["cuda" if device.type == "cuda" else "cpu"]
    (c_small, d_small), (c_large, d_large) = (_round_trip(_sample(n, dtype, device), codec) for n in (small, large))
    spread = large - small
    # a run noisier than the difference (a busy host) leaves the slope at least what the larger run alone says
    compress_rate = spread / max(c_large - c_small, c_large * spread / large)
    decompress_rate = spread / max(d_large - d_small, d_large * spread / large)
    host = max(0.0, c_small - small / compress_rate) + max(0.0, d_small - small / decompress_rate)
    return Rates(compress_rate, decompress_rate, host)
