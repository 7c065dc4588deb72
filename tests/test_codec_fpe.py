"""``fpe`` worked by hand: tables, exact payload bits, escapes, damaged streams and tables, learned tables.

Expected streams are strings of bits in stream order (the first character is
bit 0 of payload byte 0). A prefix code is written most significant bit
first, so its bits appear in the string as its binary digits; the other
fields (an escaped symbol, the tail) are LSB-first, as ``field`` makes
them. Most hand-worked streams are in table format 1 (symbols of sign and
exponent), which decoders keep reading; format 2 (a word's top 12 bits, the
serial layout), decoded too, and format 3 (the same symbols in the split
layout: codes first, tails at the end), what fits make, have their own.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitexact, decode, field, make_data, raw_bytes, stream_bytes

import buddy
from buddy.codecs.fpe import (
    MAX_CODE_BITS, MAX_CODED, REFIT_BITS, TABLE_FORMAT, FPECodec, Table, default_table, fit_table, n_symbols,
    symbol_bits, symbol_counts,
)  # fmt: skip
from buddy.errors import CorruptDataError
from buddy.layout import Layout
from buddy.spec import AUTO_MODES

# bfloat16, table format 1: S = 2**9 symbols (sign << 8 | exponent), ZERO = 512, ESC = 513
ZERO, ESC = 512, 513
# table formats 2 and 3 (3: what a fit makes), 2- and 4-byte words: S = 2**12 symbols (a word's top 12 bits)
ZERO2, ESC2 = 4096, 4097


def v1(word_bytes: int, lengths: dict[int, int]) -> Table:
    """A table of format 1 (symbols of sign and exponent)."""
    return Table(word_bytes, lengths, table_format=1)


def top12(sign_exponent: int, mantissa_top: int = 0) -> int:
    """The format-2 symbol of a 2- or 4-byte word: sign and exponent, then the mantissa's top 3 bits."""
    return sign_exponent << 3 | mantissa_top


def bf16(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.bfloat16).view(torch.int16)) & 0xFFFF


def code(table: Table, sym: int) -> str:
    """The code of ``sym`` as stream bits (most significant first)."""
    return f"{table.codes[sym]:0{table.lengths[sym]}b}"


def encode_with(codec: FPECodec, values: torch.Tensor, entry_bytes: int):
    entries = raw_bytes(values).view(-1, entry_bytes)
    w = buddy.spec.word_bytes(values.dtype)
    payload, k, modes = buddy.format.encode(codec, entries, w)
    assert torch.equal(decode(codec, payload, k, modes, w), entries)
    return entries, payload, k, modes


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------
def test_canonical_codes_from_lengths():
    t = v1(2, {127: 1, 126: 2, ZERO: 3, ESC: 3})
    assert t.order == [127, 126, ZERO, ESC]
    assert [code(t, s) for s in t.order] == ["0", "10", "110", "111"]
    # equal lengths: by symbol
    t = Table(2, {ESC2: 2, 5: 2, 3: 2, 2048: 2})
    assert t.order == [3, 5, 2048, ESC2] and [code(t, s) for s in t.order] == ["00", "01", "10", "11"]


def test_symbols_by_table_format():
    assert TABLE_FORMAT == 3
    assert [symbol_bits(w, 1) for w in (1, 2, 4, 8)] == [5, 9, 9, 12]
    assert [symbol_bits(w) for w in (1, 2, 4, 8)] == [8, 12, 12, 12]
    assert [symbol_bits(w, 2) for w in (1, 2, 4, 8)] == [8, 12, 12, 12]
    assert [n_symbols(w) for w in (1, 2, 4, 8)] == [258, 4098, 4098, 4098]
    assert [n_symbols(w, 1) for w in (1, 2, 4, 8)] == [34, 514, 514, 4098]
    with pytest.raises(ValueError, match="formats"):
        symbol_bits(2, 4)


def test_from_counts_is_huffman_and_scale_free():
    counts = torch.zeros(n_symbols(2), dtype=torch.int64)
    a, b, c = top12(127), top12(126, 5), top12(125, 7)
    counts[a], counts[b], counts[c], counts[ZERO2] = 50, 25, 13, 12
    t = Table.from_counts(counts, 2)
    # ESC weighs 1 (no regular symbol escapes): a gets 1 bit, b 2, then c 3 and ZERO and ESC 4
    assert t.lengths == {a: 1, b: 2, c: 3, ZERO2: 4, ESC2: 4} and t.format == 3 and t.split
    assert Table.from_counts(counts * 1000, 2) == t
    assert Table.from_counts(counts.double() / counts.sum(), 2) == t
    # no zero words: no ZERO code
    counts[ZERO2] = 0
    assert ZERO2 not in Table.from_counts(counts, 2).lengths


