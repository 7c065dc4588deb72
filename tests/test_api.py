"""The public API: the issue's example, argument checking, optional dependencies, reprs."""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA, assert_bitexact, assert_roundtrip, make_data

import buddy
from buddy import deps, spec

REPO = Path(__file__).resolve().parents[1]


def test_issue_example(store, capsys):
    torch.manual_seed(0)
    t = torch.relu(torch.randn(8, 16, 28, 28))
    bt = buddy.compress(t, target_ratio=2.0, codec="zvc", entry_bytes=128, store=store)
    print(bt.original_bytes, bt.device_bytes, bt.buddy_bytes, bt.target_ratio, bt.codec)
    printed = capsys.readouterr().out.split()
    assert printed == [str(bt.original_bytes), str(bt.device_bytes), str(bt.buddy_bytes), "2.0", "zvc"]
    n_entries = t.numel() * 4 // 128
    assert bt.original_bytes == t.numel() * 4 == 401408
    assert bt.device_bytes == n_entries * (64 + 1)  # two sectors of slot + one metadata byte per entry
    assert 0 < bt.buddy_bytes < bt.original_bytes // 4
    assert bt.target_ratio == 2.0 and bt.codec == "zvc"
    assert bt.slot_sectors == 2
    assert isinstance(bt.histogram, tuple) and sum(bt.histogram) == n_entries
    assert 0 < bt.compressed_bytes < bt.original_bytes
    assert bt.effective_ratio == bt.original_bytes / bt.device_bytes
    assert not bt.freed
    assert_roundtrip(bt, t)
    bt.free()
    assert bt.freed


def test_top_level_names():
    for name in ("compress", "unpack", "pack", "BuddyTensor", "BuddyStore", "available_codecs", "get_codec"):
        assert hasattr(buddy, name), name
    assert {"raw", "zvc"} <= set(buddy.available_codecs())
    assert buddy.codecs.DEFAULT_CODEC in buddy.available_codecs()
    assert issubclass(buddy.UnsupportedTensorError, TypeError)
    assert issubclass(buddy.CorruptDataError, ValueError)
    assert issubclass(buddy.HostStoreFull, MemoryError)
    assert issubclass(buddy.MissingDependencyError, ImportError)
    for err in (
        buddy.FreedTensorError,
        buddy.HostStoreFull,
        buddy.CorruptDataError,
        buddy.UnsupportedTensorError,
        buddy.MissingDependencyError,
    ):
        assert issubclass(err, buddy.BuddyError)


# ---------------------------------------------------------------------------
# the names: __all__, and the names that moved (buddy._MOVED, docs/api.md)
# ---------------------------------------------------------------------------
def test_all_holds_what_a_user_calls():
    assert len(buddy.__all__) == len(set(buddy.__all__)) <= 40
    missing = [name for name in buddy.__all__ if not hasattr(buddy, name)]
    assert not missing, missing
    assert not [name for name in buddy.__all__ if inspect.ismodule(getattr(buddy, name))]  # modules are reached by path
    assert not set(buddy.__all__) & set(buddy._MOVED)
    namespace: dict = {}
    exec("from buddy import *", namespace)
    assert set(buddy.__all__) <= set(namespace)


def test_warn_once_is_not_public():
    assert "warn_once" not in buddy.__all__ and "warn_once" not in buddy.errors.__all__
    assert not hasattr(buddy, "warn_once")
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        buddy.no_such_name  # noqa: B018


@pytest.mark.parametrize("old", sorted(buddy._MOVED))
def test_a_moved_name_warns_once_with_its_new_place(old, monkeypatch):
    """The same object as at its new place, a public name there; the first use warns naming that place."""
    module_name, new = buddy._MOVED[old]
    module = importlib.import_module(module_name)
    expected = getattr(module, new)
    assert inspect.ismodule(expected) or new in module.__all__
    monkeypatch.setattr(buddy.__getattr__, "_warned", set())  # as in a fresh process
    with pytest.warns(DeprecationWarning, match=rf"^buddy\.{old} is deprecated; use {module_name}\.{new}$") as caught:
        assert getattr(buddy, old) is expected
    assert [w.filename for w in caught] == [__file__]  # the warning points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(buddy, old) is expected  # once per name


