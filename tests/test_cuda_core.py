"""The CUDA path without a GPU: its sources, its dispatch, the glue under emulated kernels.

(The per-entry device code itself is tested against the reference in
``tests/test_device_codecs.py``.)

* the translation unit the loader hands NVRTC compiles (nvcc, and NVRTC itself
  when its library can be found).
* ``backend=`` picks the implementation, and ``import buddy`` works without CuPy.

Compilers are optional: each test skips when its compiler is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_roundtrip, ids, make_data
from emulator import kernel_parameters
from test_device_codecs import device_fit, run_tensor, tensor_ends, tensor_measure, tensor_pack, tensor_unpack

import buddy
import buddy.engines.tuning
from buddy.engines import cuda as bcuda
from buddy.codecs import fpe_device
from buddy.engines import kernels as bkernels
from buddy.engines import launch as blaunch
from buddy.engines import sources as bsources
from buddy.engines.tuning import Tuning
from buddy import spec
from buddy.codecs.fpe import n_symbols
from buddy.layout import Layout

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
ZVC = buddy.get_codec("zvc")

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def _defines(entry_bytes: int) -> list[str]:
    return [f"-D{k}={v}" for k, v in spec.c_defines(entry_bytes).items()]


# ---------------------------------------------------------------------------
# sources: what the loader compiles
# ---------------------------------------------------------------------------
def test_translation_unit_inlines_local_headers():
    tu = bsources.translation_unit()
    assert '#include "' not in tu and "#pragma once" not in tu
    headers = ("buddy_format.h", "buddy_device.h", "buddy_warp.h", "buddy_entry.h", "buddy_ops.h")
    codecs = ("codec_zvc.h", "codec_fpx.h", "codec_bpc.h", "codec_auto.h", "codec_fpe.h", "codec_auto2.h")
    for header in (*headers, *codecs):
        assert tu.count(f"// ---- begin {header}") == 1, header
    assert bsources.read_source("buddy_kernels.cu") == (CSRC / "buddy_kernels.cu").read_text()


def test_compile_options_carry_the_spec():
    for e in (32, 128, 65536):
        opts = bsources.compile_options(e, "fpx")
        assert "-std=c++17" in opts
        defines = {f"-D{k}={v}" for k, v in spec.c_defines(e).items()} | {"-DBUDDY_CODEC_FPX=1"}
        assert {o for o in opts if o.startswith("-D")} == defines
    with pytest.raises(ValueError):
        bsources.compile_options(100)
    assert bsources.compile_options(128, "fpe", 2)[-1] == "-DBUDDY_WORD_BYTES=2"
    for word in (0, 3, 16):  # a module is built for the word size a launch passes last: a bad one is refused
        with pytest.raises(ValueError, match="word sizes"):
            bsources.compile_options(128, "fpe", word)


def test_launch_configuration():
    """One warp per entry; pack and unpack stage an entry per warp in shared memory (at most 32 KiB a block)."""
    assert blaunch.launch_config("measure", 512, 1000) == (125, 256, 0)
    assert blaunch.launch_config("pack", 512, 1000) == (125, 256, 8 * 512)
    assert blaunch.launch_config("unpack", 4096, 1000) == (125, 256, 8 * 4096)
    assert blaunch.launch_config("pack", 16384, 10) == (5, 64, 2 * 16384)
    assert blaunch.launch_config("unpack", 65536, 3) == (3, 32, 65536)  # one warp: 64 KiB, the loader opts in
    # the table codecs decode into shared memory too: 2 E a warp
    assert blaunch.launch_config("unpack", 4096, 1000, "fpe") == (250, 128, 4 * 2 * 4096)
    assert blaunch.launch_config("unpack", 512, 1000, "auto2") == (125, 256, 8 * 2 * 512)
    assert blaunch.launch_config("pack", 4096, 1000, "auto2") == blaunch.launch_config("pack", 4096, 1000)
    assert blaunch.launch_config("measure", 128, 0) == (1, 256, 0)
    assert blaunch.launch_config("measure", 32, 10**12)[0] == blaunch.MAX_BLOCKS  # warps stride over the rest


def test_launch_configuration_with_the_table_in_shared_memory():
    """Given a device's shared memory, a table codec's unpack gives each block the table's decode rows before its
    warps' staging, its pack the table of whole fields: the most warps an SM (unpack), as many blocks as stay
    resident (their warps stride over the rest)."""
    table = fpe_device.DECODE_ROWS_BYTES
    assert table % 16 == 0 and table < fpe_device.DEVICE_TABLE_BYTES  # (the table's first bytes; its enc stays out)
    # an H100: one block of 24 warps an SM at 4 KiB (the whole table would leave room for 23); 132 blocks however
    # many entries
    assert blaunch.shared_table_layout(4096, blaunch.HOPPER) == (24, 1)
    assert blaunch.launch_config("unpack", 4096, 10**6, "auto2", blaunch.HOPPER) == (132, 768, table + 24 * 2 * 4096)
    assert blaunch.launch_config("unpack", 4096, 50, "fpe", blaunch.HOPPER) == (3, 768, table + 24 * 2 * 4096)
    assert blaunch.launch_config("unpack", 512, 10**6, "fpe", blaunch.HOPPER)[1] == 8 * 32  # small entries: 8 warps
    for e in (32, 1024, 8192, 65536):  # every entry size fits an H100, within its limits
        warps, per_sm = blaunch.shared_table_layout(e, blaunch.HOPPER)
        block = table + warps * 2 * e
        assert block <= blaunch.HOPPER.per_block and per_sm * (block + 1024) <= blaunch.HOPPER.per_sm, e
        assert warps <= (24 if e >= 4096 else 8) and warps * per_sm <= 64
    # at most so many warps an SM (BUDDY_UNPACK_WARPS): the most that fit under the cap, the larger blocks on a tie
    assert [blaunch.shared_table_layout(4096, blaunch.HOPPER, n) for n in (1, 8, 12, 16, 20, 24, 64)] == [
        (1, 1), (8, 1), (12, 1), (16, 1), (20, 1), (24, 1), (24, 1)]  # fmt: skip
    assert blaunch.shared_table_layout(512, blaunch.HOPPER, 20) == (5, 4)  # blocks of 8 would make 16
    assert blaunch.launch_config("unpack", 4096, 10**6, "auto2", blaunch.HOPPER, unpack_warps=16) == (
        132, 512, table + 16 * 2 * 4096)  # fmt: skip
    assert blaunch.launch_config("pack", 4096, 10**6, "auto2", blaunch.HOPPER, unpack_warps=16) == blaunch.launch_config(
        "pack", 4096, 10**6, "auto2", blaunch.HOPPER)  # fmt: skip
    # pack, asked for its fields (BUDDY_PACK_FIELDS=1): the table of whole fields before the warps' staging, its
    # warps as before, the resident blocks looping; by default its table in global memory, as without a device
    fields, hop = fpe_device.FIELDS_BYTES, blaunch.HOPPER
    assert blaunch.launch_config("pack", 4096, 10**6, "fpe", hop, True) == (132 * 4, 256, fields + 8 * 4096)
    assert blaunch.launch_config("pack", 4096, 1000, "auto2", hop, True) == (125, 256, fields + 8 * 4096)
    assert blaunch.launch_config("pack", 65536, 1000, "fpe", hop, True) == (264, 32, fields + 65536)
    assert blaunch.launch_config("pack", 4096, 10**6, "fpe", hop) == blaunch.launch_config("pack", 4096, 10**6, "fpe")
    # the other codecs and ops, and no device given: as before
    assert blaunch.launch_config("unpack", 4096, 1000, "zvc", blaunch.HOPPER) == blaunch.launch_config(
        "unpack", 4096, 1000
    )
    assert blaunch.launch_config("pack", 4096, 1000, "zvc", blaunch.HOPPER) == blaunch.launch_config("pack", 4096, 1000)
    assert blaunch.launch_config("measure", 4096, 1000, "fpe", blaunch.HOPPER) == blaunch.launch_config(
        "measure", 4096, 1000
    )
    # a device whose block cannot hold the rows and one warp's 128 KiB (99 KiB a block, as sm_86's): the table
    # stays in global memory; an A100's 163 KiB hold them (the whole table would not: 40 KiB)
    small = blaunch.SharedMemory(sms=84, per_block=99 << 10, per_sm=100 << 10)
    assert blaunch.shared_table_layout(65536, small) is None
    assert blaunch.launch_config("unpack", 65536, 3, "fpe", small) == blaunch.launch_config("unpack", 65536, 3, "fpe")
    a100 = blaunch.SharedMemory(sms=108, per_block=163 << 10, per_sm=164 << 10)
    assert blaunch.shared_table_layout(65536, a100) == (1, 1) and fpe_device.DEVICE_TABLE_BYTES + 2 * 65536 > 163 << 10
    assert bsources.compile_options(4096, "fpe", 4, shared_tables=True)[-1] == "-DBUDDY_SHARED_TABLES=1"
    both = ("-DBUDDY_SHARED_TABLES=1", "-DBUDDY_PACK_FIELDS=1")
    assert bsources.compile_options(4096, "fpe", 4, True, True)[-2:] == both
    assert not any("SHARED_TABLE" in o or "PACK_FIELDS" in o for o in bsources.compile_options(4096, "fpe", 4))
    with pytest.raises(ValueError, match="needs shared_tables"):
        bsources.compile_options(4096, "fpe", 4, pack_fields=True)


@pytest.mark.parametrize(("tables", "fields", "shared", "entry_bytes"), [
    pytest.param(True, False, blaunch.HOPPER, 4096, id="H100"),
    pytest.param(True, True, blaunch.HOPPER, 4096, id="H100-pack_fields"),
    pytest.param(False, False, blaunch.HOPPER, 4096, id="H100-no-shared_tables"),
    pytest.param(True, True, blaunch.SharedMemory(108, 163 << 10, 164 << 10), 65536, id="A100-E=65536"),
])  # fmt: skip
def test_the_loader_compiles_and_launches_the_table_where_it_fits(monkeypatch, tables, fields, shared, entry_bytes):
    """The loader's launch (buddy.engines.cuda._launch, CuPy faked): a table codec's kernels come from the module
    whose unpack copies its table into shared memory, launched with that configuration, where the device holds it
    and the tuning's ``shared_tables`` is set, and with ``pack_fields`` its pack makes its table of whole fields
    there too; the other codecs' as before."""
    import contextlib
    import types

    launched = []

    def kernel(codec, op, e, device, shared_bytes, word, shared_tables=False, pack_fields=False):
        def launch(grid, block, args, stream, shared_mem):
            launched.append((op, shared_tables, grid[0], block[0], shared_mem, pack_fields))
            assert shared_mem == shared_bytes

        return launch

    tuned = Tuning(shared_tables=tables, pack_fields=fields)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda index: contextlib.nullcontext()))
    monkeypatch.setattr(bcuda, "_cupy", lambda: fake)
    monkeypatch.setattr(bcuda, "_cupy_stream", lambda cupy, device: None)
    monkeypatch.setattr(bcuda, "_device_shared_memory", lambda index: shared)
    monkeypatch.setattr(bcuda, "_kernel", kernel)
    device, word = torch.device("cuda", 0), np.int32(4)
    for op in ("pack", "unpack"):
        bcuda._launch("auto2", op, entry_bytes, device, 1000, (word,), tuned)
    bcuda._launch("zvc", "unpack", entry_bytes, device, 1000, (word,), tuned)
    in_shared = tables and blaunch.shared_table_layout(entry_bytes, shared) is not None
    made = in_shared and fields  # pack's fields: asked for, and where the table goes into shared memory
    # (one module for all of a codec's kernels: the defines change its unpack, and its pack where asked)
    assert [a[:2] + a[5:] for a in launched] == [("pack", in_shared, made), ("unpack", in_shared, made),
                                                 ("unpack", False, False)]  # fmt: skip
    place = shared if in_shared else None
    assert launched[0][2:5] == blaunch.launch_config("pack", entry_bytes, 1000, "auto2", place, made)
    assert (launched[0][4] > blaunch.launch_config("pack", entry_bytes, 1000)[2]) == made  # (the fields before it)
    assert launched[1][2:5] == blaunch.launch_config("unpack", entry_bytes, 1000, "auto2", place)
    assert in_shared == tables


