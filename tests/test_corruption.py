"""Damaged and hostile buffers, for every registered codec.

With a checksum (``compress(..., checksum=True)``) any change to the
metadata, the slots or the overflow raises :class:`buddy.CorruptDataError`
before anything is decoded. Without one, ``decompress``/``unpack`` of damaged
buffers never crashes, hangs or reads out of bounds: it raises
``CorruptDataError`` or returns a tensor of the right shape, dtype and device
(possibly with wrong values -- that is what the checksum is for). Buffers of
the wrong size always raise ``CorruptDataError``.

Hypothesis settings come from the fuzz profiles in ``tests/conftest.py``
(``BUDDY_FUZZ_PROFILE=long`` for the long run).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitexact, fuzz_settings, make_data
from hypothesis import assume, event, given
from hypothesis import strategies as st

import buddy
from buddy import format as layout
from buddy import integrity, spec
from buddy.integrity import PRIME

try:  # the codecs that run on the CPU (nvcomp's need a GPU)
    CODECS = buddy.available_codecs("cpu")
except TypeError:  # a buddy whose available_codecs() takes no device
    CODECS = buddy.available_codecs()
BUFFERS = ("meta", "slots", "overflow")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.complex64]


def _store() -> buddy.BuddyStore:
    return buddy.BuddyStore(capacity_bytes=64 << 20, block_bytes=1 << 16, pin=False)


def _reference_checksum(data: bytes) -> int:
    """The checksum as :mod:`buddy.integrity` defines it, in plain Python."""
    n = len(data)
    if n % 2:
        data += b"\0"
    halves = [int.from_bytes(data[i : i + 2], "little", signed=True) for i in range(0, len(data), 2)]
    a = (n + sum(halves)) % (1 << 32)
    b = sum((i + 1) * x for i, x in enumerate(halves)) % PRIME
    return b << 32 | a


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# ---------------------------------------------------------------------------
# the checksum itself
# ---------------------------------------------------------------------------
@fuzz_settings(0.5)
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 1500), max_size=6))
def test_checksum_is_the_specified_function(data, cuts):
    """Batched torch ops give the plain-Python definition, whole or in even pieces."""
    buf = _tensor(data)
    expected = _reference_checksum(data)
    assert integrity.buffer_checksum(buf) == expected
    assert 0 <= expected < 1 << 63
    acc, start = integrity.Accumulator(), 0
    for cut in sorted({2 * c for c in cuts if 0 < 2 * c < len(data)}):
        acc.add(buf[start:cut])
        start = cut
    assert acc.add(buf[start:]).value() == expected
    if len(data) > 1:  # a view at an odd storage offset is read correctly too
        assert integrity.buffer_checksum(buf[1:]) == _reference_checksum(data[1:])


@fuzz_settings(1.0)
@given(
    size=st.sampled_from([1, 2, 3, 31, 64, 1000, 131_072 + 7, 400_001]),
    seed=st.integers(0, 2**32 - 1),
    i=st.integers(0, 10**6),
    j=st.integers(0, 10**6),
    value=st.integers(1, 255),
)
def test_checksum_catches_any_byte_change_and_any_swap(size, seed, i, j, value):
    """The guarantees of :mod:`buddy.integrity`: one changed byte, or two different bytes swapped."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)
    if size > 10_000:
        buf[::3] = 0  # runs of zeros, as in metadata and slots
    i, j = i % size, j % size
    before = integrity.buffer_checksum(buf)
    changed = buf.clone()
    changed[i] ^= value  # value != 0: the byte really changes
    assert integrity.buffer_checksum(changed) != before
    if i == j:
        return  # no swap to make
    if int(buf[i]) == int(buf[j]):
        buf[j] ^= value  # make the two bytes differ, so the swap below is a change
        before = integrity.buffer_checksum(buf)
    swapped = buf.clone()
    swapped[i], swapped[j] = buf[j], buf[i]
    assert integrity.buffer_checksum(swapped) != before


