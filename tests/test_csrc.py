"""The C header agrees with the Python spec; every CUDA source compiles.

The compilers are optional here: each test skips when its compiler is missing,
so a machine without nvcc still runs the rest of the suite.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from buddy import format as layout
from buddy import spec

CSRC = Path(__file__).resolve().parents[1] / "csrc"
ENTRY_SIZES = [32, 128, 256, 512, 4096, 65536]


def _defines(entry_bytes: int) -> list[str]:
    return [f"-D{k}={v}" for k, v in spec.c_defines(entry_bytes).items()]


_PROGRAM = r"""
#include "buddy_format.h"
#include <stdio.h>
int main(void) {
  for (unsigned k = 0; k <= BUDDY_SECTORS_PER_ENTRY; ++k)
    for (unsigned mode = 0; mode < (1u << BUDDY_META_MODE_BITS); ++mode) {
      buddy_meta_t w = buddy_meta_pack(k, mode);
      if (buddy_meta_k(w) != k || buddy_meta_mode(w) != mode) return 1;
      const unsigned char *b = (const unsigned char *)&w;
      for (int i = 0; i < BUDDY_META_BYTES; ++i) printf("%u ", b[i]);
    }
  printf("\n");
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("entry_bytes", ENTRY_SIZES, ids=lambda e: f"E={e}")
def test_header_metadata_matches_python(tmp_path, entry_bytes):
    src = tmp_path / "meta.cpp"
    src.write_text(_PROGRAM)
    exe = tmp_path / "meta"
    subprocess.run(["g++", "-std=c++17", f"-I{CSRC}", *_defines(entry_bytes), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    _, _, mode_bits = spec.meta_fields(entry_bytes)
    ks = torch.arange(spec.sectors_per_entry(entry_bytes) + 1).repeat_interleave(1 << mode_bits)
    modes = torch.arange(1 << mode_bits).repeat(spec.sectors_per_entry(entry_bytes) + 1)
    expected = layout.encode_meta(ks, modes, entry_bytes)
    assert [int(v) for v in out] == expected.tolist()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_header_rejects_missing_defines(tmp_path):
    src = tmp_path / "bad.cpp"
    src.write_text('#include "buddy_format.h"\nint main(void) { return 0; }\n')
    result = subprocess.run(["g++", f"-I{CSRC}", "-fsyntax-only", str(src)], capture_output=True, text=True)
    assert result.returncode != 0 and "buddy.spec.c_defines" in result.stderr


#: sources compiled elsewhere: every codec's kernels, for both architectures with warnings as errors, as the loader
#: hands them to NVRTC (tests/test_cuda_core.py, test_translation_unit_compiles_without_warnings)
_COMPILED_ELSEWHERE = {"buddy_kernels.cu"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize(
    "source",
    [p.name for p in sorted(CSRC.glob("*.cu")) + sorted(CSRC.glob("*.h")) if p.name not in _COMPILED_ELSEWHERE],
)
def test_cuda_sources_compile(tmp_path, source, arch):
    path = CSRC / source
    if path.suffix == ".h":  # each header on its own, as a translation unit
        unit = tmp_path / "header.cu"
        unit.write_text(f'#include "{source}"\n')
        path = unit
    # every codec's kernels: the loader builds one codec's per module
    cmd = [
        "nvcc",
        f"-arch={arch}",
        "-std=c++17",
        f"-I{CSRC}",
        *_defines(spec.DEFAULT_ENTRY_BYTES),
        "-DBUDDY_CODEC_ALL=1",
    ]
    subprocess.run([*cmd, "-c", str(path), "-o", str(tmp_path / "out.o")], check=True)