@needs_nvcc
@pytest.mark.parametrize(
    ("entry_bytes", "codec", "arch", "word", "table"),
    [
        pytest.param(512, "all", "sm_80", 4, False, id="E=512-every-codec-sm_80-w=4"),
        pytest.param(512, "all", "sm_90", 2, True, id="E=512-every-codec-sm_90-w=2-table-in-shared"),
        pytest.param(32, "auto", "sm_90", 1, False, id="E=32-auto-sm_90-w=1"),
        pytest.param(65536, "auto2", "sm_90", 8, False, id="E=65536-auto2-sm_90-w=8"),
        pytest.param(4096, "auto2", "sm_90", 8, True, id="E=4096-auto2-sm_90-w=8-table-in-shared"),
        pytest.param(4096, "auto2", "sm_90", 2, "fields", id="E=4096-auto2-sm_90-w=2-pack-fields-in-shared"),
        pytest.param(4096, "zvc", "sm_80", None, False, id="E=4096-zvc-sm_80-every-word"),
    ],
)
def test_translation_unit_compiles_without_warnings(tmp_path, entry_bytes, codec, arch, word, table):
    """The exact text given to NVRTC, through nvcc with warnings as errors, no spills to local memory (the
    loader builds a module per word size; one of all four compiles too; a table codec's unpack with its table
    in shared memory or not, and pack's table of whole fields there: ``"fields"``)."""
    unit = tmp_path / "kernels_tu.cu"
    unit.write_text(bsources.translation_unit())
    cmd = [
        "nvcc",
        f"-arch={arch}",
        "-Werror",
        "all-warnings",
        "-Xptxas",
        "-v",
        *bsources.compile_options(entry_bytes, codec, word, bool(table), table == "fields"),
    ]
    result = subprocess.run(
        [*cmd, "-c", str(unit), "-o", str(tmp_path / "k.o")], check=True, capture_output=True, text=True
    )
    assert "spill stores" in result.stderr
    assert not re.search(r"[1-9]\d* bytes spill stores", result.stderr), result.stderr