def test_from_buddy_import_of_a_moved_name(monkeypatch):
    monkeypatch.setattr(buddy.__getattr__, "_warned", set())
    with pytest.warns(DeprecationWarning, match="use buddy.ledger.DeviceLedger"):
        from buddy import DeviceLedger
    assert DeviceLedger is buddy.ledger.DeviceLedger


def test_measured_is_renamed_measured_tensor(store, gen, monkeypatch):
    """One name per idea: buddy.measure returns a MeasuredTensor (the tensor, its engine and layout, and the
    measurement its engine made); the old name ``Measured`` still answers."""
    measured = buddy.measure(make_data("relu", 1024, torch.float32, gen), "zvc")
    assert type(measured) is buddy.pipeline.MeasuredTensor
    assert repr(measured).startswith("MeasuredTensor(")
    assert "Measured" not in buddy.pipeline.__all__
    monkeypatch.setattr(buddy.pipeline.__getattr__, "_warned", set())
    with pytest.warns(
        DeprecationWarning, match=r"^buddy\.pipeline\.Measured is deprecated; use buddy\.pipeline\.MeasuredTensor$"
    ):
        assert buddy.pipeline.Measured is buddy.pipeline.MeasuredTensor
    with pytest.raises(AttributeError):
        buddy.pipeline.no_such_name  # noqa: B018


def test_what_ran_and_the_registry_have_one_name_each(store):
    """buddy.dispatch.chosen: what backend="auto" ran (Choice rows); buddy.dispatch.implementations: the registry
    (Implementation rows)."""
    buddy.compress(torch.zeros(256), 2.0, "zvc", store=store).free()
    assert all(isinstance(row, buddy.dispatch.Choice) for row in buddy.dispatch.chosen())
    assert buddy.dispatch.chosen("zvc", device="cpu")
    rows = buddy.dispatch.implementations("zvc", device="cpu")
    assert rows and all(isinstance(row, buddy.engines.Implementation) for row in rows)
    assert not {"implementations", "registered_implementations", "chosen"} & set(buddy.__all__)


_MOVED_USE = re.compile(r"(?<![\w.])buddy\.(" + "|".join(buddy._MOVED) + r")\b(?!\.py)")


def test_the_repository_uses_the_new_places():
    """Tests, experiments and docs name moved things at their new place (docs/api.md's table of moved names and
    this file excepted)."""
    paths = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "tests").rglob("*.py")]
    paths += [p for p in (REPO / "experiments").rglob("*.py") if "results" not in p.parts]
    found = []
    for path in sorted(paths):
        text = path.read_text()
        if path.name == "api.md":
            text = text.split("### Moved names")[0]
        if path != Path(__file__):
            found += [f"{path.relative_to(REPO)}: buddy.{m.group(1)}" for m in _MOVED_USE.finditer(text)]
    assert not found, "\n".join(found)


def test_compress_takes_ratio_and_codec_by_position_the_rest_by_keyword(store):
    """As docs/api.md says: ``compress(t, target_ratio, codec, *, ...)``; ``measure(t, codec, *, ...)``."""
    t = torch.zeros(1024)
    buddy.compress(t, 2.0, store=store).free()
    buddy.compress(t, 2.0, "zvc", store=store).free()
    with pytest.raises(TypeError, match="positional"):
        buddy.compress(t, 2.0, "zvc", 512, store=store)
    with pytest.raises(TypeError, match="positional"):
        buddy.measure(t, "zvc", 512)
    with pytest.raises(TypeError, match="positional"):
        buddy.pack(buddy.measure(t, "zvc"), 2, store)
    with pytest.raises(TypeError, match="positional"):
        buddy.size_histogram(t, "zvc", 512)


