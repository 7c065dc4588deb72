"""Bad input: every wrong argument is a specific error that says what to do.

``TypeError`` for the wrong kind of thing, ``ValueError`` for a wrong value,
:class:`buddy.UnsupportedTensorError` (a ``TypeError``) for tensors buddy
cannot store and :class:`buddy.CorruptDataError` (a ``ValueError``) for
buffers that do not agree -- never an ``AssertionError``, an
``AttributeError`` from deep inside, or a silent coercion. Extends the
argument checks of ``tests/test_api.py`` (not repeated here).
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from conftest import assert_bitexact, assert_roundtrip, fuzz_settings, held, make_data
from hypothesis import given
from hypothesis import strategies as st

import buddy
from buddy import spec

try:  # the codecs that run on the CPU (nvcomp's need a GPU)
    CODECS = buddy.available_codecs("cpu")
except TypeError:  # a buddy whose available_codecs() takes no device
    CODECS = buddy.available_codecs()


@pytest.fixture
def x(gen) -> torch.Tensor:
    return make_data("relu", 1000, torch.float32, gen)


def _held(store: buddy.BuddyStore) -> tuple[int, int, int]:
    return held(store)


# ---------------------------------------------------------------------------
# tensors buddy cannot store
# ---------------------------------------------------------------------------
def _two_tensor():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    return two_tensor.TwoTensor(torch.randn(4), torch.randn(4))


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.randn(16)


def _quantized(dtype):
    return lambda: torch.quantize_per_tensor(torch.randn(16), 0.1, 0, dtype)


UNSUPPORTED = {
    "sparse_csc": (lambda: torch.randn(4, 4).to_sparse_csc(), "to_dense"),
    "sparse_bsr": (lambda: torch.randn(4, 4).to_sparse_bsr((2, 2)), "to_dense"),
    "sparse_bsc": (lambda: torch.randn(4, 4).to_sparse_bsc((2, 2)), "to_dense"),
    "nested_jagged": (
        lambda: torch.nested.nested_tensor([torch.randn(3), torch.randn(5)], layout=torch.jagged),
        "component",
    ),
    "quantized_qint8": (_quantized(torch.qint8), "int_repr"),
    "quantized_qint32": (_quantized(torch.qint32), "int_repr"),
    "quantized_per_channel": (
        lambda: torch.quantize_per_channel(torch.randn(3, 4), torch.ones(3), torch.zeros(3), 0, torch.quint8),
        "int_repr",
    ),
    "fake": (_fake, "no data"),
    "wrapper_subclass": (_two_tensor, "inner"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized and jagged tensors warn in recent torch
@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_tensors_say_what_to_do(name, store):
    make, hint = UNSUPPORTED[name]
    t = make()
    for call in (
        lambda: buddy.compress(t, 2.0, store=store),
        lambda: buddy.compress(t, store=store),
        lambda: buddy.measure(t),
        lambda: buddy.size_histogram(t),
    ):
        with pytest.raises(buddy.UnsupportedTensorError, match=hint):
            call()
    assert _held(store) == (0, 0, 0)


def test_vmap_batched_tensors_are_refused(store):
    errors = []

    def f(row):
        with pytest.raises(buddy.UnsupportedTensorError, match="vmap") as info:
            buddy.compress(row, store=store)
        errors.append(info.value)
        return row

    torch.func.vmap(f)(torch.randn(3, 4))
    assert len(errors) == 1
    assert _held(store) == (0, 0, 0)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32", "quint4x2", "quint2x4"])
def test_quantized_dtypes_have_no_word_size(dtype):
    if not hasattr(torch, dtype):
        pytest.skip(f"torch has no {dtype}")
    with pytest.raises(ValueError, match="int_repr"):
        spec.word_bytes(getattr(torch, dtype))


@pytest.mark.parametrize("bad", ["float32", None, torch.float32.itemsize, torch.Size([2])])
def test_word_size_of_a_non_dtype(bad):
    with pytest.raises(TypeError, match="torch.dtype"):
        spec.word_bytes(bad)


# ---------------------------------------------------------------------------
# tensors that are fine, however unusual
# ---------------------------------------------------------------------------
def test_requires_grad_is_compressed_detached_and_not_kept_alive(store, gen):
    """The documented choice: the detached data is compressed; no autograd history, no reference kept."""
    assert "detached" in buddy.compress.__doc__
    leaf = torch.nn.Parameter(make_data("relu", 2048, torch.float32, gen))
    version = leaf._version
    bt = buddy.compress(leaf, 2.0, store=store)
    out = bt.decompress()
    assert type(out) is torch.Tensor and not out.requires_grad and out.grad_fn is None
    assert_bitexact(out, leaf.detach())
    assert leaf._version == version and leaf.grad is None
    ref = weakref.ref(leaf)
    del leaf
    gc.collect()
    assert ref() is None, "compress must not keep its input alive"
    bt.free()


def test_inference_mode_tensors_compress(store, gen):
    with torch.inference_mode():
        t = torch.relu(torch.randn(1000, generator=gen))
    with buddy.compress(t, 2.0, store=store) as bt:
        assert_roundtrip(bt, t)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", [torch.complex32, torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("codec", CODECS)
def test_complex_is_supported(dtype, codec, store, gen):
    t = torch.randint(-3, 4, (2, 300, 2), generator=gen).to(torch.float32)
    t = torch.view_as_complex(t).to(dtype)[:, ::2]  # non-contiguous
    with buddy.compress(t, 2.0, codec, store=store) as bt:
        assert_roundtrip(bt, t)


@pytest.mark.parametrize("name", ["uint4", "int3", "uint1", "bits8", "float4_e2m1fn_x2", "float8_e8m0fnu"])
def test_exotic_one_byte_dtypes_also_when_not_contiguous(name, store, gen):
    """Dtypes without a copy kernel of their own (``uint4`` ...) are copied through ``uint8``."""
    if not hasattr(torch, name):
        pytest.skip(f"torch has no {name}")
    t = torch.randint(0, 256, (40, 30), generator=gen, dtype=torch.uint8).view(getattr(torch, name))[::3, 1::2]
    with buddy.compress(t, 2.0, "bpc", store=store) as bt:
        assert_roundtrip(bt, t)


# ---------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [-math.inf, 1e-300, 0.999, -0.0])
def test_target_ratio_values(ratio, x, store):
    with pytest.raises(ValueError, match="target_ratio must be >= 1"):
        buddy.compress(x, ratio, store=store)


@pytest.mark.parametrize("ratio", [True, torch.tensor(2.0), [2.0], "inf", b"2"])
def test_target_ratio_types(ratio, x, store):
    with pytest.raises(TypeError, match="target_ratio must be a number"):
        buddy.compress(x, ratio, store=store)


@pytest.mark.parametrize("ratio", [1e300, 2**70, 2**2000])
def test_huge_finite_target_ratio_gives_the_smallest_finite_slot(ratio, x, store):
    with buddy.compress(x, ratio, entry_bytes=128, store=store) as bt:
        assert bt.slot_sectors == 1 and bt.target_ratio == 4.0
        assert_roundtrip(bt, x)


@pytest.mark.parametrize("e", [3, 48, 2**20, 2**16 + 1, 1])
@pytest.mark.parametrize("ratio", [None, 2.0])
def test_entry_bytes_values(e, ratio, x, store):
    with pytest.raises(ValueError, match="power of two between 32 and 65536"):
        buddy.compress(x, ratio, entry_bytes=e, store=store)


@pytest.mark.parametrize("e", [128.0, True, "128", torch.tensor(128)])
@pytest.mark.parametrize("ratio", [None, 2.0])
def test_entry_bytes_types(e, ratio, x, store):
    with pytest.raises(TypeError, match="entry_bytes must be an int"):
        buddy.compress(x, ratio, entry_bytes=e, store=store)


@pytest.mark.parametrize("codec", ["", "ZVC", " zvc", "zvc\n"])
def test_codec_names(codec, x, store):
    """An empty name used to fall back silently to the default codec."""
    default = buddy.defaults().codec
    for call in (
        lambda: buddy.compress(x, codec=codec, store=store),
        lambda: buddy.measure(x, codec),
        lambda: buddy.size_histogram(x, codec),
        lambda: buddy.set_defaults(codec=codec),
    ):
        with pytest.raises(ValueError, match="unknown codec .* available: "):
            call()
    assert buddy.defaults().codec == default


@pytest.mark.parametrize("codec", [b"zvc", object(), 0, ["zvc"]])
def test_codec_types(codec, x, store):
    with pytest.raises(TypeError, match="codec must be a name or a Codec"):
        buddy.compress(x, codec=codec, store=store)


@pytest.mark.parametrize("on_full", [["raise"], 0, b"raise", "raise "])
def test_on_full_values(on_full, x, store):
    with pytest.raises(ValueError, match="on_full must be one of"):
        buddy.compress(x, on_full=on_full, store=store)


# ids with "backend=": a bare "gpu" id would read as the gpu marker and skip the test without CUDA
@pytest.mark.parametrize("backend", ["gpu", "", "CUDA", "Reference", 1, 1.0], ids=lambda b: f"backend={b!r}")
def test_backend_values(backend, x, store):
    with pytest.raises(ValueError, match="backend must be one of"):
        buddy.compress(x, backend=backend, store=store)


def test_cuda_backend_for_a_cpu_tensor_says_what_to_use(x, store):
    with pytest.raises(ValueError, match="backend='reference' or 'auto'"):
        buddy.compress(x, backend="cuda", store=store)


@pytest.mark.parametrize("max_overflow", [math.nan, math.inf, -math.inf, 2, -1e-12, 1 + 1e-12])
@pytest.mark.parametrize("ratio", [None, 2.0])
def test_max_overflow_values(max_overflow, ratio, x, store):
    """Checked even when ``target_ratio`` is given (it used to be silently ignored then)."""
    with pytest.raises(ValueError, match=r"max_overflow must be a fraction in \[0, 1\]"):
        buddy.compress(x, ratio, max_overflow=max_overflow, store=store)


@pytest.mark.parametrize("max_overflow", ["0.1", True, [0.1], torch.tensor(0.1)])
@pytest.mark.parametrize("ratio", [None, 2.0])
def test_max_overflow_types(max_overflow, ratio, x, store):
    """``True`` used to mean 1.0 and strings gave a bare ``'<=' not supported`` message."""
    with pytest.raises(TypeError, match="max_overflow must be a number"):
        buddy.compress(x, ratio, max_overflow=max_overflow, store=store)


@pytest.mark.parametrize("max_overflow", [0, 1, 0.0, 1.0, 0.5])
def test_max_overflow_bounds_are_allowed(max_overflow, x, store):
    with buddy.compress(x, max_overflow=max_overflow, store=store) as bt:
        assert bt.buddy_bytes <= max_overflow * bt.original_bytes
        assert_roundtrip(bt, x)


@pytest.mark.parametrize("bad", ["store", object(), buddy.BuddyStore, 0])
def test_store_type(bad, x):
    with pytest.raises(TypeError, match="store must be a buddy.BuddyStore"):
        buddy.compress(x, store=bad)


@pytest.mark.parametrize("bad", ["slot", 2.0, [2], None, True, -1, 5])
def test_pack_slot_must_be_an_int_in_range(bad, x, store):
    with pytest.raises(ValueError, match="slot must be an int in"):
        buddy.pack(buddy.measure(x), bad, store=store)
    assert _held(store) == (0, 0, 0)


@pytest.mark.parametrize("bad", [None, "measured", 3])
def test_pack_takes_what_measure_returns(bad, x, store):
    with pytest.raises(TypeError, match="what buddy.measure returns"):
        buddy.pack(bad, 2, store=store)
    with pytest.raises(TypeError, match="what buddy.measure returns"):
        buddy.pack(x, 2, store=store)


@pytest.mark.parametrize("bad", [1, 0, "yes", 1.0, torch.tensor(True)])
def test_checksum_switch_is_a_bool(bad, x, store):
    with pytest.raises(TypeError, match="checksum must be True or False"):
        buddy.compress(x, checksum=bad, store=store)
    with pytest.raises(TypeError, match="checksum must be True or False"):
        buddy.pack(buddy.measure(x), 2, checksum=bad, store=store)
    with pytest.raises(TypeError, match="checksum must be True or False"):
        buddy.set_defaults(checksum=bad)
    assert buddy.defaults().checksum is False


def test_set_defaults_is_all_or_nothing():
    before = buddy.defaults()
    for bad in (dict(codec="auto", entry_bytes=48), dict(backend="gpu", codec="raw"), dict(checksum=1, codec="raw")):
        with pytest.raises((TypeError, ValueError)):
            buddy.set_defaults(**bad)
        assert buddy.defaults() == before


def test_verify_without_checksum_says_how_to_get_one(x, store):
    with buddy.compress(x, 2.0, store=store) as bt:
        with pytest.raises(ValueError, match="checksum=True"):
            bt.verify()
    with pytest.raises(buddy.FreedTensorError):
        bt.verify()


# ---------------------------------------------------------------------------
# unpack's arguments
# ---------------------------------------------------------------------------
@pytest.fixture
def packed(x, store):
    bt = buddy.compress(x.view(25, 40), 4.0, "zvc", entry_bytes=128, store=store)
    bufs = tuple(b.clone() for b in bt.buffers())
    args = dict(codec="zvc", entry_bytes=128, slot_sectors=1, shape=(25, 40), dtype=torch.float32)
    assert_bitexact(buddy.unpack(*bufs, **args), x.view(25, 40))
    yield bufs, args
    bt.free()


@pytest.mark.parametrize("which", [0, 1, 2], ids=["meta", "slots", "overflow"])
@pytest.mark.parametrize("bad", [None, [0, 1], b"\x00"], ids=["None", "list", "bytes"])
def test_unpack_buffers_must_be_tensors(packed, which, bad):
    bufs, args = packed
    bufs = list(bufs)
    bufs[which] = bad
    with pytest.raises(TypeError, match="must be a torch.Tensor of uint8 bytes"):
        buddy.unpack(*bufs, **args)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["meta", "slots", "overflow"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.float32, torch.bool])
def test_unpack_buffers_must_be_bytes(packed, which, dtype):
    """A slots buffer of int32 with the right element count used to be accepted and converted."""
    bufs, args = packed
    bufs = list(bufs)
    bufs[which] = bufs[which].to(dtype)
    with pytest.raises(buddy.CorruptDataError, match="uint8"):
        buddy.unpack(*bufs, **args)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["meta", "slots", "overflow"])
def test_unpack_buffers_on_the_meta_device(packed, which):
    bufs, args = packed
    bufs = list(bufs)
    bufs[which] = bufs[which].to("meta")
    with pytest.raises(ValueError, match="meta device"):
        buddy.unpack(*bufs, **args)


def test_unpack_accepts_any_shape_of_buffer(packed):
    bufs, args = packed
    meta, slots, overflow = bufs
    out = buddy.unpack(meta.view(-1, 1), slots.view(-1, 32), overflow.view(-1, 32), **args)
    assert_bitexact(out, buddy.unpack(*bufs, **args))


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(shape=(-1, 1000)), ValueError, "negative"),
        (dict(shape="25x40"), TypeError, "sequence of ints"),
        (dict(shape=None), TypeError, "sequence of ints"),
        (dict(shape=(25.0, 40)), TypeError, "ints"),
        (dict(shape=(True, 1000)), TypeError, "ints"),
        (dict(dtype="float32"), TypeError, "torch.dtype"),
        (dict(dtype=torch.qint8), ValueError, "quantized"),
        (dict(stride=(1,)), ValueError, "one int per dimension"),
        (dict(stride=(40, 1.0)), ValueError, "one int per dimension"),
        (dict(stride=(40, 2)), ValueError, "not a dense layout"),
        (dict(stride="ab"), TypeError, "sequence of ints"),
        (dict(codec=""), ValueError, "unknown codec"),
        (dict(backend="gpu"), ValueError, "backend"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unpack_argument_errors(packed, change, error, match):
    bufs, args = packed
    with pytest.raises(error, match=match):
        buddy.unpack(*bufs, **{**args, **change})


def test_unpack_of_a_different_shape_is_corrupt(packed):
    bufs, args = packed
    for shape in ((25, 41), (0,), (1,), ()):
        with pytest.raises(buddy.CorruptDataError):
            buddy.unpack(*bufs, **{**args, "shape": shape})


# ---------------------------------------------------------------------------
# anything at all: a specific error or a correct result, never a crash
# ---------------------------------------------------------------------------
_JUNK = [None, True, 0, -1, 3, 48, 128, 1.5, math.nan, math.inf, -math.inf, "", "zvc", "x", b"", [], (), object()]

_ARGS = {
    "target_ratio": st.sampled_from(_JUNK + [1, 2.0, 4 / 3, math.inf, 1e9]),
    "codec": st.sampled_from(_JUNK + CODECS),
    "entry_bytes": st.sampled_from(_JUNK + [32, 64, 256, 4096]),
    "max_overflow": st.sampled_from(_JUNK + [0.0, 0.1, 1.0]),
    "on_full": st.sampled_from(_JUNK + ["raise", "device"]),
    "backend": st.sampled_from(_JUNK + ["auto", "reference", "cuda"]),
    "checksum": st.sampled_from(_JUNK + [False]),
}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: per argument of compress, whether a value is one it takes (None: its default)
_VALID = {
    "target_ratio": lambda v: v is None or (_number(v) and v >= 1),
    "codec": lambda v: v is None or v in CODECS,
    "entry_bytes": lambda v: v is None or (type(v) is int and 32 <= v <= 65536 and not v & (v - 1)),
    "max_overflow": lambda v: v is None or (_number(v) and 0 <= v <= 1),
    "on_full": lambda v: v in ("raise", "device"),
    "backend": lambda v: v in (None, "auto", "reference") or (v == "cuda" and torch.cuda.is_available()),
    "checksum": lambda v: v is None or type(v) is bool,
}


@fuzz_settings(1.0)
@given(kwargs=st.fixed_dictionaries({}, optional=_ARGS), seed=st.integers(0, 2**16))
def test_any_arguments_give_a_result_or_a_specific_error(kwargs, seed):
    """Junk in any combination of arguments: ``TypeError``/``ValueError`` (buddy's errors are those too)."""
    store = buddy.BuddyStore(capacity_bytes=1 << 20, block_bytes=1 << 16, pin=False)
    t = make_data("relu", 300, torch.float32, torch.Generator().manual_seed(seed))
    valid = all(_VALID[name](value) for name, value in kwargs.items())
    valid = valid and not (kwargs.get("target_ratio") is not None and kwargs.get("max_overflow") is not None)
    if not valid:
        with pytest.raises((TypeError, ValueError)) as caught:
            buddy.compress(t, store=store, **kwargs)
        assert str(caught.value), "an error must say what is wrong"
    else:  # every argument is one compress takes: a result, bit-exact
        bt = buddy.compress(t, store=store, **kwargs)
        try:
            assert_roundtrip(bt, t)
        finally:
            bt.free()
    assert _held(store) == (0, 0, 0)