#: a load, store or atomic of PTX with no state space: through a generic address, which may be of shared or of
#: global memory (the hardware tells them apart at run time, later than a load of either's own)
GENERIC_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red)(?:\.\w+)*)\s", re.M)


@needs_nvcc
@pytest.mark.parametrize(("codec", "word", "table"), [
    pytest.param("all", None, False, id="every-codec-every-word"),
    pytest.param("all", None, True, id="every-codec-every-word-table-in-shared"),
    pytest.param("auto2", 2, "fields", id="auto2-w=2-pack-fields-in-shared"),
])  # fmt: skip
def test_kernels_read_and_write_memory_by_its_own_space(tmp_path, codec, word, table):
    """Every load and store of the kernels' PTX (sm_90, 4 KiB entries) names shared or global memory: none goes
    through a generic address. The compiler knows a pointer's space where it sees where the pointer comes from,
    and loses it where one pointer may be either -- pack's copy of a payload from its staging or from the entry
    itself, or a codec's decode rows from a copy in shared memory or from the table -- and then reads with
    generic loads (``ld.u64``), slower than either's own."""
    unit = tmp_path / "kernels_tu.cu"
    unit.write_text(bsources.translation_unit())
    options = bsources.compile_options(spec.DEFAULT_ENTRY_BYTES, codec, word, bool(table), table == "fields")
    ptx = tmp_path / "k.ptx"
    subprocess.run(["nvcc", "-arch=sm_90", *options, "-ptx", str(unit), "-o", str(ptx)], check=True, timeout=900)
    text = ptx.read_text()
    found = [op for op in GENERIC_ACCESS.findall(text) if op.split(".")[1] not in ("shared", "global", "local",
                                                                                   "param", "const")]  # fmt: skip
    assert re.search(r"\bld\.shared\.", text) and re.search(r"\bld\.global\.", text)  # (the pattern reads them)
    assert not found, f"generic accesses: {sorted(set(found))}"


@needs_nvcc
@pytest.mark.parametrize("table", [pytest.param(False, id="table-in-global"), pytest.param(True, id="table-in-shared")])
@pytest.mark.parametrize("word", ids("w", (2, 4)))
def test_table_codecs_unpack_within_64_registers(tmp_path, word, table):
    """fpe's and auto2's unpack at the default entry size for bfloat16 and float32, as the loader builds them
    (one word size a module; the table copied into shared memory or not) for sm_90: at most 64 registers a
    thread, no spills; and every codec's pack (its launch bounds: 4 blocks of 8 warps an SM), and its measure within
    48 (5 blocks)."""
    unit = tmp_path / "kernels_tu.cu"
    unit.write_text(bsources.translation_unit())
    options = bsources.compile_options(spec.DEFAULT_ENTRY_BYTES, "all", word, table)
    cmd = ["nvcc", "-arch=sm_90", "-Xptxas", "-v", *options, "-cubin", str(unit), "-o", str(tmp_path / "k.cubin")]
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    wanted = [(c, "unpack", 64) for c in ("fpe", "auto2")]
    wanted += [(c, op, most) for c in bsources.KERNEL_CODECS for op, most in (("pack", 64), ("measure", 48))]
    for codec, op, most in wanted:
        found = re.search(rf"entry function 'buddy_{codec}_{op}'.*?\n.*?(\d+) bytes spill stores.*?\n.*?Used (\d+) registers",
                          log, re.S)  # fmt: skip
        assert found, log
        assert int(found.group(1)) == 0, f"{codec} {op}: spills"
        assert int(found.group(2)) <= most, f"{codec} {op}: {found.group(2)} registers"


def _find_nvrtc() -> str | None:
    if os.environ.get("BUDDY_TEST_NVRTC"):
        return os.environ["BUDDY_TEST_NVRTC"]
    found = ctypes.util.find_library("nvrtc")
    if found:
        return found
    roots = [Path(sysconfig.get_paths()["purelib"]) / "nvidia", Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))]
    for root in roots:
        for lib in sorted(root.glob("**/libnvrtc.so*")) if root.is_dir() else []:
            if "builtins" not in lib.name and "alt" not in lib.name:
                return str(lib)
    return None


