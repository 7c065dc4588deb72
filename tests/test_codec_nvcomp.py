"""nvcomp chunk codecs: the engine's pieces and glue without a GPU, bit-exact round trips with one.

Without a GPU:

* the pure pieces -- chunk pointers, sizes, histogram, length headers, the
  device-side split and gather of :mod:`buddy.format` against
  ``split_payload`` / ``join_payload``, the 4-64 KiB rule, the refusals;
* the ctypes binding -- option structs as nvcomp's headers lay them out
  (every field's offset in 6.0), the C signatures per major, the calls
  :class:`capi.Batched` makes through C callbacks of those very prototypes
  (temp sizes, temp space, alignment, options by value, statuses, stream),
  finding and version-checking the library; with ``BUDDY_NVCOMP_LIBS``
  naming ``libnvcomp.so.N`` files, their host-only functions are called
  through the binding (sizes, alignments, and options nvcomp must accept or
  reject field by field);
* the whole engine on CPU tensors, nvcomp's batched calls stood in for by
  zlib on the host reading and writing through the very pointer arrays
  the engine builds (registered as the "nvcomp" backend of the CPU); the
  stand-in fails a test that hands its decompressor a chunk that is not a
  whole stream (undefined behaviour in nvcomp's Zstd, GDeflate, Cascaded and
  Bitcomp decompressors), unless the test damages a stream on purpose.

The GPU half is marked ``gpu`` and skips without CUDA and nvcomp.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import shutil
import subprocess
import threading
import warnings
import zlib

import pytest
import torch
from conftest import MiB, assert_bitexact, assert_roundtrip, ids, make_data

import buddy
from buddy import format
from buddy.engines import _nvcomp_capi as capi
from buddy.engines import nvcomp
from buddy.layout import Layout
from buddy.slots import overflow_sectors

ENTRIES = (4096, 16384, 65536)
KINDS = ("zeros", "relu", "random_bytes", "special")


def on_gpu(test):
    """A test that needs a CUDA GPU and nvcomp."""
    reason = f"nvcomp codecs cannot run here: {nvcomp.why_unusable()}"
    return pytest.mark.gpu(pytest.mark.skipif(not nvcomp.usable(), reason=reason)(test))


def mixed(entry_bytes: int, entries: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Whole entries of every kind -- zeros, ReLU, random bytes (raw), specials, a short cycle -- then a partial one."""
    per = entry_bytes // torch.empty((), dtype=dtype).element_size()

    def entry(i: int) -> torch.Tensor:
        if i % 5 == 4:  # what every nvcomp algorithm shrinks (Cascaded included): small 32-bit integers
            return (torch.arange(entry_bytes // 4, dtype=torch.int32) % 16).view(torch.uint8).view(dtype)
        return make_data(KINDS[i % 5], per, dtype, gen)

    return torch.cat([*(entry(i) for i in range(entries)), make_data("relu", per // 3 + 1, dtype, gen)])


# ---------------------------------------------------------------------------
# names, refusals, the 4-64 KiB rule
# ---------------------------------------------------------------------------
def test_names_map_to_nvcomp_algorithms():
    assert set(nvcomp.NAMES) == {f"nvcomp-{a.lower()}" for a in nvcomp.ALGORITHMS.values()}
    assert set(nvcomp.ALGORITHMS.values()) == set(capi.ALGORITHMS)  # every one has a batched C API
    with pytest.raises(ValueError, match="one of"):
        nvcomp.chunk_codec("nvcomp-brotli")


def test_chunk_codecs_are_names_not_torch_codecs():
    """nvcomp's codecs are ChunkCodecs: a name and an algorithm, no per-block torch code, so no reference."""
    codec = nvcomp.chunk_codec("nvcomp-zstd")
    assert isinstance(codec, buddy.codecs.ChunkCodec) and not isinstance(codec, buddy.codecs.Codec)
    assert (codec.name, codec.algorithm, codec.format_version, codec.table, codec.table_bytes) == (
        "nvcomp-zstd", "Zstd", 1, None, 0
    )  # fmt: skip
    assert codec == nvcomp.chunk_codec("nvcomp-zstd") and codec.fit(torch.ones(8, dtype=torch.uint8), 1) is codec
    with pytest.raises(buddy.CorruptDataError, match="takes no table"):
        codec.bind(torch.ones(4, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="reference=False"):
        buddy.codecs.register_codec(buddy.codecs.ChunkCodec("nvcomp-test", "LZ4"))
    with pytest.raises(ValueError, match="nvcomp codecs"):
        nvcomp.NvcompEngine(buddy.codecs.ChunkCodec("nvcomp-lz4", "Zstd"))  # not the algorithm of that name


@pytest.mark.skipif(nvcomp.usable(), reason="checks the refusal where nvcomp cannot run")
def test_unusable_here_is_refused_by_name_with_the_reason():
    assert not set(nvcomp.NAMES) & set(buddy.available_codecs())
    with pytest.raises(buddy.MissingDependencyError, match="not available here") as info:
        buddy.get_codec("nvcomp-lz4")
    assert nvcomp.why_unusable() in str(info.value)
    with pytest.raises(buddy.MissingDependencyError):
        buddy.compress(torch.zeros(64), codec="nvcomp-ans")


@pytest.mark.parametrize("name", nvcomp.NAMES)
def test_cpu_tensors_are_refused_before_any_work(name, store):
    codec = nvcomp.chunk_codec(name)
    rows = buddy.dispatch.implementations(name)
    assert {(i.device, i.backend, i.default) for i in rows} == {("cuda", "nvcomp", True)}
    with pytest.raises(buddy.MissingDependencyError, match="GPU"):
        buddy.compress(torch.randn(4096), codec=codec, entry_bytes=4096, store=store)
    assert store.bytes_held == 0
    with pytest.raises(buddy.MissingDependencyError):
        buddy.unpack(
            torch.full((2,), 1, dtype=torch.uint8),
            torch.zeros(4096, dtype=torch.uint8),
            torch.zeros(0, dtype=torch.uint8),
            codec=codec,
            entry_bytes=4096,
            slot_sectors=128,
            shape=(1024,),
            dtype=torch.float32,
        )
    assert not isinstance(codec, buddy.codecs.Codec)  # no per-block torch code to run on the CPU: a ChunkCodec
    engine = nvcomp.NvcompEngine(codec)  # the real engine, handed a CPU tensor directly
    with pytest.raises(buddy.MissingDependencyError, match="GPU"):
        engine.measure(torch.ones(4096, dtype=torch.uint8), Layout(4096, 4096, 1))


def test_device_filter_of_the_registry():
    cpu = buddy.available_codecs("cpu")
    assert set(cpu) <= set(buddy.available_codecs())
    assert {"raw", "zvc", "auto"} <= set(cpu)
    assert not any(name.startswith("nvcomp-") for name in cpu)
    assert buddy.available_codecs(torch.device("cpu")) == cpu


def test_entries_of_4_to_64_kib_only():
    for e in (4096, 8192, 65536):
        assert nvcomp.check_entry_bytes(e) == e
    for e in (32, 128, 512, 2048):
        with pytest.raises(ValueError, match="4-64 KiB"):
            nvcomp.check_entry_bytes(e)
    for e in (3000, 131072):
        with pytest.raises(ValueError, match="power of two"):
            nvcomp.check_entry_bytes(e)


def test_small_entries_are_refused_before_any_work(host_nvcomp):
    engine = nvcomp.NvcompEngine(nvcomp.chunk_codec("nvcomp-lz4"), batch=host_nvcomp, device_type="cpu")
    flat = torch.ones(8192, dtype=torch.uint8)
    with pytest.raises(ValueError, match="4-64 KiB"):
        engine.measure(flat, Layout(2048, flat.numel(), 1))
    measured = engine.measure(flat, Layout(4096, flat.numel(), 1))
    host_nvcomp.calls.clear()
    with pytest.raises(ValueError, match="4-64 KiB"):
        engine.pack(flat, measured, 1, Layout(2048, flat.numel(), 1))
    with pytest.raises(ValueError, match="4-64 KiB"):
        engine.unpack(
            measured.meta, torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8), 0, Layout(512, 8192, 1)
        )
    with pytest.raises(ValueError, match="4-64 KiB"):
        buddy.compress(flat.float(), codec="nvcomp-lz4", entry_bytes=1024)
    assert host_nvcomp.calls == [] and engine.readbacks == 1


# ---------------------------------------------------------------------------
# the pure pieces
# ---------------------------------------------------------------------------
def test_chunk_pointers():
    base = 0x7F00_0000_1000
    assert nvcomp.chunk_pointers(base, 4096, 4, "cpu").tolist() == [base + i * 4096 for i in range(4)]
    assert nvcomp.chunk_pointers(base, 4160, 3, "cpu", last=77).tolist() == [base, base + 4160, 77]
    assert nvcomp.chunk_pointers(base, 4096, 0, "cpu", last=77).numel() == 0
    big = nvcomp.chunk_pointers(base, 65536, 1 << 20, "cpu")
    assert big.dtype == torch.int64 and int(big[-1]) == base + ((1 << 20) - 1) * 65536


def test_the_last_pointer_is_a_fill_not_a_copy():
    """``ptrs[-1] = last`` copies a host scalar into the tensor: on CUDA a blocking copy that waits for the stream."""
    with _ops() as ops:
        nvcomp.chunk_pointers(0x1000, 4096, 5, "cpu", last=77)
    assert "aten::fill_" in ops and "aten::copy_" not in ops


def test_entry_sectors_follow_the_format_rules():
    e = 4096  # 128 sectors: a stream of L bytes takes ceil((4 + L) / 32) of them
    lengths = torch.tensor([28, 29, 1, 60, 4060, 4061, 5000, 100, 100, 0])
    ok = torch.tensor([True] * 7 + [False, True, True])
    nonzero = torch.tensor([True] * 8 + [False, True])
    k = nvcomp.entry_sectors(nonzero, lengths, ok, e)
    assert k.dtype == torch.int32
    # 28 fits one sector; 4060 is the longest coded stream; longer is raw; a failure is raw;
    # an all-zero entry is k = 0 whatever nvcomp said; an empty stream is raw
    assert k.tolist() == [1, 2, 1, 2, 127, 128, 128, 128, 0, 128]


def test_sector_histogram_is_bincount_without_a_host_read(gen):
    for e in (4096, 65536):
        spe = e // 32
        k = torch.randint(0, spe + 1, (5000,), generator=gen, dtype=torch.int32)
        k[:100] = spe
        k[100:200] = 0
        h = nvcomp.sector_histogram(k, e)
        assert h.dtype == torch.int64 and h.shape == (spe + 1,)
        assert torch.equal(h, torch.bincount(k.long(), minlength=spe + 1))
    assert nvcomp.sector_histogram(torch.zeros(0, dtype=torch.int32), 4096).tolist() == [0] * 129


def test_length_headers_are_little_endian_uint32():
    lengths = torch.tensor([0, 1, 0x1234, 0xABCDEF, 65535, 0x7FFFFFFF])
    heads = nvcomp.length_bytes(lengths)
    assert heads.dtype == torch.uint8 and heads[3].tolist() == [0xEF, 0xCD, 0xAB, 0x00]
    assert heads[2].tolist() == [0x34, 0x12, 0, 0]
    assert torch.equal(nvcomp.read_lengths(torch.cat([heads, torch.zeros(6, 10, dtype=torch.uint8)], 1)), lengths)
    assert torch.equal(heads, lengths.to(torch.int32).view(torch.uint8).view(-1, 4))  # this host is little-endian too


def test_coded_payloads_are_length_stream_then_zeros(gen):
    e, stride = 4096, 4160
    streams = torch.randint(0, 256, (3, stride), dtype=torch.uint8, generator=gen)
    lengths = torch.tensor([28, 1000, 4060])
    payload = nvcomp.coded_payloads(streams, lengths, e)
    assert payload.shape == (3, e)
    for row, n in enumerate(lengths.tolist()):
        assert int(nvcomp.read_lengths(payload[row : row + 1])) == n
        assert torch.equal(payload[row, 4 : 4 + n], streams[row, :n])
        assert not payload[row, 4 + n :].any()


@pytest.mark.parametrize("entry_bytes", ids("E", (128, 4096)))
def test_device_split_and_gather_agree_with_the_format_layer(entry_bytes, gen):
    """scatter_overflow / gather_overflow, a block at a time, == split_payload / join_payload, for every slot."""
    spe = entry_bytes // 32
    for n in (1, 5, 37):
        k = torch.randint(0, spe + 1, (n,), generator=gen, dtype=torch.int32)
        payload = torch.randint(1, 256, (n, entry_bytes), generator=gen, dtype=torch.uint8)
        payload.view(n, spe, 32)[torch.arange(spe).unsqueeze(0) >= k.unsqueeze(1)] = 0
        for slot in range(spe + 1) if spe <= 4 else (0, 1, 17, spe // 2, spe - 1, spe):
            slots, expected = format.split_payload(payload, k, slot, entry_bytes)
            m = expected.shape[0]
            starts, total = format.overflow_starts(k, slot)
            assert int(total) == m and starts.dtype == torch.int64
            overflow = torch.full(((m + 1) * 32,), 0xAA, dtype=torch.uint8)
            for a in range(0, n, 6):  # blocks: every scatter places its rows by the whole tensor's prefix sum
                format.scatter_overflow(payload[a : a + 6], k[a : a + 6], slot, starts[a : a + 6], overflow)
            assert torch.equal(overflow[: m * 32].view(m, 32), expected.view(m, 32))
            overflow[m * 32 :] = 0  # the spare sector gathers as zeros
            tail = [
                format.gather_overflow(overflow, k[a : a + 4], slot, starts[a : a + 4], entry_bytes)
                for a in range(0, n, 4)
            ]
            joined = format.join_payload(slots, expected, k, slot, entry_bytes)
            assert torch.equal(torch.cat(tail) if tail else joined[:, slot * 32 :], joined[:, slot * 32 :])


def test_device_split_and_gather_of_no_entries():
    none = torch.zeros(0, dtype=torch.int32)
    starts, total = format.overflow_starts(none, 1)
    assert starts.numel() == 0 and int(total) == 0
    spare = torch.zeros(32, dtype=torch.uint8)
    format.scatter_overflow(torch.zeros(0, 128, dtype=torch.uint8), none, 1, starts, spare)
    assert format.gather_overflow(spare, none, 1, starts, 128).shape == (0, 96)


def test_gather_with_damaged_sizes_stays_in_bounds():
    k = torch.tensor([4, 4, 4], dtype=torch.int32)  # says 9 overflow sectors with s = 1
    starts, total = format.overflow_starts(k, 1)
    overflow = torch.arange(3 * 32, dtype=torch.int32).to(torch.uint8)  # 2 sectors and the spare one
    out = format.gather_overflow(overflow, k, 1, starts, 128)
    assert out.shape == (3, 96) and int(total) == 9  # read, wrong but in bounds; the total tells


# ---------------------------------------------------------------------------
# the ctypes binding
# ---------------------------------------------------------------------------
def test_option_structs_are_laid_out_as_the_headers_declare():
    sizes4 = {"LZ4": 4, "ANS": 8, "Bitcomp": 8, "Cascaded": 24, "Gdeflate": 4, "Zstd": 4}
    for algo in capi.ALGORITHMS:
        assert ctypes.sizeof(capi.compress_options(4, algo)) == sizes4[algo]
        assert capi.decompress_options(4, algo) is None  # 4.x decompression takes no options
        for major in (5, 6):
            assert ctypes.sizeof(capi.compress_options(major, algo)) == 64
            assert ctypes.sizeof(capi.decompress_options(major, algo)) == 64
    offset = lambda major, algo, field, which=capi.compress_options: getattr(type(which(major, algo)), field).offset  # noqa: E731
    assert offset(6, "Bitcomp", "delta") == 8 and offset(6, "Bitcomp", "mode") == 16
    assert (
        offset(6, "Cascaded", "fine_grained_encoding_flags") == 24 and offset(6, "Cascaded", "compression_level") == 32
    )
    assert offset(6, "ANS", "max_sub_chunk_count") == 8
    assert offset(6, "Cascaded", "common_opts", capi.decompress_options) == 8
    assert offset(6, "ANS", "data_type", capi.decompress_options) == 4
    assert offset(4, "Cascaded", "type") == 8 and offset(5, "Cascaded", "use_bp") == 20


def test_options_carry_the_header_defaults():
    raw = lambda o: bytes(o)  # noqa: E731
    for major in (4, 5, 6):
        assert not any(raw(capi.compress_options(major, "LZ4"))) and not any(raw(capi.compress_options(major, "Zstd")))
        assert capi.compress_options(major, "Bitcomp").data_type == 1  # NVCOMP_TYPE_UCHAR
    assert capi.compress_options(4, "Gdeflate").algo == 1 and capi.compress_options(6, "Gdeflate").algorithm == 1
    c5 = capi.compress_options(5, "Cascaded")
    assert (c5.internal_chunk_bytes, c5.type, c5.num_RLEs, c5.num_deltas, c5.use_bp) == (4096, 4, 2, 1, 1)
    c6 = capi.compress_options(6, "Cascaded")
    common = c6.common_opts
    assert (common.data_type, common.mode, common.terminal_codec_flags, common.coarse_grained_encoding_flags) == (
        5,
        1,
        1,
        0,
    )
    assert (c6.fine_grained_encoding_flags, c6.compression_level) == (7, 3)
    assert capi.decompress_options(6, "ANS").data_type == 0xFF  # NVCOMP_TYPE_BITS: read from the stream
    assert capi.decompress_options(6, "Cascaded").common_opts.data_type == 0xFF
    for major in (5, 6):
        assert capi.decompress_options(major, "LZ4").backend == 2  # the CUDA backend: damaged chunks get statuses
        for algo in ("ANS", "Bitcomp", "Cascaded", "Gdeflate", "Zstd"):
            assert capi.decompress_options(major, algo).backend == 0


# The prototypes in nvcomp's headers (4.2.0; 5.0.0 to 5.3.0; 6.0.0), the options types written OPTS / DOPTS.
_ASYNC_4 = (
    "const void* const* device_uncompressed_chunk_ptrs, const size_t* device_uncompressed_chunk_bytes, "
    "size_t max_uncompressed_chunk_bytes, size_t num_chunks, void* device_temp_ptr, size_t temp_bytes, "
    "void* const* device_compressed_chunk_ptrs, size_t* device_compressed_chunk_bytes, OPTS format_opts, "
    "cudaStream_t stream",
    "const void* const* device_compressed_chunk_ptrs, const size_t* device_compressed_chunk_bytes, "
    "const size_t* device_uncompressed_buffer_bytes, size_t* device_uncompressed_chunk_bytes, size_t num_chunks, "
    "void* const device_temp_ptr, size_t temp_bytes, void* const* device_uncompressed_chunk_ptrs, "
    "nvcompStatus_t* device_statuses, cudaStream_t stream",
)
_ASYNC_5 = (
    _ASYNC_4[0].replace("OPTS format_opts,", "OPTS compress_opts, nvcompStatus_t* device_statuses,"),
    _ASYNC_4[1].replace("nvcompStatus_t*", "DOPTS decompress_opts, nvcompStatus_t*"),
)
_TEMP = "size_t num_chunks, size_t max_uncompressed_chunk_bytes, {opts}size_t* temp_bytes, size_t max_total_uncompressed_bytes"
_PROTOTYPES = {
    4: {
        "CompressGetTempSizeEx": _TEMP.format(opts="OPTS format_opts, ").replace(
            ", size_t max_total", ", const size_t max_total"
        ),
        "DecompressGetTempSizeEx": _TEMP.format(opts=""),
        "CompressAsync": _ASYNC_4[0],
        "DecompressAsync": _ASYNC_4[1],
    },
    5: {
        "CompressGetTempSizeAsync": _TEMP.format(opts="OPTS compress_opts, "),
        "DecompressGetTempSizeAsync": _TEMP.format(opts="DOPTS decompress_opts, "),
        "CompressAsync": _ASYNC_5[0],
        "DecompressAsync": _ASYNC_5[1],
    },
    6: {
        "CompressGetTempSize": _TEMP.format(opts="OPTS compress_opts, ") + ", cudaStream_t stream",
        "DecompressGetTempSize": _TEMP.format(opts="DOPTS decompress_opts, ") + ", cudaStream_t stream",
        "CompressAsync": _ASYNC_5[0],
        "DecompressAsync": _ASYNC_5[1],
    },
}


def _ctype(parameter: str, c: type, d: type):
    """The ctypes type a C parameter is bound with: sizes by value, options by value, the temp size's host
    out-parameter, and everything else (device arrays, temp space, the stream) as a pointer."""
    kind, name = parameter.rsplit(" ", 1)
    if kind in ("size_t", "const size_t"):
        return ctypes.c_size_t
    if kind in ("OPTS", "DOPTS"):
        return {"OPTS": c, "DOPTS": d}[kind]
    return capi._PS if name == "temp_bytes" else ctypes.c_void_p


@pytest.mark.parametrize("major", capi.SUPPORTED_MAJORS)
def test_signatures_match_the_header_prototypes(major):
    for algo in capi.ALGORITHMS:
        c = type(capi.compress_options(major, algo))
        d = None if major == 4 else type(capi.decompress_options(major, algo))
        by_name = dict(capi.signatures(major, c, d).values())
        assert by_name["CompressGetMaxOutputChunkSize"] == [ctypes.c_size_t, c, capi._PS]
        assert set(by_name) == {"CompressGetMaxOutputChunkSize", *_PROTOTYPES[major]}
        for name, prototype in _PROTOTYPES[major].items():
            assert by_name[name] == [_ctype(p, c, d) for p in prototype.split(", ")], (algo, name)


def test_versions_and_file_names():
    assert capi.version_string(4001) == "4.0.1" and capi.version_string(6000) == "6.0.0"
    assert capi.version_string(5300) == "5.3.0"
    assert capi.soname_major("/x/lib64/libnvcomp.so.6") == 6 and capi.soname_major("libnvcomp.so.5.1.0") == 5
    assert capi.soname_major("/x/libnvcomp_cpu.so.6") is None and capi.soname_major("libnvcomp.so") is None


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """``install(package, relative_path)``: an empty file where a wheel would put nvcomp's library."""
    dirs: dict[str, list[str]] = {}
    monkeypatch.setattr(capi, "_package_dirs", lambda package: dirs.get(package, []))
    capi.find_library.cache_clear()

    def install(package: str, relative: str) -> str:
        root = tmp_path / package.replace(".", "_")
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(b"")
        dirs.setdefault(package, []).append(str(root))
        capi.find_library.cache_clear()
        return str(root / relative)

    yield install
    capi.find_library.cache_clear()


def test_finding_the_library(fake_packages):
    assert capi.find_library() is None
    assert "not installed" in capi.why_unusable() and "buddy[cuda12]" in capi.why_unusable()
    with pytest.raises(buddy.MissingDependencyError, match="not installed"):
        capi.library()
    old = fake_packages("nvidia.nvcomp", "libnvcomp.so.4")  # a 4.x wheel: the library beside the Python API
    fake_packages("nvidia.nvcomp", "libnvcomp_cpu.so.4")
    assert capi.find_library() == old and capi.why_unusable() is None
    new = fake_packages("nvidia.libnvcomp", "lib64/libnvcomp.so.6")  # 5.1 and later: a package of its own
    assert capi.find_library() == new
    fake_packages("nvidia.libnvcomp", "lib64/libnvcomp.so.9")
    assert "9.x" in capi.why_unusable() and "4.x, 5.x, 6.x" in capi.why_unusable()
    with pytest.raises(buddy.MissingDependencyError, match="9.x"):
        capi.library()


_FAKE_LIBRARY = """
#include <stdint.h>
typedef struct { uint32_t version; uint32_t cudart_version; } nvcompProperties_t;
int nvcompGetProperties(nvcompProperties_t* p) { p->version = VERSION; p->cudart_version = 12090; return 0; }
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
@pytest.mark.parametrize(
    ("name", "version", "match"), [("libnvcomp.so.7", 7000, "7.0.0"), ("libnvcomp.so.6", 5300, "5.3.0")]
)
def test_a_library_of_another_version_is_refused(tmp_path, name, version, match):
    source = tmp_path / "fake.c"
    source.write_text(_FAKE_LIBRARY)
    path = tmp_path / name
    subprocess.run(["cc", "-shared", "-fPIC", f"-DVERSION={version}", str(source), "-o", str(path)], check=True)
    with pytest.raises(buddy.MissingDependencyError, match=match):
        capi.Library(str(path))


def _real_libraries() -> list[str]:
    """nvcomp libraries to check the binding against: ``BUDDY_NVCOMP_LIBS`` (os.pathsep-separated) and the installed one."""
    paths = [p for p in os.environ.get("BUDDY_NVCOMP_LIBS", "").split(os.pathsep) if p]
    installed = capi.find_library()
    return paths + ([installed] if installed and installed not in paths else [])


@pytest.mark.parametrize("path", _real_libraries() or [pytest.param(None, marks=pytest.mark.skip("no nvcomp library"))])
def test_binding_against_a_real_library(path):
    """nvcomp's host-only functions through the binding: sizes, alignments, and options read where we put them.

    Runs without a GPU. (Temp sizes of Zstd and of 4.x GDeflate ask the GPU, so are left to the GPU tests.)
    """
    lib = capi.Library(path)
    assert lib.major == capi.soname_major(path) and lib.major in capi.SUPPORTED_MAJORS
    for algo in capi.ALGORITHMS:
        batched = lib.algorithm(algo)
        assert 4096 < batched.max_compressed_bytes(4096) < 3 * 4096
        assert batched.alignment() in (16, 32, 64, 128, 256)
    lz4 = lib.algorithm("LZ4")
    assert lz4._temp("compress_temp", 1000, 65536, 0, lz4.copts) > 0
    assert lz4._temp("decompress_temp", 1000, 65536, 0, lz4.dopts) >= 0
    if lib.major >= 6:
        _probe_6x_fields(lib)


def _probe_6x_fields(lib):
    """Each field set where the 6.x headers put it changes what nvcomp answers, as they document."""

    def accepted(algo, **fields):
        batched, opts = lib.algorithm(algo), capi.compress_options(6, algo)
        for name, value in fields.items():
            setattr(opts, name, value)
        out = ctypes.c_size_t()
        return batched._fn["max_output"](4096, opts, ctypes.byref(out)) == 0

    assert accepted("Bitcomp") and not accepted("Bitcomp", mode=1)  # lossy needs a float type ...
    assert accepted("Bitcomp", mode=1, data_type=11, delta=0.5)  # ... FLOAT32 and a delta: offsets 4, 8, 16
    assert not accepted("Cascaded", common_opts=capi._CascadedCommon6(0, 0, 0, 0))  # mode "unspecified"
    assert not accepted("Cascaded", fine_grained_encoding_flags=0)  # asymmetric mode needs FOR: offset 24
    assert not accepted("ANS", max_sub_chunk_count=3) and not accepted("LZ4", bitshuffle_mode=9)
    assert not accepted("Gdeflate", algorithm=9)


# Every field's offset in nvcomp 6.0's option structs (offsetof, compiled against include/nvcomp/*.h of
# nvidia-libnvcomp-cu13 6.0.0.12); each struct is 64 bytes, its reserved bytes running to the end.
_OFFSETS_6 = {
    ("LZ4", "compress"): {"data_type": 0, "bitshuffle_mode": 4, "reserved": 8},
    ("LZ4", "decompress"): {
        "backend": 0,
        "sort_before_hw_decompress": 4,
        "data_type": 8,
        "bitshuffle_mode": 12,
        "reserved": 16,
    },
    ("ANS", "compress"): {
        "type": 0,
        "data_type": 4,
        "max_sub_chunk_count": 8,
        "states_per_lane": 9,
        "histogram_reduction_log2": 10,
        "reserved": 11,
    },
    ("ANS", "decompress"): {
        "backend": 0,
        "data_type": 4,
        "max_sub_chunk_count": 8,
        "states_per_lane": 9,
        "skip_validate": 10,
        "reserved": 11,
    },
    ("Bitcomp", "compress"): {"algorithm": 0, "data_type": 4, "delta": 8, "mode": 16, "reserved": 20},
    ("Bitcomp", "decompress"): {"backend": 0, "reserved": 4},
    ("Cascaded", "compress"): {
        "common_opts": 0,
        "fine_grained_encoding_flags": 24,
        "compression_level": 32,
        "reserved": 33,
    },
    ("Cascaded", "decompress"): {"backend": 0, "common_opts": 8, "reserved": 32},
    ("Gdeflate", "compress"): {"algorithm": 0, "reserved": 4},
    ("Gdeflate", "decompress"): {"backend": 0, "reserved": 4},
    ("Zstd", "compress"): {"reserved": 0},
    ("Zstd", "decompress"): {"backend": 0, "reserved": 4},
}


def test_every_6x_option_field_where_the_header_puts_it():
    assert set(_OFFSETS_6) == {(a, w) for a in capi.ALGORITHMS for w in ("compress", "decompress")}
    for (algo, which), offsets in _OFFSETS_6.items():
        struct = type((capi.compress_options if which == "compress" else capi.decompress_options)(6, algo))
        assert [name for name, _ in struct._fields_] == list(offsets), (algo, which)  # no field more or less
        assert {name: getattr(struct, name).offset for name in offsets} == offsets, (algo, which)
        assert struct.reserved.offset + struct.reserved.size == ctypes.sizeof(struct) == 64, (algo, which)
    common = capi._CascadedCommon6
    assert ctypes.sizeof(common) == 24 and (common.mode.offset, common.terminal_codec_flags.offset) == (4, 8)
    assert common.coarse_grained_encoding_flags.offset == 16
    assert (ctypes.sizeof(capi._Alignments), ctypes.sizeof(capi._Properties)) == (24, 8)


def test_what_nvcomp_documents_about_damaged_streams():
    """LZ4 (on the CUDA backend, which the options select) and ANS report a damaged chunk in its status; the
    other headers call such input undefined behaviour."""
    assert capi.REPORTS_DAMAGE == {"LZ4", "ANS"} and capi.REPORTS_DAMAGE < set(capi.ALGORITHMS)
    assert all(capi.decompress_options(major, "LZ4").backend == 2 for major in (5, 6))
    assert capi.STATUS[capi.CANNOT_DECOMPRESS] == "nvcompErrorCannotDecompress"


class FakeLibrary:
    """What :class:`capi.Batched` asks of a :class:`capi.Library`, each nvcomp function a C callback of the
    very prototype the binding declares: libffi marshals every argument (the options structs by value too)
    as in a call into libnvcomp, and the callback records what arrived."""

    def __init__(self, major: int, *, temp_bytes=5000, max_output=4200, alignments=((4, 1, 1), (1, 8, 8)), fail=()):
        self.major, self.temp_bytes, self.max_output = major, temp_bytes, max_output
        self.alignments, self.fail = dict(zip(("Compress", "Decompress"), alignments)), fail
        self.seen: dict[str, list[tuple]] = {}
        self.errors: list[Exception] = []
        self._keep: list = []  # the callbacks must outlive their calls

    def has(self, symbol: str) -> bool:
        return self.major >= 5 or not symbol.endswith("GetRequiredAlignments")

    call = staticmethod(capi.Library.call)

    def function(self, symbol: str, argtypes: list):
        def impl(*args):
            try:
                self.seen.setdefault(symbol, []).append(
                    tuple(bytes(a) if isinstance(a, ctypes.Structure) else a for a in args)
                )
                out = [a for a in args if isinstance(a, ctypes._Pointer)]  # the host out-parameter, if any
                if symbol.endswith("GetRequiredAlignments"):
                    which = "Decompress" if "Decompress" in symbol else "Compress"
                    out[0].contents.input, out[0].contents.output, out[0].contents.temp = self.alignments[which]
                elif symbol.endswith("GetMaxOutputChunkSize"):
                    out[0][0] = self.max_output
                elif "GetTempSize" in symbol:
                    out[0][0] = self.temp_bytes
            except Exception as exc:  # a callback cannot raise through C: kept, and the call fails
                self.errors.append(exc)
                return 10000
            return 10 if any(symbol.endswith(f) for f in self.fail) else 0

        made = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(impl)
        made.__name__ = symbol
        self._keep.append(made)
        return made


@pytest.mark.parametrize("major", capi.SUPPORTED_MAJORS)
def test_batched_calls_as_the_prototypes_declare(major):
    """Temp sizes for the whole batch (``n * chunk`` bytes in all), temp space as large as asked and aligned,
    the options by value byte for byte, the statuses and the stream where each major puts them."""
    n, chunk, stream = 7, 4096, 0x5EED
    for algo in capi.ALGORITHMS:
        lib = FakeLibrary(major)
        batched = capi.Batched(lib, algo)
        assert batched.alignment() == 16  # the floor: above the (4, 1, 1) and (1, 8, 8) reported here
        assert batched.max_compressed_bytes(chunk) == 4200
        name = f"nvcompBatched{algo}"
        copts, dopts = bytes(batched.copts), None if batched.dopts is None else bytes(batched.dopts)
        if major >= 5:
            assert lib.seen[f"{name}CompressGetRequiredAlignments"][0][0] == copts
            assert lib.seen[f"{name}DecompressGetRequiredAlignments"][0][0] == dopts
        t = {k: torch.zeros(n, dtype=torch.int64) for k in ("in_ptrs", "in_bytes", "out_ptrs", "out_bytes", "cap")}
        statuses = torch.zeros(n, dtype=torch.int32)
        batched.compress(device="cpu", stream=stream, in_ptrs=t["in_ptrs"], in_bytes=t["in_bytes"], chunk_bytes=chunk,
                         out_ptrs=t["out_ptrs"], out_bytes=t["out_bytes"], statuses=statuses)  # fmt: skip
        batched.decompress(device="cpu", stream=stream, in_ptrs=t["in_ptrs"], in_bytes=t["in_bytes"],
                           out_capacity=t["cap"], out_bytes=t["out_bytes"], out_ptrs=t["out_ptrs"],
                           statuses=statuses, chunk_bytes=chunk)  # fmt: skip
        temp_name = {4: "GetTempSizeEx", 5: "GetTempSizeAsync", 6: "GetTempSize"}[major]
        on_stream = (stream,) if major >= 6 else ()
        c_temp, d_temp = (lib.seen[f"{name}{which}{temp_name}"] for which in ("Compress", "Decompress"))
        assert len(c_temp) == len(d_temp) == 1 and not lib.errors
        assert c_temp[0][:3] == (n, chunk, copts) and c_temp[0][4:] == (n * chunk, *on_stream)
        d_opts = (dopts,) if major >= 5 else ()
        assert d_temp[0][: 2 + len(d_opts)] == (n, chunk, *d_opts)
        assert d_temp[0][3 + len(d_opts) :] == (n * chunk, *on_stream)
        ptr = lambda x: x.data_ptr()  # noqa: E731
        compress = lib.seen[f"{name}CompressAsync"][0]
        assert compress[:4] == (ptr(t["in_ptrs"]), ptr(t["in_bytes"]), chunk, n)
        assert compress[5] == 5000 and compress[4] % 16 == 0  # the temp space: as large as asked, aligned
        assert compress[6:9] == (ptr(t["out_ptrs"]), ptr(t["out_bytes"]), copts)
        assert compress[9:] == ((ptr(statuses), stream) if major >= 5 else (stream,))
        decompress = lib.seen[f"{name}DecompressAsync"][0]
        assert decompress[:5] == (ptr(t["in_ptrs"]), ptr(t["in_bytes"]), ptr(t["cap"]), ptr(t["out_bytes"]), n)
        assert decompress[6] == 5000 and decompress[5] % 16 == 0
        assert decompress[7:] == (ptr(t["out_ptrs"]), *((dopts,) if major >= 5 else ()), ptr(statuses), stream)


def test_alignment_is_the_largest_the_library_asks():
    lib = FakeLibrary(6, alignments=((4, 32, 1), (1, 8, 64)))
    assert capi.Batched(lib, "Zstd").alignment() == 64


def test_a_failed_call_names_its_status():
    lib = FakeLibrary(6, fail=("DecompressAsync",))
    batched = capi.Batched(lib, "Bitcomp")
    z = torch.zeros(2, dtype=torch.int64)
    failed = r"nvcompBatchedBitcompDecompressAsync failed: nvcompErrorInvalidValue \(10\)"
    with pytest.raises(capi.NvcompError, match=failed) as info:
        batched.decompress(device="cpu", stream=0, in_ptrs=z, in_bytes=z, out_capacity=z, out_bytes=z, out_ptrs=z,
                           statuses=z.to(torch.int32), chunk_bytes=4096)  # fmt: skip
    assert isinstance(info.value, RuntimeError) and info.value.status == 10
    assert str(capi.NvcompError("f", 99999)) == "nvcomp f failed: unknown status (99999)"


# ---------------------------------------------------------------------------
# the engine on CPU tensors: nvcomp's batched calls stood in for by zlib
# ---------------------------------------------------------------------------
class HostNvcomp:
    """nvcomp's batched interface on the host: zlib per chunk, read and written through the pointer arrays.

    ``strict`` (the default) holds the engine to what nvcomp's Zstd, GDeflate, Cascaded and Bitcomp
    decompressors require: every chunk handed to ``decompress`` is a whole stream the compressor wrote (an
    empty chunk is not one), decoding to no more than its capacity -- anything else fails the test, as it
    is undefined behaviour there. Unstrict, a chunk that is not a stream gets a failed status (what LZ4 on
    its CUDA backend and ANS do). ``refuse``: the status ``decompress`` returns for the whole call when a
    chunk is not a stream (Bitcomp's way), instead of per-chunk statuses.
    """

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.arrays: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.strict = True
        self.refuse: int | None = None

    def alignment(self) -> int:
        return 16

    def max_compressed_bytes(self, chunk_bytes: int) -> int:
        return chunk_bytes + 64  # zlib's bound is below it

    def _record(self, op: str, **arrays):
        with self.lock:
            self.calls.append((op, arrays["in_ptrs"].numel()))
            self.arrays[op] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in arrays.items()}

    def compress(self, *, device, stream, in_ptrs, in_bytes, chunk_bytes, out_ptrs, out_bytes, statuses):
        self._record("compress", in_ptrs=in_ptrs, in_bytes=in_bytes, chunk_bytes=chunk_bytes, out_ptrs=out_ptrs)
        for i, (src, size, dst) in enumerate(zip(in_ptrs.tolist(), in_bytes.tolist(), out_ptrs.tolist())):
            stream_ = zlib.compress(ctypes.string_at(src, size), 1)
            ctypes.memmove(dst, stream_, len(stream_))
            out_bytes[i], statuses[i] = len(stream_), 0

    def decompress(
        self, *, device, stream, in_ptrs, in_bytes, out_capacity, out_bytes, out_ptrs, statuses, chunk_bytes
    ):
        self._record("decompress", in_ptrs=in_ptrs, in_bytes=in_bytes, out_ptrs=out_ptrs, chunk_bytes=chunk_bytes)
        chunks = list(zip(in_ptrs.tolist(), in_bytes.tolist(), out_capacity.tolist(), out_ptrs.tolist()))
        decoded = [_inflate(ctypes.string_at(src, size), cap) for src, size, cap, _ in chunks]
        bad = [i for i, data in enumerate(decoded) if data is None]
        assert not (self.strict and bad), f"nvcomp was handed chunks {bad} that are not whole streams"
        if bad and self.refuse is not None:
            raise capi.NvcompError("nvcompBatchedHostDecompressAsync", self.refuse)
        for i, ((_, _, _, dst), data) in enumerate(zip(chunks, decoded)):
            if data is None:
                statuses[i] = 12  # nvcompErrorCannotDecompress
                continue
            ctypes.memmove(dst, data, len(data))
            out_bytes[i], statuses[i] = len(data), 0


def _inflate(stream_: bytes, capacity: int) -> bytes | None:
    """A whole zlib stream decoded (at most ``capacity`` bytes), or ``None`` for anything else."""
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(stream_, capacity)
    except zlib.error:
        return None
    return data if inflater.eof and not inflater.unused_data and not inflater.unconsumed_tail else None


@pytest.fixture
def host_nvcomp():
    """A :class:`HostNvcomp` registered as the "nvcomp" implementation of every nvcomp codec on the CPU."""
    fake = HostNvcomp()
    engine = functools.partial(nvcomp.NvcompEngine, batch=fake, device_type="cpu")
    for name in nvcomp.NAMES:
        buddy.dispatch.register(name, "cpu", "nvcomp", engine, default=True)
    yield fake
    for name in nvcomp.NAMES:
        buddy.dispatch.unregister(name, "cpu", "nvcomp")


def expected_buffers(x: torch.Tensor, entry_bytes: int, slot: int):
    """``(meta, slots, overflow)`` written independently: zlib streams as the module doc lays out payloads."""
    data = x.contiguous().view(-1).view(torch.uint8)
    n = -(-data.numel() // entry_bytes)
    rows = torch.zeros(n * entry_bytes, dtype=torch.uint8)
    rows[: data.numel()] = data
    rows, spe = rows.view(n, entry_bytes), entry_bytes // 32
    payload, k = torch.zeros_like(rows), []
    for i in range(n):
        stream_ = zlib.compress(rows[i].numpy().tobytes(), 1)
        sectors = math.ceil((4 + len(stream_)) / 32)
        if not rows[i].any():
            k.append(0)
        elif sectors >= spe:
            k.append(spe)
            payload[i] = rows[i]
        else:
            k.append(sectors)
            body = len(stream_).to_bytes(4, "little") + stream_
            payload[i, : len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    k = torch.tensor(k, dtype=torch.int32)
    slots, overflow = format.split_payload(payload, k, slot, entry_bytes)
    return format.encode_meta(k, torch.zeros_like(k), entry_bytes), slots.reshape(-1), overflow.reshape(-1)


@pytest.mark.parametrize("name", ids("codec", ("nvcomp-lz4", "nvcomp-zstd")))
@pytest.mark.parametrize("entry_bytes", ids("E", ENTRIES))
@pytest.mark.parametrize("kind", ids("data", KINDS))
@pytest.mark.parametrize("ratio", ids("ratio", (math.inf, 4.0, 1.0, None)))
def test_host_round_trip(host_nvcomp, name, entry_bytes, kind, ratio, store, gen):
    x = make_data(kind, 5 * entry_bytes // 4 + 300, torch.float32, gen)
    n = -(-x.numel() * 4 // entry_bytes)
    bt = buddy.compress(x, ratio, name, entry_bytes=entry_bytes, store=store)
    assert bt.backend == "nvcomp" and host_nvcomp.calls == [("compress", n)]
    assert_roundtrip(bt, x)
    # one batched call each way; the first decompress compresses its filler (one all-zero entry) once
    assert host_nvcomp.calls == [("compress", n), ("compress", 1), ("decompress", n)]
    assert_roundtrip(bt, x)
    assert host_nvcomp.calls[3:] == [("decompress", n)]  # the filler is kept
    bt.free()
    assert store.bytes_held == 0


def test_every_slot_writes_the_format_byte_for_byte(host_nvcomp, store, gen):
    e = 4096
    x = mixed(e, 9, gen)
    measured = buddy.measure(x, "nvcomp-lz4", entry_bytes=e)
    assert measured.engine.readbacks == 1
    ks = {k for k, c in enumerate(measured.histogram) if c}
    assert {0, e // 32} <= ks and len(ks) >= 4  # zero, raw and coded entries
    for slot in range(e // 32 + 1):
        bt = buddy.pack(measured, slot, store=store)
        meta, slots, overflow = expected_buffers(x, e, slot)
        assert torch.equal(bt.buffers()[0], meta) and torch.equal(bt.buffers()[1], slots), slot
        assert torch.equal(bt.buffers()[2], overflow), slot
        assert_roundtrip(bt, x)
        bt.free()
    assert measured.engine.readbacks == 1 and host_nvcomp.calls.count(("compress", 10)) == 1  # sized once


def test_the_pointer_arrays_nvcomp_gets(host_nvcomp, gen):
    e = 4096
    x = mixed(e, 6, gen)
    flat = x.view(torch.uint8)
    engine = buddy.dispatch.engine(buddy.get_codec("nvcomp-ans"), "cpu")
    measured = engine.measure(flat, Layout(e, flat.numel(), 4))
    c = host_nvcomp.arrays["compress"]
    n = 7
    assert c["chunk_bytes"] == e and c["in_bytes"].tolist() == [e] * n
    assert c["in_ptrs"][:6].tolist() == [flat.data_ptr() + i * e for i in range(6)]  # the tensor in place
    assert c["in_ptrs"][6] != flat.data_ptr() + 6 * e  # the last entry, zero-padded elsewhere
    stride = int(c["out_ptrs"][1] - c["out_ptrs"][0])
    assert stride >= e + 64 and stride % 64 == 0 and c["out_ptrs"].diff().eq(stride).all()
    slots, overflow = engine.pack(flat, measured, 2, Layout(e, flat.numel(), 4))
    engine.unpack(measured.meta, slots, overflow, 2, Layout(e, flat.numel(), 4), check=False)
    d = host_nvcomp.arrays["decompress"]
    k, _ = format.decode_meta(measured.meta, e, n)
    coded = (k > 0) & (k < e // 32)
    assert d["chunk_bytes"] == e and coded.any() and not coded.all()
    assert d["in_ptrs"][coded].diff().remainder(e).eq(0).all() and d["in_ptrs"][coded].remainder(16).eq(0).all()
    assert d["out_ptrs"][coded].diff().remainder(e).eq(0).all()  # streams and entries in rows of E, aligned
    assert d["in_bytes"][coded].gt(0).all()
    # the others: no empty chunk (nvcomp's Zstd and Bitcomp take none) but the filler -- nvcomp's stream of an
    # all-zero entry, compressed on the first decompress -- each decoded into the entry's own, unused stream row
    filler = host_nvcomp.arrays["compress"]
    assert filler["in_bytes"].tolist() == [e] and filler["chunk_bytes"] == e
    assert d["in_ptrs"][~coded].unique().tolist() == filler["out_ptrs"].tolist()
    length = d["in_bytes"][~coded].unique()
    assert length.numel() == 1 and 0 < int(length) < e
    rows = d["out_ptrs"][~coded]
    assert rows.unique().numel() == rows.numel() and rows.remainder(16).eq(0).all()
    assert (rows - d["in_ptrs"][coded][0]).remainder(e).eq(0).all()  # rows of the streams array ...
    assert not set(rows.tolist()) & (set(d["in_ptrs"][coded].tolist()) | set(d["out_ptrs"][coded].tolist()))


def test_host_reads_and_syncing_ops(host_nvcomp, gen):
    """One host read per compress (the histogram), none per decompress unless checked; no op that syncs."""
    e = 4096
    flat = mixed(e, 12, gen).view(torch.uint8)
    engine = buddy.dispatch.engine(buddy.get_codec("nvcomp-lz4"), "cpu")
    with _ops() as measured_ops:
        measured = engine.measure(flat, Layout(e, flat.numel(), 4))
    with _ops() as packed_ops:
        slots, overflow = engine.pack(flat, measured, 40, Layout(e, flat.numel(), 4))
    assert engine.readbacks == 1
    with _ops() as unpacked_ops:
        out = engine.unpack(measured.meta, slots, overflow, 40, Layout(e, flat.numel(), 4), check=False)
    assert engine.readbacks == 1 and torch.equal(out, flat)
    engine.unpack(measured.meta, slots, overflow, 40, Layout(e, flat.numel(), 4), check=True)
    assert engine.readbacks == 2
    syncing = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
               "aten::bincount", "aten::unique", "aten::_unique2", "aten::nonzero_static"}  # fmt: skip
    for ops in (measured_ops, packed_ops, unpacked_ops):
        assert not syncing & set(ops), syncing & set(ops)


@contextlib.contextmanager
def _ops():
    names: list[str] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield names
    names.extend(e.name for e in prof.events())


def test_views_tails_and_empty_tensors(host_nvcomp, store, gen):
    e = 4096
    base = mixed(e, 4, gen)
    for x in (base.view(torch.uint8)[3:-5], base[:100], base[:0], base.view(torch.uint8)[1 : e + 1]):
        bt = buddy.compress(x, 2.0, "nvcomp-cascaded", entry_bytes=e, store=store)
        assert_roundtrip(bt, x)
        bt.free()


def test_pack_without_what_measure_staged(host_nvcomp, gen):
    e = 4096
    flat = mixed(e, 5, gen).view(torch.uint8)
    engine = buddy.dispatch.engine(buddy.get_codec("nvcomp-lz4"), "cpu")
    measured = engine.measure(flat, Layout(e, flat.numel(), 4))
    bare = buddy.engines.Measurement(measured.meta, measured.histogram)  # staging dropped: pack compresses again
    slots, overflow = engine.pack(flat, bare, 3, Layout(e, flat.numel(), 4))
    assert [op for op, _ in host_nvcomp.calls] == ["compress", "compress"] and engine.readbacks == 1
    assert torch.equal(engine.unpack(measured.meta, slots, overflow, 3, Layout(e, flat.numel(), 4)), flat)


def _buffers(host_nvcomp, gen, store, entry_bytes=4096, slot=4):
    x = mixed(entry_bytes, 8, gen)
    bt = buddy.compress(x, entry_bytes / (32 * slot), "nvcomp-lz4", entry_bytes=entry_bytes, store=store)
    assert bt.slot_sectors == slot and bt.buddy_bytes > 0
    kw = dict(codec="nvcomp-lz4", entry_bytes=entry_bytes, slot_sectors=slot, shape=x.shape, dtype=x.dtype)
    return x, [b.clone() for b in bt.buffers()], kw


def test_truncated_buffers_are_refused(host_nvcomp, store, gen):
    x, (meta, slots, overflow), kw = _buffers(host_nvcomp, gen, store)
    assert_bitexact(buddy.unpack(meta, slots, overflow, **kw), x)
    for m, s, o, match in [
        (meta, slots, overflow[:-32], "overflow is not"),
        (meta, slots, overflow[:-1], "whole number of sectors"),
        (meta, slots, torch.cat([overflow, overflow[:32]]), "overflow is not"),
        (meta, slots[:-32], overflow, "slots hold"),
        (meta[:-2], slots, overflow, "metadata"),
    ]:
        with pytest.raises(buddy.CorruptDataError, match=match):
            buddy.unpack(m, s, o, **kw)


def test_damaged_metadata_and_streams_are_flagged(host_nvcomp, store, gen):
    x, (meta, slots, overflow), kw = _buffers(host_nvcomp, gen, store)
    e, spe = 4096, 128
    k, _ = format.decode_meta(meta, e, meta.numel() // 2)
    coded = int(((k > 4) & (k < spe)).nonzero()[0])  # a coded entry with overflow
    words = meta.view(-1, 2)

    def with_word(value):
        bad = meta.clone()
        bad.view(-1, 2)[coded] = torch.tensor([value & 0xFF, value >> 8], dtype=torch.uint8)
        return bad

    word = int(words[coded, 0]) | int(words[coded, 1]) << 8
    header = slots.clone()
    header[coded * 128 : coded * 128 + 4] = 0xFF  # a stream length past its sectors
    garbage = slots.clone()
    garbage[coded * 128 + 8 : coded * 128 + 40] ^= 0x5A  # the stream itself
    for m, s, match in [
        (with_word(spe + 1), slots, "more sectors"),
        (with_word(word | 1 << 12), slots, "modes"),
        (with_word(word - 1), slots, "overflow is not"),
        (meta, header, "stream's length"),
        (meta, garbage, "stream's length"),
    ]:
        # what the format can see hands nvcomp no bad stream (strict); damage inside a stream reaches it
        host_nvcomp.strict = s is not garbage
        with pytest.raises(buddy.CorruptDataError, match=match):
            buddy.unpack(m, s, overflow, **kw)
    host_nvcomp.strict = True
    assert_bitexact(buddy.unpack(meta, slots, overflow, **kw), x)


def test_one_filler_per_batch_device_and_entry_size(host_nvcomp, store, gen):
    """The filler is compressed on the first decompress of an entry size and kept with what runs nvcomp."""
    x = mixed(4096, 6, gen)
    for e in (4096, 4096, 8192, 4096):
        bt = buddy.compress(x, 2.0, "nvcomp-cascaded", entry_bytes=e, store=store)
        assert_roundtrip(bt, x)
        assert_roundtrip(bt, x)
        bt.free()
    assert [size for op, size in host_nvcomp.calls if op == "compress"] == [7, 1, 7, 4, 1, 7]
    other = HostNvcomp()  # another library (or algorithm): a filler of its own
    engine = nvcomp.NvcompEngine(nvcomp.chunk_codec("nvcomp-cascaded"), batch=other, device_type="cpu")
    flat = x.view(torch.uint8)
    measured = engine.measure(flat, Layout(4096, flat.numel(), 4))
    slots, overflow = engine.pack(flat, measured, 8, Layout(4096, flat.numel(), 4))
    assert torch.equal(engine.unpack(measured.meta, slots, overflow, 8, Layout(4096, flat.numel(), 4)), flat)
    assert other.calls == [("compress", 7), ("compress", 1), ("decompress", 7)]


@pytest.mark.parametrize("damage", ("overflow cut", "overflow grown", "k past the entry", "a mode", "k one less"))
def test_inconsistent_buffers_hand_nvcomp_no_stream(host_nvcomp, store, gen, damage):
    """Where the metadata or the overflow's size is inconsistent, where every stream lies is suspect: every
    chunk nvcomp gets is the filler (and the strict stand-in checks each is a whole stream)."""
    x, (meta, slots, overflow), kw = _buffers(host_nvcomp, gen, store)
    engine = buddy.dispatch.engine(buddy.get_codec("nvcomp-lz4"), "cpu")
    e, slot, n = 4096, 4, meta.numel() // 2
    k, _ = format.decode_meta(meta, e, n)
    coded = int(((k > slot) & (k < e // 32)).nonzero()[0])
    word = int(meta[2 * coded]) | int(meta[2 * coded + 1]) << 8
    bad_meta = meta.clone()
    value = {"k past the entry": e // 32 + 1, "a mode": word | 1 << 12, "k one less": word - 1}.get(damage, word)
    bad_meta[2 * coded], bad_meta[2 * coded + 1] = value & 0xFF, value >> 8
    bad_overflow = {"overflow cut": overflow[:-32], "overflow grown": torch.cat([overflow, overflow[:32]])}
    out = engine.unpack(bad_meta, slots, bad_overflow.get(damage, overflow), slot, Layout(e, x.numel() * 4, 4),
                        check=False)  # fmt: skip
    d = host_nvcomp.arrays["decompress"]
    filler = host_nvcomp.arrays["compress"]["out_ptrs"]  # the last compress: the filler's
    assert d["in_ptrs"].unique().tolist() == filler.tolist() and d["in_bytes"].unique().numel() == 1
    rows = torch.cat([out, out.new_zeros(n * e - out.numel())]).view(n, e)
    assert not rows[(k > 0) & (k < e // 32)].any()  # every coded entry: zeros (flagged)
    with pytest.raises(buddy.CorruptDataError):
        engine.unpack(bad_meta, slots, bad_overflow.get(damage, overflow), slot, Layout(e, x.numel() * 4, 4))


def test_a_refused_batch_decodes_its_coded_entries_to_zeros(host_nvcomp, store, gen):
    """Bitcomp refuses a whole call with a chunk it cannot parse (``nvcompErrorCannotDecompress``): the coded
    entries decode to zeros, flagged; raw and zero entries are what they were. Any other failure is raised."""
    x, (meta, slots, overflow), _ = _buffers(host_nvcomp, gen, store)
    engine = buddy.dispatch.engine(buddy.get_codec("nvcomp-lz4"), "cpu")
    flat, e, slot = x.view(torch.uint8), 4096, 4
    n = meta.numel() // 2
    k, _ = format.decode_meta(meta, e, n)
    coded = (k > 0) & (k < e // 32)
    first = int(coded.nonzero()[0])
    garbage = slots.clone()
    garbage[first * slot * 32 + 8 : first * slot * 32 + 40] ^= 0x5A  # inside the stream: the format cannot see it
    host_nvcomp.strict, host_nvcomp.refuse = False, capi.CANNOT_DECOMPRESS
    layout = Layout(e, flat.numel(), 4)
    out = engine.unpack(meta, garbage, overflow, slot, layout, check=False)
    expected = torch.zeros(n * e, dtype=torch.uint8)
    expected[: flat.numel()] = flat
    expected.view(n, e)[coded] = 0
    assert torch.equal(out, expected[: flat.numel()]) and engine.readbacks == 0
    with pytest.raises(buddy.CorruptDataError, match="stream's length"):
        engine.unpack(meta, garbage, overflow, slot, layout, check=True)
    host_nvcomp.refuse = 10  # nvcompErrorInvalidValue: not about the data
    with pytest.raises(capi.NvcompError, match="InvalidValue"):
        engine.unpack(meta, garbage, overflow, slot, layout)
    host_nvcomp.strict, host_nvcomp.refuse = True, None
    assert torch.equal(engine.unpack(meta, slots, overflow, slot, layout), flat)


def test_unchecked_failures_decode_to_zeros(host_nvcomp, store, gen):
    x, (meta, slots, overflow), _ = _buffers(host_nvcomp, gen, store)
    engine = buddy.dispatch.engine(buddy.get_codec("nvcomp-lz4"), "cpu")
    flat, e = x.view(torch.uint8), 4096
    k, _ = format.decode_meta(meta, e, meta.numel() // 2)
    coded = int(((k > 0) & (k < 128)).nonzero()[0])
    damaged = slots.clone()
    damaged[coded * 128 : coded * 128 + 4] = 0xFF
    out = engine.unpack(meta, damaged, overflow, 4, Layout(e, flat.numel(), 4), check=False)
    assert engine.readbacks == 0
    rows, expected = out.view(-1), flat.clone()
    expected[coded * e : (coded + 1) * e] = 0
    assert torch.equal(rows, expected)
    with pytest.raises(buddy.CorruptDataError):
        engine.unpack(meta, damaged, overflow, 4, Layout(e, flat.numel(), 4), check=True)


def test_blocks_of_payloads(host_nvcomp, store, gen, monkeypatch):
    monkeypatch.setattr(nvcomp, "BLOCK_BYTES", 3 * 4096)  # several blocks: overflow placed by the global prefix sum
    x = mixed(4096, 11, gen)
    for slot in (0, 5, 64, 128):
        bt = buddy.compress(
            x, 4096 / (32 * slot) if slot else math.inf, "nvcomp-gdeflate", entry_bytes=4096, store=store
        )
        meta, slots, overflow = expected_buffers(x, 4096, slot)
        assert all(torch.equal(a, b) for a, b in zip(bt.buffers(), (meta, slots, overflow)))
        assert_roundtrip(bt, x)
        bt.free()


def test_threads_compress_at_once(host_nvcomp, store, gen):
    tensors = [mixed(4096, 6 + i, torch.Generator().manual_seed(i)) for i in range(4)]
    failures = []

    def work(x):
        try:
            for _ in range(3):
                bt = buddy.compress(x, 2.0, "nvcomp-bitcomp", entry_bytes=4096, store=store)
                assert torch.equal(bt.decompress().view(torch.uint8), x.view(torch.uint8))
                bt.free()
        except Exception as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(x,)) for x in tensors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and store.bytes_held == 0


# ---------------------------------------------------------------------------
# on a GPU with nvcomp
# ---------------------------------------------------------------------------
@pytest.fixture
def pinned_store():
    return buddy.BuddyStore(capacity_bytes=256 * MiB, block_bytes=4 * MiB, pin=torch.cuda.is_available())


@on_gpu
@pytest.mark.parametrize("name", nvcomp.NAMES)
@pytest.mark.parametrize("entry_bytes", ids("E", ENTRIES))
@pytest.mark.parametrize("kind", ids("data", KINDS))
@pytest.mark.parametrize("ratio", ids("ratio", (math.inf, 2.0, 1.0)))
def test_gpu_round_trip(name, entry_bytes, kind, ratio, pinned_store):
    g = torch.Generator().manual_seed(7)
    x = make_data(kind, 5 * entry_bytes + 1000, torch.float32, g).cuda()
    bt = buddy.compress(x, ratio, name, entry_bytes=entry_bytes, store=pinned_store)
    assert bt.backend == "nvcomp"
    try:
        assert_roundtrip(bt, x)
        meta, slots, overflow = bt.buffers()
        assert_bitexact(buddy.unpack(meta, slots, overflow, codec=name, entry_bytes=entry_bytes,
                                     slot_sectors=bt.slot_sectors, shape=x.shape, dtype=x.dtype), x)  # fmt: skip
    finally:
        bt.free()
    assert pinned_store.bytes_held == 0


@on_gpu
@pytest.mark.parametrize("name", nvcomp.NAMES)
def test_gpu_every_slot_and_the_payload_layout(name, pinned_store, gen):
    e = 4096
    x = mixed(e, 12, gen).cuda()
    measured = buddy.measure(x, name, entry_bytes=e)
    assert measured.engine.readbacks == 1
    for slot in range(e // 32 + 1):
        bt = buddy.pack(measured, slot, store=pinned_store)
        assert bt.buddy_bytes == overflow_sectors(measured.histogram, slot) * 32
        assert_roundtrip(bt, x)
        if slot == 3:  # the payloads, put back together on the host: length, stream, zeros to k sectors
            meta, slots, overflow = (b.cpu() for b in bt.buffers())
            k, modes = format.decode_meta(meta, e, meta.numel() // 2)
            payload = format.join_payload(slots, overflow, k, slot, e)
            coded = (k > 0) & (k < e // 32)
            lengths = nvcomp.read_lengths(payload)
            assert not modes.any() and coded.any()
            assert torch.equal((lengths[coded] + 4 + 31) // 32, k[coded].long())  # k = ceil((4 + L) / 32)
        bt.free()
    assert measured.engine.readbacks == 1  # sized once


@on_gpu
@pytest.mark.parametrize("name", nvcomp.NAMES)
def test_gpu_truncated_and_damaged_buffers(name, pinned_store, gen):
    e, slot = 4096, 1
    x = mixed(e, 8, gen).cuda()
    bt = buddy.compress(x, e / (32 * slot), name, entry_bytes=e, store=pinned_store, checksum=True)
    assert bt.slot_sectors == slot
    meta, slots, overflow = (b.clone() for b in bt.buffers())
    kw = dict(codec=name, entry_bytes=e, slot_sectors=slot, shape=x.shape, dtype=x.dtype)
    k, _ = format.decode_meta(meta, e, meta.numel() // 2)
    coded = int(((k > slot) & (k < e // 32)).nonzero()[0])
    word = int(meta[2 * coded]) | int(meta[2 * coded + 1]) << 8

    def with_word(value):
        bad = meta.clone()
        bad[2 * coded], bad[2 * coded + 1] = value & 0xFF, value >> 8
        return bad

    header = slots.clone()
    header[coded * 32 : coded * 32 + 4] = 0xFF  # the length, at the start of the entry's one-sector slot
    cases = [
        (meta, slots, overflow[:-32], "overflow is not"),
        (meta, slots, overflow[:-1], "whole number"),
        (meta, slots[:-32], overflow, "slots hold"),
        (meta[:-2], slots, overflow, "metadata"),
        (with_word(e // 32 + 1), slots, overflow, "more sectors"),
        (with_word(word | 1 << 12), slots, overflow, "modes"),
        (with_word(word - 1), slots, overflow, "overflow is not"),
        (meta, header, overflow, "stream's length"),
    ]
    for m, s, o, match in cases:
        with pytest.raises(buddy.CorruptDataError, match=match):
            buddy.unpack(m, s, o, **kw)
    garbage = slots.clone()
    garbage[coded * 32 + 4 : coded * 32 + 32] ^= 0x5A  # inside the stream: beyond what the format can see
    with pytest.raises(buddy.CorruptDataError, match="slots"):  # the checksum sees it, before anything is decoded
        buddy.unpack(meta, garbage, overflow, checksum=bt.checksum, **kw)
    if nvcomp.ALGORITHMS[name] in capi.REPORTS_DAMAGE:  # the others' decompressors are undefined on it
        with contextlib.suppress(buddy.CorruptDataError):  # nvcomp may or may not notice: never a crash
            assert buddy.unpack(meta, garbage, overflow, **kw).shape == x.shape
    assert_bitexact(buddy.unpack(meta, slots, overflow, checksum=bt.checksum, **kw), x)  # the stream is still fine
    bt.free()


@on_gpu
@pytest.mark.parametrize("name", nvcomp.NAMES)
def test_gpu_one_host_read_per_compress_none_per_decompress(name, gen):
    e = 16384
    flat = mixed(e, 40, gen).cuda().view(torch.uint8)
    engine = buddy.dispatch.engine(buddy.get_codec(name), flat.device)
    with _sync_warnings() as measured_syncs:
        measured = engine.measure(flat, Layout(e, flat.numel(), 4))
    with _sync_warnings() as packed_syncs:
        slots, overflow = engine.pack(flat, measured, 100, Layout(e, flat.numel(), 4))
    with _sync_warnings() as unpacked_syncs:
        out = engine.unpack(measured.meta, slots, overflow, 100, Layout(e, flat.numel(), 4), check=False)
    # the one read (the histogram) is the engine's, made with the debug mode off: torch waits nowhere else
    assert engine.readbacks == 1 and (measured_syncs, packed_syncs, unpacked_syncs) == ([], [], [])
    assert torch.equal(out, flat)
    engine.unpack(measured.meta, slots, overflow, 100, Layout(e, flat.numel(), 4), check=True)
    assert engine.readbacks == 2


#: what torch's sync debug mode warns with, at each call that makes the host wait for the device
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def _sync_warnings():
    """The synchronizing CUDA calls torch makes in the block (torch's sync debug mode, as warnings)."""
    previous = torch.cuda.get_sync_debug_mode()
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(_sync_messages(caught))


def _sync_messages(caught) -> list[str]:
    """torch's sync warnings among ``caught``, each with the line that made it. Not torch's notice, once per
    process on the first ``set_sync_debug_mode``, that the mode "does not yet detect all synchronizing
    operations": it speaks of synchronizing too, but is no sync."""
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if SYNC_WARNING in str(w.message)]


def test_only_syncs_count_as_syncs():
    def caught(message: str, line: int) -> warnings.WarningMessage:
        return warnings.WarningMessage(UserWarning(message), UserWarning, "engine.py", line)

    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    found = _sync_messages([caught(notice, 1), caught(SYNC_WARNING, 2), caught("something else", 3)])
    assert found == [f"engine.py:2: {SYNC_WARNING}"]


class _StreamSpy:
    """The real batched calls, recording the stream and device each was given."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def compress(self, **kw):
        self.seen.append(("compress", kw["stream"], torch.cuda.current_device()))
        return self.inner.compress(**kw)

    def decompress(self, **kw):
        self.seen.append(("decompress", kw["stream"], torch.cuda.current_device()))
        return self.inner.decompress(**kw)


@on_gpu
def test_gpu_calls_run_on_torchs_current_stream(gen):
    codec = buddy.get_codec("nvcomp-lz4")
    spy = _StreamSpy(capi.library().algorithm("LZ4"))
    engine = nvcomp.NvcompEngine(codec, batch=spy)
    flat = mixed(4096, 6, gen).cuda().view(torch.uint8)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.default_stream(), side):
        with torch.cuda.stream(stream):
            measured = engine.measure(flat, Layout(4096, flat.numel(), 4))
            slots, overflow = engine.pack(flat, measured, 8, Layout(4096, flat.numel(), 4))
            out = engine.unpack(measured.meta, slots, overflow, 8, Layout(4096, flat.numel(), 4), check=True)
        stream.synchronize()
        assert torch.equal(out, flat)
        assert spy.seen[-2:] == [(op, stream.cuda_stream, flat.device.index) for op in ("compress", "decompress")]
    assert spy.seen[0][1] == torch.cuda.default_stream().cuda_stream  # the legacy default stream, as torch reports it


@on_gpu
@pytest.mark.parametrize("name", ("nvcomp-lz4", "nvcomp-zstd"))
def test_gpu_two_threads_compress_at_once(name, pinned_store):
    failures = []

    def work(seed):
        try:
            g = torch.Generator().manual_seed(seed)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                for _ in range(5):
                    x = mixed(16384, 30, g).cuda()
                    bt = buddy.compress(x, 2.0, name, entry_bytes=16384, store=pinned_store)
                    y = bt.decompress()
                    side.synchronize()
                    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
                    bt.free()
        except Exception as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert pinned_store.bytes_held == 0


@on_gpu
def test_gpu_the_library_in_use():
    lib = capi.library()
    assert lib.major in capi.SUPPORTED_MAJORS and capi.soname_major(lib.path) == lib.major
    for algo in capi.ALGORITHMS:  # every temp size, now that a GPU answers
        batched = lib.algorithm(algo)
        assert batched._temp("compress_temp", 100, 65536, 0, batched.copts) >= 0
        assert batched._temp("decompress_temp", 100, 65536, 0, batched.dopts) >= 0
