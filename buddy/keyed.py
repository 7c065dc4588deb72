"""Compressing a tensor under a key through the tracker: measure it, let the policy place it, pack it, record it.

What a training session does with a tensor it sizes first (``strict=True``, or a key the plan cannot place ahead:
:mod:`buddy.autograd`), and :func:`wrap`, the same for a tensor kept outside autograd.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .pipeline import measure, pack
from .store import BuddyStore
from .tensor import BuddyTensor
from .tracker import Policy, Tracker, default_tracker

__all__ = ["wrap"]


class _Packed(NamedTuple):
    bt: BuddyTensor | None  # None: kept as it is (the tracker chose the raw slot)
    histogram: tuple[int, ...]
    predicted: int | None  # overflow bytes the tracker predicted; None for a new key
    corrected: bool  # the bound widened the slot the key's history planned (see buddy.tracker.SlotChoice)


def _tracked(t, key, tracker: Tracker, policy, store, codec, entry_bytes, *, keep: bool, on_full="device"):
    """Measure ``t``, let the tracker place it under ``key``, pack it there, and record what happened.

    With ``keep``, a tensor the tracker gives the raw slot is not packed
    (``bt`` is ``None``): the raw slot would hold the same bytes plus
    metadata; the caller keeps it (see :class:`_Kept`). A full store keeps
    the tensor whole on the device by default (``on_full="device"``): a full
    store must not cost a training step.
    """
    measured = measure(
        t, codec, entry_bytes=entry_bytes, prior=tracker.prior(key), keep=tracker.fitted(key), count=tracker.counts(key)
    )
    place = tracker.plan(
        key, measured.histogram, layout=measured.layout, policy=policy, table_bytes=measured.codec.table_bytes
    )
    bt = None
    if not (keep and place.keep):
        bt = pack(measured, place.slot, store=store, on_full=on_full, ledger=tracker.ledger)
    tracker.record(
        key,
        measured.histogram,
        slot=place.slot if bt is None else bt.slot_sectors,
        layout=measured.layout,
        predicted_overflow_bytes=place.predicted_overflow_bytes,
        statistics=measured.statistics,
        fitted=measured.codec,
    )
    return _Packed(bt, measured.histogram, place.predicted_overflow_bytes, place.corrected)


def wrap(
    tensor: torch.Tensor,
    key: str,
    *,
    policy: Policy | None = None,
    tracker: Tracker | None = None,
    store: BuddyStore | None = None,
    codec: str | None = None,
    entry_bytes: int | None = None,
    on_full: str = "raise",
) -> BuddyTensor:
    """Compress a tensor kept outside autograd under a user-given ``key``.

    The slot comes from the tracker (default: the process-wide one, with its
    policy unless ``policy`` is given), which learns the key's history across
    calls exactly as for saved activations. ``on_full`` is as in
    :func:`buddy.compress`.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    tracker = tracker if tracker is not None else default_tracker()
    return _tracked(tensor, key, tracker, policy, store, codec, entry_bytes, keep=False, on_full=on_full).bt