# ---------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [None, 3.0, [1.0, 2.0], "tensor", b"\x00\x01"])
def test_non_tensor_is_a_type_error(bad, store):
    with pytest.raises(TypeError):
        buddy.compress(bad, store=store)


def test_numpy_array_is_a_type_error(store):
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError):
        buddy.compress(np.zeros(4, dtype=np.float32), store=store)


def _quantized():
    return torch.quantize_per_tensor(torch.randn(16), 0.1, 0, torch.quint8)


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated in recent torch
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(4, 4).to_sparse(), id="sparse_coo"),
        pytest.param(lambda: torch.randn(4, 4).to_sparse_csr(), id="sparse_csr"),
        pytest.param(lambda: torch.empty(4, 4, device="meta"), id="meta"),
        pytest.param(_quantized, id="quantized"),
        pytest.param(lambda: torch.nested.nested_tensor([torch.randn(3), torch.randn(5)]), id="nested"),
    ],
)
def test_unsupported_tensors(make, store):
    t = make()
    with pytest.raises(buddy.UnsupportedTensorError):
        buddy.compress(t, target_ratio=2.0, store=store)
    with pytest.raises(TypeError):  # it is a TypeError too
        buddy.compress(t, store=store)
    assert buddy.ledger.default_ledger().tensors_held == 0


def test_unknown_codec_lists_the_available_ones(store):
    with pytest.raises(ValueError) as info:
        buddy.compress(torch.zeros(8), codec="no_such_codec", store=store)
    for name in buddy.available_codecs():
        assert name in str(info.value)
    with pytest.raises(TypeError):
        buddy.compress(torch.zeros(8), codec=3, store=store)


@pytest.mark.parametrize("ratio", [0.5, 0.0, -2.0, math.nan])
def test_bad_target_ratio(ratio, store):
    with pytest.raises(ValueError):
        buddy.compress(torch.zeros(8), target_ratio=ratio, store=store)


def test_target_ratio_of_wrong_type(store):
    with pytest.raises(TypeError):
        buddy.compress(torch.zeros(8), target_ratio="2", store=store)


@pytest.mark.parametrize("e", [100, 16, 2**17, 0, 96, -128])
@pytest.mark.parametrize("ratio", [None, 2.0])
def test_bad_entry_bytes(e, ratio, store):
    with pytest.raises(ValueError):
        buddy.compress(torch.zeros(8), target_ratio=ratio, entry_bytes=e, store=store)


@pytest.mark.parametrize("on_full", ["x", "", None, "Device"])
def test_bad_on_full(on_full, store):
    with pytest.raises(ValueError):
        buddy.compress(torch.zeros(8), target_ratio=2.0, on_full=on_full, store=store)


@pytest.mark.parametrize("max_overflow", [-0.1, 1.5])
def test_bad_max_overflow(max_overflow, store):
    with pytest.raises(ValueError):
        buddy.compress(torch.zeros(8), max_overflow=max_overflow, store=store)


def test_measure_then_pack_is_compress(store, gen):
    """The pipeline's two public steps: the caller decides the slot from the histogram in between."""
    t = make_data("relu", 4096, torch.float32, gen)
    measured = buddy.measure(t, "zvc")
    assert len(measured.histogram) == 5 and sum(measured.histogram) == measured.n_entries == 128
    cpu_default = "native" if buddy.engines.native.why_unusable() is None else "reference"
    assert measured.overflow_bytes(4) == 0 and measured.backend == cpu_default
    assert buddy.size_histogram(t, "zvc") == list(measured.histogram)
    bt = buddy.pack(measured, 3, store=store)
    assert bt.slot_sectors == 3 and bt.histogram == measured.histogram
    assert bt.buddy_bytes == measured.overflow_bytes(3)
    same = buddy.compress(t, spec.ratio_for_slot(3, 128), "zvc", store=store)
    for a, b in zip(bt.buffers(), same.buffers()):
        assert torch.equal(a, b)
    assert_roundtrip(bt, t)
    for bad in (5, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="slot must be an int"):
            buddy.pack(measured, bad, store=store)
    with pytest.raises(TypeError, match="buddy.measure"):
        buddy.pack(t, 3, store=store)


