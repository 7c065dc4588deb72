"""Property-based fuzzing of compress/decompress and pack/unpack, for every registered codec.

Hypothesis draws the dtype (every dtype buddy stores: bool, all int and uint
widths, the sub-byte ints, every float including float8/float4, complex, the
``bits`` types), the shape (0-size and 1-element included), the layout
(contiguous, offset into a larger storage, permuted, sliced with steps,
narrowed, expanded, arbitrary ``as_strided`` with overlaps), values with
structure (runs of zeros, repeated words, NaNs with payloads, signed zeros,
denormals, infinities, extreme exponents, random bytes), the entry size
(powers of two 32..65536, large ones rare) and how the slot is chosen (every
slot, odd target ratios, ``max_overflow``, ``pack``'s callback, stores so
small that the overflow does not fit). Every check compares raw bytes, and
every example frees what it compressed: the store's accounting is back at
zero afterwards.

Profiles (see ``tests/conftest.py``): "ci" by default -- quick and
derandomized: per codec 100 examples of the round trip and 20 of each other
test (about 20 s on 2 cores). The long profile draws new examples on every
run, 50 times as many: 35,000 here and 37,500 in test_corruption.py, about
25 minutes on 2 cores::

    BUDDY_FUZZ_PROFILE=long python -m pytest -q tests/test_fuzz.py tests/test_corruption.py

A failure prints a ``@reproduce_failure`` blob that replays it.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import _float_specials, assert_bitexact, assert_roundtrip, fuzz_settings, held, raw_bytes, unpack_like
from hypothesis import given
from hypothesis import strategies as st

import buddy
from buddy import integrity, spec
from buddy.slots import overflow_sectors, slot_for_overflow, tightest_slot

try:  # the codecs that run on the CPU (nvcomp's need a GPU)
    CODECS = buddy.available_codecs("cpu")
except TypeError:  # a buddy whose available_codecs() takes no device
    CODECS = buddy.available_codecs()

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def _supported_dtypes() -> list[torch.dtype]:
    """Every dtype of this torch that buddy stores (quantized dtypes are the only ones refused)."""
    found = {}
    for name in sorted(dir(torch)):
        dtype = getattr(torch, name)
        if isinstance(dtype, torch.dtype) and dtype not in found.values():
            try:
                spec.word_bytes(dtype)
            except ValueError:
                continue
            found[name] = dtype
    return list(found.values())


DTYPES = _supported_dtypes()
# the sub-byte ints (uint1..uint7, int1..int7) behave alike: a few of them are enough for speed
_SUB_BYTE = [d for d in DTYPES if re.fullmatch(r"torch\.u?int[1-7]", str(d))]
FUZZ_DTYPES = [d for d in DTYPES if d not in _SUB_BYTE] + _SUB_BYTE[:: max(1, len(_SUB_BYTE) // 3)]


# drawn more often than the rest: what activations and indices are made of
_COMMON_DTYPES = [d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64) if d in DTYPES]
_COMMON_DTYPES += [d for d in (torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64) if d in DTYPES]


def test_every_dtype_of_the_brief_is_fuzzed():
    names = {str(d).replace("torch.", "") for d in FUZZ_DTYPES}
    required = {"bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"}
    required |= {"complex64", "complex128"}
    required |= {n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)}
    assert required <= names, required - names
    for quantized in ("qint8", "quint8", "qint32"):
        assert quantized not in names


# ---------------------------------------------------------------------------
# values with structure
# ---------------------------------------------------------------------------
_COMPONENT = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _element_bytes(values: list[int], size: int) -> torch.Tensor:
    """Unsigned bit patterns -> ``(len, size)`` little-endian bytes."""
    rows = [[(v >> (8 * i)) & 0xFF for i in range(size)] for v in values]
    return torch.tensor(rows, dtype=torch.uint8).view(len(values), size)


def _patterns(dtype: torch.dtype) -> torch.Tensor:
    """``(P, element_size)`` bytes of the awkward values of ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return torch.tensor([[0], [1]], dtype=torch.uint8)
    if dtype in _COMPONENT:
        part = _patterns(_COMPONENT[dtype])
        pick = torch.arange(part.shape[0])
        re, im = part[pick], part[pick.roll(3)]
        return torch.cat([torch.cat([re, im], 1), torch.cat([im, re], 1)])
    bits = 8 * size
    top = 1 << (bits - 1)
    # byte-level extremes, meaningful for every dtype: 0, all ones, sign bit, max signed, one
    rows = [0, (1 << bits) - 1, top, top - 1, 1, top | 1]
    if dtype.is_floating_point:
        try:
            rows += _float_specials(dtype)  # NaNs with payloads, +-inf, -0.0, denormals
        except (TypeError, ValueError, NotImplementedError):
            pass
        try:
            fi = torch.finfo(dtype)
            values = [fi.max, -fi.max, fi.tiny, -fi.tiny, fi.eps, 1.0, -1.0, math.inf, -math.inf, math.nan]
            extreme = torch.tensor(values, dtype=torch.float64).to(dtype)
            rows += [int(v) % (1 << bits) for v in _as_signed_ints(extreme).tolist()]
        except (TypeError, RuntimeError, NotImplementedError):
            pass  # float4 and the like: the byte patterns above will do
    return _element_bytes(rows, size)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_signed_ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


