"""CUDA kernels of buddy's codecs, compiled at run time through CuPy (NVRTC).

**Not yet validated on a GPU, so off by default**: the pipeline uses these
kernels only when asked (``buddy.compress(t, backend="cuda")``, or
``buddy.set_defaults(backend="cuda")``); see :mod:`buddy.dispatch`, where
:class:`CudaEngine` is registered as the ``"cuda"`` implementation of the
codecs that have kernels. The
per-entry logic they run (``csrc/zvc_core.h``) is tested byte for byte
against the torch reference on the host.

The sources ship as package data (``buddy.csrc``, the repository's
``csrc/``). They are compiled once per process for each (source, options,
device architecture); the format constants arrive as ``-D`` defines from
:func:`buddy.spec.c_defines`, so there is one module per entry size.
Kernels run on PyTorch's current CUDA stream of the tensors' device, with
no synchronisation added, except that :meth:`Kernels.decode` reads its error
flag back (one sync, as the torch reference's own checks do).

``import buddy`` never imports CuPy; the first launch does, and raises
:class:`~buddy.errors.MissingDependencyError` without it.

Every argument is checked before anything is launched (device, dtype,
shape, contiguity, 8-byte alignment of data pointers): a bad one raises
``ValueError``, never an out-of-bounds access on the device.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
import threading
from pathlib import Path

import torch

from . import dispatch, spec
from .codecs.base import Codec
from .codecs.zvc import ZVCCodec
from .deps import available, require
from .engine import BlockEngine
from .errors import CorruptDataError

__all__ = [
    "BLOCK_THREADS",
    "ALIGN_BYTES",
    "CudaEngine",
    "Kernels",
    "KERNEL_CODECS",
    "why_unusable",
    "compile_options",
    "read_source",
    "translation_unit",
]

#: threads per block of every launch (8 warps: one entry per warp at a time)
BLOCK_THREADS = 256
#: alignment (bytes) the kernels need of every data pointer
ALIGN_BYTES = 8
#: most blocks of one launch; warps stride over further entries
MAX_BLOCKS = 1 << 20

_WARP = 32
_FEATURE = "buddy's CUDA backend (backend='cuda')"
_SOURCE = "buddy_kernels.cu"

# error bits of a decode (csrc/buddy_format.h, BUDDY_ERR_*)
_ERR_K, _ERR_STREAM, _ERR_MODE, _ERR_WORD = 1, 2, 4, 8

# ---------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)
_REPO_CSRC = Path(__file__).resolve().parents[1] / "csrc"


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


def compile_options(entry_bytes: int) -> tuple[str, ...]:
    """NVRTC options: C++17 and the format constants of this entry size."""
    defines = spec.c_defines(spec.check_entry_bytes(entry_bytes))
    return ("-std=c++17", *(f"-D{k}={v}" for k, v in defines.items()))


# ---------------------------------------------------------------------------
# compilation, memoised per process
# ---------------------------------------------------------------------------
_modules: dict[tuple[str, tuple[str, ...], str], object] = {}
_kernels: dict[tuple[int, int, str], object] = {}
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


def _kernel(name: str, entry_bytes: int, device: torch.device):
    """Kernel ``name`` of ``buddy_kernels.cu`` for this entry size, compiled for ``device``."""
    key = (entry_bytes, device.index, name)
    kernel = _kernels.get(key)
    if kernel is None:
        cupy = _cupy()
        module = _module(translation_unit(_SOURCE), compile_options(entry_bytes), device)
        with cupy.cuda.Device(device.index):
            kernel = module.get_function(name)  # compiles (NVRTC) on first use
        with _lock:
            kernel = _kernels.setdefault(key, kernel)
    return kernel


def _launch(name: str, entry_bytes: int, device: torch.device, n_entries: int, args: tuple) -> None:
    """Launch ``name`` over ``n_entries`` on the device's current torch stream."""
    import numpy

    cupy = _cupy()
    kernel = _kernel(name, entry_bytes, device)
    warps_per_block = BLOCK_THREADS // _WARP
    blocks = max(1, min(MAX_BLOCKS, -(-n_entries // warps_per_block)))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index)
    # pointers and sizes as fixed-width scalars: exactly the kernel's parameter types
    c_args = tuple(
        numpy.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a  # tensors: their device pointers
        for a in args
    )
    with cupy.cuda.Device(device.index):
        kernel((blocks,), (BLOCK_THREADS,), c_args, stream=stream)


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
    if shape is not None and tuple(t.shape) != shape:
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


def _check_entries(what: str, t, device_type: str) -> tuple[torch.device, int, int]:
    """``(device, n_entries, entry_bytes)`` of an ``(n, E)`` uint8 tensor on a ``device_type`` device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != device_type:
        raise ValueError(f"{what} must be on a CUDA device for the CUDA kernels, got one on {t.device}")
    if t.dim() != 2:
        raise ValueError(f"{what} must be (n_entries, entry_bytes), got shape {tuple(t.shape)}")
    n, entry_bytes = t.shape
    try:
        spec.check_entry_bytes(int(entry_bytes))
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    _check_tensor(what, t, device=t.device, dtype=torch.uint8)
    return t.device, int(n), int(entry_bytes)


def _check_word(word_bytes) -> int:
    if isinstance(word_bytes, bool) or not isinstance(word_bytes, int) or word_bytes not in (1, 2, 4, 8):
        raise ValueError(f"word_bytes must be 1, 2, 4 or 8, got {word_bytes!r}")
    return word_bytes


# ---------------------------------------------------------------------------
# the kernels of one codec: strict (no copies), checked before any launch
# ---------------------------------------------------------------------------
class Kernels:
    """The entry kernels of codec ``name`` (``buddy_<name>_measure/encode/decode``), arguments checked.

    ``launch(name, entry_bytes, device, n_entries, args)`` runs a kernel
    (default: compiled through CuPy, on torch's current stream);
    ``device_type`` is the device the tensors must live on. Tests run the
    same glue with the kernels emulated on the host by passing both.
    """

    def __init__(self, name: str, *, launch=None, device_type: str = "cuda"):
        self.name = name
        self.launch = _launch if launch is None else launch
        self.device_type = device_type

    def measure(self, entries: torch.Tensor, word_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, modes)`` of ``(n, E)`` uint8 entries (contiguous, 8-byte aligned): ``(n,)`` int32 each."""
        device, n, entry_bytes = _check_entries("entries", entries, self.device_type)
        word = _check_word(word_bytes)
        sectors = torch.empty(n, dtype=torch.int32, device=device)
        modes = torch.empty(n, dtype=torch.int32, device=device)
        if n:
            self.launch(
                f"buddy_{self.name}_measure", entry_bytes, device, n, (entries, sectors, modes, _i64(n), _i32(word))
            )
        return sectors, modes

    def encode(self, entries: torch.Tensor, word_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(payload, k, modes)`` of each entry, as the format layer and the codec write them (byte for byte)."""
        device, n, entry_bytes = _check_entries("entries", entries, self.device_type)
        word = _check_word(word_bytes)
        payload = torch.empty(n, entry_bytes, dtype=torch.uint8, device=device)  # every byte is written
        sectors = torch.empty(n, dtype=torch.int32, device=device)
        modes = torch.empty(n, dtype=torch.int32, device=device)
        if n:
            args = (entries, payload, sectors, modes, _i64(n), _i32(word))
            self.launch(f"buddy_{self.name}_encode", entry_bytes, device, n, args)
        return payload, sectors, modes

    def decode(
        self, payload: torch.Tensor, sectors: torch.Tensor, modes: torch.Tensor, word_bytes: int
    ) -> torch.Tensor:
        """Entries back from payloads, ``k`` and modes (``(n,)`` int32 on the payload's device).

        Raises :class:`~buddy.errors.CorruptDataError` when a ``k`` exceeds
        ``E/32``, a payload disagrees with its ``k`` or a mode does not fit;
        such entries are never read past their ``k`` sectors.
        """
        device, n, entry_bytes = _check_entries("payload", payload, self.device_type)
        _check_tensor("sectors", sectors, device=device, dtype=torch.int32, shape=(n,))
        _check_tensor("modes", modes, device=device, dtype=torch.int32, shape=(n,))
        word = _check_word(word_bytes)
        out = torch.empty(n, entry_bytes, dtype=torch.uint8, device=device)  # every byte is written
        if not n:
            return out
        error = torch.zeros(1, dtype=torch.int32, device=device)
        args = (payload, sectors, modes, out, error, _i64(n), _i32(word))
        self.launch(f"buddy_{self.name}_decode", entry_bytes, device, n, args)
        _raise_decode_error(self.name, int(error.item()))  # the one sync: corrupt data must not pass silently
        return out


def _raise_decode_error(codec: str, bits: int) -> None:
    if not bits:
        return
    if bits & _ERR_MODE:
        raise CorruptDataError(f"metadata holds modes that codec {codec!r} never writes for such entries")
    if bits & _ERR_K:
        raise CorruptDataError(f"{codec}: metadata claims more sectors than an entry has")
    if bits & _ERR_STREAM:
        raise CorruptDataError(
            f"{codec}: a payload (its bitmap or stream) does not match the entry sizes in the metadata"
        )
    raise CorruptDataError(f"{codec} CUDA decode failed (error bits {bits:#x})")


def _i64(v: int):
    import numpy

    return numpy.int64(v)


def _i32(v: int):
    import numpy

    return numpy.int32(v)


# ---------------------------------------------------------------------------
# the engine the pipeline calls (registered in buddy.dispatch)
# ---------------------------------------------------------------------------
def why_unusable() -> str | None:
    """Why the CUDA kernels cannot run here (no CuPy, no GPU), or ``None``."""
    if not available("cupy"):
        return "CuPy is not importable: pip install 'buddy[cuda12]' or 'buddy[cuda13]'"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


#: codecs with kernels: the exact class the kernels reproduce, by registry name
KERNEL_CODECS: dict[str, type] = {"zvc": ZVCCodec}


class CudaEngine(BlockEngine):
    """The format operations with the codec's CUDA kernels per block: the same bytes as the reference.

    Accepts what the pipeline hands it (views at any offset, int64 sizes)
    and copies only when a tensor is not already dense and aligned.
    ``decode`` syncs once per block to check its error flag. ``launch`` and
    ``device_type``: see :class:`Kernels`.
    """

    backend = "cuda"

    def __init__(self, codec: Codec, *, launch=None, device_type: str = "cuda"):
        if type(codec) is not KERNEL_CODECS.get(codec.name):  # the kernels reproduce that class, not a subclass
            have = ", ".join(sorted(KERNEL_CODECS))
            raise ValueError(
                f"codec {codec.name!r} ({type(codec).__name__}) has no CUDA kernels (codecs with them: {have})"
            )
        super().__init__(codec)
        self.kernels = Kernels(codec.name, launch=launch, device_type=device_type)

    def measure_block(self, entries, word_bytes):
        k, modes = self.kernels.measure(_dense(entries), word_bytes)
        return k, modes, None

    def encode_block(self, entries, word_bytes, k, modes, reuse):
        return self.kernels.encode(_dense(entries), word_bytes)[0]

    def decode_block(self, payload, k, modes, word_bytes):
        return self.kernels.decode(_dense(payload), _dense(k, torch.int32), _dense(modes, torch.int32), word_bytes)


def _dense(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` contiguous and aligned (and integer sizes/modes as ``dtype``), copying only when needed.

    Anything else (a wrong dtype for entries, a CPU tensor) is left for the
    strict checks of the launchers to name.
    """
    if not isinstance(t, torch.Tensor):
        return t
    if dtype is not None and t.dtype != dtype and t.dtype in _INTEGER_DTYPES:
        t = t.to(dtype)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() and t.data_ptr() % ALIGN_BYTES:
        t = t.clone()  # a fresh allocation is aligned
    return t


_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

for _name in KERNEL_CODECS:  # not the default: the kernels have not yet run on a GPU
    dispatch.register(_name, "cuda", "cuda", CudaEngine, requires=why_unusable)
