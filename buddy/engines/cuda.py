"""CUDA kernels of buddy's codecs, compiled at run time through CuPy (NVRTC).

**The default on CUDA tensors, behind a self-test**: :class:`CudaEngine` is
registered in :mod:`buddy.dispatch` as the default (``backend="auto"``)
implementation of ``zvc``, ``fpx``, ``bpc``, ``auto``, ``fpe`` and ``auto2``
on CUDA devices. Their first use on a device runs :mod:`buddy.selftest`
(golden vectors through the kernels both ways, once per process, device and
codec); a failure warns once and that codec runs the torch reference on that
device. ``backend="cuda"`` asks for the kernels explicitly (no self-test);
``backend="reference"`` or ``BUDDY_BACKEND=reference`` for the reference;
``buddy.dispatch.chosen()`` says what ran and why. What runs where without
a GPU:

* the kernels themselves -- ``csrc/buddy_kernels.cu`` and its headers,
  unchanged, compiled for the host with the defines of :func:`compile_options`
  -- run under a block emulator (``tests/emulator.py``, ``docs/emulator.md``):
  every thread of a block a fiber in seeded random orders, built with
  ThreadSanitizer (races between barriers) and with AddressSanitizer and
  UBSan (misaligned loads, bytes past a buffer). Its launches come from this
  module's own :class:`Kernels` and :class:`CudaEngine` (their ``launch=``),
  and the tests compare every buffer with the torch reference;
* the per-entry device code (``csrc/codec_*.h`` inside the format rules of
  ``csrc/buddy_entry.h`` and the operations of ``csrc/buddy_ops.h``) also runs
  under an emulated warp in a harness of its own (``tests/host/codec_host.cpp``);
* NVRTC, the compiler this module uses through CuPy, compiles every codec at
  every entry size (``tests/test_nvrtc.py``, with the ``nvidia-cuda-nvrtc`` wheel).

One kernel per format operation over the whole tensor, the codec a template
parameter (``csrc/buddy_kernels.cu``): ``measure`` (metadata + size
histogram), ``ends`` (the overflow's prefix sums, one block), ``sizes``
(measure, then the ends in whichever block is done last: a slot chosen
before the sizes compresses in two launches), ``pack`` (slots + overflow
compacted in entry order, written directly) and ``unpack``. A compress sized first reads one small thing back to the host
-- the histogram, which the slot choice needs --, a compress packed ahead
(:meth:`CudaEngine.pack_ahead`) nothing, and a decompress nothing
(:meth:`CudaEngine.unpack` reads the kernel's error flag only when asked to
check). :class:`CudaEngine` is the one kernel engine of every device, its
launcher passed in: CuPy's here, the native build's on the CPU.

Codecs with a table (format version 2: ``fpe``, and ``auto2`` through its
``fpe`` member) code with the fitted codec's :class:`~buddy.codecs.fpe.Table`:
:func:`device_table` lays out its lookups as the kernels read them
(``BuddyFpeTable`` in ``csrc/codec_fpe.h``), and every kernel takes it by
pointer (null for the other codecs). Their engine fits the table itself
(:meth:`CudaEngine.fit_measure`): a ``count`` kernel gives the tensor's
symbol counts, and a ``fit`` kernel -- one warp,
:meth:`~buddy.codecs.fpe.Table.from_counts` byte for byte
(``csrc/codec_fpe_fit.h``) -- fits a table to them, or to learned statistics
(a prior) when the table fitted to the prior before no longer codes it well,
and writes the device table and the serialized table, which comes back in the
histogram's read. So a compress reads the device once with or without a
prior, and the host lays out no table it fitted.

The sources ship as package data (``buddy.csrc``, the repository's
``csrc/``). They are compiled once per process for each (codec, entry size,
device architecture); the format constants arrive as ``-D`` defines from
:func:`buddy.spec.c_defines`. Kernels run on PyTorch's current CUDA stream of
the tensors' device. ``import buddy`` never imports CuPy; the first launch
does, and raises :class:`~buddy.errors.MissingDependencyError` without it.

Every argument is checked before anything is launched (device, dtype,
shape, contiguity, alignment of data pointers): a bad one raises
``ValueError``, never an out-of-bounds access on the device.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from .. import spec
from ..codecs.auto import AUTO_MEMBERS, AutoCodec, member_kinds
from ..codecs.base import Codec, CodecLike
from ..codecs.bpc import BPCCodec
from ..codecs.fpe import MAX_CODED, FPECodec, Table, default_table, fit_weights, n_symbols, refits
from ..codecs.fpe_device import (
    DECODE_ROWS_BYTES,
    DEVICE_TABLE_BYTES,
    FIELDS_BYTES,
    FIT_SERIAL_BYTES,
    FIT_WORK_BYTES,
    device_table,
    remember_device_table,
)  # fmt: skip
from ..codecs.fpx import FPXCodec
from ..codecs.zvc import ZVCCodec
from ..deps import available, require
from ..errors import CorruptDataError
from ..layout import WORD_SIZES, Layout
from . import PLACE_WORDS, Engine, Implementation, Measurement, pinned, raise_for_errors
from .tuning import Tuning, current

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "ALIGN_BYTES",
    "CudaEngine",
    "Kernels",
    "compile_module",
    "KERNEL_CODECS",
    "TABLED_KERNELS",
    "DEVICE_TABLE_BYTES",
    "DECODE_ROWS_BYTES",
    "FIELDS_BYTES",
    "FIT_SERIAL_BYTES",
    "FIT_WORK_BYTES",
    "device_table",
    "codec_table",
    "why_unusable",
    "rows",
    "compile_options",
    "read_source",
    "translation_unit",
    "launch_config",
    "SharedMemory",
    "Launcher",
    "HOPPER",
    "shared_table_layout",
    "shares_tables",
]

#: alignment (bytes) the kernels need of the tensor's data (every other buffer is allocated here)
ALIGN_BYTES = 16
#: most blocks of one launch; warps stride over further entries
MAX_BLOCKS = 1 << 20
#: most blocks of a count launch: about what a Hopper GPU holds at once (132 SMs x 8 blocks of 256 threads). Each
#: block zeroes its histogram in shared memory and adds it to the tensor's once, so a block per entry would spend
#: more on its histogram than on counting (docs/gpu.md)
COUNT_BLOCKS = 1024
#: shared memory (bytes) a block of pack or unpack stages payloads in: one entry per warp
STAGING_BYTES = 32 << 10
#: threads of the one block of an ends launch (``BUDDY_ENDS_THREADS``)
ENDS_THREADS = 256

_WARP = 32
_FEATURE = "buddy's CUDA backend (backend='cuda')"
_SOURCE = "buddy_kernels.cu"

#: what a bad stream (ERR_STREAM) means for the kernels' unpack
_BAD_STREAM = (
    "a payload (its bitmap or stream) does not match the entry sizes in the metadata "
    "(or, for a codec with a table, holds codes the table does not give)"
)

# ---------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)
_REPO_CSRC = Path(__file__).resolve().parents[2] / "csrc"


def read_source(name: str) -> str:
    """Text of ``csrc/<name>``: from the installed ``buddy.csrc`` package, else the repository."""
    try:
        return importlib.resources.files("buddy.csrc").joinpath(name).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        pass
    path = _REPO_CSRC / name
    if not path.is_file():
        raise FileNotFoundError(
            f"CUDA source {name!r} is neither in the installed package (buddy.csrc) nor in {_REPO_CSRC}"
        )
    return path.read_text(encoding="utf-8")


def translation_unit(name: str = _SOURCE) -> str:
    """``csrc/<name>`` with its local ``#include "..."`` files inlined (each once).

    NVRTC compiles one string; inlining makes it independent of where the
    package lives, and the text hashed for the compile cache is exactly
    what is compiled.
    """
    seen: set[str] = set()

    def expand(file: str) -> str:
        seen.add(file)
        text = _PRAGMA_ONCE.sub("", read_source(file))

        def include(match: re.Match) -> str:
            header = match.group(1)
            if header in seen:
                return f"// {header}: already included"
            return f"// ---- begin {header}\n{expand(header)}\n// ---- end {header}"

        return _LOCAL_INCLUDE.sub(include, text)

    return f"// buddy: {name}, local includes inlined\n{expand(name)}"


def compile_options(
    entry_bytes: int, codec: str = "all", word_bytes: int | None = None, shared_tables: bool = False,
    pack_fields: bool = False,
) -> tuple[str, ...]:  # fmt: skip
    """NVRTC options: C++17, the format constants of this entry size, which codec's kernels to build, when given
    the one word size they are built for (csrc/buddy_kernels.cu: a kernel of one word size needs fewer registers
    than one of all four), and whether a table codec's tables are in each block's shared memory (``shared_tables``:
    unpack's copy of the device table's decode rows, and with ``pack_fields`` pack's table of whole fields;
    launched with :func:`launch_config`'s ``shared`` and ``pack_fields`` then)."""
    if pack_fields and not shared_tables:
        raise ValueError("pack's table of whole fields is in shared memory: pack_fields needs shared_tables")
    defines = spec.c_defines(spec.check_entry_bytes(entry_bytes))
    if word_bytes is not None and word_bytes not in WORD_SIZES:  # a launch's last argument, read as the word size
        raise ValueError(f"word sizes are 1, 2, 4 or 8 bytes, got {word_bytes!r}")
    words = () if word_bytes is None else (f"-DBUDDY_WORD_BYTES={int(word_bytes)}",)
    table: tuple[str, ...] = ("-DBUDDY_SHARED_TABLES=1",) if shared_tables else ()
    table += ("-DBUDDY_PACK_FIELDS=1",) if pack_fields else ()
    return (
        "-std=c++17", *(f"-D{k}={v}" for k, v in defines.items()), f"-DBUDDY_CODEC_{codec.upper()}=1", *words, *table
    )


@dataclass(frozen=True)
class SharedMemory:
    """What a device's shared memory allows a launch: its SMs, the most dynamic shared memory one block may ask
    for (opted in), an SM's, and what the runtime keeps of an SM's for each block resident on it."""

    sms: int
    per_block: int
    per_sm: int
    reserved: int = 1 << 10

    def blocks_per_sm(self, block_bytes: int, warps: int) -> int:
        """Blocks of ``warps`` warps and ``block_bytes`` of shared memory resident on an SM at once (64 warps and 32
        blocks an SM at most)."""
        return min(self.per_sm // (block_bytes + self.reserved), 64 // warps, 32)


#: an H100's (SXM) and an H200's: the launches the emulator runs and the kernel budget estimates
HOPPER = SharedMemory(sms=132, per_block=227 << 10, per_sm=228 << 10)
@functools.cache
def shared_table_layout(entry_bytes: int, shared: SharedMemory, most_an_sm: int = 64) -> tuple[int, int] | None:
    """``(warps a block, blocks an SM)`` of a table codec's unpack with its table in shared memory on a device
    of ``shared``: each block holds the table's decode rows (:data:`DECODE_ROWS_BYTES`) and ``2 E`` a warp; the
    most warps an SM (ties: the larger blocks, fewer copies of the rows), at most 24 warps a block at 4 KiB
    entries and more (the kernel's launch bounds), 8 below, ``most_an_sm`` warps (at most 64) and 32 blocks an
    SM. None where one warp's does not fit a block: the table stays in global memory."""
    most = min(24 if entry_bytes >= 4096 else 8, most_an_sm)
    best: tuple[int, int] | None = None
    for warps in range(1, most + 1):
        block = DECODE_ROWS_BYTES + warps * 2 * entry_bytes
        if block > shared.per_block:
            break
        per_sm = min(shared.blocks_per_sm(block, warps), most_an_sm // warps)
        if per_sm and (best is None or per_sm * warps >= best[0] * best[1]):
            best = warps, per_sm
    return best


def launch_config(
    op: str, entry_bytes: int, n_entries: int, codec: str = "", shared: SharedMemory | None = None,
    pack_fields: bool = False, unpack_warps: int | None = None,
) -> tuple[int, int, int]:  # fmt: skip
    """``(blocks, threads per block, dynamic shared bytes)`` of a launch of ``op`` over ``n_entries``.

    One warp per entry; pack and unpack give each warp ``E`` bytes of shared
    memory to stage a payload in (at most :data:`STAGING_BYTES` a block, at
    least one warp), and the unpack of a table codec (``codec`` in
    :data:`TABLED_KERNELS`, whose lanes decode into shared memory) ``2 E``;
    measure, and sizes (measure, then the ends in its last block), stage
    nothing and run 8 warps a block (:data:`ENDS_THREADS` threads). A table codec's
    ``count`` runs 256 threads a block, a thread per 16 bytes
    (``n_entries``: the 8-byte units) up to :data:`COUNT_BLOCKS` blocks,
    which then loop; its ``fit`` is one warp.

    Given the device's ``shared`` memory, a table codec's tables go into
    each block's shared memory, before the warps' staging (the module
    compiled with ``compile_options(..., shared_tables=True)``): unpack's copy
    of the device table's decode rows, where :func:`shared_table_layout` finds room, and
    with ``pack_fields`` (:attr:`Tuning.pack_fields`) pack's table of whole fields
    (:data:`FIELDS_BYTES`), its warps as before. Either runs as many blocks as
    stay resident at once, their warps striding over the entries, so a block
    makes its table once. ``unpack_warps`` (:attr:`Tuning.unpack_warps`): that unpack at most so many warps an SM.
    """
    if op == "fit":
        return 1, _WARP, 0
    if op == "ends":  # one block (csrc/buddy_kernels.cu: BUDDY_ENDS_THREADS)
        return 1, ENDS_THREADS, 0
    if op == "count":  # a lane loads 16 bytes a round; the blocks loop, their histograms zeroed and added once
        return max(1, min(COUNT_BLOCKS, -(-n_entries // 512))), 256, 0
    tables = shared if codec in TABLED_KERNELS else None
    found = None
    if tables is not None and op == "unpack":
        found = shared_table_layout(entry_bytes, tables, unpack_warps or 64)
    if tables is not None and found is not None:
        warps, per_sm = found
        blocks = max(1, min(tables.sms * per_sm, -(-n_entries // warps)))
        return blocks, warps * _WARP, DECODE_ROWS_BYTES + warps * 2 * entry_bytes
    staged = op not in ("measure", "sizes")
    per_warp = entry_bytes * (2 if op == "unpack" and codec in TABLED_KERNELS else 1)
    warps = max(1, min(8, STAGING_BYTES // per_warp)) if staged else 8
    blocks = max(1, min(MAX_BLOCKS, -(-n_entries // warps)))
    if tables is not None and pack_fields and op == "pack":  # the fields, then the warps' staging; resident blocks loop
        block = FIELDS_BYTES + warps * entry_bytes
        return max(1, min(tables.sms * max(1, tables.blocks_per_sm(block, warps)), blocks)), warps * _WARP, block
    return blocks, warps * _WARP, warps * per_warp if staged else 0


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
    :func:`compile_options`), compiled for ``device`` (and allowed its shared memory): a module per codec, entry
    size, word size and table place."""
    key = (codec, op, entry_bytes, device.index, word_bytes, shared_tables, pack_fields)
    kernel = _kernels.get(key)
    if kernel is None:
        cupy = _cupy()
        options = compile_options(entry_bytes, codec, word_bytes, shared_tables, pack_fields)
        module = _module(translation_unit(_SOURCE), options, device)
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


def device_shared_memory(device: torch.device, tuning: Tuning) -> SharedMemory | None:
    """:class:`SharedMemory` of ``device`` (its properties), or None where ``tuning`` asks a table codec's pack and
    unpack to read its table in global memory (:attr:`Tuning.shared_tables` false)."""
    if not tuning.shared_tables:
        return None
    return _device_shared_memory(device.index)


def shares_tables(codec: str, entry_bytes: int, shared: SharedMemory) -> bool:
    """Whether ``codec``'s tables go into the shared memory of a device of ``shared`` (its module compiled so: every
    kernel of the codec comes from that one module). Unpack's needs the most room: where it fits, pack's does."""
    return codec in TABLED_KERNELS and shared_table_layout(entry_bytes, shared) is not None


def _table_in_shared(codec: str, entry_bytes: int, device: torch.device, tuning: Tuning) -> SharedMemory | None:
    """The device's :class:`SharedMemory` where ``codec``'s tables go into its shared memory (:func:`shares_tables`;
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
# argument checks (before any launch)
# ---------------------------------------------------------------------------
def _check_tensor(
    what: str, t, *, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...] | None = None
) -> None:
    """``ValueError`` unless ``t`` is a dense, aligned tensor of this device, dtype and shape."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{what} is on {t.device}, expected {device} (all buffers on the same CUDA device)")
    if t.dtype != dtype:
        raise ValueError(f"{what} must be {dtype}, got {t.dtype}")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {tuple(t.shape)}")
    if t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous (dense) tensor")
    if t.numel():
        ptr = t.data_ptr()
        if ptr == 0:
            raise ValueError(f"{what} has a null data pointer")
        if ptr % ALIGN_BYTES:
            raise ValueError(
                f"{what}'s data pointer {ptr:#x} is not {ALIGN_BYTES}-byte aligned (a view at an odd "
                f"offset?); pass a copy (.clone())"
            )


def _i64(v: int):
    import numpy

    return numpy.int64(v)


def _i32(v: int):
    import numpy

    return numpy.int32(v)


# ---------------------------------------------------------------------------
# codec tables: the device form of an fpe Table
# ---------------------------------------------------------------------------
#: codecs with kernels: the exact class the kernels reproduce, by registry name (the one list: the
#: implementation table, the self-test and the tests read it; csrc/ has its own, checked against it)
KERNEL_CODECS: dict[str, type[Codec]] = {
    "zvc": ZVCCodec, "fpx": FPXCodec, "bpc": BPCCodec, "auto": AutoCodec, "fpe": FPECodec, "auto2": AutoCodec,
}  # fmt: skip
#: codecs whose kernels code with a table (their ``table`` argument is a device table, not null): ``fpe`` and the
#: auto codecs with it among their members
TABLED_KERNELS = frozenset(
    name for name, cls in KERNEL_CODECS.items() if FPECodec in (cls, *AUTO_MEMBERS.get(name, ()))
)
def _on_device(table: Table, device: torch.device) -> torch.Tensor:
    """:func:`device_table` of ``table`` on ``device``: copied there once (kept on the table), never written."""
    return _copy_once(table.on_device, device, lambda: device_table(table))


def _copy_once(copies: dict[torch.device, torch.Tensor], device: torch.device, host) -> torch.Tensor:
    """``copies[device]``, made the first time from ``host()`` (host bytes nothing writes): on a GPU from pinned
    memory, without waiting (the kernels that read it follow on the current stream)."""
    found = copies.get(device)
    if found is None:
        made = host()
        if made.device != device:
            made = (made.pin_memory() if device.type == "cuda" else made).to(device, non_blocking=True)
        found = copies[device] = made
    return found


_ZEROS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _zeros(device: torch.device, nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes on ``device``, made once per process and never written (a read-only input)."""
    found = _ZEROS.get((device, nbytes))
    if found is None:
        found = _ZEROS.setdefault((device, nbytes), torch.zeros(nbytes, dtype=torch.uint8, device=device))
    return found


#: the sizes kernel's ``room`` when nothing bounds the step's overflow
NO_BOUND = 1 << 62


def _placement(place, reserve, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack's and unpack's ``place`` and ``reserve`` arguments: the given ones, else null pointers (no placement:
    every overflow sector in the overflow buffer, in order)."""
    if place is None:
        return _zeros(device, 0).view(torch.int64), _zeros(device, 0)
    return place, reserve


def codec_table(codec: Codec, word_bytes: int) -> Table | None:
    """The fpe table the kernels of ``codec`` code with, ``None`` for a codec without one.

    ``fpe``'s own, or ``auto2``'s fpe member's: the table it was fitted to or bound
    to, else (an unfitted codec, as the reference) the word size's default table.
    """
    fpe = _fpe_member(codec)
    if fpe is None:
        return None
    table = fpe.fitted
    if table is None:
        return default_table(word_bytes)
    if table.word_bytes != word_bytes:
        raise ValueError(f"this fpe table is for {table.word_bytes}-byte words, got {word_bytes}-byte words")
    return table


def _fpe_member(codec: CodecLike | None) -> FPECodec | None:
    """``codec`` itself if it is fpe, else its fpe member (an auto codec's), else ``None``."""
    if isinstance(codec, AutoCodec):
        return next((member for _, member in codec.members if isinstance(member, FPECodec)), None)
    return codec if isinstance(codec, FPECodec) else None


# ---------------------------------------------------------------------------
# the kernels of one codec: strict (no copies), checked before any launch
# ---------------------------------------------------------------------------
class Launcher(NamedTuple):
    """A launch function looked up where it lives at each launch (``of()`` returns it): an engine kept from call to
    call (:mod:`buddy.dispatch`) launches through what is there then, a test's stand-in included."""

    of: Callable[[], Callable]


class Kernels:
    """The three kernels of codec ``name`` (``buddy_<name>_measure/pack/unpack``), arguments checked.

    ``launch(codec, op, entry_bytes, device, n_entries, args, tuning)`` runs
    a kernel (default: compiled through CuPy, on torch's current stream: this
    module's ``_launch``, looked up at each launch; a :class:`Launcher` is
    asked at each launch too), laid out as :attr:`tuning` says (given, else
    the current one when made: :mod:`buddy.engines.tuning`); ``device_type``
    is the device the tensors must live on. Tests run the same glue with the
    kernels emulated on the host by passing both.
    Buffers: ``data`` the tensor's ``n_full`` whole entries (16-byte
    aligned), ``tail`` the last entry zero-padded (``E`` bytes), ``meta``
    ``n * META_BYTES`` bytes, ``ends`` ``(n,)`` int64 (see csrc/buddy_ops.h);
    ``table`` the codec's device table for the codecs that code with one
    (:data:`TABLED_KERNELS`), else ``None``.
    """

    def __init__(self, name: str, *, launch=None, device_type: str = "cuda", tuning: Tuning | None = None):
        self.name = name
        self._launch = launch
        self.device_type = device_type
        self.tuning = current() if tuning is None else tuning

    @property
    def launcher(self) -> Callable:
        """What runs a kernel now (see the class doc)."""
        given = self._launch
        if given is None:
            return _launch
        return given.of() if isinstance(given, Launcher) else given

    def launch(self, codec: str, op: str, entry_bytes: int, device: torch.device, n_entries: int, args: tuple) -> None:
        self.launcher(codec, op, entry_bytes, device, n_entries, args, self.tuning)

    def _check(self, layout: Layout, entries: tuple = (), **buffers) -> torch.device:
        """The buffers' common device; ``ValueError`` for any that is not what the kernels need.

        ``entries``: ``(data, tail)``, the tensor's whole entries and its last one (``E`` bytes, zero-padded).
        """
        if entries:
            data, tail = entries
            whole = (data, torch.uint8, layout.n_full * layout.entry_bytes)
            buffers = dict(data=whole, tail=(tail, torch.uint8, layout.entry_bytes), **buffers)
        device: torch.device | None = None
        for what, (t, dtype, numel) in buffers.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != self.device_type:
                raise ValueError(f"{what} must be on a CUDA device for the CUDA kernels, got one on {t.device}")
            device = device or t.device
            _check_tensor(what, t, device=device, dtype=dtype, shape=(numel,))
        if device is None:
            raise ValueError("no buffers to check")
        return device

    def _table(self, table, device: torch.device) -> torch.Tensor:
        """The kernels' ``table`` argument: the codec's device table (:func:`device_table`), checked; for a
        codec without one, nothing (an empty tensor: a null pointer)."""
        want = DEVICE_TABLE_BYTES if self.name in TABLED_KERNELS else 0
        if table is None:
            if want:
                raise ValueError(f"codec {self.name!r} codes with a table: pass its device table (device_table)")
            table = torch.empty(0, dtype=torch.uint8, device=device)
        _check_tensor("table", table, device=device, dtype=torch.uint8, shape=(want,))
        return table

    def measure(self, layout: Layout, data, tail, meta, histogram, table=None) -> None:
        """Every entry's metadata word into ``meta``; entries of ``k`` sectors added to ``histogram[k]``."""
        device = self._check(
            layout, (data, tail), meta=(meta, torch.uint8, layout.meta_bytes),
            histogram=(histogram, torch.int64, layout.bins),
        )  # fmt: skip
        table = self._table(table, device)
        n_full, n, word = _i64(layout.n_full), _i64(layout.n_entries), _i32(layout.word_bytes)
        args = (data, tail, n_full, n, meta, histogram, table, word)
        self.launch(self.name, "measure", layout.entry_bytes, device, layout.n_entries, args)

    def count(self, layout: Layout, data, tail, counts) -> None:
        """A table codec's symbol counts of the tensor's whole words added to ``counts`` (``S + 2`` int64): the
        8-byte units of ``data`` and the whole words of the tail's :attr:`~Layout.tail_bytes`. A warp's lanes of
        equal keys add their number once, or its zero words are counted by ballots and the other words added one by
        one (:meth:`Tuning.count_matches`: 2-byte words by default): the same counts."""
        self._tabled()
        word = layout.word_bytes
        device = self._check(layout, (data, tail), counts=(counts, torch.int64, n_symbols(word)))
        n_units, tail_words = layout.n_full * layout.entry_bytes // 8, layout.tail_bytes // word
        aggregate = _i32(int(self.tuning.count_matches(word)))
        args = (data, _i64(n_units), tail, _i32(tail_words), counts, aggregate, _i32(word))
        self.launch(self.name, "count", layout.entry_bytes, device, n_units, args)

    def fit(self, layout: Layout, counts, work, table, serial, weighted: bool = False) -> None:
        """The table fitted to ``counts`` (:meth:`Table.from_counts`): the device table into ``table``
        (:data:`DEVICE_TABLE_BYTES`), the serialized one into ``serial`` (:data:`FIT_SERIAL_BYTES`, zeros
        after it); ``work``: :data:`FIT_WORK_BYTES` of scratch. ``weighted``: ``counts`` are the weights
        :func:`~buddy.codecs.fpe.fit_weights` makes of counts or frequencies, fitted as they are."""
        self._tabled()
        device = self._check(
            layout, counts=(counts, torch.int64, n_symbols(layout.word_bytes)),
            work=(work, torch.uint8, FIT_WORK_BYTES), table=(table, torch.uint8, DEVICE_TABLE_BYTES),
            serial=(serial, torch.uint8, FIT_SERIAL_BYTES),
        )  # fmt: skip
        args = (counts, work, table, serial, _i32(int(weighted)), _i32(layout.word_bytes))
        self.launch(self.name, "fit", layout.entry_bytes, device, 1, args)

    def sizes(
        self, layout: Layout, data, tail, meta, histogram, slot: int, ends, place, *, room: int | None = None,
        step=None, reserve_sectors: int = 0, table=None,
    ) -> None:  # fmt: skip
        """:meth:`measure` and :meth:`ends` in one launch, for slots of ``slot`` sectors chosen before the sizes are
        known, and where the overflow goes: every entry's metadata word into ``meta``, entries of ``k`` sectors
        added to ``histogram[k]``, the overflow's prefix sums into ``ends`` (``n`` int64), and its placement into
        ``place`` (:data:`PLACE_WORDS` int64, zero: ``cap``, ``r``, ``offset``, then the kernel's count of its
        blocks done), all of it but measure's by the launch's last block.

        The placement: the first ``cap`` overflow sectors to buddy memory, as many as ``room`` (the sectors the
        step's bound allows its tensors so far, this one's included; None: no bound) less what the step sent there
        before (``step[0]``); the next ``r`` to the step's reserve on the device at sector ``offset``, as many as
        are left of its ``reserve_sectors`` (``step[1]`` used); any others to buddy memory. ``step``: 2 int64 on
        the device, zero at the step's start, which it adds to (None: no step, no reserve)."""
        n = layout.n_entries
        buffers = dict(
            meta=(meta, torch.uint8, layout.meta_bytes), histogram=(histogram, torch.int64, layout.bins),
            ends=(ends, torch.int64, n), place=(place, torch.int64, PLACE_WORDS),
        )  # fmt: skip
        if step is not None:
            buffers["step"] = (step, torch.int64, 2)
        device = self._check(layout, (data, tail), **buffers)
        if reserve_sectors < 0 or (reserve_sectors and step is None):
            raise ValueError(f"a reserve of {reserve_sectors} sectors needs a step's state (step=) and is >= 0")
        table = self._table(table, device)
        step = _zeros(device, 0).view(torch.int64) if step is None else step
        room = _i64(NO_BOUND if room is None else max(0, min(int(room), NO_BOUND)))
        n_full, word = _i64(layout.n_full), _i32(layout.word_bytes)
        args = (data, tail, n_full, _i64(n), meta, histogram, table, _i32(slot), ends, place, room, step,
                _i64(reserve_sectors), word)  # fmt: skip
        self.launch(self.name, "sizes", layout.entry_bytes, device, n, args)

    def ends(self, layout: Layout, meta, slot: int, ends) -> None:
        """Per entry into ``ends`` (``n`` int64), the overflow sectors of entries ``0..i`` with slots of ``slot``
        sectors: ``max(k - slot, 0)`` summed, ``k`` from ``meta``."""
        n = layout.n_entries
        device = self._check(layout, meta=(meta, torch.uint8, layout.meta_bytes), ends=(ends, torch.int64, n))
        args = (meta, _i64(n), _i32(slot), ends, _i32(layout.word_bytes))
        self.launch(self.name, "ends", layout.entry_bytes, device, n, args)

    def _tabled(self) -> None:
        if self.name not in TABLED_KERNELS:
            raise ValueError(f"codec {self.name!r} codes without a table: it has no count or fit kernel")

    def _overflow_buffers(self, overflow, place, reserve) -> tuple[dict, bool]:
        """Pack's and unpack's overflow and placement buffers for :meth:`_check`, and whether the overflow is in
        host memory, which the CUDA kernels reach where it is (then checked apart: :func:`_check_host_overflow`). A
        placement (:meth:`sizes`'s) and the step's reserve go together."""
        if (place is None) != (reserve is None):
            raise ValueError("a placement and a reserve go together: pass both or neither")
        in_place = self.device_type == "cuda" and isinstance(overflow, torch.Tensor) and overflow.device.type == "cpu"
        buffers = {} if in_place else {"overflow": (overflow, torch.uint8, overflow.numel())}
        if place is not None:
            buffers.update(place=(place, torch.int64, PLACE_WORDS), reserve=(reserve, torch.uint8, reserve.numel()))
        return buffers, in_place

    def pack(
        self, layout: Layout, data, tail, meta, ends, slot: int, slots, overflow, table=None, place=None,
        reserve=None,
    ) -> None:  # fmt: skip
        """Every entry's slot (``slot`` sectors) into ``slots``, its overflow into ``overflow`` at its place.

        ``overflow`` is on the device, or (CUDA kernels) in pinned host memory mapped into the device's address
        space, written where it is over the bus (:meth:`CudaEngine.writes_overflow_at`). With ``place`` (the
        :meth:`sizes` kernel's) and ``reserve`` (the step's, on the device: whole sectors), the overflow's
        sectors go where the placement says, some of them into the reserve."""
        n = layout.n_entries
        buffers, in_place = self._overflow_buffers(overflow, place, reserve)
        device = self._check(
            layout, (data, tail), meta=(meta, torch.uint8, layout.meta_bytes), ends=(ends, torch.int64, n),
            slots=(slots, torch.uint8, layout.slots_bytes(slot)), **buffers,
        )  # fmt: skip
        if in_place:
            _check_host_overflow(overflow, "write")
        table = self._table(table, device)
        place, reserve = _placement(place, reserve, device)
        n_full, word = _i64(layout.n_full), _i32(layout.word_bytes)
        args = (data, tail, n_full, _i64(n), meta, ends, _i32(slot), slots, overflow, place, reserve, table, word)
        self.launch(self.name, "pack", layout.entry_bytes, device, n, args)

    def unpack(
        self, layout: Layout, meta, ends, slot: int, slots, overflow, out, error, table=None, place=None,
        reserve=None,
    ) -> None:  # fmt: skip
        """The entries into ``out`` (``n * E`` bytes); ``error`` (one int32) ORed with what was flagged.

        ``overflow`` is on the device, or (CUDA kernels) in pinned host memory, read where it is over the bus
        (:func:`reads_overflow_in_place`). With ``place`` and ``reserve`` (as :meth:`pack`'s), the overflow's
        sectors are where the placement says, ``overflow`` holding those not in the reserve; a placement that
        would read outside either is flagged."""
        if overflow.numel() % spec.SECTOR_BYTES:
            raise CorruptDataError(f"overflow holds {overflow.numel()} bytes, not a whole number of sectors")
        n = layout.n_entries
        if reserve is not None and reserve.numel() % spec.SECTOR_BYTES:
            raise CorruptDataError(f"the reserve holds {reserve.numel()} bytes, not a whole number of sectors")
        buffers, in_place = self._overflow_buffers(overflow, place, reserve)
        device = self._check(
            layout, meta=(meta, torch.uint8, layout.meta_bytes), ends=(ends, torch.int64, n),
            slots=(slots, torch.uint8, layout.slots_bytes(slot)), out=(out, torch.uint8, n * layout.entry_bytes),
            error=(error, torch.int32, 1), **buffers,
        )  # fmt: skip
        if in_place:
            _check_host_overflow(overflow, "read")
        m = overflow.numel() // spec.SECTOR_BYTES
        table = self._table(table, device)
        word = _i32(layout.word_bytes)
        reserved = 0 if reserve is None else reserve.numel() // spec.SECTOR_BYTES
        place, reserve = _placement(place, reserve, device)
        args = (meta, ends, _i32(slot), slots, overflow, _i64(m), place, reserve, _i64(reserved), out, error, _i64(n),
                table, word)  # fmt: skip
        self.launch(self.name, "unpack", layout.entry_bytes, device, n, args)


def _check_host_overflow(overflow: torch.Tensor, verb: str) -> None:
    """``ValueError`` unless an overflow in host memory is what the CUDA kernels can ``verb`` where it is: pinned
    (when it holds anything), dense and aligned."""
    if overflow.numel() and not overflow.is_pinned():
        raise ValueError(f"an overflow in host memory must be pinned for the CUDA kernels to {verb} it")
    _check_tensor("overflow", overflow, device=overflow.device, dtype=torch.uint8, shape=(overflow.numel(),))


#: cudaDevAttrCanUseHostPointerForRegisteredMem: a registered host pointer is a valid device pointer as it is
_HOST_POINTER_ATTRIBUTE = 91


def reads_overflow_in_place(overflow: torch.Tensor, device: torch.device, tuning: Tuning) -> bool:
    """Whether an unpack on ``device`` reads ``overflow`` in pinned host memory, over the bus, as its kernel runs.

    By default the overflow is first copied to the device whole (on the compute stream, before the kernel):
    its time adds to the kernel's. Read in place, the copy is the kernel's own loads, overlapped with its
    decoding. Opt-in (:attr:`Tuning.zero_copy`) until a GPU run says which is faster; it needs the overflow
    pinned and a device that takes registered host pointers as they are.
    """
    if not tuning.zero_copy:
        return False
    return bool(overflow.numel()) and _device_reaches(overflow, device)


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


def _error_flag(given: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The int32 an unpack ORs its error bits into: ``given`` (checked), else a fresh zero."""
    if given is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    _check_tensor("error_flag", given, device=device, dtype=torch.int32, shape=(1,))
    return given


# ---------------------------------------------------------------------------
# the engine the pipeline calls (its rows: buddy.dispatch's table)
# ---------------------------------------------------------------------------
def why_unusable() -> str | None:
    """Why the CUDA kernels cannot run here (no CuPy, no GPU), or ``None``."""
    if not available("cupy"):
        return "CuPy is not importable: pip install 'buddy[cuda12]' or 'buddy[cuda13]'"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def rows() -> tuple[Implementation, ...]:
    """The kernels of every codec of :data:`KERNEL_CODECS`: the default on CUDA devices, once its self-test passed
    there (see :mod:`buddy.dispatch`)."""
    return tuple(
        Implementation(name, "cuda", "cuda", CudaEngine, default=True, requires=why_unusable) for name in KERNEL_CODECS
    )


class CudaEngine(Engine):
    """The format operations as kernels over the whole tensor: the same bytes as the reference.

    The one kernel engine of every device: its launcher is passed in
    (``launch`` and ``device_type``, see :class:`Kernels`): CuPy's on a CUDA
    device (the default), the native build's on the CPU
    (:func:`buddy.engines.native.NativeEngine`), the emulator's in the tests.
    So what the host does per tensor -- argument checks, allocations, the
    count, fit, measure, sizes, ends, pack and unpack launches, reads -- is the same
    on every device, and what the CPU counts of it is what a GPU pays.
    :attr:`readbacks` counts the device-to-host reads made (per compress
    sized first one: the histogram, with a table codec's table when it fits
    one; none per decompress unless ``check=True``; none by :meth:`pack_ahead`).
    """

    backend = "cuda"
    codec: Codec

    def __init__(self, codec: CodecLike, *, launch=None, device_type: str = "cuda", tuning: Tuning | None = None):
        # the kernels reproduce exactly buddy's class of that name (an auto codec: with its own members, in order)
        kinds = tuple((m, type(c)) for m, c in codec.members) if isinstance(codec, AutoCodec) else None
        exact = type(codec) is KERNEL_CODECS.get(codec.name)
        if not exact or (kinds is not None and kinds != member_kinds(codec.name)):
            have = ", ".join(sorted(KERNEL_CODECS))
            raise ValueError(
                f"codec {codec.name!r} ({type(codec).__name__}) has no CUDA kernels (codecs with them: {have})"
            )
        super().__init__(codec)
        self.kernels = Kernels(codec.name, launch=launch, device_type=device_type, tuning=tuning)
        self._tables: dict[tuple[torch.device, int], torch.Tensor | None] = {}

    def for_tensor(self) -> Self:
        """:meth:`Engine.for_tensor`: the kernels shared; the device tables of the copy's codec its own (a fit
        puts the fitted table's there)."""
        made = super().for_tensor()
        made._tables = {}
        return made

    def _table(self, device: torch.device, word_bytes: int) -> torch.Tensor | None:
        """The codec's device table for the kernels (``None`` for a codec without one).

        Copied to a device once per table (:attr:`Table.on_device`): a key's table
        kept from step to step (and every decompress of a tensor coded with it) reads
        the same copy, never written. The copy is from pinned memory, non-blocking,
        on the current stream, which the kernels reading it follow.
        """
        key = (device, word_bytes)
        if key not in self._tables:
            table = codec_table(self.codec, word_bytes)
            self._tables[key] = None if table is None else _on_device(table, device)
        return self._tables[key]

    @staticmethod
    def _entries(flat: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, tail)``: the whole entries in place (aligned), the last one zero-padded (``E`` bytes).

        A tensor of whole entries (most activations) has no last entry to pad: its ``tail`` is a buffer of zeros
        kept per device and entry size, which the kernels never write (the glue makes one per tensor otherwise)."""
        whole = layout.n_full * layout.entry_bytes
        if flat.numel() and flat.data_ptr() % ALIGN_BYTES:
            flat = flat.clone()  # a view at an odd offset: the kernels load 16 bytes at a time
        if not layout.tail_bytes:
            return flat[:whole], _zeros(flat.device, layout.entry_bytes)
        tail = torch.zeros(layout.entry_bytes, dtype=torch.uint8, device=flat.device)
        tail[: layout.tail_bytes] = flat[whole:]
        return flat[:whole], tail

    def _ends(self, meta: torch.Tensor, slot: int, layout: Layout) -> torch.Tensor:
        """Per entry, the overflow sectors of entries 0..i: the prefix sums that place each entry's overflow (the
        ends kernel, on every device: one launch, one allocation)."""
        ends = torch.empty(layout.n_entries, dtype=torch.int64, device=meta.device)
        if layout.n_entries:
            self.kernels.ends(layout, meta, slot, ends)
        return ends

    def _measure(self, flat, entries, layout: Layout, histogram) -> torch.Tensor:
        """The metadata of ``entries`` (:meth:`_entries`); sizes added to the device ``histogram``."""
        meta = torch.empty(layout.meta_bytes, dtype=torch.uint8, device=flat.device)
        if layout.n_entries:
            table = self._table(flat.device, layout.word_bytes)
            data, tail = entries
            self.kernels.measure(layout, data, tail, meta, histogram, table)
        return meta

    def measure(self, flat, layout):
        return self._measure_read(flat, self._entries(flat, layout), layout)

    def _measure_read(self, flat, entries, layout: Layout) -> Measurement:
        """:meth:`measure` of entries already made: the histogram is the one read."""
        histogram = torch.zeros(layout.bins, dtype=torch.int64, device=flat.device)
        meta = self._measure(flat, entries, layout, histogram)
        return Measurement(meta, tuple(self.read(histogram).tolist()), reuse=entries)

    def fit_measure(self, flat, layout, prior=None, keep=None, count=True):
        """The codec fitted to ``flat`` and its sizes, with one read of the device (see the module doc).

        A codec with a table (:data:`TABLED_KERNELS`) is counted and fitted
        on the device: the ``count`` kernel gives the tensor's symbol counts
        (the fitted codec's :attr:`~buddy.codecs.base.Codec.statistics`, left
        on the device). The ``fit`` kernel fits the table to them, or, with a
        ``prior``, to the weights the host's fit makes of it
        (:func:`~buddy.codecs.fpe.fit_weights`: the table
        :meth:`~buddy.codecs.fpe.Table.from_counts` would make of the prior)
        -- unless ``keep``'s table still codes the prior well
        (:func:`~buddy.codecs.fpe.refits`), which is then kept (nothing
        fitted, nothing more read). A fitted table's serialized bytes come
        back with the histogram, from which the host rebuilds the same
        :class:`~buddy.codecs.fpe.Table`
        (:meth:`~buddy.codecs.fpe.Table.from_bytes`); on the CPU its laid-out
        bytes are kept for the engines of later steps
        (:func:`remember_device_table`). With a prior and without ``count``
        nothing is counted (the fitted codec's statistics are ``None``). Any
        other codec has nothing to fit.
        """
        if self.codec.name not in TABLED_KERNELS:
            return super().fit_measure(flat, layout, prior, keep, count)
        device, codec, word = flat.device, self.codec, layout.word_bytes
        entries = self._entries(flat, layout)
        counts = self._count(layout, entries, device) if prior is None or count else None
        kept = codec.kept_table(keep)
        if prior is not None and kept is not None and not refits(prior, word, kept):
            self.codec = codec.with_table(kept, counts)  # keep's table, still good: what codec.fit(prior) returns
            self._tables.clear()  # the fitted table, not the unfitted codec's
            return self.codec, self._measure_read(flat, entries, layout)
        # fitted here: to the tensor's counts, or to the prior's weights (the host's fit of them, byte for byte)
        if prior is None and counts is not None:
            fit_to = counts
        else:
            weights = fit_weights(prior, word)
            fit_to = (weights.pin_memory() if device.type == "cuda" else weights).to(device, non_blocking=True)
        # one buffer for what comes back: the histogram, then (16-byte aligned) the serialized table
        at = -(-layout.bins // 2) * 2
        readout = torch.zeros(at + -(-FIT_SERIAL_BYTES // 8), dtype=torch.int64, device=device)
        serial = readout[at:].view(torch.uint8)[:FIT_SERIAL_BYTES]
        table = torch.empty(DEVICE_TABLE_BYTES, dtype=torch.uint8, device=device)
        work = torch.empty(FIT_WORK_BYTES, dtype=torch.uint8, device=device)
        self.kernels.fit(layout, fit_to, work, table, serial, weighted=prior is not None)
        self._tables[(device, word)] = table
        meta = self._measure(flat, entries, layout, readout[: layout.bins])
        host = self.read(readout)
        raw = host[at:].view(torch.uint8)[:FIT_SERIAL_BYTES]
        n = int(raw[2]) | int(raw[3]) << 8
        if n > MAX_CODED + 2:
            raise RuntimeError(f"the fit kernel wrote a table of {n} codes (at most {MAX_CODED + 2})")
        fitted = Table.from_bytes(raw[: 4 + 3 * n].clone(), word)
        if prior is not None:
            fitted.fit_slack = fitted.slack(prior)  # as Table.from_counts sets it: the next step may keep the table
        if device.type == "cpu":
            remember_device_table(fitted, table)  # its decompress, and the next step's engine, need not lay it out
        self.codec = codec.with_table(fitted, counts)
        return self.codec, Measurement(meta, tuple(host[: layout.bins].tolist()), reuse=entries)

    def _count(self, layout: Layout, entries: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> torch.Tensor:
        """The count kernel's symbol counts of the tensor's ``entries`` (:meth:`_entries`), on its device."""
        counts = torch.zeros(n_symbols(layout.word_bytes), dtype=torch.int64, device=device)
        self.kernels.count(layout, *entries, counts)
        return counts

    def pack(self, flat, measured, slot, layout, into=None):
        self._refuse_into(into, f"on {flat.device}")
        data, tail = measured.reuse or self._entries(flat, layout)
        spilled = layout.overflow_bytes(measured.histogram, slot)  # known on the host: no read
        slots = torch.empty(layout.slots_bytes(slot), dtype=torch.uint8, device=flat.device)
        overflow = torch.empty(spilled, dtype=torch.uint8, device=flat.device) if into is None else into
        if layout.n_entries:
            ends = self._ends(measured.meta, slot, layout)
            table = self._table(flat.device, layout.word_bytes)
            self.kernels.pack(layout, data, tail, measured.meta, ends, slot, slots, overflow, table)
        return slots, overflow

    #: whether :meth:`pack_ahead` can compress a tensor with a slot chosen before its sizes are known
    packs_ahead = True

    @property
    def packs_into_host(self) -> bool:  # type: ignore[override]  # a property over the class attribute
        """Kernels launched on the host's tensors (the native build, the emulator) write the overflow where it is
        kept, buddy memory being the host's."""
        return self.kernels.device_type == "cpu"

    def writes_overflow_at(self, into: torch.Tensor, device: torch.device) -> bool:
        """Whether the pack kernel on ``device`` can write an overflow into ``into`` (buddy memory) where it is:
        the host's memory, for tensors of the host; on a GPU, pinned memory mapped into the device's address
        space, on a device that takes a registered host pointer as it is (each write then crosses the bus as the
        kernel runs)."""
        if into.device.type != "cpu" or into.data_ptr() % ALIGN_BYTES:
            return False
        if self.kernels.device_type == "cpu":
            return device.type == "cpu"
        return not into.numel() or _device_reaches(into, device)

    def pack_ahead(
        self, flat, layout, slot, sizes, into, *, prior=None, keep=None, count=True, room=None, step=None,
        reserve=None,
    ):  # fmt: skip
        """Compress ``flat`` with a slot chosen before its sizes are known: nothing is read back.

        ``sizes``: :data:`PLACE_WORDS` ``+ layout.bins`` int64 on the tensor's device, zero: the sizes kernel's
        placement words (:meth:`Kernels.sizes`), then the histogram the entries' sizes are added to (a slice of
        a step's buffer, read once for all its tensors). ``room``, ``step``: the step's bound and its state on the
        device (:meth:`Kernels.sizes`); ``reserve``: the step's reserve, whole sectors on the device, which takes
        the overflow sectors past the tensor's room (None: none, they go to buddy memory); ``into``: the overflow's place in buddy
        memory, at least ``layout.slots_bytes(E / 32) - layout.slots_bytes(slot)`` bytes (the worst case: every
        entry stored raw), where the pack kernel writes it (:meth:`writes_overflow_at`); the bytes it holds are
        ``32 * ends[-1]``, known once ``histogram`` is read. A codec with a table fits it on the host to
        ``prior`` (``keep``'s while it still codes the prior well) and counts the tensor's symbols on the device
        where ``count`` says so; it needs a ``prior`` (without one its table is fitted to the tensor's counts,
        which are read back). Returns ``(codec, meta, slots, ends)``: the fitted codec, the metadata and slots on
        the device, and per entry the overflow sectors of entries ``0..i`` (int64 on the device; kept for
        unpack). Two launches (the count a third, where asked): sizes -- the metadata, the histogram and the
        prefix sums --, then pack.
        """
        device = flat.device
        worst = layout.slots_bytes(layout.sectors_per_entry) - layout.slots_bytes(slot)
        if into.numel() < worst or not self.writes_overflow_at(into, device):
            raise ValueError(f"pack_ahead writes the overflow into {worst} bytes of buddy memory it can reach")
        entries = self._fit_ahead(flat, layout, prior, keep, count)
        meta = torch.empty(layout.meta_bytes, dtype=torch.uint8, device=device)
        slots = torch.empty(layout.slots_bytes(slot), dtype=torch.uint8, device=device)
        ends = torch.empty(layout.n_entries, dtype=torch.int64, device=device)
        if layout.n_entries:
            table = self._table(device, layout.word_bytes)
            place, histogram = sizes[:PLACE_WORDS], sizes[PLACE_WORDS:]
            reserved = 0 if reserve is None else reserve.numel() // spec.SECTOR_BYTES
            self.kernels.sizes(
                layout, *entries, meta, histogram, slot, ends, place, room=room, step=step, reserve_sectors=reserved,
                table=table,
            )  # fmt: skip
            placed = {} if reserve is None else {"place": place, "reserve": reserve}
            self.kernels.pack(layout, *entries, meta, ends, slot, slots, into, table, **placed)
        return self.codec, meta, slots, ends

    def stored_table(self, device: torch.device) -> torch.Tensor | None:
        """The table a tensor coded with the engine's codec carries (:attr:`CodecLike.table`) on ``device``: one
        copy per table and device, shared by every tensor coded with it (none writes it); ``None`` without one."""
        fpe = _fpe_member(self.codec)
        table = None if fpe is None else fpe.fitted
        return None if table is None else _copy_once(table.stored_on, device, table.to_bytes)

    def measure_ahead(self, flat, layout, sizes, *, prior=None, keep=None, count=True):
        """:meth:`pack_ahead`'s fit and sizes alone, nothing packed (a tensor kept as it is, whose key goes on
        learning): the fitted codec; the sizes are added to ``sizes``' histogram (as :meth:`pack_ahead`'s)."""
        entries = self._fit_ahead(flat, layout, prior, keep, count)
        self._measure(flat, entries, layout, sizes[PLACE_WORDS:])
        return self.codec

    def _fit_ahead(self, flat, layout: Layout, prior, keep, count: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensor's entries (:meth:`_entries`), the engine's codec fitted with nothing read back: a codec with
        a table fits it on the host to ``prior`` (counting the tensor's symbols on the device where ``count``
        says so); any other is itself."""
        entries = self._entries(flat, layout)
        if self.codec.name in TABLED_KERNELS:
            if prior is None:
                raise ValueError(f"codec {self.codec.name!r} fits its table to the tensor without a prior: a read")
            counts = self._count(layout, entries, flat.device) if count else None
            self.codec = self.codec.fit(flat, layout.word_bytes, prior, None, keep, counts=counts, count=count)
            self._tables.clear()  # the fitted table, not the unfitted codec's
        return entries

    def unpack(
        self, meta, slots, overflow, slot, layout, *, check=True, error_flag=None, ends=None, place=None, reserve=None
    ):  # fmt: skip
        """:meth:`Engine.unpack`; ``ends``: the overflow's prefix sums :meth:`pack_ahead` made, kept with the tensor
        (else made again here from the metadata); ``place``, ``reserve``: where it put the overflow's sectors, some
        of them in the step's reserve (``overflow`` then holds the others)."""
        n, e = layout.n_entries, layout.entry_bytes
        if meta.numel() != layout.meta_bytes:
            raise CorruptDataError(f"metadata holds {meta.numel()} bytes, expected {layout.meta_bytes}")
        out = torch.empty(n * e, dtype=torch.uint8, device=slots.device)
        if n:
            meta = meta if meta.data_ptr() % 2 == 0 else meta.clone()  # 2-byte words are read aligned
            if not reads_overflow_in_place(overflow, slots.device, self.kernels.tuning):
                overflow = overflow.to(slots.device, non_blocking=True)  # H2D from pinned memory, on the current stream
            error = _error_flag(error_flag, slots.device)
            ends = self._ends(meta, slot, layout) if ends is None else ends
            table = self._table(slots.device, layout.word_bytes)
            self.kernels.unpack(layout, meta, ends, slot, slots, overflow, out, error, table, place, reserve)
            if check:
                raise_for_errors(self.codec.name, int(self.read(error)[0]), _BAD_STREAM)
        return out[: layout.nbytes]
