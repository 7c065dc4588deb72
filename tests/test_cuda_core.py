"""The CUDA path without a GPU: its sources, its dispatch, the glue under emulated kernels.

(The per-entry device code itself is tested against the reference in
``tests/test_device_codecs.py``.)

* the translation unit the loader hands NVRTC compiles (nvcc, and NVRTC itself
  when its library can be found).
* ``backend=`` picks the implementation, and ``import buddy`` works without CuPy.

Compilers are optional: each test skips when its compiler is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_roundtrip, ids, make_data
from test_device_codecs import run_decode, run_encode

import buddy
from buddy import cuda as bcuda
from buddy import spec

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
    tu = bcuda.translation_unit()
    assert '#include "' not in tu and "#pragma once" not in tu
    for header in ("buddy_format.h", "buddy_device.h", "buddy_warp.h", "buddy_entry.h", "codec_zvc.h"):
        assert tu.count(f"// ---- begin {header}") == 1, header
    assert bcuda.read_source("buddy_kernels.cu") == (CSRC / "buddy_kernels.cu").read_text()


def test_compile_options_carry_the_spec():
    for e in (32, 128, 65536):
        opts = bcuda.compile_options(e)
        assert "-std=c++17" in opts
        assert {o for o in opts if o.startswith("-D")} == {f"-D{k}={v}" for k, v in spec.c_defines(e).items()}
    with pytest.raises(ValueError):
        bcuda.compile_options(100)


@needs_nvcc
@pytest.mark.parametrize("entry_bytes", ids("E", (32, 256, 512, 65536)))
def test_translation_unit_compiles_without_warnings(tmp_path, entry_bytes):
    """The exact text given to NVRTC, through nvcc with warnings as errors (sm_80)."""
    unit = tmp_path / "kernels_tu.cu"
    unit.write_text(bcuda.translation_unit())
    cmd = ["nvcc", "-arch=sm_80", "-Werror", "all-warnings", *bcuda.compile_options(entry_bytes)]
    subprocess.run([*cmd, "-c", str(unit), "-o", str(tmp_path / "zvc.o")], check=True)


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
        source = bcuda.translation_unit().encode()
        assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"buddy_kernels.cu", 0, None, None) == 0
        options = [o.encode() for o in (*bcuda.compile_options(e), "-arch=compute_80")]
        result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert result == 0, f"NVRTC failed for E={e}:\n{log.value.decode(errors='replace')}"
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        for kernel in ("buddy_zvc_measure", "buddy_zvc_encode", "buddy_zvc_decode"):
            assert f".entry {kernel}(".encode() in ptx.value


# ---------------------------------------------------------------------------
# argument checks of the launchers (they run before any launch, on any device)
# ---------------------------------------------------------------------------
def test_launchers_reject_cpu_tensors():
    entries = torch.zeros(4, 128, dtype=torch.uint8)
    kernels = bcuda.Kernels("zvc")
    with pytest.raises(ValueError, match="CUDA device"):
        kernels.measure(entries, 4)
    with pytest.raises(ValueError, match="CUDA device"):
        kernels.encode(entries, 4)
    with pytest.raises(ValueError, match="CUDA device"):
        kernels.decode(entries, torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="torch.Tensor"):
        kernels.measure(entries.numpy(), 4)


def test_tensor_check_names_each_problem():
    cpu = torch.device("cpu")
    check = bcuda._check_tensor
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
        bcuda._check_word(3)
    with pytest.raises(ValueError, match="word_bytes"):
        bcuda._check_word(True)


def test_dense_copies_only_when_needed():
    t = torch.zeros(4, 128, dtype=torch.uint8)
    assert bcuda._dense(t) is t
    odd = torch.zeros(4 * 128 + 1, dtype=torch.uint8)[1:].view(4, 128)
    fixed = bcuda._dense(odd)
    assert fixed.data_ptr() % bcuda.ALIGN_BYTES == 0 and torch.equal(fixed, odd)
    assert bcuda._dense(torch.arange(3), torch.int32).dtype == torch.int32


# ---------------------------------------------------------------------------
# the whole CUDA path on the CPU: kernels emulated by the host harness
# ---------------------------------------------------------------------------
_C_TYPES = {"uint8_t*": torch.uint8, "int32_t*": torch.int32, "int*": torch.int32}


def _kernel_signatures() -> dict[str, list[str]]:
    """Parameter types of each extern "C" kernel, from the translation unit with its macros expanded."""
    import re

    expanded = subprocess.run(
        ["g++", "-E", "-P", "-x", "c++", "-std=c++17", *_defines(128), "-"],
        input=bcuda.translation_unit(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sigs = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\((.*?)\)\s*\{', expanded, re.S):
        types = []
        for param in re.sub(r"/\*.*?\*/", "", params).split(","):
            decl = param.replace("__restrict__", "").replace("const", "")
            decl = " ".join(decl.split()).replace(" *", "*")
            types.append(decl.rsplit(" ", 1)[0])
        sigs[name] = types
    return sigs


@pytest.fixture
def emulated_gpu(host_exe, tmp_path):
    """The CUDA engine for CPU tensors, each launch run by the host harness, registered as zvc's "cuda" on the CPU.

    Selected through the public registry (``backend="cuda"`` on a CPU tensor
    then runs the real glue of :mod:`buddy.cuda`). Every launch's arguments
    are checked against the kernel's C signature (pointers: tensors of the
    pointee's dtype; long long / int: numpy int64 / int32).
    """
    sigs = _kernel_signatures()
    launches = []

    def launch(name, entry_bytes, device, n, args):
        types = sigs[name]
        assert len(args) == len(types), f"{name}: {len(args)} arguments for {len(types)} parameters"
        for arg, ctype in zip(args, types):
            if ctype in _C_TYPES:
                assert isinstance(arg, torch.Tensor) and arg.dtype == _C_TYPES[ctype], (name, ctype, arg)
                assert arg.is_contiguous() and arg.data_ptr() % bcuda.ALIGN_BYTES == 0
            else:
                assert type(arg) is {"long long": np.int64, "int": np.int32}[ctype], (name, ctype, type(arg))
        assert int(args[-2]) == n and 1 <= n
        exe, word = host_exe(entry_bytes), int(args[-1])
        launches.append(name)
        if name == "buddy_zvc_decode":
            payload, sectors, modes, out, error = args[:5]
            got = run_decode(exe, "zvc", payload, sectors, modes, word, tmp_path)
            out.copy_(got["decoded"])
            error |= int(np.bitwise_or.reduce(got["err"].numpy()))
            return
        got = run_encode(exe, "zvc", args[0], word, tmp_path)
        if name == "buddy_zvc_measure":
            args[1].copy_(got["k"])
            args[2].copy_(got["mode"])
        else:
            args[1].copy_(got["payload"])
            args[2].copy_(got["k"])
            args[3].copy_(got["mode"])

    engine = functools.partial(bcuda.CudaEngine, launch=launch, device_type="cpu")
    buddy.register_implementation("zvc", "cpu", "cuda", engine)
    yield launches
    buddy.unregister_implementation("zvc", "cpu", "cuda")


def test_kernel_signatures_parsed():
    sigs = _kernel_signatures()
    assert sigs["buddy_zvc_measure"] == ["uint8_t*", "int32_t*", "int32_t*", "long long", "int"]
    assert sigs["buddy_zvc_encode"] == ["uint8_t*", "uint8_t*", "int32_t*", "int32_t*", "long long", "int"]
    assert sigs["buddy_zvc_decode"] == ["uint8_t*", "int32_t*", "int32_t*", "uint8_t*", "int*", "long long", "int"]


@needs_gxx
@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(d, id=f"dtype={d}".replace("torch.", ""))
        for d in (torch.float32, torch.bfloat16, torch.uint8, torch.float64, torch.complex64, torch.bool)
    ],
)
def test_cuda_path_emulated(emulated_gpu, dtype, store, gen, monkeypatch):
    """compress/decompress(backend="cuda") == the reference, buffer for buffer, through the real glue."""
    monkeypatch.setattr(buddy.format, "BLOCK_BYTES", 8 * 1024)  # several chunks: size pass, chunked pack
    t = make_data("relu", 20_001 // torch.empty((), dtype=dtype).element_size(), dtype, gen)
    for ratio in (float("inf"), 2.0, 1.0):
        a = buddy.compress(t, target_ratio=ratio, store=store, backend="cuda")
        b = buddy.compress(t, target_ratio=ratio, store=store, backend="reference")
        assert (a.backend, b.backend) == ("cuda", "reference")
        assert a.histogram == b.histogram
        for name, x, y in zip(("meta", "slots", "overflow"), a.buffers(), b.buffers()):
            assert torch.equal(x, y), f"{name} differs at ratio {ratio}"
        assert_roundtrip(a, t)  # decompress with the stored backend: the emulated kernels
        assert torch.equal(b.decompress(backend="cuda"), t)
        a.free()
        b.free()
    assert {"buddy_zvc_measure", "buddy_zvc_encode", "buddy_zvc_decode"} <= set(emulated_gpu)


@needs_gxx
def test_cuda_path_emulated_views_and_damage(emulated_gpu, store, gen):
    base = make_data("relu", 20_000, torch.float32, gen)
    odd = base.view(torch.uint8)[1:-2]  # misaligned: the glue copies before launching
    bt = buddy.compress(odd, target_ratio=2.0, store=store, backend="cuda")
    assert bt.backend == "cuda"
    assert_roundtrip(bt, odd)
    engine = buddy.dispatch.engine(ZVC, "cpu", "cuda")
    assert isinstance(engine, bcuda.CudaEngine)
    entries = base.view(torch.uint8).view(-1, 128)
    k, modes = engine.measure_block(entries, 4)[:2]
    payload = engine.encode_block(entries, 4, k, modes, None)
    assert torch.equal(engine.decode_block(payload, k.long(), modes, 4), entries)  # int64 sizes accepted
    bad = k.clone()
    coded = ((k > 0) & (k < 4)).nonzero().view(-1)
    bad[coded[0]] = 9
    with pytest.raises(buddy.CorruptDataError, match="more sectors"):
        engine.decode_block(payload, bad, modes, 4)
    bad_modes = modes.clone()
    bad_modes[0] = 2
    with pytest.raises(buddy.CorruptDataError, match="modes"):
        engine.decode_block(payload, k, bad_modes, 4)
    kernels = engine.kernels
    assert kernels.measure(entries[:0], 4)[0].shape == (0,)
    assert kernels.decode(payload[:0], k[:0], k[:0], 4).shape == (0, 128)