def test_nvrtc_compiles_translation_unit():
    """NVRTC (what CuPy uses) compiles the unit: no GPU needed, only libnvrtc.

    Set BUDDY_TEST_NVRTC=/path/to/libnvrtc.so.N when it is not on the search path.
    """
    path = _find_nvrtc()
    if path is None:
        pytest.skip("needs libnvrtc (pip install nvidia-cuda-nvrtc, or set BUDDY_TEST_NVRTC)")
    # NVRTC opens libnvrtc-builtins at compile time: load the one beside it first
    here = Path(path).parent if os.sep in path else None
    for builtins in sorted(here.glob("libnvrtc-builtins.so*")) if here else []:
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            break
    nvrtc = ctypes.CDLL(path)
    size = ctypes.c_size_t()
    for e in (32, 128, 65536):
        prog = ctypes.c_void_p()
        source = bsources.translation_unit().encode()
        assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"buddy_kernels.cu", 0, None, None) == 0
        options = [o.encode() for o in (*bsources.compile_options(e, "all"), "-arch=compute_80")]
        result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert result == 0, f"NVRTC failed for E={e}:\n{log.value.decode(errors='replace')}"
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        for codec in bsources.KERNEL_CODECS:
            for op in ("measure", "ends", "sizes", "pack", "unpack", "drain"):
                assert f".entry buddy_{codec}_{op}(".encode() in ptx.value


# ---------------------------------------------------------------------------
# argument checks of the launchers (they run before any launch, on any device)
# ---------------------------------------------------------------------------
def test_launchers_reject_cpu_tensors():
    kernels = bkernels.Kernels("zvc", launch=bcuda.LAUNCHER)
    b = torch.zeros(4 * 128, dtype=torch.uint8)
    tail, meta, hist = (
        torch.zeros(128, dtype=torch.uint8),
        torch.zeros(4, dtype=torch.uint8),
        torch.zeros(5, dtype=torch.int64),
    )
    layout = Layout(128, 4 * 128, 4)
    with pytest.raises(ValueError, match="CUDA device"):
        kernels.measure(layout, b, tail, meta, hist)
    with pytest.raises(ValueError, match="torch.Tensor"):
        kernels.measure(layout, b.numpy(), tail, meta, hist)


def test_launcher_checks_name_each_problem():
    """Run with the CPU as the kernels' device: every check, no launch."""
    launched = []
    kernels = bkernels.Kernels("zvc", launch=lambda *a: launched.append(a), device_type="cpu")
    e, n = 128, 4
    b, tail = torch.zeros(n * e, dtype=torch.uint8), torch.zeros(e, dtype=torch.uint8)
    meta, hist = torch.zeros(n, dtype=torch.uint8), torch.zeros(5, dtype=torch.int64)
    layout = Layout(e, n * e, 4)
    kernels.measure(layout, b, tail, meta, hist)
    assert len(launched) == 1 and launched[0][1] == "measure"
    cases = [
        (dict(data=b[:-1]), "shape"),
        (dict(data=b.view(torch.int32)), "uint8"),
        (dict(data=torch.zeros(n * e + 1, dtype=torch.uint8)[1:]), "aligned"),
        (dict(tail=tail[:64]), "shape"),
        (dict(meta=torch.zeros(2 * n, dtype=torch.uint8)), "shape"),
        (dict(histogram=hist.to(torch.int32)), "int64"),
        (dict(layout=Layout(e, n * e - 1, 4)), "shape"),  # a partial last entry: the data holds one entry less
        (dict(layout=Layout(2 * e, n * e, 4)), "shape"),
    ]
    for change, match in cases:
        args = dict(layout=layout, data=b, tail=tail, meta=meta, histogram=hist) | change
        with pytest.raises(ValueError, match=match):
            kernels.measure(**args)
    assert len(launched) == 1, "no bad launch got through"
    with pytest.raises(buddy.CorruptDataError, match="whole number of sectors"):
        ends, out, error = torch.zeros(n, dtype=torch.int64), b, torch.zeros(1, dtype=torch.int32)
        kernels.unpack(layout, meta, ends, 1, b[: n * 32], b[:33], out, error)
    for bad, match in ((dict(word_bytes=3), "word_bytes"), (dict(entry_bytes=100), "power of two")):
        with pytest.raises(ValueError, match=match):  # a layout is checked when it is made
            Layout(**(dict(entry_bytes=e, nbytes=n * e, word_bytes=4) | bad))


def test_tensor_check_names_each_problem():
    cpu = torch.device("cpu")
    check = bkernels.check_tensor
    good = torch.zeros(8, 128, dtype=torch.uint8)
    check("x", good, device=cpu, dtype=torch.uint8, shape=(8, 128))
    with pytest.raises(ValueError, match="must be torch.int32"):
        check("x", good, device=cpu, dtype=torch.int32)
    with pytest.raises(ValueError, match="shape"):
        check("x", good, device=cpu, dtype=torch.uint8, shape=(8, 256))
    with pytest.raises(ValueError, match="contiguous"):
        check("x", good.t(), device=cpu, dtype=torch.uint8)
    with pytest.raises(ValueError, match="aligned"):
        check("x", torch.zeros(129, dtype=torch.uint8)[1:], device=cpu, dtype=torch.uint8)
    with pytest.raises(ValueError, match="is on cpu"):
        check("x", good, device=torch.device("cuda", 0), dtype=torch.uint8)
    with pytest.raises(ValueError, match="word_bytes"):
        Layout(128, 0, 3)
    with pytest.raises(ValueError, match="word_bytes"):
        Layout(128, 0, True)


def test_table_sizes_agree_with_the_sources():
    """The buffer sizes the loader allocates for the table kernels are the sources' (static_asserts hold them there)."""
    fit = bsources.read_source("codec_fpe_fit.h")
    assert int(re.search(r"#define BUDDY_FPE_FIT_WORK_BYTES (\d+)u", fit).group(1)) == fpe_device.FIT_WORK_BYTES
    assert fpe_device.FIT_SERIAL_BYTES == 4 + 3 * (255 + 2) == 775
    fpe_h = bsources.read_source("codec_fpe.h")
    assert "8u * BUDDY_FPE_ROWS + 2u * BUDDY_FPE_SYMBOLS + 12u" in fpe_h
    assert fpe_device.DEVICE_TABLE_BYTES == 8 * 4096 + 2 * 4098 + 12
    # pack's table of whole fields in shared memory: a word a symbol of 12 bits and a zero word's, to 16 bytes
    assert int(re.search(r"FIELDS_BYTES = (\d+)u;", fpe_h).group(1)) == fpe_device.FIELDS_BYTES == 16400
    assert fpe_device.FIELDS_BYTES % 16 == 0 and fpe_device.FIELDS_BYTES >= 4 * (4096 + 1)


