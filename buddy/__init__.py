"""buddy: lossless compression that stretches GPU memory for training.

Tensors are cut into fixed-size entries, each compressed into a fixed-size
slot on the device; what does not fit goes to buddy memory in host RAM.

    >>> import torch, buddy
    >>> t = torch.relu(torch.randn(64, 1024))
    >>> bt = buddy.compress(t, target_ratio=2.0, codec="zvc")
    >>> torch.equal(bt.decompress().view(torch.uint8), t.view(torch.uint8))
    True
    >>> bt.free()

``__all__`` is what a user calls (docs/api.md lists it); everything else
lives in its submodule (``buddy.dispatch``, ``buddy.ledger``, ``buddy.codecs``,
...). A name that moved or was renamed still answers here, with a
``DeprecationWarning`` naming its new place (:data:`_MOVED`).
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import TYPE_CHECKING

# the submodules the moved names live in, imported so that `import buddy` reaches them all
from . import (  # noqa: F401
    codecs,
    dispatch,
    engines,
    errors,
    hooks,
    ledger,
    overlap,
    pipeline,
    prefetch,
    recording,
    selftest,
    slots,
    spec,
    store,
    tracker,
)
from .autograd import Session, compressed_activations, wrap
from .budget import MemoryTarget, TimeBudget
from .codecs import available_codecs, get_codec
from .config import defaults, set_defaults
from .errors import (
    BuddyError,
    CorruptDataError,
    FreedTensorError,
    HostStoreFull,
    MissingDependencyError,
    UnsupportedTensorError,
)
from .pipeline import compress, measure, pack, size_histogram, unpack
from .overlap import Overlap
from .prefetch import Prefetch
from .recording import record_activations
from .stats import KeyRow, SessionStats
from .store import BuddyStore, default_store, set_default_store
from .tensor import BuddyTensor
from .tracker import (
    BuddyThreshold,
    BudgetExceededWarning,
    CompressedOffload,
    DeviceBudget,
    FixedRatio,
    OverflowBudget,
    Policy,
    Tracker,
    default_tracker,
    set_default_tracker,
)

__all__ = [
    "__version__",
    # one tensor
    "compress",
    "measure",
    "pack",
    "unpack",
    "size_histogram",
    "BuddyTensor",
    # training
    "compressed_activations",
    "Session",
    "SessionStats",
    "KeyRow",
    "wrap",
    "Prefetch",
    "Overlap",
    "record_activations",
    # how slots are chosen
    "Tracker",
    "Policy",
    "FixedRatio",
    "BuddyThreshold",
    "DeviceBudget",
    "OverflowBudget",
    "CompressedOffload",
    "MemoryTarget",
    "TimeBudget",
    "default_tracker",
    "set_default_tracker",
    # buddy memory
    "BuddyStore",
    "default_store",
    "set_default_store",
    # codecs and defaults
    "available_codecs",
    "get_codec",
    "defaults",
    "set_defaults",
    # errors and warnings
    "BuddyError",
    "CorruptDataError",
    "FreedTensorError",
    "HostStoreFull",
    "MissingDependencyError",
    "UnsupportedTensorError",
    "BudgetExceededWarning",
]

#: names that were public here and are no longer: old name -> (module, name there). Each still answers as
#: ``buddy.<old name>`` (and ``from buddy import <old name>``), the same object, with one DeprecationWarning per name
#: and process naming its place. docs/api.md lists them.
_MOVED: dict[str, tuple[str, str]] = {
    # renamed: one name per idea (what backend="auto" ran is dispatch.chosen, the registry dispatch.implementations;
    # engines.Measurement is what an engine's measure returns, MeasuredTensor what buddy.measure does)
    "implementations": ("buddy.dispatch", "chosen"),
    "registered_implementations": ("buddy.dispatch", "implementations"),
    "register_implementation": ("buddy.dispatch", "register"),
    "unregister_implementation": ("buddy.dispatch", "unregister"),
    "Measured": ("buddy.pipeline", "MeasuredTensor"),
    # moved to their submodule under the same name
    "cuda": ("buddy.engines", "cuda"),
    "Choice": ("buddy.dispatch", "Choice"),
    "Codec": ("buddy.codecs", "Codec"),
    "DEFAULT_CODEC": ("buddy.codecs", "DEFAULT_CODEC"),
    "register_codec": ("buddy.codecs", "register_codec"),
    "unregister_codec": ("buddy.codecs", "unregister_codec"),
    "DEFAULT_MAX_OVERFLOW": ("buddy.slots", "DEFAULT_MAX_OVERFLOW"),
    "DEFAULT_MIN_BYTES": ("buddy.hooks", "DEFAULT_MIN_BYTES"),
    "Recorder": ("buddy.recording", "Recorder"),
    "RecordedTensor": ("buddy.recording", "RecordedTensor"),
    "PrefetchStats": ("buddy.prefetch", "PrefetchStats"),
    "Placement": ("buddy.tracker", "Placement"),
    "BuddyAllocation": ("buddy.store", "BuddyAllocation"),
    "StoreStats": ("buddy.store", "StoreStats"),
    "DeviceLedger": ("buddy.ledger", "DeviceLedger"),
    "Hold": ("buddy.ledger", "Hold"),
    "LedgerStats": ("buddy.ledger", "LedgerStats"),
    "default_ledger": ("buddy.ledger", "default_ledger"),
    "set_default_ledger": ("buddy.ledger", "set_default_ledger"),
}

if not TYPE_CHECKING:  # hidden from mypy, which would otherwise accept any attribute of buddy
    __getattr__ = errors.Moved("buddy", _MOVED)