def test_codec_instance_is_accepted(store, gen):
    t = make_data("relu", 1000, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=2.0, codec=buddy.get_codec("zvc"), store=store)
    assert bt.codec == "zvc"
    assert_roundtrip(bt, t)


def test_requires_grad_tensor_compresses_detached(store, gen):
    t = make_data("relu", 2048, torch.float32, gen).view(32, 64).requires_grad_()
    y = t * 1  # a non-leaf with a grad_fn
    for src in (t, y):
        bt = buddy.compress(src, target_ratio=2.0, store=store)
        out = bt.decompress()
        assert not out.requires_grad and out.grad_fn is None
        assert_bitexact(out, src.detach())
    assert t.grad is None


def test_decompress_gives_a_new_tensor(store, gen):
    t = make_data("special", 1000, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=1.0, store=store)
    a, b = bt.decompress(), bt.decompress()
    assert a.data_ptr() != b.data_ptr() != t.data_ptr()
    a.zero_()
    assert_bitexact(b, t)
    assert_bitexact(bt.decompress(), t)


def test_unpack_with_codec_by_name_and_instance(store, gen):
    t = make_data("relu", 3000, torch.bfloat16, gen).view(30, 100)
    bt = buddy.compress(t, target_ratio=4.0, store=store)
    meta, slots, overflow = bt.buffers()
    for codec in ("zvc", buddy.get_codec("zvc")):
        out = buddy.unpack(
            meta, slots, overflow, codec=codec, entry_bytes=128, slot_sectors=1, shape=(30, 100), dtype=torch.bfloat16
        )
        assert_bitexact(out, t)


# ---------------------------------------------------------------------------
# optional dependencies
# ---------------------------------------------------------------------------
def test_import_without_cupy():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None              # any `import cupy` now fails
        sys.modules["nvidia.nvcomp"] = None
        import torch, buddy
        t = torch.relu(torch.randn(64, 64))
        bt = buddy.compress(t, target_ratio=2.0)
        assert torch.equal(bt.decompress().view(torch.uint8), t.view(torch.uint8))
        assert "cupy" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("OK")


def test_import_buddy_does_not_import_cupy():
    code = "import sys, buddy; print(sorted(m for m in ('cupy', 'nvidia.nvcomp') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_require_missing_module_has_install_hint():
    with pytest.raises(buddy.MissingDependencyError) as info:
        deps.require("cupy_that_does_not_exist", "the x feature")
    msg = str(info.value)
    assert "cupy_that_does_not_exist" in msg and "the x feature" in msg
    assert "pip install" in msg
    assert isinstance(info.value, ImportError)


@pytest.mark.skipif(deps.available("cupy"), reason="cupy is installed")
def test_require_known_module_hint():
    with pytest.raises(buddy.MissingDependencyError) as info:
        deps.require("cupy", "x")
    assert "buddy[cuda12]" in str(info.value)


def test_require_present_module_returns_it():
    assert deps.require("math", "x") is math
    assert deps.available("math") and not deps.available("cupy_that_does_not_exist")
    assert deps.version_of("cupy_that_does_not_exist") is None


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here")
def test_require_cuda_without_cuda():
    with pytest.raises(buddy.MissingDependencyError) as info:
        deps.require_cuda("the x feature")
    assert "the x feature" in str(info.value) and "CUDA" in str(info.value)


@pytest.mark.gpu
def test_require_cuda_with_cuda():
    deps.require_cuda("x")  # no error


