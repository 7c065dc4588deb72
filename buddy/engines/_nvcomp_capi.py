"""nvcomp's batched C API through ctypes: the library found in its wheel, bound per major version.

buddy calls ``nvcompBatched<Algo>CompressAsync`` / ``DecompressAsync`` once
per tensor, with device arrays of chunk pointers and sizes. Their C
signatures changed between majors, so each is bound as its headers declare it:

* **nvcomp 4.x** (``nvidia-nvcomp-cu12`` 4.0-4.2): one options struct per
  algorithm (compression only); compression reports no per-chunk status;
  temp sizes from ``...GetTempSizeEx``.
* **nvcomp 5.x** (``-cu12`` / ``-cu13`` 5.0-5.3): 64-byte compression and
  decompression options structs passed by value; per-chunk statuses in both
  directions; temp sizes from ``...GetTempSizeAsync``. (5.1-5.3 added fields
  inside the reserved bytes, whose zero is their default.)
* **nvcomp 6.x**: the 5.x calls, temp sizes from ``...GetTempSize`` taking
  a stream, new option layouts (Cascaded's common options, Bitcomp's lossy
  mode, ANS's stream parameters).

The library lives in the ``nvidia.libnvcomp`` package (``lib64/libnvcomp.so.N``,
nvcomp 5.1 and later) or in ``nvidia.nvcomp`` itself (``libnvcomp.so.N``,
earlier wheels); it is found on disk without importing nvcomp's Python API,
loaded on first use, and its major version (``nvcompGetProperties``, which
reports ``major * 1000 + minor * 100 + patch``) must agree with its file
name and be one bound here, else :class:`~buddy.errors.MissingDependencyError`.

The batched C API keeps no state between calls: the loaded library is the only
thing threads share. Temp space is a torch allocation on the device, made for
each call on the stream the call runs on.

What ``DecompressAsync`` may be handed (the 6.x headers): every chunk must be a
stream nvcomp's compressor of that algorithm wrote -- an empty chunk is not one.
Only LZ4 on its CUDA backend and ANS report a damaged chunk in its status
(:data:`REPORTS_DAMAGE`); for Zstd, GDeflate, Cascaded and Bitcomp "passing
corrupt, invalid, or insufficient data leads to undefined behavior or
out-of-bound errors". Bitcomp moreover ignores the compressed sizes ("this
argument is not used") and reads every chunk's header on the host before it
launches (it synchronizes the stream to do so): one chunk that is not a Bitcomp
stream fails the whole call with ``nvcompErrorCannotDecompress``.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import re
import threading
from typing import Any

import torch

from ..errors import MissingDependencyError

__all__ = [
    "SUPPORTED_MAJORS",
    "ALGORITHMS",
    "STATUS",
    "CANNOT_DECOMPRESS",
    "REPORTS_DAMAGE",
    "NvcompError",
    "Batched",
    "Library",
    "find_library",
    "library",
    "why_unusable",
    "compress_options",
    "decompress_options",
    "signatures",
]

#: nvcomp majors bound here (what ``buddy[cuda12]`` / ``buddy[cuda13]`` can install)
SUPPORTED_MAJORS = (4, 5, 6)
#: algorithms as the C API spells them (``nvcompBatched<name>...``)
ALGORITHMS = ("LZ4", "ANS", "Bitcomp", "Cascaded", "Gdeflate", "Zstd")
#: algorithms whose batched decompression sets a chunk's status for a damaged stream (LZ4 on the CUDA backend,
#: which :func:`decompress_options` selects); the others' headers call such input undefined behaviour
REPORTS_DAMAGE = frozenset({"LZ4", "ANS"})
_INSTALL = "pip install 'buddy[cuda12]' or 'buddy[cuda13]'"

#: ``nvcompStatus_t`` (shared_types.h; later majors only add codes)
STATUS = {
    0: "nvcompSuccess", 10: "nvcompErrorInvalidValue", 11: "nvcompErrorNotSupported",
    12: "nvcompErrorCannotDecompress", 13: "nvcompErrorBadChecksum", 14: "nvcompErrorCannotVerifyChecksums",
    15: "nvcompErrorOutputBufferTooSmall", 16: "nvcompErrorWrongHeaderLength", 17: "nvcompErrorAlignment",
    18: "nvcompErrorChunkSizeTooLarge", 19: "nvcompErrorCannotCompress", 20: "nvcompErrorWrongInputLength",
    21: "nvcompErrorBatchSizeTooLarge", 22: "nvcompErrorSubChunkCountTooLarge",
    23: "nvcompErrorSubChunkCountTooSmall", 24: "nvcompErrorOutputBufferAlignmentTooSmall",
    1000: "nvcompErrorCudaError", 10000: "nvcompErrorInternal",
}  # fmt: skip
#: ``nvcompErrorCannotDecompress``: what Bitcomp's batched decompression returns for the whole call when a
#: chunk is not a Bitcomp stream (it reads every chunk's header on the host before it launches anything)
CANNOT_DECOMPRESS = 12


class NvcompError(RuntimeError):
    """An nvcomp call that returned a status other than ``nvcompSuccess`` (:attr:`status`)."""

    def __init__(self, function: str, status: int):
        self.function, self.status = function, status
        super().__init__(f"nvcomp {function} failed: {STATUS.get(status, 'unknown status')} ({status})")


# nvcompType_t values used here (the same in every major)
_CHAR, _UCHAR, _INT, _UINT, _BITS = 0, 1, 4, 5, 0xFF
# nvcompDecompressBackend_t: the CUDA implementation reports damaged chunks in their statuses (the
# hardware decompression engine, which nvcomp may pick for LZ4 by default, leaves them undefined)
_BACKEND_CUDA = 2

_int, _u8, _u64, _size, _double = ctypes.c_int, ctypes.c_uint8, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_double


def _struct(name: str, fields: list) -> type:
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def _reserved(n: int) -> tuple:
    return ("reserved", ctypes.c_char * n)


_CascadedCommon6 = _struct(
    "nvcompCascadedCommonOpts_t",
    [("data_type", _int), ("mode", _int), ("terminal_codec_flags", _u64), ("coarse_grained_encoding_flags", _u64)],
)
_CASCADED_5 = [
    ("internal_chunk_bytes", _size),
    ("type", _int),
    ("num_RLEs", _int),
    ("num_deltas", _int),
    ("use_bp", _int),
]

# compression options, by major: (struct, the header's default values)
_COMPRESS: dict[int, dict[str, tuple[type[ctypes.Structure], dict[str, Any]]]] = {
    4: {
        "LZ4": (_struct("nvcompBatchedLZ4Opts_t", [("data_type", _int)]), {}),
        "ANS": (_struct("nvcompBatchedANSOpts_t", [("type", _int), ("data_type", _int)]), {}),
        "Bitcomp": (
            _struct("nvcompBatchedBitcompOpts_t", [("algorithm_type", _int), ("data_type", _int)]),
            {"data_type": _UCHAR},
        ),
        "Cascaded": (
            _struct("nvcompBatchedCascadedOpts_t", _CASCADED_5),
            {"internal_chunk_bytes": 4096, "type": _INT, "num_RLEs": 2, "num_deltas": 1, "use_bp": 1},
        ),
        "Gdeflate": (_struct("nvcompBatchedGdeflateOpts_t", [("algo", _int)]), {"algo": 1}),
        "Zstd": (_struct("nvcompBatchedZstdOpts_t", [("reserved", _int)]), {}),
    },
    5: {
        "LZ4": (_struct("nvcompBatchedLZ4CompressOpts_t", [("data_type", _int), _reserved(60)]), {}),
        "ANS": (_struct("nvcompBatchedANSCompressOpts_t", [("type", _int), ("data_type", _int), _reserved(56)]), {}),
        "Bitcomp": (
            _struct("nvcompBatchedBitcompCompressOpts_t", [("algorithm", _int), ("data_type", _int), _reserved(56)]),
            {"data_type": _UCHAR},
        ),
        "Cascaded": (
            _struct("nvcompBatchedCascadedCompressOpts_t", [*_CASCADED_5, _reserved(40)]),
            {"internal_chunk_bytes": 4096, "type": _INT, "num_RLEs": 2, "num_deltas": 1, "use_bp": 1},
        ),
        "Gdeflate": (
            _struct("nvcompBatchedGdeflateCompressOpts_t", [("algorithm", _int), _reserved(60)]),
            {"algorithm": 1},
        ),
        "Zstd": (_struct("nvcompBatchedZstdCompressOpts_t", [_reserved(64)]), {}),
    },
    6: {
        "LZ4": (
            _struct("nvcompBatchedLZ4CompressOpts_t", [("data_type", _int), ("bitshuffle_mode", _int), _reserved(56)]),
            {},
        ),
        "ANS": (
            _struct(
                "nvcompBatchedANSCompressOpts_t",
                [
                    ("type", _int),
                    ("data_type", _int),
                    ("max_sub_chunk_count", _u8),
                    ("states_per_lane", _u8),
                    ("histogram_reduction_log2", _u8),
                    _reserved(53),
                ],
            ),
            {},
        ),
        "Bitcomp": (
            _struct(
                "nvcompBatchedBitcompCompressOpts_t",
                [("algorithm", _int), ("data_type", _int), ("delta", _double), ("mode", _int), _reserved(44)],
            ),
            {"data_type": _UCHAR},  # mode 0: BITCOMP_LOSSLESS
        ),
        "Cascaded": (
            _struct(
                "nvcompBatchedCascadedCompressOpts_t",
                [
                    ("common_opts", _CascadedCommon6),
                    ("fine_grained_encoding_flags", _u64),
                    ("compression_level", _u8),
                    _reserved(31),
                ],
            ),
            {"common_opts": (_UINT, 1, 1, 0), "fine_grained_encoding_flags": 7, "compression_level": 3},
        ),
        "Gdeflate": (
            _struct("nvcompBatchedGdeflateCompressOpts_t", [("algorithm", _int), _reserved(60)]),
            {"algorithm": 1},
        ),
        "Zstd": (_struct("nvcompBatchedZstdCompressOpts_t", [_reserved(64)]), {}),
    },
}


def _decompress_structs(major: int) -> dict:
    """Decompression options of 5.x and 6.x: (struct, values) -- the header's defaults, LZ4 on its CUDA backend."""
    plain = [("backend", _int), _reserved(60)]
    lz4 = [("backend", _int), ("sort_before_hw_decompress", _int), _reserved(56)]
    ans, cascaded = plain, plain
    ans_values, cascaded_values = {}, {}
    if major >= 6:
        lz4 = [("backend", _int), ("sort_before_hw_decompress", _int), ("data_type", _int),
               ("bitshuffle_mode", _int), _reserved(48)]  # fmt: skip
        ans = [("backend", _int), ("data_type", _int), ("max_sub_chunk_count", _u8), ("states_per_lane", _u8),
               ("skip_validate", _u8), _reserved(53)]  # fmt: skip
        cascaded = [("backend", _int), ("common_opts", _CascadedCommon6), _reserved(32)]
        ans_values = {"data_type": _BITS}  # the type is read from the stream
        cascaded_values = {"common_opts": (_BITS, 0, 0, 0)}  # mode unspecified: any Cascaded stream
    structs = {"LZ4": lz4, "ANS": ans, "Cascaded": cascaded}
    values = {"LZ4": {"backend": _BACKEND_CUDA}, "ANS": ans_values, "Cascaded": cascaded_values}
    return {
        name: (_struct(f"nvcompBatched{name}DecompressOpts_t", structs.get(name, plain)), values.get(name, {}))
        for name in ALGORITHMS
    }