def test_from_counts_limits_lengths_and_coded_symbols():
    counts = torch.zeros(n_symbols(4), dtype=torch.float64)
    counts[:40] = torch.tensor([2.0**-i for i in range(40)])  # a Huffman code of 40 lengths 1..39
    t = Table.from_counts(counts, 4)
    assert max(t.lengths.values()) == MAX_CODE_BITS
    assert sum(2.0 ** -n for n in t.lengths.values()) <= 1.0
    many = torch.arange(n_symbols(4), 0, -1, dtype=torch.float64)  # every symbol, the first most often
    many[-2:] = 0
    t = Table.from_counts(many, 4)
    assert len(t.lengths) == MAX_CODED + 1  # 255 regular symbols and ESC
    assert all(s < MAX_CODED for s in t.lengths if s != t.esc), "the most frequent symbols keep their codes"


def test_from_counts_rejects_bad_counts():
    for bad in (torch.zeros(10), -torch.ones(n_symbols(2)), torch.full((n_symbols(2),), float("nan"))):
        with pytest.raises(ValueError, match="non-negative"):
            Table.from_counts(bad, 2)
    with pytest.raises(ValueError, match="4098 non-negative"):
        Table.from_counts(torch.ones(n_symbols(2, 1)), 2)  # counts of format-1 symbols
    # no counts at all: a table of ESC alone, which codes everything as an escape
    assert Table.from_counts(torch.zeros(n_symbols(2)), 2).lengths == {ESC2: 1}


@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_table_bytes_round_trip(word):
    g = torch.Generator().manual_seed(word)
    counts = torch.randint(0, 1000, (n_symbols(word),), generator=g)
    t = Table.from_counts(counts, word)
    data = t.to_bytes()
    assert data.dtype == torch.uint8 and data.numel() == 4 + 3 * len(t.order)
    assert data[:2].tolist() == [3, word]
    assert Table.from_bytes(data, word) == t
    serial = Table(word, t.lengths, table_format=2)  # format 2 reads back as format 2
    assert serial.to_bytes()[0] == 2 and Table.from_bytes(serial.to_bytes(), word) == serial != t
    old = v1(word, {0: 1, n_symbols(word, 1) - 1: 1})  # format 1 reads back as format 1
    assert old.to_bytes()[0] == 1 and Table.from_bytes(old.to_bytes(), word) == old
    assert Table.from_bytes(old.to_bytes(), word) != Table(word, {0: 1, n_symbols(word) - 1: 1})


def _bytes(t: Table) -> list[int]:
    return t.to_bytes().tolist()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: [4] + b[1:], "format"),
        (lambda b: [2] + b[1:], "out of range|ESC"),  # format 1's symbols read as format 2's
        (lambda b: b[:-1], "bytes for"),
        (lambda b: b[:4] + b[4:7] + b[4:], "bytes for|twice"),
        (lambda b: b[:6] + [13] + b[7:], "out of range|canonical"),
        (lambda b: b[:6] + [0] + b[7:], "out of range|canonical"),
        (lambda b: b[:4] + [0xFF, 0x7F] + b[6:], "out of range|canonical"),
        (lambda b: b[:4] + b[7:10] + b[4:7] + b[10:], "canonical"),
    ],
    ids=["format", "other-format", "short", "duplicate", "too-long", "zero-length", "symbol", "order"],
)
def test_damaged_tables_are_refused(damage, message):
    t = v1(2, {127: 1, 126: 2, ZERO: 3, ESC: 3})
    bad = torch.tensor(damage(_bytes(t)), dtype=torch.uint8)
    with pytest.raises(CorruptDataError, match=message):
        Table.from_bytes(bad, 2)


def test_tables_that_are_not_codes_are_refused():
    with pytest.raises(CorruptDataError, match="ESC"):
        Table(2, {127: 1})
    with pytest.raises(CorruptDataError, match="prefix code"):
        Table(2, {127: 1, 126: 1, ESC2: 2})
    with pytest.raises(CorruptDataError, match="more than"):
        Table(4, {**{s: 12 for s in range(MAX_CODED + 1)}, ESC2: 12})
    with pytest.raises(CorruptDataError, match="out of range"):
        v1(2, {600: 1, ESC: 1})  # a format-2 symbol in a format-1 table
    with pytest.raises(CorruptDataError, match="2-byte words"):
        Table.from_bytes(Table(2, {ESC2: 1}).to_bytes(), 4)
    with pytest.raises(CorruptDataError, match="uint8"):
        Table.from_bytes(torch.zeros(7, dtype=torch.int32), 2)