def test_codecs_with_kernels():
    """The kernels' table rows decide which codec objects they run: their factory refuses any other."""
    assert set(bsources.KERNEL_CODECS) == {"zvc", "fpx", "bpc", "auto", "fpe", "auto2"}
    rows = {row.codec: row for row in bcuda.rows()}
    assert set(rows) == set(bsources.KERNEL_CODECS)
    for name, row in rows.items():
        assert row.factory(buddy.get_codec(name)).codec is buddy.get_codec(name)
    with pytest.raises(ValueError, match="has no CUDA kernels"):
        bcuda.CudaEngine(buddy.get_codec("raw"))
    swapped = buddy.codecs.AutoCodec([(2, buddy.get_codec("fpx")), (3, buddy.get_codec("zvc"))], name="auto")
    with pytest.raises(ValueError, match="has no CUDA kernels"):  # the kernels compose zvc, fpx and bpc in that order
        rows["auto"].factory(swapped)
    remoded = buddy.codecs.AutoCodec([(m + 1, c) for m, c in buddy.codecs.auto.members_of("auto")], name="auto")
    with pytest.raises(ValueError, match="has no CUDA kernels"):  # ... with their own modes
        rows["auto"].factory(remoded)


# ---------------------------------------------------------------------------
# the whole CUDA path on the CPU: kernels emulated by the host harness
# ---------------------------------------------------------------------------
_C_TYPES = {"uint8_t*": torch.uint8, "int*": torch.int32, "long long*": torch.int64, "unsigned long long*": torch.int64}


def _kernel_signatures() -> dict[str, list[str]]:
    """Parameter types of each extern "C" kernel, from the sources with their macros expanded."""
    return {name: [p.ctype for p in params] for name, params in kernel_parameters().items()}


def _check_launch(sigs, name: str, args: tuple) -> None:
    types = sigs[name]
    assert len(args) == len(types), f"{name}: {len(args)} arguments for {len(types)} parameters"
    for arg, ctype in zip(args, types):
        if ctype in _C_TYPES:
            assert isinstance(arg, torch.Tensor) and arg.dtype == _C_TYPES[ctype], (name, ctype, arg)
            assert arg.is_contiguous() and (arg.numel() == 0 or arg.data_ptr() % 8 == 0)
        else:
            assert type(arg) is {"long long": np.int64, "int": np.int32}[ctype], (name, ctype, type(arg))


class HostKernels:
    """Runs each launch of the kernels' glue (buddy.engines.kernels) in the host harness, on CPU tensors; records
    the launches."""

    def __init__(self, host_exe, tmp_path):
        self.host_exe, self.tmp_path = host_exe, tmp_path
        self.sigs = _kernel_signatures()
        self.launches: list[str] = []

    def __call__(self, codec, op, entry_bytes, device, n, args, tuning):
        _check_launch(self.sigs, f"buddy_{codec}_{op}", args)
        self.launches.append(op)
        with torch.profiler.record_function("emulated kernel"):  # its torch ops are the harness's, not launches
            self._run(codec, op, entry_bytes, args)

    def _run(self, codec, op, entry_bytes, args):
        exe, word = self.host_exe(entry_bytes), int(args[-1])
        if op == "count":
            data, n_units, tail, tail_words, counts = args[:5]
            sizes = (int(n_units), int(tail_words))
            r = run_tensor(exe, "fpe", "count", word, sizes, [data, tail], self.tmp_path)
            counts += r.take(8 * counts.numel()).view(torch.int64)
            r.done()
            return
        if op == "ends":  # (the kernel itself runs under the emulator and natively: test_emulator, test_native)
            meta, _, slot, ends = args[:4]
            ends.copy_(tensor_ends(meta, int(slot), entry_bytes))
            return
        if op == "fit":
            counts, _, table, serial, weighted, word = args
            got_table, got_serial = device_fit(exe, counts, int(word), self.tmp_path, bool(int(weighted)))
            table.copy_(got_table)
            serial.copy_(got_serial)
            return
        table = args[-2] if args[-2].numel() else None  # the device table of a codec with one
        if op == "measure":
            data, tail, n_full, n_, meta, histogram = args[:6]
            full = torch.cat([data, tail])[: int(n_) * entry_bytes] if int(n_full) < int(n_) else data
            got_meta, got_hist = tensor_measure(exe, codec, full, entry_bytes, word, self.tmp_path, table)
            meta.copy_(got_meta)
            histogram += got_hist
        elif op == "pack":
            data, tail, n_full, n_, meta, ends, slot, slots, overflow, place = args[:10]
            assert not place.numel(), "the host harness packs an overflow into one buffer (no placement)"
            full = torch.cat([data, tail])[: int(n_) * entry_bytes] if int(n_full) < int(n_) else data
            got_slots, got_overflow = tensor_pack(
                exe, codec, full, meta, int(slot), entry_bytes, word, self.tmp_path, table
            )
            assert torch.equal(ends, tensor_ends(meta, int(slot), entry_bytes))
            slots.copy_(got_slots)
            overflow.copy_(got_overflow)
        else:
            meta, ends, slot, slots, overflow, m, place, _, _, out, error, n_ = args[:12]
            assert not place.numel(), "the host harness unpacks an overflow in one buffer (no placement)"
            assert torch.equal(ends, tensor_ends(meta, int(slot), entry_bytes))
            got, bits = tensor_unpack(
                exe, codec, meta, slots, overflow, int(slot), int(n_), entry_bytes, word, self.tmp_path, table
            )
            out.copy_(got)
            error |= bits


@pytest.fixture
def emulated_gpu(host_exe, tmp_path):
    """The CUDA engine for CPU tensors, each launch run by the host harness, registered as "cuda" on the CPU.

    Selected through the public registry (``backend="cuda"`` on a CPU tensor
    then runs the real glue of :mod:`buddy.engines.kernels`). Every launch's arguments
    are checked against the kernel's C signature.
    """
    kernels = HostKernels(host_exe, tmp_path)
    engine = functools.partial(bcuda.CudaEngine, launch=kernels, device_type="cpu")
    for name in bsources.KERNEL_CODECS:
        buddy.dispatch.register(name, "cpu", "cuda", engine)
    yield kernels
    for name in bsources.KERNEL_CODECS:
        buddy.dispatch.unregister(name, "cpu", "cuda")