_DECOMPRESS = {4: None, 5: _decompress_structs(5), 6: _decompress_structs(6)}


def compress_options(major: int, algorithm: str) -> ctypes.Structure:
    """The compression options passed by value: zeroed (reserved bytes included), then the header's defaults."""
    struct, values = _COMPRESS[major][algorithm]
    return struct(**values)


def decompress_options(major: int, algorithm: str) -> ctypes.Structure | None:
    """The decompression options (``None`` for nvcomp 4.x, whose calls take none)."""
    table = _DECOMPRESS[major]
    if table is None:
        return None
    struct, values = table[algorithm]
    return struct(**values)


_P, _S, _PS = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)


def signatures(major: int, copts: type, dopts: type | None) -> dict[str, tuple[str, list]]:
    """The C functions of one algorithm: role -> (name after ``nvcompBatched<Algo>``, argument types).

    Pointers (device arrays, temp space, the stream) are ``void*``; every
    function returns ``nvcompStatus_t``.
    """
    temp_name, temp_stream = {4: ("GetTempSizeEx", []), 5: ("GetTempSizeAsync", []), 6: ("GetTempSize", [_P])}[major]
    d = [dopts] if dopts is not None else []
    statuses = [_P] if major >= 5 else []  # 4.x compression reports no per-chunk status
    return {
        "max_output": ("CompressGetMaxOutputChunkSize", [_S, copts, _PS]),
        "compress_temp": (f"Compress{temp_name}", [_S, _S, copts, _PS, _S, *temp_stream]),
        "decompress_temp": (f"Decompress{temp_name}", [_S, _S, *d, _PS, _S, *temp_stream]),
        # in ptrs, in bytes, max chunk, chunks, temp, temp bytes, out ptrs, out bytes, opts, [statuses], stream
        "compress": ("CompressAsync", [_P, _P, _S, _S, _P, _S, _P, _P, copts, *statuses, _P]),
        # in ptrs, in bytes, out capacities, out bytes, chunks, temp, temp bytes, out ptrs, [opts], statuses, stream
        "decompress": ("DecompressAsync", [_P, _P, _P, _P, _S, _P, _S, _P, *d, _P, _P]),
    }