# ---------------------------------------------------------------------------
# streams worked by hand
# ---------------------------------------------------------------------------
def test_bfloat16_entry_by_hand():
    # format 1, E = 128: 64 words -- 1.0 (sym 127), 0.5 (126), 0.0 (ZERO), -1.0 (256 | 127 = 383: escapes)
    table = v1(2, {127: 1, 126: 2, ZERO: 3, ESC: 3})
    codec = FPECodec(table)
    values = torch.tensor([1.0, 0.5, 0.0, -1.0] * 16, dtype=torch.bfloat16)
    one = code(table, 127) + field(0, 7) + code(table, 126) + field(0, 7) + code(table, ZERO)
    one += code(table, ESC) + field(383, 9) + field(0, 7)
    assert one == "0" + "0000000" + "10" + "0000000" + "110" + "111" + "111111101" + "0000000"
    bits = one * 16
    assert len(bits) == 16 * ((1 + 7) + (2 + 7) + 3 + (3 + 9 + 7))
    _, payload, k, modes = encode_with(codec, values, 128)
    assert k.tolist() == [-(-len(bits) // 256)] == [3] and modes.tolist() == [0]
    assert payload[0].tolist() == stream_bytes(bits, 128)


def test_bfloat16_entry_by_hand_format_2():
    # E = 128: 64 words -- 1.0 (top 12 bits 0x3F8), 1.75 (0x3FE: mantissa 1100000), 0.0 (ZERO),
    # -1.0 (0xBF8: escapes); the tail is the mantissa's low 4 bits; the serial layout
    one, seven4, minus = 0x3F8, 0x3FE, 0xBF8
    table = Table(2, {one: 1, seven4: 2, ZERO2: 3, ESC2: 3}, table_format=2)
    codec = FPECodec(table)
    assert bf16(1.75) == 0x3FE0 and bf16(-1.0) == 0xBF80
    values = torch.tensor([1.0, 1.75, 0.0, -1.0] * 16, dtype=torch.bfloat16)
    once = code(table, one) + field(0, 4) + code(table, seven4) + field(0, 4) + code(table, ZERO2)
    once += code(table, ESC2) + field(minus, 12) + field(0, 4)
    assert once == "0" + "0000" + "10" + "0000" + "110" + "111" + "000111111101" + "0000"
    bits = once * 16
    assert len(bits) == 16 * ((1 + 4) + (2 + 4) + 3 + (3 + 12 + 4))
    _, payload, k, modes = encode_with(codec, values, 128)
    assert k.tolist() == [-(-len(bits) // 256)] == [3] and modes.tolist() == [0]
    assert payload[0].tolist() == stream_bytes(bits, 128)
    # a tail of its own: 1.0 + 2**-7 (mantissa 0000001) has the symbol of 1.0 and tail 0001
    values = torch.tensor([1.0 + 2.0**-7] + [0.0] * 63, dtype=torch.bfloat16)
    bits = code(table, one) + field(1, 4) + code(table, ZERO2) * 63
    _, payload, k, _ = encode_with(codec, values, 128)
    assert payload[0].tolist() == stream_bytes(bits, 128)


def test_bfloat16_entry_by_hand_format_3():
    # the entry of the format-2 test in the split layout: every code in word order from bit 0, the
    # tails at the payload's end backwards (the j-th tail at 256 k - 4 (j + 1)), zeros between
    one, seven4, minus = 0x3F8, 0x3FE, 0xBF8
    table = Table(2, {one: 1, seven4: 2, ZERO2: 3, ESC2: 3})
    assert table.format == 3 and table.split
    codec = FPECodec(table)
    values = torch.tensor([1.0 + 2.0**-7, 1.75, 0.0, -1.0 - 3 * 2.0**-7] * 16, dtype=torch.bfloat16)
    codes = (code(table, one) + code(table, seven4) + code(table, ZERO2) + code(table, ESC2) + field(minus, 12)) * 16
    assert len(codes) == 16 * (1 + 2 + 3 + 3 + 12)
    tails = [1, 0, 3] * 16  # the words with tails, in word order: 1.0 + 2**-7, 1.75, -1.0 - 3 * 2**-7
    k = -(-(len(codes) + 4 * len(tails)) // 256)
    assert k == 3  # the serial layout's too: the same bits
    bits = codes + "0" * (256 * k - len(codes) - 4 * len(tails)) + "".join(field(v, 4) for v in reversed(tails))
    _, payload, got_k, modes = encode_with(codec, values, 128)
    assert got_k.tolist() == [k] and modes.tolist() == [0]
    assert payload[0].tolist() == stream_bytes(bits, 128)
    serial = FPECodec(Table(2, table.lengths, table_format=2))
    assert encode_with(serial, values, 128)[2].tolist() == [k]
    # a bit set between the sections is damage, and so is a k one too small (the tails' places move)
    damaged = payload.clone()
    damaged[0, len(codes) // 8 + 1] |= 1
    with pytest.raises(CorruptDataError, match="between"):
        decode(codec, damaged, got_k, modes, 2)
    with pytest.raises(CorruptDataError, match="length"):
        decode(codec, payload, got_k - 1, modes, 2)


def test_one_byte_words_of_format_2_are_all_symbol():
    table = Table(1, {0x38: 1, ZERO2 // 16: 2, 257: 2})  # 1-byte words: 256 symbols, ZERO = 256, ESC = 257
    codec = FPECodec(table)
    values = torch.tensor([0x38, 0, 0x7F] + [0x38] * 125, dtype=torch.uint8)
    bits = code(table, 0x38) + code(table, 256) + code(table, 257) + field(0x7F, 8) + code(table, 0x38) * 125
    _, payload, k, _ = encode_with(codec, values, 128)
    assert payload[0].tolist() == stream_bytes(bits, 128)


def test_a_table_without_zero_codes_zero_words_as_symbol_zero():
    table = v1(2, {0: 1, ESC: 1})  # symbol 0: +0.0 and the tiny positives
    codec = FPECodec(table)
    values = torch.zeros(64, dtype=torch.bfloat16)
    values[0] = 1.0
    bits = code(table, ESC) + field(127, 9) + field(0, 7) + (code(table, 0) + field(0, 7)) * 63
    _, payload, k, _ = encode_with(codec, values, 128)
    assert k.tolist() == [3] and payload[0].tolist() == stream_bytes(bits, 128)


@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["relu", "zeros", "special", "random_bytes"])
def test_fitted_and_default_tables_round_trip(word, kind):
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[word]
    t = make_data(kind, 4096 // word * 3, dtype, torch.Generator().manual_seed(word))
    entries = raw_bytes(t).view(-1, 256)
    for codec in (buddy.get_codec("fpe").fit(entries.reshape(-1), word), buddy.get_codec("fpe")):
        payload, k, modes = buddy.format.encode(codec, entries, word)
        assert torch.equal(decode(codec, payload, k, modes, word), entries)
    assert buddy.get_codec("fpe").fitted is None and repr(buddy.get_codec("fpe")).endswith("(no table)>")


def test_the_fitted_table_beats_fpx_on_activations():
    t = make_data("relu", 1 << 16, torch.float32, torch.Generator().manual_seed(3))
    entries = raw_bytes(t).view(-1, 512)
    fpe = buddy.get_codec("fpe").fit(entries.reshape(-1), 4)
    k_fpe = buddy.format.encode(fpe, entries, 4)[1]
    k_fpx = buddy.format.encode(buddy.get_codec("fpx"), entries, 4)[1]
    assert int(k_fpe.sum()) < int(k_fpx.sum())


def test_fit_counts_symbols_and_follows_a_prior():
    values = torch.tensor([1.0, 1.0, 1.5, -2.0, 0.0, 0.0, 0.0, 0.25], dtype=torch.bfloat16)
    counts = symbol_counts(raw_bytes(values), 2)
    assert counts.shape == (4098,) and counts.sum() == 8
    assert counts[top12(127)] == 2 and counts[top12(127, 4)] == 1  # 1.5: mantissa 1000000
    assert counts[top12(256 | 128)] == 1 and counts[top12(125)] == 1
    assert counts[ZERO2] == 3 and counts[ESC2] == 0
    fitted = buddy.get_codec("fpe").fit(raw_bytes(values), 2)
    assert torch.equal(fitted.statistics, counts) and fitted.fitted == Table.from_counts(counts, 2)
    prior = torch.zeros(n_symbols(2))
    prior[top12(126)] = 1.0
    guided = buddy.get_codec("fpe").fit(raw_bytes(values), 2, prior=prior)
    assert guided.fitted.lengths == {top12(126): 1, ESC2: 1}, "the prior, not the tensor, decides the table"
    assert torch.equal(guided.statistics, counts), "the tensor's own counts are still reported"


# ---------------------------------------------------------------------------
# damage
# ---------------------------------------------------------------------------
def _one_entry(table: Table, bits: str, entry_bytes: int = 128):
    payload = torch.tensor([stream_bytes(bits, entry_bytes)], dtype=torch.uint8)
    k = torch.tensor([-(-len(bits) // 256)], dtype=torch.int32)
    return payload, k, torch.zeros(1, dtype=torch.int32)


def test_damaged_streams_are_refused():
    table = v1(2, {127: 1, ZERO: 3, ESC: 3})  # "0", "100", "101": no code starts "11"
    codec = FPECodec(table)
    ok = code(table, 127) + field(0, 7) + code(table, ZERO) * 63  # 1.0 and 63 zeros: 197 bits
    out = decode(codec, *_one_entry(table, ok), 2).view(torch.int16)
    assert out[0].tolist() == [bf16(1.0)] + [0] * 63
    with pytest.raises(CorruptDataError, match="does not have"):
        decode(codec, *_one_entry(table, "11" + ok), 2)
    escaped_known = code(table, ESC) + field(127, 9) + field(0, 7) + code(table, ZERO) * 63
    with pytest.raises(CorruptDataError, match="escape of a symbol"):
        decode(codec, *_one_entry(table, escaped_known), 2)
    payload, _, modes = _one_entry(table, ok)
    with pytest.raises(CorruptDataError, match="length"):
        decode(codec, payload, torch.tensor([2], dtype=torch.int32), modes, 2)  # 197 bits are 1 sector
    payload[0, 230 // 8] |= 1 << (230 % 8)  # a bit after the stream, inside its sector
    with pytest.raises(CorruptDataError, match="after the end"):
        decode(codec, payload, torch.tensor([1], dtype=torch.int32), modes, 2)


@pytest.mark.parametrize("word", [2, 4])
def test_random_damage_never_reads_out_of_bounds(word):
    g = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16 if word == 2 else torch.float32
    t = make_data("relu", 64 * 128 // word, dtype, g)
    entries = raw_bytes(t).view(-1, 128)
    codec = buddy.get_codec("fpe").fit(entries.reshape(-1), word)
    payload, k, modes = buddy.format.encode(codec, entries, word)
    coded = (k > 0) & (k < 4)
    flips = torch.randint(0, 8 * 128, (payload.shape[0],), generator=g)
    damaged = payload.clone()
    rows = torch.arange(payload.shape[0])
    damaged[rows, flips // 8] ^= (1 << (flips % 8)).to(torch.uint8)
    damaged[k.long().unsqueeze(1) * 32 <= torch.arange(128)] = 0  # keep the format's zero tail
    intact = int(torch.nonzero(coded)[0])  # an undamaged coded entry, the damaged one's neighbour on both sides
    refused = 0
    for i in torch.nonzero(coded).flatten().tolist():
        rows = [intact, i, intact]
        batch = torch.stack([payload[intact], damaged[i], payload[intact]])
        try:
            alone = decode(codec, damaged[i : i + 1], k[i : i + 1], modes[i : i + 1], word)
        except CorruptDataError:
            refused += 1
            with pytest.raises(CorruptDataError):  # refused alone, refused between its neighbours
                decode(codec, batch, k[rows], modes[rows], word)
            continue
        # an undetected flip decodes to some bytes of its own entry: between two neighbours it decodes to the same
        # bytes, and they to theirs (nothing read or written across an entry's bounds)
        out = decode(codec, batch, k[rows], modes[rows], word)
        assert torch.equal(out[1:2], alone), f"entry {i} decodes otherwise between neighbours"
        assert torch.equal(out[0], entries[intact]) and torch.equal(out[2], entries[intact])
    assert 0 < refused < int(coded.sum()), "the damage is caught in some entries and decodes undetected in others"


# ---------------------------------------------------------------------------
# through the pipeline: the table travels with the tensor
# ---------------------------------------------------------------------------
def test_compressed_tensor_carries_its_table(store, gen):
    t = make_data("relu", 30_001, torch.float32, gen)
    bt = buddy.compress(t, target_ratio=1.5, codec="fpe", store=store, checksum=True)
    assert bt.format_version == 3 and bt.table.device == t.device
    assert Table.from_bytes(bt.table, 4) == Table.from_counts(symbol_counts(raw_bytes(t), 4), 4)
    assert bt.device_bytes == bt.buffers()[0].numel() + bt.buffers()[1].numel() + bt.table.numel()
    assert_bitexact(bt.decompress(), t)
    kwargs = dict(codec="fpe", entry_bytes=bt.entry_bytes, slot_sectors=bt.slot_sectors, shape=t.shape, dtype=t.dtype)
    with pytest.raises(CorruptDataError, match="needs its table"):
        buddy.unpack(*bt.buffers(), **kwargs)
    with pytest.raises(CorruptDataError, match="takes no table"):
        buddy.unpack(*bt.buffers(), **dict(kwargs, codec="fpx"), table=bt.table)
    damaged = bt.table.clone()
    damaged[-1] = 0  # a code length of 0
    with pytest.raises(CorruptDataError):
        buddy.unpack(*bt.buffers(), **kwargs, table=damaged)
    with pytest.raises(CorruptDataError, match="checksum mismatch in the codec table"):
        buddy.unpack(*bt.buffers(), **kwargs, table=damaged, checksum=bt.checksum)


def test_compress_is_deterministic(store, gen):
    t = make_data("special", 20_000, torch.bfloat16, gen)
    a = buddy.compress(t, target_ratio=2.0, codec="auto2", store=store)
    b = buddy.compress(t.clone(), target_ratio=2.0, codec="auto2", store=store)
    assert torch.equal(a.table, b.table)
    for x, y in zip(a.buffers(), b.buffers()):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------
# auto2: auto's members, then fpe
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto2_is_never_larger_than_auto_and_uses_fpe(dtype):
    t = make_data("relu", 1 << 15, dtype, torch.Generator().manual_seed(4))
    entries = raw_bytes(t).view(-1, 512)
    w = buddy.spec.word_bytes(dtype)
    auto2 = buddy.get_codec("auto2").fit(entries.reshape(-1), w)
    payload, k2, modes = buddy.format.encode(auto2, entries, w)
    k1 = buddy.format.encode(buddy.get_codec("auto"), entries, w)[1]
    assert bool((k2 <= k1).all()) and int(k2.sum()) < int(k1.sum())
    fpe_rows = modes == AUTO_MODES["fpe"]
    assert bool(fpe_rows.any())
    # an fpe entry's payload is exactly what fpe with the same table writes
    alone = buddy.format.encode(FPECodec(auto2.members[-1][1].fitted), entries[fpe_rows], w)[0]
    assert torch.equal(payload[fpe_rows], alone)
    assert torch.equal(decode(auto2, payload, k2, modes, w), entries)


def test_auto2_takes_and_gives_the_fpe_table():
    auto2 = buddy.get_codec("auto2")
    assert auto2.format_version == 3 and auto2.table is None
    fitted = auto2.fit(raw_bytes(torch.ones(64)), 4)
    assert fitted.table is not None and fitted is not auto2
    bound = auto2.bind(fitted.table, 4)
    assert torch.equal(bound.table, fitted.table)
    with pytest.raises(CorruptDataError, match="needs its table"):
        auto2.bind(None, 4)
    with pytest.raises(ValueError, match="at most one"):
        buddy.codecs.AutoCodec([(2, FPECodec()), (3, FPECodec())], name="two-tables")


@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_table_bytes_is_the_serialized_size(word, gen):
    """What budgets count for a tensor's table, without serializing it, is its serialized size."""
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[word]
    flat = raw_bytes(make_data("relu", 5000, dtype, gen))
    for name in ("fpe", "auto2"):
        fitted = buddy.get_codec(name).fit(flat, word)
        assert fitted.table_bytes == fitted.table.numel() == 4 + 3 * len(Table.from_bytes(fitted.table, word).order)
        assert buddy.get_codec(name).table_bytes == 0 and buddy.get_codec(name).table is None
    assert buddy.get_codec("fpx").table_bytes == 0


# ---------------------------------------------------------------------------
# tables learned across steps
# ---------------------------------------------------------------------------
def test_tracker_learns_statistics_across_steps():
    tracker = buddy.Tracker(decay=0.5)
    a = torch.zeros(n_symbols(2), dtype=torch.int64)
    a[top12(127)] = 30
    b = torch.zeros(n_symbols(2), dtype=torch.int64)
    b[top12(126)] = 10
    kw = dict(slot=2, layout=Layout(128, 4096), predicted_overflow_bytes=0)
    assert tracker.prior("x") is None
    tracker.record("x", (0, 32, 0, 0, 0), **kw, statistics=a)
    assert tracker.prior("x")[top12(127)] == 1.0
    tracker.record("x", (0, 32, 0, 0, 0), **kw, statistics=b)
    learned = tracker.prior("x")
    assert learned[top12(126)] == pytest.approx(1 / 1.5) and learned[top12(127)] == pytest.approx(0.5 / 1.5)
    assert tracker.prior("y") is None


def test_measure_fits_to_a_prior():
    t = torch.relu(torch.randn(4096))
    prior = torch.zeros(n_symbols(4))
    prior[top12(126)] = 1.0
    m = buddy.measure(t, "fpe", entry_bytes=512, prior=prior)
    assert Table.from_bytes(m.table, 4) == Table.from_counts(prior, 4)
    assert torch.equal(m.statistics, symbol_counts(raw_bytes(t), 4))
    assert buddy.measure(t, "fpx", entry_bytes=512).table is None


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_measure_counts_with_a_prior_only_when_asked(backend):
    t = torch.relu(torch.randn(4099))  # an awkward size: a tail entry
    prior = torch.zeros(n_symbols(4))
    prior[top12(126)] = 1.0
    counted = buddy.measure(t, "auto2", entry_bytes=512, prior=prior, backend=backend)
    skipped = buddy.measure(t, "auto2", entry_bytes=512, prior=prior, count=False, backend=backend)
    assert torch.equal(counted.statistics.cpu(), symbol_counts(raw_bytes(t), 4)) and skipped.statistics is None
    assert torch.equal(skipped.table, counted.table) and skipped.histogram == counted.histogram
    alone = buddy.measure(t, "auto2", entry_bytes=512, count=False, backend=backend)
    assert torch.equal(alone.statistics.cpu(), symbol_counts(raw_bytes(t), 4)), "no prior: counted (its table's fit)"
    bt = buddy.pack(skipped, skipped.histogram.index(max(skipped.histogram)))
    assert_bitexact(bt.decompress(), t)


def _linear_steps(tracker, store, steps: int, after, scale=lambda step: 1.0):
    """``steps`` training steps of a ReLU'd linear layer in sessions on ``tracker`` (auto2), ``after(step)`` after
    each; the weight's gradients, and the layer and its input (``x``, each step's scaled by ``scale(step)``).
    Sized first (strict=True): each tensor through ``measure``, which the tests watch."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    grads = []
    for step in range(steps):
        lin.zero_grad()
        with buddy.compressed_activations(tracker=tracker, store=store, codec="auto2", min_bytes=1024, strict=True):
            (torch.relu(lin(x * scale(step))) * 2).sum().backward()
        grads.append(lin.weight.grad.clone())
        after(step)
    return grads, (lin, x)


def test_tracker_counts_a_learned_key_every_few_steps(store, monkeypatch):
    """count_every=3 after count_warmup=2 steps: a key's symbols counted at its first two steps, then every third;
    what it learns only then."""
    asked = []

    def spy(t, codec, **kwargs):
        asked.append(kwargs.get("count"))
        return buddy.pipeline.measure(t, codec, **kwargs)

    monkeypatch.setattr(buddy.keyed, "measure", spy)
    with pytest.raises(ValueError, match="count_every"):
        buddy.Tracker(count_every=0)
    with pytest.raises(ValueError, match="count_warmup"):
        buddy.Tracker(count_warmup=-1)
    tracker = buddy.Tracker(count_every=3, count_warmup=2)
    learned = []

    def after(step: int) -> None:
        assert asked and len(set(asked)) == 1, "every key of the step on the same schedule"
        assert asked[0] == (step < 2 or step % 3 == 1), f"step {step}: counted at steps 0, 1, 4, 7"
        asked.clear()
        learned.append({h.key: h.statistics for h in tracker.histories()})
        assert all(h.uncounted == (0 if step < 2 else (step - 1) % 3) for h in tracker.histories())

    grads, _ = _linear_steps(tracker, store, 9, after)
    keys = learned[0].keys()
    assert all(learned[1][k] is not learned[0][k] for k in keys), "learned at each warm-up step"
    assert all(learned[2][k] is learned[1][k] and learned[3][k] is learned[1][k] for k in keys), "nothing learned"
    assert all(learned[4][k] is not learned[3][k] for k in keys), "learned again at the third step after"
    for g in grads[1:]:
        assert_bitexact(g, grads[0])


def test_session_passes_learned_statistics_to_the_next_step(store, monkeypatch):
    priors = []

    def spy(t, codec, **kwargs):
        priors.append(kwargs.get("prior"))
        return buddy.pipeline.measure(t, codec, **kwargs)

    monkeypatch.setattr(buddy.keyed, "measure", spy)
    tracker = buddy.Tracker()
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    steps = []
    for _ in range(2):
        priors.clear()
        with buddy.compressed_activations(tracker=tracker, store=store, codec="auto2", min_bytes=1024, strict=True):
            (torch.relu(lin(x)) * 2).sum().backward()  # (sized first: each tensor through measure, watched)
        steps.append(list(priors))
    assert steps[0] and all(p is None for p in steps[0]), "the first step fits each tensor's own table"
    assert steps[1] and all(p is not None for p in steps[1]), "later steps fit the learned table"
    learned = [h.learned for h in tracker.histories()]
    assert all(p is not None and float(p.sum()) == pytest.approx(1.0) for p in learned)


@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_slack_is_what_a_prefix_code_costs_over_the_entropy(word, gen):
    """Never below the entropy (Kraft), zero for a dyadic distribution the code matches, by hand for one case."""
    s = n_symbols(word)
    for trial in range(20):
        counts = torch.zeros(s, dtype=torch.int64)
        used = torch.randperm(s - 1, generator=gen)[: 1 + trial * 7]  # regular symbols and ZERO, never ESC
        counts[used] = torch.randint(1, 1 << (trial % 20 + 1), (used.numel(),), generator=gen)
        table = Table.from_counts(counts, word)
        assert table.fit_slack == table.slack(counts) >= -1e-9
    halves = torch.zeros(s)
    halves[[3, 4]] = 1.0  # two symbols, half each: codes of 2 bits (ESC takes one), entropy 1 bit
    t = Table.from_counts(halves, word)
    assert t.slack(halves) == pytest.approx(sum(t.lengths[x] for x in (3, 4)) / 2 - 1)
    assert Table.from_bytes(t.to_bytes(), word).fit_slack is None  # a stored table: nothing known of its fit


def test_slack_remembers_only_the_same_unchanged_tensor():
    base = torch.zeros(n_symbols(4), dtype=torch.float64)
    base[[top12(s) for s in range(120, 127)]] = torch.tensor([1.0, 2, 4, 8, 16, 32, 64], dtype=torch.float64)
    table = Table.from_counts(base, 4)
    other = Table.from_counts(base.flip(0), 4)
    prior = base.clone()
    before = table.slack(prior)
    assert table.slack(prior) == before == table.slack(prior.clone()) == table.slack(prior.tolist())
    prior[top12(120)] += 1000.0  # changed in place: torch's version moves, the answer is made again
    assert table.slack(prior) == table.slack(prior.clone()) != before
    assert other.slack(prior) == other.slack(prior.clone()), "each table remembers its own"
    with torch.inference_mode():
        frozen = prior.clone()  # no version counter: asked each time
    assert table.slack(frozen) == table.slack(frozen) == table.slack(prior)


def test_wrap_under_inference_mode_learns_and_keeps_its_table(store):
    """A key wrapped under inference mode step after step: its learned statistics are inference tensors."""
    tracker = buddy.Tracker(count_every=2, count_warmup=1)
    t = torch.relu(torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)))
    with torch.inference_mode():
        for _ in range(5):
            bt = buddy.wrap(t, "x", tracker=tracker, store=store, codec="auto2")
            assert_bitexact(bt.decompress(), t)
            bt.free()
    assert tracker.prior("x") is not None


def test_fit_table_keeps_a_table_that_still_fits():
    base = torch.zeros(n_symbols(4), dtype=torch.float64)
    base[[top12(s) for s in range(120, 127)]] = torch.tensor([1.0, 2, 4, 8, 16, 32, 64], dtype=torch.float64)
    table = fit_table(base, 4)
    assert table == Table.from_counts(base, 4)
    drifted = base.clone()
    drifted[top12(126)] *= 1.01  # a step later: nearly the same statistics
    assert fit_table(drifted, 4, keep=table) is table, "kept: no fit"
    assert table.slack(drifted) <= table.fit_slack + REFIT_BITS
    moved = base.roll(-8 * 8)  # every value eight binades smaller: the table escapes them all
    refit = fit_table(moved, 4, keep=table)
    assert refit is not table and refit == Table.from_counts(moved, 4)
    assert fit_table(base, 2, keep=table) == Table.from_counts(base, 2), "a table of another word size is not kept"
    stored = Table.from_bytes(table.to_bytes(), 4)
    assert fit_table(base, 4, keep=stored) is not stored, "a table read from bytes is fitted again"
    old = v1(4, {126: 1, 514 - 1: 1})
    old.fit_slack = 0.0
    assert fit_table(base, 4, keep=old) == table, "a table of format 1 is not kept: fits make format 3"
    serial = Table(4, table.lengths, table_format=2)
    serial.fit_slack = table.fit_slack
    assert fit_table(base, 4, keep=serial) == table != serial, "nor one of format 2: fits make format 3"


def test_session_keeps_a_keys_table_while_it_fits(store):
    """Steps on the same data: one fit per key, its table kept after; bit-exact whichever table codes it."""
    tracker = buddy.Tracker(count_every=1)  # statistics every step: the step after the data moved refits
    tables = []

    def after(step: int) -> None:
        fitted = {h.key: h.fitted for h in tracker.histories()}
        assert fitted and all(c is not None and c.table is not None for c in fitted.values())
        tables.append({k: c._tabled.fitted for k, c in fitted.items()})

    # other binades from step 3 on: learned then, refitted at step 4
    grads, (lin, x) = _linear_steps(tracker, store, 5, after, scale=lambda step: 1.0 if step < 3 else 2.0**-20)
    keys = tables[0].keys()
    assert all(tables[2][k] is tables[1][k] for k in keys), "same data, learned statistics: the table is kept"
    assert all(tables[3][k] is tables[2][k] for k in keys), "the step the data moved still codes with the prior"
    assert any(tables[4][k] is not tables[3][k] for k in keys), "statistics that moved: fitted again"
    lin.zero_grad()
    (torch.relu(lin(x)) * 2).sum().backward()
    assert_bitexact(grads[2], lin.weight.grad)
