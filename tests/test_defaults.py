"""buddy's own defaults — ``auto2`` at 4096-byte entries, measured by ``experiments.decide`` — end to end.

The rest of the suite pins ``zvc`` at E = 128 (see ``suite_defaults`` in
conftest); these tests run with the library's defaults untouched.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_roundtrip, make_data
from test_autograd import assert_same_training, cnn_batch, small_cnn, train

import buddy
from buddy import spec

pytestmark = pytest.mark.library_defaults


def test_the_defaults_are_the_measured_choice():
    d = buddy.defaults()
    assert (d.codec, d.entry_bytes) == ("auto2", 4096) == (buddy.codecs.DEFAULT_CODEC, spec.DEFAULT_ENTRY_BYTES)
    assert d.backend == "auto" and d.checksum is False  # the kernels on CUDA tensors, behind their self-test


@pytest.mark.parametrize("kind", ["zeros", "relu", "random_bytes", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_default_compress_round_trips(kind, dtype, store):
    x = make_data(kind, 40_000 + 3, dtype, torch.Generator().manual_seed(1))
    with buddy.compress(x, store=store) as bt:
        assert (bt.codec, bt.entry_bytes, bt.format_version) == ("auto2", 4096, 3)
        assert_roundtrip(bt, x)
        for ratio in (16 / 16, 16 / 9, 16 / 1, float("inf")):
            with buddy.compress(x, ratio, store=store) as forced:
                assert_roundtrip(forced, x)
    assert store.bytes_held == 0


def test_default_session_trains_bit_identically(store):
    tracker = buddy.Tracker(buddy.BuddyThreshold(0.1))
    plain = train(small_cnn, cnn_batch, 3)
    packed = train(
        small_cnn, cnn_batch, 3, lambda: buddy.compressed_activations(tracker=tracker, store=store, min_bytes=4096)
    )
    assert_same_training(plain, packed)
    stats = packed[2][-1].stats()
    codecs = {row.codec for row in stats.rows}
    assert "auto2" in codecs and codecs <= {"auto2", "kept"}
    assert stats.effective_capacity > 1