def test_checksum_sees_length():
    zeros = torch.zeros(64, dtype=torch.uint8)
    sums = {integrity.buffer_checksum(zeros[:n]) for n in range(65)}
    assert len(sums) == 65  # zero bytes added or removed change it


# ---------------------------------------------------------------------------
# damage to the buffers of a real BuddyTensor
# ---------------------------------------------------------------------------
@st.composite
def compressed(draw, codec: str, checksum: bool):
    """``(bt, original, store)``: a tensor compressed with ``codec`` (overflow more often than not)."""
    dtype = draw(st.sampled_from(_DTYPES))
    kind = draw(st.sampled_from(["relu", "special", "random_bytes", "zeros"]))
    numel = draw(st.integers(1, 700))
    e = draw(st.sampled_from([32, 64, 128, 128, 256, 512, 1024]))
    slot = draw(st.integers(0, min(2, e // 32)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    t = make_data(kind, numel, dtype, g)
    store = _store()
    bt = buddy.compress(t, spec.ratio_for_slot(slot, e), codec, entry_bytes=e, store=store, checksum=checksum)
    return bt, t, store


@st.composite
def damage(draw, sizes: dict[str, int]):
    """A list of ``(buffer, kind, position, value)``: changes to non-empty buffers."""
    names = [name for name in BUFFERS if sizes[name]]
    changes = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        kind = draw(st.sampled_from(["bit", "byte", "swap", "sector", "word"]))
        pos = draw(st.integers(0, sizes[name] - 1))
        other = draw(st.integers(0, sizes[name] - 1))
        value = draw(st.integers(1, 255))
        changes.append((name, kind, pos, other, value))
    return changes


def _apply(buffers: dict[str, torch.Tensor], changes) -> None:
    """Damage the buffers in place (they are the BuddyTensor's own memory)."""
    for name, kind, pos, other, value in changes:
        b = buffers[name]
        if kind == "bit":
            b[pos] ^= 1 << (value % 8)
        elif kind == "byte":
            b[pos] ^= value  # a different byte
        elif kind == "swap":
            b[pos], b[other] = int(b[other]), int(b[pos])
        elif kind == "sector":  # a whole sector zeroed, or overwritten by another one
            dst = b[pos // 32 * 32 :][:32]
            src = min(other // 32 * 32, b.numel() - dst.numel())
            dst.copy_(torch.zeros_like(dst) if value % 2 else b[src : src + dst.numel()].clone())
        else:  # a 4-byte word set to a value
            lo = pos // 4 * 4
            b[lo : lo + 4] = value


def _snapshot(bt: buddy.BuddyTensor) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in zip(BUFFERS, bt.buffers())}


def _changed(bt: buddy.BuddyTensor, before: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, b in zip(BUFFERS, bt.buffers()) if not torch.equal(b, before[name])]


def _restore(bt: buddy.BuddyTensor, before: dict[str, torch.Tensor]) -> None:
    for b, name in zip(bt.buffers(), BUFFERS):
        b.copy_(before[name])


def _damage(bt: buddy.BuddyTensor, data) -> dict[str, torch.Tensor]:
    """Damage ``bt``'s buffers as hypothesis draws it; returns their undamaged copies."""
    before = _snapshot(bt)
    sizes = {name: b.numel() for name, b in before.items()}
    assume(any(sizes.values()))
    _apply(dict(zip(BUFFERS, bt.buffers())), data.draw(damage(sizes), label="damage"))
    return before


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(0.3)
@given(data=st.data())
def test_damage_with_checksum_always_raises(codec, data):
    bt, t, store = data.draw(compressed(codec, checksum=True), label="compressed")
    try:
        before = _damage(bt, data)
        changed = _changed(bt, before)
        assume(changed)  # a swap of equal bytes, or a sector copied onto itself, changes nothing
        with pytest.raises(buddy.CorruptDataError) as info:
            bt.decompress()
        named = str(info.value).split(":")[0]  # "checksum mismatch in the ... and the ..."
        for name in BUFFERS:
            assert ({"meta": "metadata", "slots": "slots", "overflow": "overflow"}[name] in named) == (name in changed)
        with pytest.raises(buddy.CorruptDataError):
            bt.verify()
        _restore(bt, before)  # undamaged again: decodes and verifies
        bt.verify()
        assert_bitexact(bt.decompress(), t)
    finally:
        bt.free()
    assert store.stats().buddy_bytes_held == 0 and buddy.ledger.default_ledger().tensors_held == 0


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(0.3)
@given(data=st.data())
def test_damage_without_checksum_never_crashes(codec, data):
    bt, t, store = data.draw(compressed(codec, checksum=False), label="compressed")
    try:
        before = _damage(bt, data)
        try:
            out = bt.decompress()
        except buddy.CorruptDataError:
            event("damage detected by the format")
        else:
            event("decoded (values may differ)")
            assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device
        with pytest.raises(ValueError, match="without a checksum"):
            bt.verify()
        _restore(bt, before)
        assert_bitexact(bt.decompress(), t)
    finally:
        bt.free()
    assert store.stats().buddy_bytes_held == 0 and buddy.ledger.default_ledger().tensors_held == 0


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(0.3)
@given(data=st.data())
def test_hostile_buffers(codec, data):
    """Metadata, slots and overflow made up from scratch, with sizes that agree: no crash, no hang."""
    dtype = data.draw(st.sampled_from(_DTYPES), label="dtype")
    numel = data.draw(st.integers(0, 400), label="numel")
    e = data.draw(st.sampled_from([32, 64, 128, 256, 512, 2048]), label="entry_bytes")
    spe = e // 32
    slot = data.draw(st.integers(0, spe), label="slot")
    n = -(-numel * torch.empty((), dtype=dtype).element_size() // e)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    if data.draw(st.booleans(), label="meta from legal fields"):
        k = torch.randint(0, spe + 1, (n,), generator=g, dtype=torch.int32)
        modes = torch.randint(0, 16, (n,), generator=g, dtype=torch.int32)
        if data.draw(st.booleans(), label="modes this codec writes"):
            allowed = torch.tensor(sorted(buddy.get_codec(codec).modes), dtype=torch.int32)
            modes = allowed[modes % allowed.numel()]
        meta = layout.encode_meta(k, modes, e)
    else:
        meta = torch.randint(0, 256, (n * spec.meta_bytes(e),), generator=g, dtype=torch.uint8)
    try:
        k, _ = layout.decode_meta(meta, e, n)
        spill = int(torch.clamp(k - slot, min=0).sum())
    except buddy.CorruptDataError:
        spill = data.draw(st.integers(0, 4), label="overflow sectors")
    density = data.draw(st.sampled_from([0, 1, 2, 8]), label="zero every")
    slots = torch.randint(0, 256, (n * slot * 32,), generator=g, dtype=torch.uint8)
    overflow = torch.randint(0, 256, (spill * 32,), generator=g, dtype=torch.uint8)
    if density:
        slots[::density] = 0
        overflow[::density] = 0
    args = dict(codec=codec, entry_bytes=e, slot_sectors=slot, shape=(numel,), dtype=dtype)
    try:
        out = buddy.unpack(meta, slots, overflow, **args)
    except buddy.CorruptDataError:
        event("rejected")
        return
    event("decoded")
    assert out.shape == (numel,) and out.dtype == dtype


@st.composite
def resized(draw, sizes: dict[str, int]):
    """``(buffer, delta)``: a buffer made shorter or longer by ``delta != 0`` bytes."""
    name = draw(st.sampled_from(BUFFERS))
    longer = st.integers(1, 64)
    if sizes[name] == 0:
        return name, draw(longer)
    return name, draw(st.one_of(longer, st.integers(-min(64, sizes[name]), -1)))


@pytest.mark.parametrize("codec", CODECS, ids=[f"codec={c}" for c in CODECS])
@fuzz_settings(0.3)
@given(data=st.data())
def test_truncated_or_extended_buffers_raise(codec, data):
    bt, t, store = data.draw(compressed(codec, checksum=False), label="compressed")
    try:
        bufs = _snapshot(bt)
        name, delta = data.draw(resized({k: b.numel() for k, b in bufs.items()}), label="resize")
        b = bufs[name]
        bufs[name] = b[: b.numel() + delta] if delta < 0 else torch.cat([b, b.new_zeros(delta)])
        args = dict(
            codec=codec, entry_bytes=bt.entry_bytes, slot_sectors=bt.slot_sectors, shape=bt.shape, dtype=bt.dtype
        )
        with pytest.raises(buddy.CorruptDataError):
            buddy.unpack(*bufs.values(), **args)
        sums = integrity.checksums(*bt.buffers())
        with pytest.raises(buddy.CorruptDataError):  # with a checksum: the checksum or the size catches it
            buddy.unpack(*bufs.values(), **args, checksum=sums)
    finally:
        bt.free()


# ---------------------------------------------------------------------------
# a few cases by hand
# ---------------------------------------------------------------------------
def test_checksum_defaults_and_switch(gen):
    store = _store()
    t = make_data("relu", 5000, torch.float32, gen)
    with buddy.compress(t, 4.0, store=store) as bt:
        assert bt.checksum is None
    previous = buddy.set_defaults(checksum=True)
    try:
        assert buddy.defaults().checksum is True
        with buddy.compress(t, 4.0, store=store) as bt:
            assert isinstance(bt.checksum, integrity.Checksum)
            assert bt.checksum == integrity.checksums(*bt.buffers())
            bt.verify()
        with buddy.compress(t, 4.0, store=store, checksum=False) as bt:  # an explicit argument wins
            assert bt.checksum is None
    finally:
        buddy.set_defaults(checksum=previous.checksum)
    assert buddy.defaults().checksum is False


def test_checksum_error_names_the_buffer_and_what_to_do(gen):
    t = make_data("relu", 5000, torch.float32, gen)
    with buddy.compress(t, 4.0, "zvc", entry_bytes=128, store=_store(), checksum=True) as bt:
        meta, slots, overflow = bt.buffers()
        assert overflow.numel() > 0
        overflow[-1] ^= 0x10
        with pytest.raises(buddy.CorruptDataError) as info:
            bt.decompress()
        msg = str(info.value)
        assert "overflow" in msg and "buddy memory" in msg and "metadata" not in msg.split("expected")[0]
        assert "recompute" in msg or "compress it again" in msg
        overflow[-1] ^= 0x10
        slots[0] ^= 1
        meta[0] ^= 1
        with pytest.raises(buddy.CorruptDataError, match="metadata .* and the slots"):
            bt.decompress()


def test_checksum_of_an_empty_and_a_zero_slot_tensor():
    store = _store()
    for t, ratio in ((torch.empty(0), 2.0), (torch.zeros(0, 3), float("inf")), (torch.ones(100), float("inf"))):
        with buddy.compress(t, ratio, store=store, checksum=True) as bt:
            bt.verify()
            assert_bitexact(bt.decompress(), t)


def test_unpack_with_a_wrong_checksum_type(gen):
    t = make_data("relu", 500, torch.float32, gen)
    with buddy.compress(t, 2.0, "zvc", entry_bytes=128, store=_store(), checksum=True) as bt:
        with pytest.raises(TypeError):
            buddy.unpack(
                *bt.buffers(),
                codec="zvc",
                entry_bytes=128,
                slot_sectors=2,
                shape=t.shape,
                dtype=t.dtype,
                checksum=tuple(bt.checksum)[:2],
            )