def test_kernel_signatures_parsed():
    sigs = _kernel_signatures()
    for codec in bsources.KERNEL_CODECS:
        # the last pointer: the codec's device table (null for a codec without one)
        assert sigs[f"buddy_{codec}_measure"] == [
            "uint8_t*", "uint8_t*", "long long", "long long", "uint8_t*", "unsigned long long*", "uint8_t*", "int",
        ]  # fmt: skip
        assert sigs[f"buddy_{codec}_pack"] == [
            "uint8_t*", "uint8_t*", "long long", "long long", "uint8_t*", "long long*", "int", "uint8_t*", "uint8_t*",
            "long long*", "uint8_t*", "uint8_t*", "int",
        ]  # fmt: skip
        assert sigs[f"buddy_{codec}_unpack"] == [
            "uint8_t*", "long long*", "int", "uint8_t*", "uint8_t*", "long long", "long long*", "uint8_t*", "long long",
            "uint8_t*", "int*", "long long", "uint8_t*", "int",
        ]  # fmt: skip
        assert sigs[f"buddy_{codec}_sizes"] == [
            "uint8_t*", "uint8_t*", "long long", "long long", "uint8_t*", "unsigned long long*", "uint8_t*", "int",
            "long long*", "long long*", "long long", "unsigned long long*", "long long", "int",
        ]  # fmt: skip


def test_one_cupy_stream_a_torch_stream_and_no_deprecation_warning(monkeypatch):
    """CuPy 14 warns that ExternalStream is deprecated: on the H200 every launch printed it. The handle is made
    once per torch stream, the warning left out."""
    import types
    import warnings

    made = []

    class ExternalStream:
        def __init__(self, ptr, device_id):
            warnings.warn("ExternalStream is deprecated", DeprecationWarning, stacklevel=2)
            made.append((ptr, device_id))

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=ExternalStream))
    streams = {0: 0x1000}
    monkeypatch.setattr(bcuda, "_current_stream_handle", lambda device: streams[0])
    monkeypatch.setattr(bcuda, "_streams", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = bcuda._cupy_stream(cupy, torch.device("cuda", 0))
        assert bcuda._cupy_stream(cupy, torch.device("cuda", 0)) is first
        streams[0] = 0x2000  # another current stream: its own handle
        assert bcuda._cupy_stream(cupy, torch.device("cuda", 0)) is not first
    assert made == [(0x1000, 0), (0x2000, 0)]


def test_the_current_streams_handle_from_torchs_accessor_or_its_stream(monkeypatch):
    """torch's raw accessor of the current stream where it has one (for a device with its index), else the stream
    object's handle: the same number."""
    import types

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=0x1000))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0x2000 + index, raising=False)
    assert bcuda._current_stream_handle(torch.device("cuda", 1)) == 0x2001
    assert bcuda._current_stream_handle(torch.device("cuda")) == 0x1000, "no index: the current device's stream"
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    assert bcuda._current_stream_handle(torch.device("cuda", 1)) == 0x1000


def test_every_kernels_last_parameter_is_the_word_size():
    """A launch on a GPU builds the module of the word size it reads from the kernel's last argument (one module
    per word size). On an H200 the fit kernel's last argument was its ``weighted`` flag: a module for words of 0
    bytes failed to compile, and every compress of fpe and auto2 with it. No build here reads the word size so."""
    params = kernel_parameters()
    # (decode: fpe's lockstep decoder, a layout weighed -- codec_fpe.h, decode_lockstep)
    ops = {"measure", "ends", "sizes", "pack", "unpack", "drain", "count", "fit", "decode"}
    assert {name.rsplit("_", 1)[1] for name in params} == ops
    for name, ps in params.items():
        assert (ps[-1].name, ps[-1].ctype) == ("word_bytes", "int"), name


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_each_launch_passes_its_word_size_last(word, weighted):
    """What :func:`buddy.engines.cuda._launch` reads as the word size is the layout's, for every kernel (the fit's
    ``weighted`` flag, 0 or 1, once stood there)."""
    launched = []
    kernels = bkernels.Kernels("fpe", launch=lambda *a: launched.append(a), device_type="cpu")
    e, n = 128, 4
    layout = Layout(e, n * e, word)
    data, tail = torch.zeros(n * e, dtype=torch.uint8), torch.zeros(e, dtype=torch.uint8)
    meta, hist = torch.zeros(layout.meta_bytes, dtype=torch.uint8), torch.zeros(layout.bins, dtype=torch.int64)
    table = torch.zeros(fpe_device.DEVICE_TABLE_BYTES, dtype=torch.uint8)
    counts = torch.zeros(n_symbols(word), dtype=torch.int64)
    kernels.count(layout, data, tail, counts)
    kernels.fit(layout, counts, torch.zeros(fpe_device.FIT_WORK_BYTES, dtype=torch.uint8), table,
                torch.zeros(fpe_device.FIT_SERIAL_BYTES, dtype=torch.uint8), weighted=weighted)  # fmt: skip
    kernels.measure(layout, data, tail, meta, hist, table)
    ends, slots = torch.zeros(n, dtype=torch.int64), torch.zeros(n * 32, dtype=torch.uint8)
    kernels.ends(layout, meta, 1, ends)
    kernels.pack(layout, data, tail, meta, ends, 1, slots, torch.zeros(0, dtype=torch.uint8), table)
    kernels.unpack(layout, meta, ends, 1, slots, torch.zeros(0, dtype=torch.uint8), data.clone(),
                   torch.zeros(1, dtype=torch.int32), table)  # fmt: skip
    assert [a[1] for a in launched] == ["count", "fit", "measure", "ends", "pack", "unpack"]
    for codec, op, _, _, _, args, _ in launched:
        assert type(args[-1]) is np.int32 and int(args[-1]) == word, (op, args[-1])


