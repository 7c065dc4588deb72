"""The CUDA kernels of buddy's codecs, compiled at run time through CuPy (NVRTC) and launched on torch's stream.

**The default on CUDA tensors, behind a self-test**: :func:`CudaEngine` --
the one kernel engine (:class:`~buddy.engines.kernel_engine.KernelEngine`)
with this module's :data:`LAUNCHER` -- is registered in :mod:`buddy.dispatch`
as the default (``backend="auto"``) implementation of ``zvc``, ``fpx``,
``bpc``, ``auto``, ``fpe`` and ``auto2`` on CUDA devices. Their first use on
a device runs :mod:`buddy.selftest` (golden vectors through the kernels both
ways, once per process, device and codec); a failure warns once and that
codec runs the torch reference on that device. ``backend="cuda"`` asks for
the kernels explicitly (no self-test); ``backend="reference"`` or
``BUDDY_BACKEND=reference`` for the reference; ``buddy.dispatch.chosen()``
says what ran and why. What runs where without a GPU:

* the kernels themselves -- ``csrc/buddy_kernels.cu`` and its headers,
  unchanged, compiled for the host with the defines of
  :func:`~buddy.engines.sources.compile_options` -- run under a block
  emulator (``tests/emulator.py``, ``docs/emulator.md``): every thread of a
  block a fiber in seeded random orders, built with ThreadSanitizer (races
  between barriers) and with AddressSanitizer and UBSan (misaligned loads,
  bytes past a buffer). Its launches come from the engine's own
  :class:`~buddy.engines.kernels.Kernels` (their ``launch=``), and the tests
  compare every buffer with the torch reference;
* the per-entry device code (``csrc/codec_*.h`` inside the format rules of
  ``csrc/buddy_entry.h`` and the operations of ``csrc/buddy_ops.h``) also runs
  under an emulated warp in a harness of its own (``tests/host/codec_host.cpp``);
* NVRTC, the compiler this module uses through CuPy, compiles every codec at
  every entry size (``tests/test_nvrtc.py``, with the ``nvidia-cuda-nvrtc`` wheel).

What is CUDA's alone is here: the compile cache (a module per codec, entry
size, word size, table place and device architecture, once per process; the
sources and options from :mod:`buddy.engines.sources`), torch's current
stream as CuPy sees it, the device's shared memory (which lays a launch out:
:func:`buddy.engines.launch.launch_config`), and which host memory the
device's kernels reach where it is (:func:`reads_overflow_in_place`).
``import buddy`` never imports CuPy; the first launch does, and raises
:class:`~buddy.errors.MissingDependencyError` without it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import warnings
from collections.abc import Callable, Sequence

import torch

from ..codecs.base import CodecLike
from ..deps import available, require
from ..layout import WORD_SIZES, Layout
from . import Implementation, pinned
from .kernel_engine import KernelEngine
from .kernels import ALIGN_BYTES, Launcher, reads_in_place
from .launch import SharedMemory, launch_config, shares_tables
from .sources import KERNEL_CODECS, SOURCE, TABLED_KERNELS, compile_options, translation_unit
from .tuning import Tuning, current

__all__ = [
    "CudaEngine", "LAUNCHER", "compile_module", "device_shared_memory", "reads_overflow_in_place", "why_unusable",
    "rows",
]  # fmt: skip

_FEATURE = "buddy's CUDA backend (backend='cuda')"


# ---------------------------------------------------------------------------
# compilation, memoised per process
# ---------------------------------------------------------------------------
_modules: dict[tuple[str, tuple[str, ...], str], object] = {}
_kernels: dict[tuple[str, str, int, int | None, int, bool, bool], object] = {}
_lock = threading.Lock()


def _cupy():
    return require("cupy", _FEATURE)


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _module(source: str, options: tuple[str, ...], device: torch.device):
    """The ``cupy.RawModule`` of (source, options, device architecture)."""
    cupy = _cupy()
    key = (hashlib.sha256(source.encode()).hexdigest(), options, _arch(device))
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = _modules[key] = cupy.RawModule(code=source, options=options)
    return module


def _kernel(
    codec: str, op: str, entry_bytes: int, device: torch.device, shared_bytes: int, word_bytes: int,
    shared_tables: bool = False, pack_fields: bool = False,
):  # fmt: skip
    """Kernel ``buddy_<codec>_<op>`` for this entry and word size (and ``shared_tables``, ``pack_fields``: see
    :func:`~buddy.engines.sources.compile_options`), compiled for ``device`` (and allowed its shared memory): a
    module per codec, entry size, word size and table place."""
    key = (codec, op, entry_bytes, device.index, word_bytes, shared_tables, pack_fields)
    kernel = _kernels.get(key)
    if kernel is None:
        cupy = _cupy()
        options = compile_options(entry_bytes, codec, word_bytes, shared_tables, pack_fields)
        module = _module(translation_unit(SOURCE), options, device)
        with cupy.cuda.Device(device.index):
            kernel = module.get_function(f"buddy_{codec}_{op}")  # compiles (NVRTC) on first use
            if shared_bytes > 48 << 10:  # beyond the default a block may ask for: opt in
                kernel.max_dynamic_shared_size_bytes = shared_bytes
        with _lock:
            kernel = _kernels.setdefault(key, kernel)
    return kernel


def compile_module(
    codec: str, entry_bytes: int, device: torch.device | str, word_sizes: Sequence[int] = WORD_SIZES,
    tuning: Tuning | None = None,
) -> None:  # fmt: skip
    """Compile the kernels of ``codec`` at ``entry_bytes`` for ``device`` now, not at their first launch: a
    module per word size in ``word_sizes`` (the tensors' element sizes: 1, 2, 4 or 8 bytes), laid out as
    ``tuning`` says (default: the current one, :func:`buddy.engines.tuning.current`).

    What a launch would do first (NVRTC through CuPy, memoised in this
    process and kept in CuPy's on-disk cache for later ones); a GPU session
    calls it for many modules in parallel processes before its tests.
    """
    if codec not in KERNEL_CODECS:
        raise ValueError(f"codec {codec!r} has no CUDA kernels (codecs with them: {', '.join(sorted(KERNEL_CODECS))})")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the kernels compile for a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for word_bytes in word_sizes:
        if word_bytes not in WORD_SIZES:
            raise ValueError(f"word sizes are 1, 2, 4 or 8 bytes, got {word_bytes!r}")
        layout = Layout(entry_bytes, 0, word_bytes)  # validates the entry size
        tuning = current() if tuning is None else tuning
        table = _table_in_shared(codec, layout.entry_bytes, device, tuning) is not None
        _kernel(codec, "measure", layout.entry_bytes, device, 0, layout.word_bytes, table, table and tuning.pack_fields)


# ---------------------------------------------------------------------------
# torch's current stream, as CuPy launches on it
# ---------------------------------------------------------------------------
_streams: dict[tuple[int, int | None], object] = {}


def _current_stream_handle(device: torch.device) -> int:
    """The raw handle (``cudaStream_t``) of torch's current stream on ``device``: torch's own accessor of it where
    it has one (what its compiler's generated code calls), else ``torch.cuda.current_stream`` (a Python stream
    object made at every call: a profiled training step spent a share of its host time making them)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and device.index is not None:
        return raw(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _cupy_stream(cupy, device: torch.device):
    """CuPy's handle of torch's current stream on ``device``, one per stream (a wrapper of the raw handle, owning
    nothing). CuPy 14 deprecates ``ExternalStream`` for ``Stream.from_external``, and said so at every launch: the
    warning is left out, once per stream."""
    ptr = _current_stream_handle(device)
    stream = _streams.get((ptr, device.index))
    if stream is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = _streams.setdefault((ptr, device.index), cupy.cuda.ExternalStream(ptr, device.index))
    return stream


# ---------------------------------------------------------------------------
# the device's shared memory, and the launch it lays out
# ---------------------------------------------------------------------------
def device_shared_memory(device: torch.device, tuning: Tuning) -> SharedMemory | None:
    """:class:`~buddy.engines.launch.SharedMemory` of ``device`` (its properties), or None where ``tuning`` asks a
    table codec's pack and unpack to read its table in global memory (:attr:`Tuning.shared_tables` false)."""
    if not tuning.shared_tables:
        return None
    return _device_shared_memory(device.index)


def _table_in_shared(codec: str, entry_bytes: int, device: torch.device, tuning: Tuning) -> SharedMemory | None:
    """The device's :class:`SharedMemory` where ``codec``'s tables go into its shared memory
    (:func:`~buddy.engines.launch.shares_tables`;
    not where ``tuning`` keeps them in global memory), else None."""
    limits = device_shared_memory(device, tuning) if codec in TABLED_KERNELS else None
    return limits if limits is not None and shares_tables(codec, entry_bytes, limits) else None


#: the CUDA runtime's device attributes read (cudaDevAttr*: driver_types.h)
_ATTR_SMS, _ATTR_SHARED_SM, _ATTR_SHARED_BLOCK, _ATTR_RESERVED = 16, 81, 97, 111


@functools.cache
def _device_shared_memory(index: int) -> SharedMemory:
    attribute = _cupy().cuda.runtime.deviceGetAttribute
    return SharedMemory(
        sms=attribute(_ATTR_SMS, index), per_block=attribute(_ATTR_SHARED_BLOCK, index),
        per_sm=attribute(_ATTR_SHARED_SM, index), reserved=attribute(_ATTR_RESERVED, index),
    )  # fmt: skip


def _launch(
    codec: str, op: str, entry_bytes: int, device: torch.device, n_entries: int, args: tuple, tuning: Tuning
) -> None:
    """Launch ``buddy_<codec>_<op>`` over ``n_entries`` on the device's current torch stream, laid out as ``tuning``
    says."""
    import numpy

    cupy = _cupy()
    limits = _table_in_shared(codec, entry_bytes, device, tuning)
    fields = limits is not None and tuning.pack_fields
    blocks, threads, shared = launch_config(op, entry_bytes, n_entries, codec, limits, fields, tuning.unpack_warps)
    # every kernel's last argument: the word size
    kernel = _kernel(codec, op, entry_bytes, device, shared, int(args[-1]), limits is not None, fields)
    stream = _cupy_stream(cupy, device)
    # pointers and sizes as fixed-width scalars: exactly the kernel's parameter types
    c_args = tuple(numpy.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args)
    with cupy.cuda.Device(device.index):
        kernel((blocks,), (threads,), c_args, stream=stream, shared_mem=shared)


# ---------------------------------------------------------------------------
# host memory the device's kernels reach where it is
# ---------------------------------------------------------------------------
#: cudaDevAttrCanUseHostPointerForRegisteredMem: a registered host pointer is a valid device pointer as it is
_HOST_POINTER_ATTRIBUTE = 91


def reads_overflow_in_place(overflow: torch.Tensor, device: torch.device, tuning: Tuning) -> bool:
    """Whether an unpack on CUDA ``device`` reads ``overflow`` in pinned host memory, over the bus, as its kernel
    runs (:func:`~buddy.engines.kernels.reads_in_place` with what the device reaches: opt-in,
    :attr:`Tuning.zero_copy`)."""
    return reads_in_place(overflow, device, tuning, _device_reaches)


def _device_reaches(host: torch.Tensor, device: torch.device) -> bool:
    """Whether the kernels on CUDA ``device`` can load and store ``host`` (host memory) where it is, over the bus:
    16-byte aligned (their loads and stores), pinned with the mapping into the device's address space (not a store
    block the runtime pinned without it), on a device that takes a registered host pointer as it is."""
    if host.device.type != "cpu" or host.data_ptr() % ALIGN_BYTES or not host.is_pinned():
        return False
    if pinned.is_unmapped(host.untyped_storage().data_ptr()):
        return False
    return _takes_host_pointers(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _takes_host_pointers(index: int) -> bool:
    return bool(_cupy().cuda.runtime.deviceGetAttribute(_HOST_POINTER_ATTRIBUTE, index))


# ---------------------------------------------------------------------------
# the engine the pipeline calls (its rows: buddy.dispatch's table)
# ---------------------------------------------------------------------------
#: CuPy's launcher: :func:`_launch` on torch's current stream, and what the device's kernels reach of host memory
#: (:func:`_device_reaches`); both looked up here at each use, a test's stand-in included
LAUNCHER = Launcher(lambda: _launch, lambda host, device: _device_reaches(host, device))


def why_unusable() -> str | None:
    """Why the CUDA kernels cannot run here (no CuPy, no GPU), or ``None``."""
    if not available("cupy"):
        return "CuPy is not importable: pip install 'buddy[cuda12]' or 'buddy[cuda13]'"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def rows() -> tuple[Implementation, ...]:
    """The kernels of every codec of :data:`~buddy.engines.sources.KERNEL_CODECS`: the default on CUDA devices,
    once its self-test passed there (see :mod:`buddy.dispatch`)."""
    return tuple(
        Implementation(name, "cuda", "cuda", CudaEngine, default=True, requires=why_unusable) for name in KERNEL_CODECS
    )


def CudaEngine(
    codec: CodecLike, *, launch: Launcher | Callable | None = None, device_type: str = "cuda",
    tuning: Tuning | None = None,
) -> KernelEngine:  # fmt: skip
    """The kernels' format operations on CUDA tensors: the one kernel engine with CuPy's :data:`LAUNCHER` (another
    ``launch`` and ``device_type``: the tests' emulator on CPU tensors), laid out as ``tuning`` says (default: the
    current one when made)."""
    return KernelEngine(codec, launch=LAUNCHER if launch is None else launch, device_type=device_type, tuning=tuning)
