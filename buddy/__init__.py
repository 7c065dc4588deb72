"""buddy: lossless compression that stretches GPU memory for training.

Tensors are cut into fixed-size entries, each compressed into a fixed-size
slot on the device; what does not fit goes to buddy memory in host RAM.

    >>> import torch, buddy
    >>> t = torch.relu(torch.randn(64, 1024))
    >>> bt = buddy.compress(t, target_ratio=2.0, codec="zvc")
    >>> torch.equal(bt.decompress().view(torch.uint8), t.view(torch.uint8))
    True
    >>> bt.free()
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import dispatch, engines, errors, selftest, spec
from .engines import cuda  # buddy.cuda: the CUDA kernels' module, buddy.engines.cuda (imports no CuPy)
from .autograd import (
    DEFAULT_MIN_BYTES,
    RecordedTensor,
    Recorder,
    Session,
    compressed_activations,
    record_activations,
    wrap,
)
from .codecs import DEFAULT_CODEC, Codec, available_codecs, get_codec, register_codec, unregister_codec
from .config import defaults, set_defaults
from .dispatch import Choice
from .dispatch import chosen as implementations
from .dispatch import implementations as registered_implementations
from .dispatch import register as register_implementation
from .dispatch import unregister as unregister_implementation
from .errors import (
    BuddyError,
    CorruptDataError,
    FreedTensorError,
    HostStoreFull,
    MissingDependencyError,
    UnsupportedTensorError,
)
from .ledger import DeviceLedger, Hold, LedgerStats, default_ledger, set_default_ledger
from .pipeline import Measured, compress, measure, pack, size_histogram, unpack
from .prefetch import Prefetch, PrefetchStats
from .slots import DEFAULT_MAX_OVERFLOW
from .stats import KeyRow, SessionStats
from .store import BuddyAllocation, BuddyStore, StoreStats, default_store, set_default_store
from .tensor import BuddyTensor
from .tracker import (
    BuddyThreshold,
    BudgetExceededWarning,
    CompressedOffload,
    DeviceBudget,
    OverflowBudget,
    FixedRatio,
    Placement,
    Policy,
    Tracker,
    default_tracker,
    set_default_tracker,
)

__all__ = [
    "__version__",
    "spec",
    "dispatch",
    "engines",
    "cuda",
    "selftest",
    "compress",
    "measure",
    "pack",
    "Measured",
    "unpack",
    "size_histogram",
    "BuddyTensor",
    "BuddyStore",
    "BuddyAllocation",
    "StoreStats",
    "default_store",
    "set_default_store",
    "Codec",
    "DEFAULT_CODEC",
    "DEFAULT_MAX_OVERFLOW",
    "available_codecs",
    "get_codec",
    "register_codec",
    "unregister_codec",
    "implementations",
    "Choice",
    "registered_implementations",
    "register_implementation",
    "unregister_implementation",
    "DeviceLedger",
    "Hold",
    "LedgerStats",
    "default_ledger",
    "set_default_ledger",
    "compressed_activations",
    "Session",
    "record_activations",
    "Recorder",
    "RecordedTensor",
    "SessionStats",
    "KeyRow",
    "Prefetch",
    "PrefetchStats",
    "DEFAULT_MIN_BYTES",
    "wrap",
    "Policy",
    "Placement",
    "FixedRatio",
    "BuddyThreshold",
    "DeviceBudget",
    "OverflowBudget",
    "CompressedOffload",
    "Tracker",
    "BudgetExceededWarning",
    "default_tracker",
    "set_default_tracker",
    "defaults",
    "set_defaults",
]
__all__ += errors.__all__  # BuddyError and the errors derived from it, imported above