# ---------------------------------------------------------------------------
# repr
# ---------------------------------------------------------------------------
def test_repr_live_and_freed(store, gen):
    t = make_data("relu", 1000, torch.float32, gen).view(10, 100)
    bt = buddy.compress(t, target_ratio=2.0, store=store)
    live = repr(bt)
    assert live.startswith("BuddyTensor(")
    for part in (
        "shape=(10, 100)",
        "dtype=torch.float32",
        "device=cpu",
        "codec='zvc'",
        "entry_bytes=128",
        "target_ratio=2.00",
        "original_bytes=4,000",
    ):
        assert part in live, part
    assert f"device_bytes={bt.device_bytes:,}" in live and f"buddy_bytes={bt.buddy_bytes:,}" in live
    assert "freed" not in live
    bt.free()
    dead = repr(bt)
    assert "freed" in dead and "device_bytes" not in dead
    assert "shape=(10, 100)" in dead


def test_repr_zero_slot(store):
    bt = buddy.compress(torch.zeros(64), target_ratio=math.inf, store=store)
    assert "target_ratio=inf" in repr(bt)
    assert bt.target_ratio == math.inf and bt.device_bytes == 2 and bt.buddy_bytes == 0


def test_size_histogram_matches_compress():
    g = torch.Generator().manual_seed(7)
    t = torch.relu(torch.randn(70_000, generator=g)).to(torch.bfloat16)
    hist = buddy.size_histogram(t, "zvc", entry_bytes=256)
    bt = buddy.compress(t, codec="zvc", entry_bytes=256)
    assert hist == list(bt.histogram) and sum(hist) == bt.n_entries
    assert sum(k * n for k, n in enumerate(hist)) * buddy.spec.SECTOR_BYTES == bt.compressed_bytes
    bt.free()
    with pytest.raises(TypeError):
        buddy.size_histogram([1, 2, 3])


@pytest.mark.parametrize(
    "make,dense",
    [
        (lambda: torch.randn(64, 48).t(), True),
        (lambda: torch.randn(4, 8, 6, 6).to(memory_format=torch.channels_last), True),
        (lambda: torch.randn(4, 5, 6).permute(2, 0, 1), True),
        (lambda: torch.randn(40, 30)[:, ::3], False),
        (lambda: torch.randn(5, 1).expand(5, 7), False),
    ],
    ids=["transposed", "channels_last", "permuted", "strided_slice", "expanded"],
)
def test_decompress_restores_dense_strides(make, dense):
    x = make()
    out = buddy.compress(x, codec="zvc").decompress()
    assert torch.equal(out, x)
    assert out.stride() == (x.stride() if dense else x.contiguous().stride())


def test_decompress_and_unpack_share_one_decode(store, gen, monkeypatch):
    """BuddyTensor.decompress decodes through the engines' one decode, as buddy.unpack does, with its layout."""
    seen = []
    real = buddy.engines.decode

    def spy(engine, buffers, slot, layout, shape, dtype, stride, **kwargs):
        seen.append((slot, layout, tuple(shape), dtype, kwargs.get("check", True)))
        return real(engine, buffers, slot, layout, shape, dtype, stride, **kwargs)

    monkeypatch.setattr(buddy.engines, "decode", spy)
    t = make_data("relu", 5000, torch.float32, gen).t()
    bt = buddy.compress(t, codec="zvc", entry_bytes=512, target_ratio=2.0, store=store)
    assert_bitexact(bt.decompress(), t)
    meta, slots, overflow = bt.buffers()
    out = buddy.unpack(
        meta, slots, overflow, codec="zvc", entry_bytes=512, slot_sectors=bt.slot_sectors, shape=bt.shape,
        dtype=bt.dtype, stride=bt.stride,
    )  # fmt: skip
    assert_bitexact(out, t)
    expected = (bt.slot_sectors, bt.layout, tuple(t.shape), t.dtype)
    assert [s[:4] for s in seen] == [expected, expected]
    assert [s[4] for s in seen] == [False, True]  # decompress reads the device's verdict only when asked