_KINDS = ("zeros", "repeat", "special", "random", "small", "ones")


@st.composite
def element_bytes(draw, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` as ``(numel, size)`` bytes, in up to 16 runs of one kind each.

    Hypothesis picks the kinds; the run boundaries and random bytes come from
    a generator it seeds (a draw per element would overrun its buffer).
    """
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    kinds = [draw(st.sampled_from(_KINDS)) for _ in range(draw(st.integers(1, 16)) if numel else 0)]
    cuts = sorted(torch.randint(0, numel + 1, (max(len(kinds) - 1, 0),), generator=g).tolist())
    patterns = _patterns(dtype)
    parts = []
    for kind, lo, hi in zip(kinds, [0, *cuts], [*cuts, numel]):
        n = hi - lo
        if kind == "zeros":
            part = torch.zeros(n, size, dtype=torch.uint8)
        elif kind == "repeat":  # one word, repeated: bpc's deltas and fpx's exponents see a flat line
            part = torch.randint(0, 256, (1, size), generator=g, dtype=torch.uint8).expand(n, size)
        elif kind == "special":
            part = patterns[torch.randint(0, patterns.shape[0], (n,), generator=g)]
        elif kind == "small":  # small integers: low byte only
            part = torch.zeros(n, size, dtype=torch.uint8)
            part[:, 0] = torch.randint(0, 8, (n,), generator=g, dtype=torch.uint8)
        elif kind == "ones":
            part = torch.full((n, size), 0xFF, dtype=torch.uint8)
        else:
            part = torch.randint(0, 256, (n, size), generator=g, dtype=torch.uint8)
        parts.append(part)
    data = torch.cat(parts) if parts else torch.empty(0, size, dtype=torch.uint8)
    if dtype == torch.bool:
        data = data & 1  # other bytes are not bools
    return data.contiguous()


# ---------------------------------------------------------------------------
# shapes and layouts
# ---------------------------------------------------------------------------
_LAYOUTS = ("contiguous", "offset", "permute", "step", "narrow", "expand", "as_strided")


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return strides[::-1]


@st.composite
def tensors(draw, max_numel: int = 1500):
    """A tensor viewing a larger storage in one of :data:`_LAYOUTS`, and that storage's bytes."""
    dtype = draw(st.sampled_from(_COMMON_DTYPES * 3 + FUZZ_DTYPES))
    layout = draw(st.sampled_from(_LAYOUTS))
    size = draw(st.sampled_from(["medium", "small", "medium", "large", "medium", "large", "one", "empty"]))
    if size == "empty":
        shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
        shape[draw(st.integers(0, len(shape) - 1))] = 0
    elif size == "one":
        shape = [1] * draw(st.integers(0, 4))
    else:
        limit = {"small": 16, "medium": 300, "large": max_numel}[size]
        ndim = draw(st.integers(2 if layout == "permute" else 1, 4))
        cap = max(2, round(limit ** (1 / ndim)))
        shape = [draw(st.integers(2, cap)) for _ in range(ndim)]
        if draw(st.booleans()):  # a size-1 dimension somewhere: its stride is free
            shape.insert(draw(st.integers(0, ndim)), 1)
    offset = draw(st.integers(0, 9)) if layout != "contiguous" else 0

    # the view as (sizes, strides) into a storage of `span` elements from `offset`
    if layout == "step":
        steps = [draw(st.integers(1, 3)) for _ in shape]
        big = [n * s for n, s in zip(shape, steps)]
        strides = [st_ * s for st_, s in zip(_contiguous_strides(big), steps)]
    elif layout == "narrow" and shape:
        dim = draw(st.integers(0, len(shape) - 1))
        extra = draw(st.integers(1, 4))
        start = draw(st.integers(0, extra))
        big = list(shape)
        big[dim] += extra
        strides = _contiguous_strides(big)
        offset += start * strides[dim]
    elif layout == "expand" and shape:
        expanded = [draw(st.booleans()) for _ in shape]
        base = [1 if e else n for n, e in zip(shape, expanded)]
        strides = [0 if e else s for e, s in zip(expanded, _contiguous_strides(base))]
    elif layout == "as_strided":
        strides = [draw(st.integers(0, 12)) for _ in shape]
    else:
        strides = _contiguous_strides(shape)
    span = 0 if 0 in shape else offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    span = max(span, offset) + draw(st.integers(0, 5))  # storage may run past the view

    storage = draw(element_bytes(dtype, span)).view(-1).view(dtype)
    t = storage.as_strided(shape, strides, offset)
    if layout == "permute" and t.dim() >= 2:
        order = draw(st.permutations(range(t.dim())))
        t = t.permute(*(order if order != sorted(order) else order[::-1]))  # never the identity
    return t, storage


# entry sizes: small ones most of the time, the large ones rare (they are slow for bpc/auto)
ENTRY_BYTES = st.sampled_from([32] * 4 + [64] * 4 + [128] * 5 + [256] * 3 + [512, 1024, 2048, 4096, 8192, 16384, 65536])


@st.composite
def slot_choices(draw, entry_bytes: int):
    """How the slot is chosen: ``(mode, value)``."""
    spe = entry_bytes // spec.SECTOR_BYTES
    mode = draw(st.sampled_from(["slot", "slot", "ratio", "max_overflow", "pack"]))
    if mode in ("slot", "pack"):
        # the small slots (lots of overflow) twice as often
        return mode, draw(st.one_of(st.integers(0, min(2, spe)), st.integers(0, spe)))
    if mode == "ratio":
        return mode, draw(
            st.one_of(
                st.floats(1.0, 64.0, allow_nan=False),
                st.sampled_from([1, 4 / 3, 1.33, 2, 3, 4, 1e9, 2**70, math.inf]),
            )
        )
    return mode, draw(st.floats(0.0, 1.0, allow_nan=False))


def _new_store(capacity: int | None = None) -> buddy.BuddyStore:
    return buddy.BuddyStore(capacity_bytes=64 << 20 if capacity is None else capacity, block_bytes=1 << 16, pin=False)


def _assert_store_empty(store: buddy.BuddyStore) -> None:
    assert held(store) == (0, 0, 0), (store.stats(), buddy.ledger.default_ledger().stats())


def _check_format(bt: buddy.BuddyTensor, nbytes: int) -> None:
    """Sizes of the three buffers agree with the histogram and the spec."""
    e, s = bt.entry_bytes, bt.slot_sectors
    n = -(-nbytes // e)
    assert bt.original_bytes == nbytes and bt.n_entries == n
    assert sum(bt.histogram) == n and len(bt.histogram) == e // 32 + 1
    meta, slots, overflow = bt.buffers()
    assert meta.numel() == n * spec.meta_bytes(e) and meta.dtype == torch.uint8
    assert slots.numel() == n * s * spec.SECTOR_BYTES
    assert overflow.numel() == bt.buddy_bytes == overflow_sectors(bt.histogram, s) * spec.SECTOR_BYTES
    assert bt.device_bytes == meta.numel() + slots.numel() + (0 if bt.table is None else bt.table.numel())
    assert bt.compressed_bytes == sum(k * c for k, c in enumerate(bt.histogram)) * spec.SECTOR_BYTES


def _check_unpack(bt: buddy.BuddyTensor, original: torch.Tensor) -> None:
    """``unpack`` of copies of the buffers, cut to exactly their sizes, gives the same bytes."""
    meta, slots, overflow = (b.clone() for b in bt.buffers())
    # the bytes are in the memory order of bt's strides
    out = unpack_like(bt, meta, slots, overflow, stride=bt.stride, checksum=bt.checksum)
    assert_bitexact(out, original)


# ---------------------------------------------------------------------------
# the fuzz tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(1.0)
@given(data=st.data())
def test_fuzz_roundtrip(codec, data):
    t, storage = data.draw(tensors(), label="tensor")
    e = data.draw(ENTRY_BYTES, label="entry_bytes")
    mode, value = data.draw(slot_choices(e), label="slot choice")
    checksum = data.draw(st.booleans(), label="checksum")
    before = raw_bytes(storage).clone()
    nbytes = t.numel() * t.element_size()
    store = _new_store()
    seen = []

    if mode == "pack":
        measured = buddy.measure(t, codec, entry_bytes=e)
        seen.append(list(measured.histogram))
        bt = buddy.pack(measured, value, store=store, checksum=checksum)
    elif mode == "max_overflow":
        bt = buddy.compress(t, codec=codec, entry_bytes=e, max_overflow=value, store=store, checksum=checksum)
    else:
        ratio = spec.ratio_for_slot(value, e) if mode == "slot" else value
        bt = buddy.compress(t, ratio, codec, entry_bytes=e, store=store, checksum=checksum)
    try:
        assert torch.equal(raw_bytes(storage), before), "compress changed its input"
        assert bt.codec == codec and bt.entry_bytes == e and bt.dtype == t.dtype and bt.shape == t.shape
        if mode in ("slot", "pack"):
            assert bt.slot_sectors == value
        elif mode == "ratio":
            assert bt.slot_sectors == spec.slot_for_ratio(value, e)
            assert (bt.slot_sectors == 0) == (value == math.inf)
        else:
            assert bt.slot_sectors == slot_for_overflow(bt.histogram, value, nbytes)
            assert bt.buddy_bytes <= value * nbytes
        if mode == "pack":
            assert seen == [list(bt.histogram)]
        _check_format(bt, nbytes)
        assert (bt.checksum is not None) == checksum
        if checksum:
            bt.verify()
        assert store.stats().buddy_bytes_held >= bt.buddy_bytes
        assert_roundtrip(bt, t)
        _check_unpack(bt, t)
    finally:
        bt.free()
    _assert_store_empty(store)


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(0.2)
@given(data=st.data())
def test_fuzz_small_store(codec, data):
    """A store too small for the overflow: ``on_full="raise"`` leaves nothing behind, ``"device"`` keeps it whole."""
    t, _ = data.draw(tensors(max_numel=600), label="tensor")
    e = data.draw(st.sampled_from([32, 64, 128, 256, 512]), label="entry_bytes")
    slot = data.draw(st.integers(0, min(2, e // 32)), label="slot")
    capacity = data.draw(st.sampled_from([0, 32, 64, 96, 256, 1024]), label="capacity")
    on_full = data.draw(st.sampled_from(["raise", "device"]), label="on_full")
    store = _new_store(capacity)
    ratio = spec.ratio_for_slot(slot, e)
    needed = overflow_sectors(buddy.size_histogram(t, codec, entry_bytes=e), slot) * spec.SECTOR_BYTES
    fits = needed <= capacity
    if not fits and on_full == "raise":
        with pytest.raises(buddy.HostStoreFull):
            buddy.compress(t, ratio, codec, entry_bytes=e, store=store, on_full=on_full)
        _assert_store_empty(store)
        return
    bt = buddy.compress(t, ratio, codec, entry_bytes=e, store=store, on_full=on_full)
    try:
        if fits:
            assert bt.slot_sectors == slot and bt.buddy_bytes == needed
        else:
            assert bt.slot_sectors == tightest_slot(bt.histogram) and bt.buddy_bytes == 0
        _check_format(bt, t.numel() * t.element_size())
        assert_roundtrip(bt, t)
    finally:
        bt.free()
    _assert_store_empty(store)


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(0.2)
@given(data=st.data())
def test_fuzz_many_chunks(codec, data):
    """Tiny chunks (and checksum steps): every chunk boundary and overflow offset is exercised."""
    t, _ = data.draw(tensors(max_numel=800), label="tensor")
    e = data.draw(st.sampled_from([32, 64, 128, 256]), label="entry_bytes")
    chunk_entries = data.draw(st.integers(1, 5), label="entries per chunk")
    slot = data.draw(st.integers(0, e // 32), label="slot")
    step = data.draw(st.sampled_from([64, 320, 1 << 10]), label="checksum step bytes")
    store = _new_store()
    chunk_bytes, step_bytes = buddy.format.BLOCK_BYTES, integrity.STEP_BYTES
    buddy.format.BLOCK_BYTES, integrity.STEP_BYTES = chunk_entries * e, step
    try:
        bt = buddy.compress(t, spec.ratio_for_slot(slot, e), codec, entry_bytes=e, store=store, checksum=True)
        try:
            buddy.format.BLOCK_BYTES, integrity.STEP_BYTES = chunk_bytes, step_bytes
            whole = integrity.checksums(*bt.buffers(), table=bt.table)  # one piece, the default step
            assert whole == bt.checksum
            _check_format(bt, t.numel() * t.element_size())
            assert_roundtrip(bt, t)
        finally:
            bt.free()
    finally:
        buddy.format.BLOCK_BYTES, integrity.STEP_BYTES = chunk_bytes, step_bytes
    _assert_store_empty(store)


# ---------------------------------------------------------------------------
# what the fuzzing found, pinned down
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.complex64, torch.float64], ids=str)
@pytest.mark.parametrize("chunk_entries", [None, 1], ids=["one-chunk", "many-chunks"])
def test_view_at_an_unaligned_offset(codec, dtype, chunk_entries, monkeypatch):
    """``x[1:]`` starts 2-8 bytes into its storage; bpc and auto view entries as 8-byte words.

    The entries of such a view used to reach the codecs misaligned and raise a
    RuntimeError from ``Tensor.view``; they are copied to aligned memory now.
    """
    if chunk_entries is not None:
        monkeypatch.setattr(buddy.format, "BLOCK_BYTES", 128 * chunk_entries)
    base = torch.arange(1, 8 * 128 + 2, dtype=torch.int64).to(dtype)
    x = base[1:]  # a whole number of 128-byte entries, one element in
    x[::3] = 0
    store = _new_store()
    with buddy.compress(x, 2.0, codec, store=store) as bt:
        assert_roundtrip(bt, x)
    _assert_store_empty(store)


def test_huge_finite_target_ratio_is_not_the_zero_slot():
    """``target_ratio=2**70`` is finite: the most aggressive finite slot (1 sector), never the zero slot."""
    for ratio in (1e300, 2**70, 2**2000, 1e308):
        assert spec.slot_for_ratio(ratio, 128) == 1
    assert spec.slot_for_ratio(math.inf, 128) == 0