@pytest.mark.parametrize(
    ("match", "word", "aggregate"),
    [(None, 4, 1), (None, 2, 0), (None, 1, 1), (None, 8, 1), (True, 2, 1), (True, 4, 1), (False, 4, 0),
     (False, 2, 0)],
)  # fmt: skip
def test_the_count_kernel_matches_or_takes_ballots_by_word_size(match, word, aggregate):
    """The count kernel's ``aggregate`` argument: 2-byte words by ballots (0), the others by a warp's match (1),
    unless the tuning's ``count_match`` says True (match) or False (ballots) for all."""
    launched = []
    with buddy.engines.tuning.tuned(count_match=match):
        kernels = bkernels.Kernels("auto2", launch=lambda *a: launched.append(a), device_type="cpu")
    layout = Layout(128, 4 * 128, word)
    data, tail = torch.zeros(4 * 128, dtype=torch.uint8), torch.zeros(128, dtype=torch.uint8)
    kernels.count(layout, data, tail, torch.zeros(n_symbols(word), dtype=torch.int64))
    (args,) = [a[5] for a in launched]
    assert type(args[-2]) is np.int32 and int(args[-2]) == aggregate
    assert launched[0][6] == Tuning(count_match=match)  # what it launched with: the tuning when it was made


@pytest.mark.parametrize(("change", "error", "says"), [
    ({"count_match": "yes"}, TypeError, "count_match"), ({"pack_fields": 1}, TypeError, "pack_fields"),
    ({"unpack_warps": "8"}, ValueError, "got '8'"), ({"unpack_warps": 0}, ValueError, "got 0"),
    ({"unpack_warps": 65}, ValueError, "got 65"), ({"unpack_warps": True}, ValueError, "got True"),
    ({"pack_fields": True, "shared_tables": False}, ValueError, "needs shared_tables"),
    ({"unpack_wraps": 8}, TypeError, "unpack_wraps"),
])  # fmt: skip
def test_a_tuning_refuses_what_it_cannot_mean(change, error, says):
    with pytest.raises(error, match=says):
        with buddy.engines.tuning.tuned(**change):
            pass
    assert buddy.engines.tuning.current() == Tuning()


def test_a_tuning_holds_for_its_block_and_is_restored_after_an_error():
    assert buddy.engines.tuning.current() == Tuning()
    with pytest.raises(RuntimeError, match="inside"):
        with buddy.engines.tuning.tuned(unpack_warps=16) as inside:
            assert buddy.engines.tuning.current() is inside and inside.changed() == {"unpack_warps": 16}
            with buddy.engines.tuning.tuned(zero_copy=True) as both:  # on top of the one around it
                assert both.changed() == {"unpack_warps": 16, "zero_copy": True}
            assert buddy.engines.tuning.current() is inside
            raise RuntimeError("inside")
    assert buddy.engines.tuning.current() == Tuning() and not Tuning().changed()


