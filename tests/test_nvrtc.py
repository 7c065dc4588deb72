"""Every codec's kernels at every entry size through NVRTC, the run-time compiler CuPy uses -- no GPU needed.

The loader (buddy.engines.cuda) hands NVRTC :func:`buddy.engines.sources.translation_unit` with
:func:`buddy.engines.sources.compile_options` for one codec and one entry size; here
each of the 6 codecs at each of the 12 entry sizes (32 B ... 64 KiB) and each
of the 4 word sizes (the loader builds a module per word size) goes the same
way, to PTX for compute capability 9.0, and must compile without a warning
into the codec's kernels. CI installs the wheel and requires it.

NVRTC comes from the PyPI wheel ``nvidia-cuda-nvrtc`` (CUDA 13; about 100 MB,
so not in the ``test`` extra): ``pip install 'nvidia-cuda-nvrtc>=13,<14'``,
or point ``BUDDY_TEST_NVRTC`` at a ``libnvrtc.so``. Without it the tests skip,
unless ``BUDDY_REQUIRE_NVRTC=1``: then they fail.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import re
from pathlib import Path

import pytest
from test_cuda_core import _find_nvrtc

from buddy.engines import launch as blaunch
from buddy.engines import sources as bsources
from buddy import spec
from buddy.layout import WORD_SIZES

ENTRY_SIZES = [spec.MIN_ENTRY_BYTES << i for i in range((spec.MAX_ENTRY_BYTES // spec.MIN_ENTRY_BYTES).bit_length())]
ARCH = "--gpu-architecture=compute_90"


@functools.cache
def _library():
    """libnvrtc (with its builtins library loaded first, which it opens at compile time), or None."""
    path = _find_nvrtc()
    if path is None:
        return None
    folder = Path(path).parent if os.sep in path else None
    for builtins in sorted(folder.glob("libnvrtc-builtins.so*")) if folder else []:
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            break
    return ctypes.CDLL(path)


@pytest.fixture(scope="module")
def nvrtc():
    library = _library()
    if library is None:
        why = "needs libnvrtc: pip install 'nvidia-cuda-nvrtc>=13,<14' (or set BUDDY_TEST_NVRTC to a libnvrtc.so)"
        if os.environ.get("BUDDY_REQUIRE_NVRTC") == "1":
            pytest.fail(f"BUDDY_REQUIRE_NVRTC=1, but NVRTC was not found: {why}")
        pytest.skip(why)
    return library


def compile_ptx(nvrtc, source: str, options: tuple[str, ...]) -> tuple[int, str, bytes]:
    """``(nvrtcResult, log, PTX)`` of one NVRTC compile."""
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"buddy_kernels.cu", 0, None, None) == 0
    try:
        opts = [o.encode() for o in options]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        ptx = b""
        if result == 0:
            nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
            out = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetPTX(prog, out)
            ptx = out.value
        return result, log.value.decode(errors="replace"), ptx
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("entry_bytes", ENTRY_SIZES, ids=lambda e: f"E={e}")
def test_every_codec_compiles_with_nvrtc(nvrtc, entry_bytes):
    source = bsources.translation_unit()

    def one(job: tuple[str, int]):
        codec, word_bytes = job
        table = blaunch.shares_tables(codec, entry_bytes, blaunch.HOPPER)
        options = (*bsources.compile_options(entry_bytes, codec, word_bytes, table), ARCH)
        return codec, word_bytes, compile_ptx(nvrtc, source, options)

    # what the loader compiles on an H100: a module per codec, entry size and word size, a table codec's unpack
    # with its table in shared memory
    jobs = [(codec, w) for codec in bsources.KERNEL_CODECS for w in WORD_SIZES]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # NVRTC compiles programs side by side
        results = list(pool.map(one, jobs))
    for codec, w, (result, log, ptx) in results:
        assert result == 0, f"NVRTC failed for {codec} at E={entry_bytes}, words of {w} B:\n{log}"
        assert not log.strip(), f"NVRTC warned for {codec} at E={entry_bytes}, words of {w} B:\n{log}"
        ops = ("measure", "ends", "sizes", "pack", "unpack", "drain",
               *(("count", "fit") if codec in bsources.TABLED_KERNELS else ()),
               *(("lockstep_decode",) if codec == "fpe" else ()))  # (a layout weighed: codec_fpe.h, decode_lockstep)
        entries = {name.decode() for name in _entries(ptx)}
        assert entries == {f"buddy_{codec}_{op}" for op in ops}, (codec, sorted(entries))


def _entries(ptx: bytes) -> list[bytes]:
    """The kernel entry points a PTX module defines."""
    return re.findall(rb"\.entry (\w+)\(", ptx)