class _Alignments(ctypes.Structure):
    _fields_ = [("input", _size), ("output", _size), ("temp", _size)]


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


class Batched:
    """One algorithm of a loaded nvcomp: the calls the engine makes, over device arrays of chunks.

    Every array is a torch tensor on the device: pointers and sizes ``int64``
    (``size_t``), statuses ``int32`` (``nvcompStatus_t``). Temp space is
    allocated here with torch, on the device the arrays live on.
    """

    def __init__(self, lib: Library, algorithm: str):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"nvcomp algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm, self.major = algorithm, lib.major
        self.copts = compress_options(lib.major, algorithm)
        self.dopts = decompress_options(lib.major, algorithm)
        sigs = signatures(lib.major, type(self.copts), None if self.dopts is None else type(self.dopts))
        self._fn = {role: lib.function(f"nvcompBatched{algorithm}{name}", args) for role, (name, args) in sigs.items()}
        self._align = 16  # above every requirement nvcomp 4.0-6.0 declares; raised to what the library reports
        for name, opts in (("Compress", self.copts), ("Decompress", self.dopts)):
            symbol = f"nvcompBatched{algorithm}{name}GetRequiredAlignments"
            if opts is not None and lib.has(symbol):  # 4.2 and later
                found = _Alignments()
                lib.call(lib.function(symbol, [type(opts), ctypes.POINTER(_Alignments)]), opts, ctypes.byref(found))
                self._align = max(self._align, found.input, found.output, found.temp)

    def alignment(self) -> int:
        """Bytes every chunk, output buffer and temp space must be aligned to."""
        return self._align

    def max_compressed_bytes(self, chunk_bytes: int) -> int:
        """The most bytes a chunk of ``chunk_bytes`` compresses to (the staging room of each)."""
        out = _S()
        Library.call(self._fn["max_output"], chunk_bytes, self.copts, ctypes.byref(out))
        return int(out.value)

    def _temp(self, role: str, n: int, chunk_bytes: int, stream: int, opts) -> int:
        out = _S()
        args = [n, chunk_bytes, *([] if opts is None else [opts]), ctypes.byref(out), n * chunk_bytes]
        Library.call(self._fn[role], *args, *([ctypes.c_void_p(stream)] if self.major >= 6 else []))
        return int(out.value)

    def compress(self, *, device, stream, in_ptrs, in_bytes, chunk_bytes, out_ptrs, out_bytes, statuses) -> None:
        """One ``CompressAsync`` over ``in_ptrs.numel()`` chunks, on ``stream`` (4.x leaves ``statuses`` alone)."""
        n = in_ptrs.numel()
        temp_bytes = self._temp("compress_temp", n, chunk_bytes, stream, self.copts)
        temp = torch.empty(max(temp_bytes, 1), dtype=torch.uint8, device=device)
        status = [_ptr(statuses)] if self.major >= 5 else []
        Library.call(
            self._fn["compress"], _ptr(in_ptrs), _ptr(in_bytes), chunk_bytes, n, _ptr(temp), temp_bytes,
            _ptr(out_ptrs), _ptr(out_bytes), self.copts, *status, ctypes.c_void_p(stream),
        )  # fmt: skip

    def decompress(
        self, *, device, stream, in_ptrs, in_bytes, out_capacity, out_bytes, out_ptrs, statuses, chunk_bytes
    ):
        """One ``DecompressAsync`` over ``in_ptrs.numel()`` chunks of at most ``chunk_bytes``, on ``stream``."""
        n = in_ptrs.numel()
        temp_bytes = self._temp("decompress_temp", n, chunk_bytes, stream, self.dopts)
        temp = torch.empty(max(temp_bytes, 1), dtype=torch.uint8, device=device)
        opts = [] if self.dopts is None else [self.dopts]
        Library.call(
            self._fn["decompress"], _ptr(in_ptrs), _ptr(in_bytes), _ptr(out_capacity), _ptr(out_bytes), n,
            _ptr(temp), temp_bytes, _ptr(out_ptrs), *opts, _ptr(statuses), ctypes.c_void_p(stream),
        )  # fmt: skip


