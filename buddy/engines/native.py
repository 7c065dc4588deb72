"""The native CPU engine: the CUDA kernels' own sources compiled for the host, the default on CPU tensors.

``csrc/buddy_kernels.cu`` and its headers -- the very sources NVRTC compiles
for the GPU -- are compiled by the host's C++ compiler through the CUDA shim
(``csrc/host/cuda_shim.h``) into a shared library per (codec, entry size),
with the loaders' defines (:func:`buddy.engines.sources.compile_options`), and run by a
runtime made for speed (``csrc/host/native.cpp``): every block one warp,
its 32 lanes fibers switched at collectives in a fixed order, the blocks
spread over host threads (``torch.get_num_threads()``, or ``BUDDY_NATIVE_THREADS``): the OpenMP runtime's, which
is torch's (:func:`_openmp_flags`), else the engine's own.
Each codec with kernels has a second build of one lane a warp (``BUDDY_WARP_SIZE`` 1):
a block is a plain call, the lane's loops doing what 32 lanes do on a GPU, no
fibers; it runs every kernel of :data:`SOLO_CODECS`, so the build of 32 lanes is compiled only when asked for
(:func:`library`). :func:`NativeEngine`
is :class:`~buddy.engines.kernel_engine.KernelEngine`, the one kernel engine, with this module's
:data:`LAUNCHER` on CPU tensors, so the
host's work -- argument checks, the table codecs' count and fit kernels, the
overflow's prefix sums, the error flag, every allocation -- is the GPU path's, line for line.

Registered in :mod:`buddy.dispatch` for every codec with kernels on the CPU,
the default (``backend="auto"``) of :data:`DEFAULT_CODECS`, behind the same
self-test as the GPU's (golden vectors through it both ways, once per process
and codec); ``backend="native"`` asks for it explicitly, ``backend="reference"`` or
``BUDDY_BACKEND=reference`` for the torch reference (the oracle).

Builds are compiled at first use (about 3 s a codec and entry size on two
cores) and cached on disk by the hash of the sources, flags, compiler and
processor (``BUDDY_NATIVE_CACHE``, default ``~/.cache/buddy/native``). Where
no compiler is found (``CXX``, else ``g++``, ``c++``, ``clang++``) or a build
fails, :func:`why_unusable` / the self-test say why, one warning says so, and
the reference runs; ``BUDDY_NATIVE=0`` turns the engine off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..codecs.base import Codec
from . import Implementation
from .kernel_engine import KernelEngine
from .kernels import Launcher
from .launch import launch_config
from .sources import KERNEL_CODECS, REPO_CSRC, compile_options

__all__ = [
    "NativeEngine", "LAUNCHER", "why_unusable", "switched_off", "describe", "library", "launch", "rows",
    "DEFAULT_CODECS", "ENV_SWITCH", "ENV_CACHE", "ENV_THREADS", "ENTRIES_PER_BLOCK", "SOLO_CODECS",
]  # fmt: skip

#: ``BUDDY_NATIVE=0`` turns the native engine off (the reference runs on the CPU)
ENV_SWITCH = "BUDDY_NATIVE"
#: where builds are cached (default ``~/.cache/buddy/native``)
ENV_CACHE = "BUDDY_NATIVE_CACHE"
#: host threads a launch runs on (default: ``torch.get_num_threads()``)
ENV_THREADS = "BUDDY_NATIVE_THREADS"
#: entries (8-byte units for ``count``) a block takes on before another block is worth its set-up
ENTRIES_PER_BLOCK = 16
_COUNT_UNITS_PER_BLOCK = 64 * 64  # a warp counts 64 units a round
#: -O3, not -O2: the host compiler makes vector code of more of the kernels' plain loops (count and measure faster,
#: the others as fast); not -funroll-loops, which made bfloat16's unpack slower (docs/cpu_engine.md)
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread", "-fno-strict-aliasing")
#: the codecs whose kernel sources are written for any warp size (``BUDDY_WARP_SIZE``, csrc/buddy_warp.h): their
#: native build runs one lane a warp -- a block is one plain call, the work of a warp's 32 lanes that lane's loops,
#: every collective its own value -- with no fibers (csrc/host/native.cpp, ``BUDDY_NATIVE_SOLO``); their ``fit``
#: too, in its one-lane form (codec_fpe_fit.h: sorts where a warp ranks, the rounds in turn where a warp tries one a
#: lane). The others tile 32 lanes in their formats.
SOLO_CODECS = frozenset({"fpe", "zvc", "fpx", "bpc", "auto", "auto2"})
_SOLO_DEFINES = ("-DBUDDY_NATIVE_SOLO=1", "-DBUDDY_WARP_SIZE=1u")
_lock = threading.Lock()


class _Arg(ctypes.Structure):
    """``BuddyEmuArg`` (csrc/host/launch.h): a buffer or an integer of a launch (its layout: three 8-byte fields,
    the kind's int padded, as :meth:`_Library.launch` lays them out)."""

    _fields_ = [("kind", ctypes.c_int), ("ptr", ctypes.c_void_p), ("value", ctypes.c_longlong)]


#: whether _Arg is three 8-byte fields, as :meth:`_Library.launch` lays the arguments out (else the engine is off)
_ARGS_LAID_OUT = (ctypes.sizeof(_Arg), _Arg.ptr.offset, _Arg.value.offset) == (24, 8, 16)


# an argument's kind, as the first int64 of its _Arg holds it (the int and its padding)
_BUFFER, _I32, _I64 = (kind << (0 if sys.byteorder == "little" else 32) for kind in range(3))


def _csrc() -> Path:
    """The folder of the kernel sources: the installed ``buddy.csrc`` package, else the repository's."""
    try:
        found = Path(str(importlib.resources.files("buddy.csrc")))
        if (found / "host" / "native.cpp").is_file():
            return found
    except (ModuleNotFoundError, TypeError):
        pass
    return REPO_CSRC


@functools.cache
def _compiler() -> tuple[str, str] | str:
    """``(compiler, its --version)``, or why there is none."""
    if platform.system() != "Linux" and platform.system() != "Darwin":
        return f"the native engine builds on Linux and macOS (this is {platform.system()})"
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for name in names:
        path = shutil.which(name)
        if path is None:
            continue
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        return path, version
    return f"no C++ compiler found ({', '.join(names)}; set CXX)"


def _openmp_flags() -> tuple[str, ...]:
    """``("-fopenmp",)`` where the compiler builds OpenMP code, else nothing (a launch then runs on the engine's own
    threads). Built with it, a launch runs on the OpenMP runtime's threads -- torch's, where torch is built with
    OpenMP (the process holds one runtime): its threads spin a while after each of torch's operations, and a
    launch on threads of its own would share the cores with them."""
    compiler = _compiler()
    return () if isinstance(compiler, str) else _openmp_probe(compiler[0])


@functools.cache
def _openmp_probe(compiler: str) -> tuple[str, ...]:
    """:func:`_openmp_flags` of ``compiler``: whether it builds a library with ``-fopenmp``."""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "probe.cpp"
        source.write_text("#include <omp.h>\nint buddy_probe() { return omp_in_parallel(); }\n")
        try:
            built = subprocess.run([compiler, "-fopenmp", "-fPIC", "-shared", str(source), "-o",
                                    str(Path(folder) / "probe.so")], capture_output=True, timeout=120)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return ()
    return ("-fopenmp",) if built.returncode == 0 else ()


def switched_off() -> bool:
    """Whether ``BUDDY_NATIVE=0`` turns the engine off (read at every use)."""
    return os.environ.get(ENV_SWITCH, "").strip() == "0"


def why_unusable() -> str | None:
    """Why the native engine cannot run here (off, no compiler), or ``None``."""
    if switched_off():
        return f"{ENV_SWITCH}=0"
    if not _ARGS_LAID_OUT:
        return f"a launch's arguments are not three 8-byte fields on this platform ({ctypes.sizeof(_Arg)} bytes)"
    found = _compiler()
    return found if isinstance(found, str) else None


@functools.cache
def _machine() -> str:
    """What ``-march=native`` compiles for: the processor's model and features (a cache shared by machines keeps
    a build per kind of processor)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    fields = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(sorted(set(fields)))


def describe() -> str:
    """What builds the native engine here (its compiler's first ``--version`` line), or why none can."""
    why, found = why_unusable(), _compiler()
    if why is not None or isinstance(found, str):
        return f"off: {why or found}"
    cxx, version = found
    return f"{Path(cxx).name}: {version.strip().splitlines()[0] if version.strip() else 'unknown version'}"


def _cache_dir() -> Path:
    folder = Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "buddy" / "native")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _sources(csrc: Path) -> list[tuple[str, bytes]]:
    files = sorted(p for folder in (csrc, csrc / "host") for p in folder.iterdir() if p.suffix in (".h", ".cu", ".cpp"))
    return [(str(p.relative_to(csrc)), p.read_bytes()) for p in files]


class _Library:
    """One build: its kernels by name, and the launch."""

    def __init__(self, path: Path):
        self.path = path
        self.dll = ctypes.CDLL(str(path))
        self.dll.buddy_native_kernel.argtypes = [ctypes.c_char_p]
        self.dll.buddy_native_kernel.restype = ctypes.c_int
        self.dll.buddy_native_launch.argtypes = [
            ctypes.c_int, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint,
            ctypes.c_char_p, ctypes.c_size_t,
        ]  # fmt: skip  (the arguments: an array of BuddyEmuArg, _Arg's layout, made in numpy: launch)
        self.dll.buddy_native_launch.restype = ctypes.c_int
        self._kernels: dict[str, int] = {}

    def kernel(self, name: str) -> int:
        index = self._kernels.get(name)
        if index is None:
            index = self._kernels[name] = self.dll.buddy_native_kernel(name.encode())
            if index < 0:
                raise ValueError(f"no kernel {name} in {self.path.name}")
        return index

    def launch(self, name: str, grid: int, shared: int, args: tuple, threads: int) -> None:
        """Run kernel ``name`` over ``grid`` blocks (one warp each) on ``threads`` host threads."""
        fields: list[int] = []  # per argument its _Arg: kind (with its padding, one int64), pointer, value
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                fields += (_BUFFER, a.data_ptr() if a.numel() else 0, 0)
            elif isinstance(a, np.int32):
                fields += (_I32, 0, int(a))
            elif isinstance(a, np.int64):
                fields += (_I64, 0, int(a))
            else:
                raise TypeError(f"{name}: argument {i} must be a tensor, numpy.int32 or numpy.int64, got {type(a)}")
        c_args = np.array(fields, dtype=np.int64)
        why = ctypes.create_string_buffer(256)
        kernel = self.kernel(name)
        if self.dll.buddy_native_launch(kernel, grid, shared, c_args.ctypes.data, len(args), threads, why, 256):
            raise ValueError(f"{name}: {why.value.decode()}")


_libraries: dict[tuple[str, int, bool], _Library] = {}


def library(codec: str, entry_bytes: int, solo: bool = False) -> _Library:
    """The native build of ``codec``'s kernels at ``entry_bytes``: compiled on first use (cached on disk).
    ``solo``: the build of one lane a warp (:data:`SOLO_CODECS`), the one the engine runs them from."""
    if solo and codec not in SOLO_CODECS:
        raise ValueError(f"{codec}'s kernels tile 32 lanes a warp: it has no build of one lane a warp")
    key = (codec, entry_bytes, solo)
    found = _libraries.get(key)
    if found is not None:
        return found
    with _lock:
        found = _libraries.get(key)
        if found is None:
            found = _libraries[key] = _Library(_build(codec, entry_bytes, solo))
    return found


def _build(codec: str, entry_bytes: int, solo: bool = False) -> Path:
    """The library's path, compiled unless cached."""
    compiler = _compiler()
    if isinstance(compiler, str):
        raise RuntimeError(f"the native engine cannot be built: {compiler}")
    cxx, version = compiler
    csrc = _csrc()
    options = compile_options(entry_bytes, codec)
    if solo:
        options += _SOLO_DEFINES
    flags = _FLAGS + _openmp_flags()
    h = hashlib.sha256()
    for part in (*_sources(csrc), options, flags, version, _machine()):
        h.update(repr(part).encode())
    kind = "-solo" if solo else ""
    out = _cache_dir() / f"buddy-native-{codec}{kind}-E{entry_bytes}-{h.hexdigest()[:20]}.so"
    if out.exists():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    # a first use waits for the compiler (seconds): say so, once per build, where the wait is
    print(
        f"buddy: building the native engine of {codec} at {entry_bytes}-byte entries (once; cached in {out.parent})",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    cmd = [cxx, *options, *flags, f"-I{csrc}", f"-I{csrc / 'host'}", str(csrc / "host" / "native.cpp"), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"the native engine's build failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
    os.replace(tmp, out)  # atomic: concurrent builds of one key write the same file
    return out


def _grid(op: str, n: int, threads: int) -> int:
    """Blocks of a launch: enough for every thread to take several, few enough that each loops over many entries."""
    if op in ("fit", "ends"):  # one block
        return 1
    per_block = _COUNT_UNITS_PER_BLOCK if op == "count" else ENTRIES_PER_BLOCK  # (sizes, drain: as measure)
    return max(1, min(-(-n // per_block), 8 * threads))


def _threads() -> int:
    """Host threads of a launch: ``BUDDY_NATIVE_THREADS`` (read at every launch), else torch's intra-op threads."""
    value = os.environ.get(ENV_THREADS, "").strip()
    if not value:
        return max(1, torch.get_num_threads())
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV_THREADS}={value!r} must be a whole number of threads, at least 1")
    return int(value)


#: wall seconds the launches of each operation took in this process, by op (:func:`kernel_seconds`)
_seconds: dict[str, float] = {}
_seconds_lock = threading.Lock()


def kernel_seconds() -> dict[str, float]:
    """Wall seconds this process's native launches took so far, by operation (``count``, ``fit``, ``measure``,
    ``pack``, ``unpack``): take it before and after a piece of work to see what of it the kernels were."""
    with _seconds_lock:
        return dict(_seconds)


def launch(codec: str, op: str, entry_bytes: int, device, n_entries: int, args: tuple, tuning=None) -> None:
    """:data:`LAUNCHER`'s launch function: kernel ``buddy_<codec>_<op>`` natively on the host (a
    native block is one warp, its tables in memory: no GPU tuning applies)."""
    del device, tuning  # CPU tensors: Kernels checked them
    lib = library(codec, entry_bytes, solo=codec in SOLO_CODECS)
    threads = _threads()
    grid = _grid(op, n_entries, threads)
    _, block, shared = launch_config(op, entry_bytes, n_entries, codec)
    shared = shared // (block // 32)  # a native block is one warp: one warp's staging
    start = time.perf_counter()
    lib.launch(f"buddy_{codec}_{op}", grid, shared, args, min(threads, grid))
    took = time.perf_counter() - start
    with _seconds_lock:
        _seconds[op] = _seconds.get(op, 0.0) + took


#: the native build's launcher: :func:`launch`, looked up here at each launch (a test's stand-in included); the
#: kernels run on the host, so they reach no host memory beyond their own tensors'
LAUNCHER = Launcher(lambda: launch)


def NativeEngine(codec: Codec) -> KernelEngine:
    """The kernels' format operations on CPU tensors, natively: the one kernel engine
    (:class:`~buddy.engines.kernel_engine.KernelEngine`) with this module's :data:`LAUNCHER` (see the module
    doc)."""
    return KernelEngine(codec, launch=LAUNCHER, device_type="cpu")


#: the codecs the native engine is the CPU default of: those whose compress and decompress together take less time
#: natively than through the torch reference on real activations (docs/cpu_engine.md: ``python -m
#: experiments.bench_codecs --entry-bytes 4096 --backends reference native``): all six since their one-lane builds
#: (bpc, the slowest, 0.37 s against the reference's 2.0 s for the bench's 72 MiB).
DEFAULT_CODECS = frozenset({"auto2", "fpe", "fpx", "zvc", "auto", "bpc"})


def rows() -> tuple[Implementation, ...]:
    """The native engine of every codec with kernels on CPU tensors; the default of :data:`DEFAULT_CODECS`, once
    its self-test passed (see :mod:`buddy.dispatch`)."""
    return tuple(
        Implementation(name, "cpu", "native", NativeEngine, default=name in DEFAULT_CODECS, requires=why_unusable)
        for name in KERNEL_CODECS
    )