@pytest.mark.parametrize("codec", ids("codec", ("zvc", "auto", "auto2")))
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(d, id=f"dtype={d}".replace("torch.", ""))
        for d in (torch.float32, torch.bfloat16, torch.uint8, torch.float64, torch.complex64, torch.bool)
    ],
)
def test_cuda_path_emulated(emulated_gpu, codec, dtype, store, gen):
    """compress/decompress(backend="cuda") == the reference, buffer for buffer, through the real glue."""
    t = make_data("relu", 20_001 // torch.empty((), dtype=dtype).element_size(), dtype, gen)
    for ratio in (float("inf"), 2.0, 1.0):
        a = buddy.compress(t, target_ratio=ratio, codec=codec, store=store, backend="cuda")
        b = buddy.compress(t, target_ratio=ratio, codec=codec, store=store, backend="reference")
        assert (a.backend, b.backend) == ("cuda", "reference")
        assert a.histogram == b.histogram
        for name, x, y in zip(("meta", "slots", "overflow"), a.buffers(), b.buffers()):
            assert torch.equal(x, y), f"{name} differs at ratio {ratio}"
        assert_roundtrip(a, t)  # decompress with the stored backend: the emulated kernels
        assert torch.equal(b.decompress(backend="cuda", check=True), t)
        a.free()
        b.free()
    tabled = {"count", "fit"} if codec in bsources.TABLED_KERNELS else set()
    assert set(emulated_gpu.launches) == {"measure", "ends", "pack", "unpack"} | tabled


def test_cuda_path_emulated_views_and_damage(emulated_gpu, store, gen):
    base = make_data("relu", 20_000, torch.float32, gen)
    odd = base.view(torch.uint8)[1:-2]  # misaligned: the glue copies before launching
    bt = buddy.compress(odd, target_ratio=2.0, store=store, backend="cuda")
    assert bt.backend == "cuda"
    assert_roundtrip(bt, odd)
    meta, slots, overflow = (x.clone() for x in bt.buffers())
    kw = dict(codec="zvc", entry_bytes=128, slot_sectors=2, shape=odd.shape, dtype=odd.dtype, backend="cuda")
    assert torch.equal(buddy.unpack(meta, slots, overflow, **kw), odd)
    damaged = meta.clone()
    coded = ((meta > 0) & (meta < 4)).nonzero().view(-1)
    damaged[coded[0]] = 3 if int(meta[coded[0]]) != 3 else 1  # a k its bitmap disagrees with
    with pytest.raises(buddy.CorruptDataError, match="does not match|overflow is not"):
        buddy.unpack(damaged, slots, overflow, **kw)  # the public unpack checks: the error flag is read
    modes = meta.clone()
    modes[coded[0]] |= 0x20  # mode 2: zvc writes only 0
    with pytest.raises(buddy.CorruptDataError, match="modes"):
        buddy.unpack(modes, slots, overflow, **kw)
    with pytest.raises(buddy.CorruptDataError, match="overflow is not"):
        buddy.unpack(meta, slots, overflow[:-32], **kw)


@pytest.mark.parametrize("codec", ids("codec", ("zvc", "auto", "auto2")))
def test_launches_and_host_reads_do_not_grow_with_the_tensor(emulated_gpu, codec, gen):
    """A compress: a handful of launches (kernels and torch ops) and one host read; a decompress: none.

    Counted on the emulated engine: kernel launches by the launcher, torch ops
    (each at most a launch on a GPU) by the profiler, host reads by the engine.
    """
    counts = {}
    for numel in (4_000, 40_003):
        t = make_data("relu", numel, torch.float32, gen)
        emulated_gpu.launches.clear()
        ops = []
        with _profiled(ops):
            measured = buddy.measure(t, codec, entry_bytes=512, backend="cuda")
        engine = measured.engine
        with _profiled(ops):
            slots, overflow = engine.pack(measured.flat, measured.measurement, 4, measured.layout)
        after_compress = engine.readbacks
        with _profiled(ops):
            out = engine.unpack(measured.measurement.meta, slots, overflow, 4, measured.layout, check=False)
        assert torch.equal(out, measured.flat)
        counts[numel] = (list(emulated_gpu.launches), ops, after_compress, engine.readbacks)
    small, large = counts.values()
    assert small == large, f"launches depend on the tensor's size: {counts}"
    kernels, (measure_ops, pack_ops, unpack_ops), after_compress, readbacks = large
    tabled = ["count", "fit"] if codec in bsources.TABLED_KERNELS else []  # the table counted and fitted first
    # the overflow's prefix sums by the ends kernel before pack, and again before unpack (a tensor sized first keeps
    # none: pack_ahead's keep theirs)
    assert kernels == [*tabled, "measure", "ends", "pack", "ends", "unpack"]
    assert after_compress == readbacks == 1, "one host read per compress (the histogram), none in decompress"
    # measure: zeros (histogram, tail); pack: k from the metadata, the prefix sum, the tail; unpack: the same, the error flag
    assert max(len(measure_ops), len(pack_ops), len(unpack_ops)) <= 10, (measure_ops, pack_ops, unpack_ops)


@pytest.mark.parametrize("codec", ids("codec", ("fpe", "auto2")))
def test_host_reads_of_codecs_with_a_table(emulated_gpu, codec, gen):
    """A codec with a table: one read per compress with a prior or without, none in pack or decompress.

    Without a prior (a key's first step in a session, a standalone compress)
    the table is fitted on the device and comes back with the histogram; with
    one it is fitted to the prior there alike (the host makes the prior's
    weights: fpe.fit_weights), unless the table fitted to it before still
    codes it well, which is kept (no fit). Either way the reference's table
    and buffers, and the tensor's symbol counts as its statistics.
    """
    for numel in (40_003, 777):
        t = make_data("relu", numel, torch.float32, gen)
        reference = buddy.measure(t, codec, entry_bytes=512, backend="reference")
        emulated_gpu.launches.clear()
        first = buddy.measure(t, codec, entry_bytes=512, backend="cuda")
        assert emulated_gpu.launches == ["count", "fit", "measure"]
        assert first.engine.readbacks == 1, "the histogram and the table, together"
        assert torch.equal(first.table, reference.table)
        assert torch.equal(first.statistics, reference.statistics)
        assert first.histogram == reference.histogram
        assert torch.equal(first.measurement.meta, reference.measurement.meta)
        prior = first.statistics.to(torch.float64) / 3 + 0.5  # frequencies, not counts; every symbol seen
        want = buddy.measure(t, codec, entry_bytes=512, backend="reference", prior=prior)
        emulated_gpu.launches.clear()
        fitted = buddy.measure(t, codec, entry_bytes=512, backend="cuda", prior=prior)
        assert emulated_gpu.launches == ["count", "fit", "measure"]
        assert fitted.engine.readbacks == 1, "the histogram and the table, together"
        assert torch.equal(fitted.table, want.table) and fitted.histogram == want.histogram
        assert torch.equal(fitted.measurement.meta, want.measurement.meta)
        assert torch.equal(fitted.statistics, reference.statistics)
        emulated_gpu.launches.clear()
        again = buddy.measure(t, codec, entry_bytes=512, backend="cuda", prior=prior, keep=fitted.codec)
        assert emulated_gpu.launches == ["count", "measure"]  # the table fitted to the prior, kept
        assert again.engine.readbacks == 1, "the histogram alone"
        assert torch.equal(again.table, want.table) and again.histogram == want.histogram
        engine = again.engine
        slots, overflow = engine.pack(again.flat, again.measurement, 4, again.layout)
        out = engine.unpack(again.measurement.meta, slots, overflow, 4, again.layout, check=False)
        assert torch.equal(out, again.flat) and engine.readbacks == 1, "none in pack or decompress"
        bt = buddy.compress(t, target_ratio=2.0, codec=codec, backend="cuda")
        assert torch.equal(bt.table, reference.table) and torch.equal(bt.decompress(), t)
        bt.free()


@contextlib.contextmanager
def _profiled(into: list):
    """Appends the torch ops the block ran (on a GPU each is at most one launch), allocations and views left out."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield
    into.append(_aten_ops(prof))


#: torch ops that launch nothing on a GPU: allocations and views
_NO_LAUNCH = {
    "aten::empty", "aten::empty_strided", "aten::view", "aten::slice", "aten::as_strided", "aten::select",
    "aten::detach", "aten::alias", "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::_reshape_alias",
}  # fmt: skip


def _aten_ops(prof) -> list[str]:
    """The top-level torch ops a profiled region ran that launch work on a GPU (at most one each)."""
    events = prof.events()
    return sorted(
        e.name for e in events if e.cpu_parent is None and e.name.startswith("aten::") and e.name not in _NO_LAUNCH
    )


def test_the_overflow_is_read_in_place_only_when_asked_pinned_and_supported(monkeypatch):
    """Tuned zero_copy, a pinned overflow with bytes, a device that takes registered host pointers: all four."""
    overflow, device, asked = torch.zeros(64, dtype=torch.uint8), torch.device("cuda", 0), Tuning(zero_copy=True)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(bcuda, "_takes_host_pointers", lambda index: True)
    assert not bcuda.reads_overflow_in_place(overflow, device, Tuning())  # not asked
    assert bcuda.reads_overflow_in_place(overflow, device, asked)
    assert not bcuda.reads_overflow_in_place(overflow[:0], device, asked)  # nothing to read
    monkeypatch.setattr(bcuda, "_takes_host_pointers", lambda index: False)
    assert not bcuda.reads_overflow_in_place(overflow, device, asked)
    monkeypatch.setattr(bcuda, "_takes_host_pointers", lambda index: True)
    misaligned = torch.zeros(80, dtype=torch.uint8)[8:72]
    assert not bcuda.reads_overflow_in_place(misaligned, device, asked)  # copied
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    assert not bcuda.reads_overflow_in_place(overflow, device, asked)