class Library:
    """A loaded ``libnvcomp.so.N``: its version checked, its algorithms bound on demand."""

    def __init__(self, path: str):
        self.path = path
        named = soname_major(path)
        try:
            self._cdll = ctypes.CDLL(path, mode=getattr(os, "RTLD_LOCAL", 0))
        except OSError as exc:
            raise MissingDependencyError(f"nvcomp's library {path} cannot be loaded ({exc}); {_INSTALL}") from exc
        props = _Properties()
        self.call(self.function("nvcompGetProperties", [ctypes.POINTER(_Properties)]), ctypes.byref(props))
        self.version = int(props.version)
        self.major = self.version // 1000
        if self.major != named or self.major not in SUPPORTED_MAJORS:
            raise MissingDependencyError(
                f"nvcomp {version_string(self.version)} ({path}) is not a version buddy binds: it calls nvcomp's "
                f"batched C API of nvcomp {', '.join(f'{m}.x' for m in SUPPORTED_MAJORS)}; {_INSTALL}"
            )
        self._algorithms: dict[str, Batched] = {}
        self._lock = threading.Lock()

    def has(self, symbol: str) -> bool:
        return hasattr(self._cdll, symbol)

    def function(self, symbol: str, argtypes: list):
        """A private ctypes function object of ``symbol`` (returning ``nvcompStatus_t``)."""
        try:
            fn = self._cdll[symbol]  # a new object: argtypes set here are this binding's only
        except AttributeError as exc:
            raise MissingDependencyError(
                f"nvcomp {self.path} has no {symbol}: not the nvcomp {self.path.rsplit('.', 1)[-1]}.x it claims"
            ) from exc
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn

    @staticmethod
    def call(fn, *args) -> None:
        """Call an nvcomp function; :class:`NvcompError` (a ``RuntimeError``) naming the status unless it succeeded."""
        status = fn(*args)
        if status != 0:
            raise NvcompError(fn.__name__, int(status))

    def algorithm(self, name: str) -> Batched:
        """The bound calls of algorithm ``name`` (bound once per library)."""
        with self._lock:
            found = self._algorithms.get(name)
            if found is None:
                found = self._algorithms[name] = Batched(self, name)
        return found


