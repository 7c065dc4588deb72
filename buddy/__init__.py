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

from . import spec
from .codecs import DEFAULT_CODEC, Codec, available_codecs, get_codec, register_codec
from .errors import (
    BuddyError,
    CorruptDataError,
    FreedTensorError,
    HostStoreFull,
    MissingDependencyError,
    UnsupportedTensorError,
)
from .slots import DEFAULT_MAX_OVERFLOW
from .store import BuddyAllocation, BuddyStore, StoreStats, default_store, set_default_store
from .tensor import BuddyTensor, compress, pack, unpack

__all__ = [
    "__version__",
    "spec",
    "compress",
    "pack",
    "unpack",
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
    "BuddyError",
    "CorruptDataError",
    "FreedTensorError",
    "HostStoreFull",
    "MissingDependencyError",
    "UnsupportedTensorError",
]