def version_string(version: int) -> str:
    """``major.minor.patch`` of ``nvcompGetProperties``'s version number."""
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


_SONAME = re.compile(r"libnvcomp\.so\.(\d+)")


def soname_major(path: str) -> int | None:
    """The major version in a library's file name (``libnvcomp.so.6`` -> 6), or ``None``."""
    found = _SONAME.search(os.path.basename(path))
    return int(found.group(1)) if found else None


def _package_dirs(package: str) -> list[str]:
    """Where an installed package lives, found without importing it (``[]`` when it is not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


@functools.lru_cache(maxsize=1)
def find_library() -> str | None:
    """Path of the ``libnvcomp.so.N`` of the installed nvcomp wheels (the highest N), or ``None``."""
    places: list[tuple[str, tuple[str, ...]]] = [(d, ("lib64", "lib", "bin")) for d in _package_dirs("nvidia.libnvcomp")]
    places += [(d, ("",)) for d in _package_dirs("nvidia.nvcomp")]
    for root, subdirs in places:
        found = [p for sub in subdirs for p in glob.glob(os.path.join(root, sub, "libnvcomp.so.*"))]
        found = [p for p in found if soname_major(p) is not None]
        if found:
            return max(found, key=lambda p: (soname_major(p), p))
    return None


def why_unusable() -> str | None:
    """Why nvcomp's library cannot be used here (judged from its file), or ``None``."""
    path = find_library()
    if path is None:
        return f"nvcomp is not installed: {_INSTALL}"
    major = soname_major(path)
    if major not in SUPPORTED_MAJORS:
        bound = ", ".join(f"{m}.x" for m in SUPPORTED_MAJORS)
        return f"the installed nvcomp ({os.path.basename(path)}) is {major}.x; buddy binds nvcomp {bound}: {_INSTALL}"
    return None


_loaded: dict[str, Library] = {}
_lock = threading.Lock()


def library(path: str | None = None) -> Library:
    """The loaded library (the installed one unless ``path``); :class:`MissingDependencyError` if it cannot serve."""
    if path is None:
        why = why_unusable()
        if why is not None:
            raise MissingDependencyError(f"buddy's nvcomp codecs cannot run: {why}")
        path = find_library()
        assert path is not None  # why_unusable() is None only when the library was found
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            lib = _loaded[path] = Library(path)
    return lib
