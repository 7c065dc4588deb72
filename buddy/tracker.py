"""The compression-ratio tracker: per key, which slot to give a tensor.

For every **key** (a stable name for "the same tensor next step") the tracker
keeps the entry-size histograms of recent steps: an exponentially weighted
mean of them, so it follows drift within a few steps, **predicts** the key's
next histogram. A **policy** picks each tensor's slot just before it is
packed, when the tensor's own size pass (its exact histogram) is at hand:
policies that bound overflow (:class:`BuddyThreshold`,
:class:`OverflowBudget`) check the bound against that, so it holds for every
tensor or step, not only for those the prediction got right; policies that
plan a whole step ahead (:class:`OverflowBudget`, :class:`DeviceBudget`)
plan from the predictions. After packing, the tracker records what the key's
prediction said the chosen slot would spill next to what it did, so
experiments can say how often and by how much the history was wrong.

Policies:

* :class:`FixedRatio` -- one target ratio for every tensor (the paper's naive
  baseline).
* :class:`BuddyThreshold` -- per tensor, the most aggressive slot whose
  overflow stays within ``max_overflow`` of the tensor's bytes (the paper's
  per-allocation policy; the paper's hardware had to predict it, here it is
  measured).
* :class:`OverflowBudget` -- a step's overflow within ``max_overflow`` of
  its bytes, spent on the tensors where a sector of slot costs the least
  spill (slots come in whole sectors, so a per-tensor threshold leaves part
  of each tensor's allowance unused).
* :class:`DeviceBudget` -- all slots chosen together so the device bytes of
  everything held fit ``budget_bytes`` with the least overflow.
* :class:`CompressedOffload` -- the zero slot for every tensor: only metadata
  stays on the device, every compressed sector goes to buddy memory (like
  ``save_on_cpu``, moving ``ratio`` times fewer bytes over the link).

From "keep on the device" to "offload everything" is one continuum:
``DeviceBudget(budget_bytes)`` spends whatever device memory it is given on
the tensors where it saves the most link traffic and puts the rest in buddy
memory, down to the zero slot when the budget demands it.

**Groups.** A key's **group** is everything before its last ``/``
(``"_GPT/3:bfloat16[16, 128, 64]"`` is in group ``"_GPT"``; a key without a
``/`` is in group ``""``). A training session names a key's group after the
model that saved the tensor (see :mod:`buddy.autograd`), so two models on
one tracker never share history: history is shared on purpose only between
the steps of the same model. A step plans each group from the keys that
group had in its own most recent step.

**A bound is a bound.** History only guides. Every policy that states an
overflow bound (:attr:`Policy.overflow_bound`) keeps it on the tensors'
real histograms, whatever the history says: :class:`BuddyThreshold` per
tensor, :class:`OverflowBudget` at every point of a step (the overflow of
the step's tensors so far never passes ``max_overflow`` of their bytes, so
the step ends within it however many tensors it turns out to have), and
:class:`DeviceBudget` for the keys it has no plan for. The bound is exact:
overflow is counted in whole sectors on both sides, with no rounding.
"""

from __future__ import annotations

import collections
import heapq
import threading
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import spec
from ._process_default import ProcessDefault
from .layout import LaidOut, Layout
from .errors import Moved
from .ledger import DeviceLedger, default_ledger
from .slots import DEFAULT_MAX_OVERFLOW, larger_than, overflow_sectors, slot_for_overflow, tightest_slot

if TYPE_CHECKING:
    from .codecs.base import CodecLike
    from .peak import StepProfile

__all__ = [
    "Policy",
    "FixedRatio",
    "BuddyThreshold",
    "DeviceBudget",
    "OverflowBudget",
    "CompressedOffload",
    "Decision",
    "SlotChoice",
    "Placement",
    "group_of",
    "KeyHistory",
    "Tracker",
    "BudgetExceededWarning",
    "default_tracker",
    "set_default_tracker",
    "COUNT_EVERY",
    "COUNT_WARMUP",
]

if not TYPE_CHECKING:  # (hidden from the type checker: a typo stays an error there)
    __getattr__ = Moved(__name__, {"Choice": (__name__, "SlotChoice")})

#: a :class:`Tracker`'s defaults of how often a learned key's symbols are counted (see its ``count_every``): every
#: step for a key's first COUNT_WARMUP steps, then every COUNT_EVERY-th (over 100 training steps of the tuning
#: workloads 0.01-0.07 % of capacity against counting every step: ``experiments.over_training --count-every 1``)
COUNT_EVERY, COUNT_WARMUP = 4, 32


class BudgetExceededWarning(RuntimeWarning):
    """DeviceBudget could not fit a tensor: it went to buddy memory with the zero slot."""


def group_of(key: str) -> str:
    """The group of a key: everything before its last ``/`` (``""`` when it has none)."""
    return key.rpartition("/")[0]


@dataclass(frozen=True)
class Decision(LaidOut):
    """What a policy is asked to decide, and with what.

    ``predicted`` is the key's predicted histogram (``None`` for a new key);
    ``current`` is this tensor's own histogram from the size pass.
    ``held_device_bytes`` are the device bytes held on the tracker's ledger
    right now (for budgets). ``layout``: the tensor's entries and bytes
    (:class:`~buddy.layout.Layout`). ``table_bytes``: the codec table the
    tensor carries on the device (format version 2), whatever its slot.
    ``group``: the key's group (:func:`group_of`). ``ahead``: the slot is
    chosen before the tensor is sized (:meth:`Tracker.plan_ahead`):
    ``current`` is then the prediction (empty for a new key).
    """

    key: str
    layout: Layout
    current: tuple[float, ...]
    predicted: tuple[float, ...] | None
    held_device_bytes: int
    table_bytes: int = 0
    group: str = ""
    ahead: bool = False

    def device_bytes(self, slot: int) -> int:
        return self.layout.device_bytes(slot, self.table_bytes)

    def overflow_bytes(self, slot: int) -> int:
        """What this tensor really spills with ``slot`` (from its own histogram of whole entries)."""
        return self.layout.overflow_bytes(self.current, slot)


@dataclass(frozen=True)
class SlotChoice:
    """A policy's slot, and whether the bound corrected the plan made from history.

    ``corrected``: the slot the plan (the key's history) asked for would have
    taken the step past the policy's overflow bound on this tensor's real
    histogram, so a wider one was given. :meth:`Policy.choose` may return a
    plain ``int`` (never corrected).
    """

    slot: int
    corrected: bool = False


@dataclass(frozen=True)
class Placement(LaidOut):
    """What the tracker decided for one tensor (:meth:`Tracker.plan`).

    ``slot``: sectors per entry. ``predicted_overflow_bytes``: the overflow
    the key's history predicts with that slot (``None`` for a new key).
    ``keep``: the raw slot -- a training session keeps such a tensor as it
    is (a raw slot would hold the same bytes plus metadata).
    ``device_bytes``: what the tensor holds on the device that way (its
    codec table, ``table_bytes``, included when it is compressed).
    ``corrected``: see :class:`SlotChoice`.
    """

    slot: int
    predicted_overflow_bytes: int | None
    layout: Layout
    table_bytes: int = 0
    corrected: bool = False

    @property
    def keep(self) -> bool:
        return self.slot == self.layout.sectors_per_entry

    @property
    def device_bytes(self) -> int:
        return self.original_bytes if self.keep else self.layout.device_bytes(self.slot, self.table_bytes)


class Policy:
    """Chooses a slot (sectors per entry) for one tensor."""

    #: the overflow bound the policy keeps, as a fraction of the bytes it places (``None``: it states none);
    #: a session checks each step against it (see :class:`~buddy.SessionStats`)
    overflow_bound: float | None = None

    def begin_step(self, tracker: Tracker) -> None:
        """Called when a step (a ``compressed_activations`` block) opens."""

    def choose(self, decision: Decision, tracker: Tracker) -> int | SlotChoice:
        """The slot for the tensor of ``decision``: an ``int``, or a :class:`SlotChoice`."""
        raise NotImplementedError

    def choose_ahead(self, decision: Decision, tracker: Tracker) -> int | SlotChoice | None:
        """The slot for a tensor not yet sized (``decision.ahead``: its ``current`` is the key's prediction), or
        ``None`` where the policy needs the tensor's own sizes (a key it has no plan for; by default every key):
        it is then sized first and :meth:`choose` decides."""
        return None

    def leaves(self, key: str) -> str | None:
        """Why a training step should keep the tensor of ``key`` as it is, uncompressed; ``None`` (the default):
        compress it (see :mod:`buddy.budget`)."""
        return None

    def describe(self) -> str | None:
        """A line on what the policy planned for the step now open, for ``session.stats()`` (``None``: none)."""
        return None

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class FixedRatio(Policy):
    """The same target ratio for every tensor, e.g. ``FixedRatio(2.0)``."""

    def __init__(self, ratio: float):
        spec.slot_for_ratio(ratio, spec.DEFAULT_ENTRY_BYTES)  # validates
        self.ratio = ratio

    def choose(self, decision: Decision, tracker: Tracker) -> int:
        return spec.slot_for_ratio(self.ratio, decision.entry_bytes)

    choose_ahead = choose  # the slot needs no sizes


class BuddyThreshold(Policy):
    """Per tensor, the smallest slot whose overflow is <= ``max_overflow`` of its bytes.

    The overflow is the tensor's own, from the size pass that precedes every
    pack (:attr:`Decision.current`), not a prediction: the bound holds for
    every tensor, whatever its key's history says.
    """

    def __init__(self, max_overflow: float = DEFAULT_MAX_OVERFLOW):
        if isinstance(max_overflow, bool) or not isinstance(max_overflow, (int, float)) or not 0 <= max_overflow <= 1:
            raise ValueError(f"max_overflow must be a fraction in [0, 1], got {max_overflow!r}")
        self.max_overflow = float(max_overflow)

    @property
    def overflow_bound(self) -> float:  # type: ignore[override]  # a property over the class attribute
        return self.max_overflow

    def choose(self, decision: Decision, tracker: Tracker) -> int:
        return slot_for_overflow(decision.current, self.max_overflow, decision.original_bytes)

    def choose_ahead(self, decision: Decision, tracker: Tracker) -> int | None:
        """The slot the key's prediction would get (a new key: ``None``)."""
        return None if decision.predicted is None else self.choose(decision, tracker)


class DeviceBudget(Policy):
    """Fit the device bytes of everything held into ``budget_bytes`` with the least overflow.

    At the start of each step the policy plans every key seen before from its
    predicted histogram: starting from raw slots, it repeatedly shrinks the
    slot whose next step down adds the least overflow per device byte saved,
    until the planned total fits. A key with no history gets the
    ``BuddyThreshold(new_key_overflow)`` slot. Either way the slot is then
    shrunk, if needed, to what is left of the budget at that moment.

    When even the zero slot does not fit (metadata alone exceeds what is
    left), the tensor is still compressed with the zero slot -- everything in
    buddy memory, only metadata on the device -- the budget is exceeded and a
    :class:`BudgetExceededWarning` says so. Data is never dropped.
    """

    def __init__(self, budget_bytes: int, *, new_key_overflow: float = DEFAULT_MAX_OVERFLOW):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative int (bytes), got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._new_key = BuddyThreshold(new_key_overflow)
        self.new_key_overflow = self._new_key.max_overflow
        self._plan: dict[str, int] = {}
        self.exceeded = 0

    def begin_step(self, tracker: Tracker) -> None:
        self._plan = self.plan(tracker)

    def plan(self, tracker: Tracker) -> dict[str, int]:
        """Slots for every key with history, fitting the budget if possible."""
        keys = [h for h in tracker.histories() if h.steps]
        if not keys:
            return {}
        spe = {h.key: len(h.predicted()) - 1 for h in keys}
        slots = dict(spe)
        larger = {h.key: larger_than(h.predicted()) for h in keys}
        per_sector = {h.key: h.layout.slots_bytes(1) for h in keys}
        total = sum(h.layout.device_bytes(spe[h.key], 0 if h.fitted is None else h.fitted.table_bytes) for h in keys)

        def cost(key: str) -> float:  # added overflow per device byte saved by one step down
            return larger[key][slots[key] - 1] / per_sector[key]

        while total > self.budget_bytes:
            candidates = [k for k in slots if slots[k] > 0]
            if not candidates:
                break
            best = min(candidates, key=cost)
            slots[best] -= 1
            total -= per_sector[best]
        return slots

    def choose_ahead(self, decision: Decision, tracker: Tracker) -> int | None:
        """The planned slot, within what is left of the budget (a key with no plan: ``None``)."""
        return None if decision.key not in self._plan else self.choose(decision, tracker)

    def choose(self, decision: Decision, tracker: Tracker) -> int:
        slot = self._plan.get(decision.key)
        if slot is None:
            slot = self._new_key.choose(decision, tracker)
        left = self.budget_bytes - decision.held_device_bytes
        while slot > 0 and decision.device_bytes(slot) > left:
            slot -= 1
        if decision.device_bytes(slot) > left:
            self.exceeded += 1
            warnings.warn(
                f"DeviceBudget({self.budget_bytes:,}): {decision.key} does not fit ({left:,} bytes left, its "
                f"metadata alone needs {decision.device_bytes(0):,}); it is kept with the zero slot, all in "
                f"buddy memory, and the budget is exceeded. Raise the budget or compress fewer tensors.",
                BudgetExceededWarning,
                stacklevel=2,
            )
        return slot


#: keys of a step from which :class:`OverflowBudget`'s plan keeps its running room in a numpy array, not a list: the
#: count of keys where numpy's cost a call, paid once, falls below the list's, paid a key (``experiments.host_cost``'s
#: plan column times it)
PLAN_ARRAY_KEYS = 80


class OverflowBudget(Policy):
    """A step's overflow within ``max_overflow`` of its bytes, spent where it saves the most device memory.

    Shrinking a tensor's slot by a sector saves a sector per entry on the
    device and spills one more sector of each entry larger than the new
    slot: the spill per device byte saved is the share of entries larger.

    **The plan (from history).** When a step's first tensor of a group
    arrives (see :func:`group_of`; a session's group is its model), the
    policy plans the keys that group had in its own most recent step from
    their predicted histograms: starting from the tightest slots (no
    overflow), it takes the cheapest such step down among all keys, again and
    again, skipping those that no longer fit, until the predicted overflow
    reaches ``max_overflow`` of the keys' bytes. Should the per-tensor slots
    of ``BuddyThreshold(max_overflow)`` (which meet the same bound) hold fewer
    device bytes, those are the plan. The plan gives each key an
    **allowance**: the overflow its predicted histogram has in its slot.

    **The step (from the real histograms).** When a tensor arrives, its own
    size pass (:attr:`Decision.current`) says what each slot really spills.
    A planned key gets the smallest slot whose real overflow is within its
    allowance plus whatever the step's earlier tensors left unspent: wider
    than planned when it compresses worse than its key did, tighter when
    there is allowance to spare. A key with no plan (a key's first step, a
    new model, a new shape or dtype) gets the ``BuddyThreshold(max_overflow)``
    slot of its own histogram. Either way the slot must keep the **running
    bound**: the overflow of the step's tensors so far, this one included,
    within ``max_overflow`` of their bytes. When the plan's slot would break
    it -- the history was stale, came from another model, or was wrong in
    any other way -- the slot is widened to the smallest that keeps it, and
    the tensor is counted as **corrected** (:attr:`Placement.corrected`,
    ``session.stats().corrected``). The running bound holds after every
    tensor, so the step ends within ``max_overflow`` whatever tensors it
    turns out to have, exactly (overflow is whole sectors on both sides).
    Where history is right the plan keeps the bound by itself and nothing is
    corrected.

    A plan is made only in a step: a ``compressed_activations`` block opens
    one; :func:`buddy.wrap` alone plans nothing (call
    :meth:`Tracker.begin_step` once a step's keys have history).

    Against :class:`BuddyThreshold` with the same ``max_overflow``: the same
    bound on the step's traffic, no longer on each tensor's -- one tensor
    may spill 20 % while another keeps everything -- and the allowance that
    whole-sector slots leave unused in each tensor is spent where it saves
    the most.
    """

    def __init__(self, max_overflow: float = DEFAULT_MAX_OVERFLOW):
        self._per_tensor = BuddyThreshold(max_overflow)
        self.max_overflow = self._per_tensor.max_overflow
        self._stepping = False  # a step is open: groups are planned as they arrive
        self._planned: set[str] = set()  # groups planned this step
        self._allowance: dict[str, float] = {}  # per planned key not yet served this step: overflow bytes
        self._spare = 0.0  # allowance the step's planned tensors so far left unspent
        self._seen = 0  # bytes of the step's tensors so far
        self._spent = 0  # their overflow bytes

    @property
    def overflow_bound(self) -> float:  # type: ignore[override]  # a property over the class attribute
        return self.max_overflow

    def begin_step(self, tracker: Tracker) -> None:
        self._stepping = True
        self._planned, self._allowance = set(), {}
        self._spare, self._seen, self._spent = 0.0, 0, 0

    def plan(self, tracker: Tracker, group: str | None = None) -> dict[str, int]:
        """Slots for the keys of ``group``'s most recent step (every group's, for ``None``)."""
        groups = {h.group for h in tracker.histories()} if group is None else {group}
        slots: dict[str, int] = {}
        for g in sorted(groups):
            slots.update(self._planned_slots(tracker.latest_keys(g))[0])
        return slots

    def _planned_slots(self, keys: list[KeyHistory]) -> tuple[dict[str, int], dict[str, tuple[float, ...]]]:
        """The plan's slots for ``keys`` (in their step's order), and the predicted histograms it was made from.

        The plan keeps the running bound itself: at every key, the predicted
        overflow of the keys up to it stays within ``max_overflow`` of their
        bytes. So where the history is right, the step follows its plan and no
        slot is corrected.
        """
        keys = [h for h in keys if h.histograms and h.observations]
        plan, each, n, beyond, at = {}, {}, {}, {}, {}  # per key: slot, per-tensor rule's, entries, larger, place
        # slack[j]: how much more the keys up to the j-th may spill before the running bound is reached
        slack, room = [], 0.0
        predicted = {h.key: h.predicted() for h in keys}
        for j, h in enumerate(keys):
            counts, nbytes = predicted[h.key], h.observations[-1].original_bytes
            beyond[h.key], n[h.key], at[h.key] = larger_than(counts), h.n_entries, j
            plan[h.key] = tightest_slot(counts)
            each[h.key] = slot_for_overflow(counts, self.max_overflow, nbytes)
            room += self.max_overflow * nbytes
            slack.append(room)
        # cheapest spill first; at equal cost the widest slot, so that the spill spreads over the keys
        heap = [(beyond[key][s - 1] / n[key], -s, key) for key, s in plan.items() if s > 0 and n[key]]
        heapq.heapify(heap)
        # the running room as a list for a few keys, as a numpy array for many: the same subtractions, element by
        # element, and the same minimum (numpy's cost a call is more than a short list's loop, less than a long one's)
        many = len(slack) >= PLAN_ARRAY_KEYS
        room_left = np.array(slack, dtype=np.float64) if many else None
        while heap:
            _, _, key = heapq.heappop(heap)
            added = beyond[key][plan[key] - 1] * spec.SECTOR_BYTES
            if room_left is not None:
                after = room_left[at[key] :]
                if added > after.min():
                    continue  # this key's next steps down spill more still: it stays where it is
                after -= added
            else:
                rest = slack[at[key] :]
                if added > min(rest):
                    continue  # (as above)
                slack[at[key] :] = [v - added for v in rest]
            plan[key] -= 1
            if plan[key] > 0:
                heapq.heappush(heap, (beyond[key][plan[key] - 1] / n[key], -plan[key], key))
        # the greedy plan is not always the best: never hold more than the per-tensor rule would
        device = lambda slots: sum(n[key] * slot for key, slot in slots.items())  # noqa: E731
        return (each if device(each) < device(plan) else plan), predicted

    def _plan_group(self, tracker: Tracker, group: str) -> None:
        """Allowances for the keys of ``group``'s most recent step (once per group and step)."""
        self._planned.add(group)
        slots, predicted = self._planned_slots(tracker.latest_keys(group))
        for key, s in slots.items():
            self._allowance[key] = overflow_sectors(predicted[key], s) * spec.SECTOR_BYTES

    def choose(self, decision: Decision, tracker: Tracker) -> SlotChoice:
        if self._stepping and decision.group not in self._planned:
            self._plan_group(tracker, decision.group)
        # the running bound: the step's overflow so far, this tensor's included, within max_overflow of their bytes
        cap = self.max_overflow * (self._seen + decision.original_bytes) - self._spent
        allowance = self._allowance.pop(decision.key, None)
        corrected = False
        if allowance is None or decision.predicted is None:
            slot = self._per_tensor.choose(decision, tracker)  # spills <= max_overflow of itself <= cap
        else:
            wanted = allowance + self._spare
            slot = slot_for_overflow(decision.current, 1.0, min(wanted, cap))  # the smallest slot within both
            corrected = wanted > cap and slot != slot_for_overflow(decision.current, 1.0, wanted)
            self._spare = wanted - decision.overflow_bytes(slot)
        self._seen += decision.original_bytes
        self._spent += decision.overflow_bytes(slot)
        return SlotChoice(slot, corrected)

    def choose_ahead(self, decision: Decision, tracker: Tracker) -> SlotChoice | None:
        """A planned key's slot from its prediction alone (a key with no plan: ``None``, it is sized first).

        The same rule as :meth:`choose` with the prediction for the tensor's sizes: the smallest slot whose
        predicted overflow is within the key's allowance and what the step's earlier tensors left, and within the
        running bound. So the step keeps its bound where the history is right; where the tensor spills more than
        predicted, the step passes it by that much (the session reports it, and the next plan learns it)."""
        if self._stepping and decision.group not in self._planned:
            self._plan_group(tracker, decision.group)
        if decision.predicted is None or decision.key not in self._allowance:
            return None
        return self.choose(decision, tracker)


class CompressedOffload(Policy):
    """Offload every tensor, compressed: the zero slot, only metadata on the device.

    All of a tensor's compressed sectors go to buddy memory, so the link
    carries the compressed bytes -- ``ratio`` times fewer than an
    uncompressed offload (``torch.autograd.graph.save_on_cpu``). In a
    :func:`~buddy.compressed_activations` session, backward's look-ahead
    (:class:`~buddy.Prefetch`) brings them back before they are needed.
    """

    def choose(self, decision: Decision, tracker: Tracker) -> int:
        return 0

    choose_ahead = choose  # the slot needs no sizes


@dataclass
class Observation:
    """One packing of a key: the slot chosen, and predicted vs actual overflow (bytes)."""

    slot: int
    predicted_overflow_bytes: int | None
    overflow_bytes: int
    original_bytes: int
    ideal_bytes: int


@dataclass
class KeyHistory(LaidOut):
    """Recent entry-size histograms of one key, and how the predictions went."""

    key: str
    layout: Layout  # the tensor's entries and bytes when the key was last recorded
    decay: float
    window: int
    #: the key's group (:func:`group_of`), the tracker step it was last recorded in, and its place in that
    #: step's order of the group's keys (0 first)
    group: str = ""
    last_step: int = 0
    position: int = 0
    histograms: deque = field(default_factory=deque)
    observations: list[Observation] = field(default_factory=list)
    #: symbol statistics learned over the steps (a codec with a table fits it to them), or ``None``
    statistics: torch.Tensor | None = None
    #: the codec the last step was measured with (a codec with a table keeps it while it fits), or ``None``
    fitted: CodecLike | None = None
    #: steps recorded since the last with statistics (:meth:`Tracker.counts`)
    uncounted: int = 0
    #: GPU statistics on their way to the host: (pinned copy, event), oldest first
    _pending: deque = field(default_factory=deque, repr=False)
    #: (what it was made from, predicted()): the last one made
    _predicted: tuple | None = field(default=None, repr=False, compare=False)
    #: the window's histograms as float64 arrays (predicted's), kept beside ``histograms`` by add
    _arrays: deque = field(default_factory=deque, repr=False, compare=False)
    #: histograms added so far: what :meth:`predicted`'s last result was made after
    _added: int = field(default=0, repr=False, compare=False)

    def fits(self, layout: Layout) -> bool:
        """Whether a tensor of ``layout`` is the tensor this history is of (same entry size, same entries)."""
        return (layout.entry_bytes, layout.n_entries) == (self.entry_bytes, self.n_entries)

    @property
    def steps(self) -> int:
        return len(self.observations)

    def predicted(self) -> tuple[float, ...]:
        """Exponentially weighted mean histogram; the newest step weighs most."""
        # asked by the step's plan and again by each tensor's decision: made once per histogram added (the
        # window's contents change with every add, its length not once it is full)
        key = (self._added, self.decay)
        if self._predicted is not None and self._predicted[0] == key:
            return self._predicted[1]
        weights = [self.decay**age for age in range(len(self.histograms))]
        mixed = np.zeros(len(self.histograms[0]))
        # the window's histograms as float64 arrays, made once each as they were added (else here)
        arrays = self._arrays if len(self._arrays) == len(self.histograms) else self.histograms
        for w, hist in zip(weights, reversed(arrays)):  # a bin's sum in the same order, the same bits
            mixed += w * np.asarray(hist, dtype=np.float64)
        total = sum(weights)
        made = tuple((mixed / total).tolist())
        self._predicted = (key, made)
        return made

    def add(
        self, histogram, observation: Observation, statistics: torch.Tensor | None = None, fitted=None
    ) -> None:
        self.fitted = fitted
        self._added += 1
        self.histograms.append(tuple(histogram))
        self._arrays.append(np.asarray(self.histograms[-1], dtype=np.float64))
        while len(self.histograms) > self.window:
            self.histograms.popleft()
        while len(self._arrays) > len(self.histograms):
            self._arrays.popleft()
        self.observations.append(observation)
        self.uncounted = 0 if statistics is not None else self.uncounted + 1
        if statistics is not None:
            self.learn(statistics)

    def learn(self, statistics: torch.Tensor) -> None:
        """Mix a step's symbol statistics into the key's: frequencies, the newest weighing ``1 / decay`` as much.

        Statistics on a GPU come to the host on their own (a non-blocking
        copy and an event): the step that recorded them never waits, and a
        later step mixes them in once the copy has landed (:attr:`learned`).
        """
        if statistics.device.type == "cuda":
            host = torch.empty(statistics.shape, dtype=statistics.dtype, pin_memory=True)
            host.copy_(statistics, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(statistics.device))  # the copy above was queued on this stream
            self._pending.append((host, done))
        else:
            self._mix(statistics)

    def _mix(self, statistics: torch.Tensor) -> None:
        # (numpy: the same operations, element by element, on a few thousand numbers; the sum of counts is exact)
        new = statistics.detach().to("cpu", torch.float64).numpy()
        new = new / max(float(new.sum()), 1.0)
        old = self.statistics
        if old is not None and old.shape == new.shape:
            new = (new + self.decay * old.numpy()) / (1 + self.decay)
        self.statistics = torch.from_numpy(new)

    @property
    def learned(self) -> torch.Tensor | None:
        """The statistics learned so far (host, float64 frequencies), with every landed GPU copy mixed in."""
        while self._pending and self._pending[0][1].query():
            self._mix(self._pending.popleft()[0])
        return self.statistics

    @property
    def has_learned(self) -> bool:
        """Whether statistics have been learned, or are on their way (a GPU step's, not yet landed)."""
        return self.statistics is not None or bool(self._pending)

    @property
    def last_slot(self) -> int | None:
        return self.observations[-1].slot if self.observations else None

    def prediction_errors(self) -> list[float]:
        """Per predicted step: (actual - predicted overflow) / original bytes."""
        return [
            (o.overflow_bytes - o.predicted_overflow_bytes) / o.original_bytes
            for o in self.observations
            if o.predicted_overflow_bytes is not None and o.original_bytes
        ]



def _layout_arg(layout: Layout | None, entry_bytes: int | None, original_bytes: int | None) -> Layout:
    """The tensor's layout: ``layout``, or the one of ``entry_bytes`` and ``original_bytes`` (the earlier keywords)."""
    if layout is None:
        if entry_bytes is None or original_bytes is None:
            raise TypeError("the tracker needs the tensor's layout= (or entry_bytes= and original_bytes=)")
        return Layout(entry_bytes, original_bytes)
    if entry_bytes is not None or original_bytes is not None:
        raise TypeError("give the tracker layout= or entry_bytes= and original_bytes=, not both")
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a buddy.layout.Layout, got {type(layout).__name__}")
    return layout


class Tracker:
    """Per-key history and the slot decisions of a policy.

    Args:
        policy: default policy (a session may pass its own per step);
            default ``OverflowBudget(0.10)``, chosen on the tuning set
            (``experiments/decide.py``).
        decay: weight of a histogram one step older than the next (0..1);
            smaller follows drift faster. Default 0.5.
        window: histograms kept per key. Default 8.
        count_every: a codec with a table learns a key's symbol statistics:
            its tensor's symbols are counted -- a pass over the tensor -- and
            mixed into the key's. Every step for the key's first
            ``count_warmup`` steps (default 32: activations' statistics move
            most early in training), then every ``count_every`` steps
            (default 4; 1: every step). See :meth:`counts`.
        ledger: the :class:`~buddy.ledger.DeviceLedger` budgets are planned against,
            and that what is packed through the tracker holds its device
            bytes on. Default: the process-wide one at the time of use.

    Thread-safe. The process has a default tracker (:func:`default_tracker`),
    so history persists across ``compressed_activations`` blocks.

    One step of a tensor is :meth:`plan` (before packing) then :meth:`record`
    (with the slot it got): the training session, :func:`buddy.wrap` and the
    experiments' simulations all make exactly these two calls.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        decay: float = 0.5,
        window: int = 8,
        ledger: DeviceLedger | None = None,
        count_every: int = COUNT_EVERY,
        count_warmup: int = COUNT_WARMUP,
    ):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if isinstance(count_every, bool) or not isinstance(count_every, int) or count_every < 1:
            raise ValueError(f"count_every must be a positive int, got {count_every!r}")
        if isinstance(count_warmup, bool) or not isinstance(count_warmup, int) or count_warmup < 0:
            raise ValueError(f"count_warmup must be a non-negative int, got {count_warmup!r}")
        self.count_every, self.count_warmup = count_every, count_warmup
        self.policy = policy if policy is not None else OverflowBudget()
        self.decay = decay
        self.window = window
        if ledger is not None and not isinstance(ledger, DeviceLedger):
            raise TypeError(f"ledger must be a buddy.ledger.DeviceLedger, got {type(ledger).__name__}")
        self._ledger = ledger
        self._keys: dict[str, KeyHistory] = {}
        self._step = 0  # steps begun (begin_step)
        self._recorded: dict[str, tuple[int, int]] = {}  # per group: (step, keys recorded in it so far)
        # per group: the overflow sectors past the bound of its most recent steps packed ahead (the device reserve's)
        self._excess: dict[str, collections.deque[int]] = {}
        #: the most recent training step's saves, uses and memory (a session records it: :mod:`buddy.peak`), which
        #: the budget policies plan the next step from
        self.last_profile: StepProfile | None = None
        self._lock = threading.RLock()

    @property
    def ledger(self) -> DeviceLedger:
        """The ledger given, else the process-wide one."""
        return self._ledger if self._ledger is not None else default_ledger()

    @property
    def held_device_bytes(self) -> int:
        """Device bytes held on :attr:`ledger` right now."""
        return self.ledger.bytes_held

    def begin_step(self, policy: Policy | None = None) -> None:
        """A step opens (a ``compressed_activations`` block does this): ``policy`` (default: the tracker's)
        plans it."""
        with self._lock:
            self._step += 1
            (policy or self.policy).begin_step(self)

    @property
    def step(self) -> int:
        """Steps begun so far (:meth:`begin_step`)."""
        return self._step

    def latest_keys(self, group: str) -> list[KeyHistory]:
        """The keys of ``group`` (:func:`group_of`) recorded in that group's most recent step.

        What a step of the group plans from: keys the group stopped using
        (another shape, dtype or phase of training) drop out.
        """
        with self._lock:
            keys = [h for h in self._keys.values() if h.group == group and h.observations]
            last = max((h.last_step for h in keys), default=0)
            return sorted((h for h in keys if h.last_step == last), key=lambda h: h.position)

    def history(self, key: str) -> KeyHistory | None:
        return self._keys.get(key)

    def prior(self, key: str) -> torch.Tensor | None:
        """The symbol statistics learned for ``key`` over earlier steps (for :func:`buddy.measure`), or ``None``."""
        with self._lock:
            hist = self._keys.get(key)
            return None if hist is None else hist.learned

    def counts(self, key: str) -> bool:
        """Whether ``key``'s tensor this step should have its symbols counted (``count`` of :func:`buddy.measure`):
        unless the key has learned statistics, has :attr:`count_warmup` steps behind it, and was counted fewer
        than :attr:`count_every` steps ago."""
        with self._lock:
            hist = self._keys.get(key)
            if hist is None or not hist.has_learned or hist.steps < self.count_warmup:
                return True
            return hist.uncounted + 1 >= self.count_every

    def fitted(self, key: str) -> CodecLike | None:
        """The codec ``key``'s last step was measured with (``keep`` of :func:`buddy.measure`), or ``None``."""
        with self._lock:
            hist = self._keys.get(key)
            return None if hist is None else hist.fitted

    def histories(self) -> list[KeyHistory]:
        with self._lock:
            return list(self._keys.values())

    def plan(
        self,
        key: str,
        histogram,
        *,
        layout: Layout | None = None,
        policy: Policy | None = None,
        table_bytes: int = 0,
        entry_bytes: int | None = None,
        original_bytes: int | None = None,
    ) -> Placement:
        """Where a tensor about to be packed goes: its slot under ``policy`` (default: the tracker's).

        ``layout``: the tensor's entries and bytes (:attr:`buddy.pipeline.MeasuredTensor.layout`; or ``entry_bytes`` and
        ``original_bytes``, from which it is built); ``table_bytes``: the codec table it will carry on the device
        (budgets count it).
        """
        layout = _layout_arg(layout, entry_bytes, original_bytes)
        slot, predicted, corrected = self._decide(key, histogram, layout, policy, table_bytes)
        return Placement(slot, predicted, layout, table_bytes, corrected)

    def plan_ahead(
        self, key: str, layout: Layout, *, policy: Policy | None = None, table_bytes: int = 0
    ) -> Placement | None:
        """Where a tensor not yet sized goes, from the key's history alone (:meth:`Policy.choose_ahead`): what a
        step that reads nothing back per tensor packs with. ``None`` where the policy needs the tensor's own sizes
        (a new key, under most policies): size it first and :meth:`plan`. Record it as any other, once its sizes
        are read."""
        layout = _layout_arg(layout, None, None)
        policy = policy or self.policy
        held = self.ledger.bytes_held
        with self._lock:
            hist = self._keys.get(key)
            predicted = hist.predicted() if hist is not None and hist.fits(layout) and hist.histograms else None
            decision = Decision(
                key=key, layout=layout, current=() if predicted is None else predicted, predicted=predicted,
                held_device_bytes=held, table_bytes=table_bytes, group=group_of(key), ahead=True,
            )  # fmt: skip
            chosen = policy.choose_ahead(decision, self)
            if chosen is None:
                return None
            slot, corrected = (chosen.slot, chosen.corrected) if isinstance(chosen, SlotChoice) else (int(chosen), False)
            overflow = None if predicted is None else int(round(overflow_sectors(predicted, slot) * spec.SECTOR_BYTES))
            return Placement(slot, overflow, layout, table_bytes, corrected)

    def choose(self, key: str, histogram, **options) -> tuple[int, int | None]:
        """``(slot, predicted_overflow_bytes or None)`` for a tensor about to be packed: :meth:`plan`'s (the same
        keyword options), as a pair."""
        placement = self.plan(key, histogram, **options)
        return placement.slot, placement.predicted_overflow_bytes

    def _decide(self, key, histogram, layout: Layout, policy, table_bytes):
        """``(slot, predicted overflow bytes or None, corrected)``."""
        policy = policy or self.policy
        held = self.ledger.bytes_held
        with self._lock:
            hist = self._keys.get(key)
            compatible = hist is not None and hist.fits(layout)
            predicted = hist.predicted() if hist is not None and compatible and hist.histograms else None
            decision = Decision(
                key=key,
                layout=layout,
                current=tuple(histogram),
                predicted=predicted,
                held_device_bytes=held,
                table_bytes=table_bytes,
                group=group_of(key),
            )
            chosen = policy.choose(decision, self)
            slot, corrected = (chosen.slot, chosen.corrected) if isinstance(chosen, SlotChoice) else (int(chosen), False)
            if predicted is None:
                return slot, None, corrected
            return slot, int(round(overflow_sectors(predicted, slot) * spec.SECTOR_BYTES)), corrected

    def record(
        self,
        key: str,
        histogram,
        *,
        slot: int,
        layout: Layout | None = None,
        predicted_overflow_bytes,
        statistics: torch.Tensor | None = None,
        fitted: CodecLike | None = None,
        entry_bytes: int | None = None,
        original_bytes: int | None = None,
    ):
        """Add what happened when ``key`` (of ``layout``, or ``entry_bytes`` and ``original_bytes``) was packed
        with ``slot``.

        ``statistics``: the tensor's symbol statistics, if any; ``fitted``: the
        codec it was measured with (:attr:`buddy.pipeline.MeasuredTensor.codec`), for the next step to keep its table.
        """
        layout = _layout_arg(layout, entry_bytes, original_bytes)
        observation = Observation(
            slot=slot,
            predicted_overflow_bytes=predicted_overflow_bytes,
            overflow_bytes=layout.overflow_bytes(histogram, slot),
            original_bytes=layout.nbytes,
            ideal_bytes=layout.compacted_bytes(histogram),
        )
        with self._lock:
            hist = self._keys.get(key)
            if hist is None or not hist.fits(layout):
                # a new key, or the same name for a different tensor: start over
                hist = KeyHistory(key, layout, self.decay, self.window, group_of(key))
                self._keys[key] = hist
            step, count = self._recorded.get(hist.group, (self._step, 0))
            count = count if step == self._step else 0
            hist.last_step, hist.position = self._step, count
            self._recorded[hist.group] = (self._step, count + 1)
            hist.add(histogram, observation, statistics, fitted)
        return observation

    def record_excess(self, group: str, sectors: int) -> None:
        """A step of ``group`` packed ahead sent ``sectors`` overflow sectors past its running bound (to its device
        reserve, or, where that had no room, to buddy memory): what :meth:`reserve_sectors` sizes the next from."""
        if isinstance(sectors, bool) or not isinstance(sectors, int) or sectors < 0:
            raise ValueError(f"sectors must be a non-negative int, got {sectors!r}")
        with self._lock:
            self._excess.setdefault(group, collections.deque(maxlen=RESERVE_STEPS)).append(sectors)

    def reserve_sectors(self, group: str, bound: float) -> int:
        """The device reserve a step of ``group`` packed ahead under an overflow ``bound`` sets aside, in sectors:
        the most its last :data:`RESERVE_STEPS` steps sent past their bound, and a quarter more (0 where they sent
        none). Until :data:`RESERVE_STEPS` of its steps were packed ahead, at least a quarter of what the bound
        allows the group's latest step's bytes: the first plans are the least tried, and a model's first steps
        change the most."""
        with self._lock:
            seen = list(self._excess.get(group, ()))
            learned = -(-max(seen, default=0) * 5 // 4)
            if len(seen) >= RESERVE_STEPS:
                return learned
            nbytes = sum(h.observations[-1].original_bytes for h in self.latest_keys(group) if h.observations)
        return max(learned, int(bound * nbytes / 4) // spec.SECTOR_BYTES)

    def forget(self) -> None:
        """Drop every key's history (what the ledger holds stays)."""
        with self._lock:
            self._keys.clear()
            self._excess.clear()
            self.last_profile = None

    def __repr__(self) -> str:
        return f"Tracker(policy={self.policy!r}, keys={len(self._keys)}, decay={self.decay}, window={self.window})"


#: steps of a group whose overflow past their bound sizes its next device reserve (:meth:`Tracker.reserve_sectors`)
RESERVE_STEPS = 4

_default = ProcessDefault(Tracker, Tracker)


def default_tracker() -> Tracker:
    """The process-wide tracker (created on first use, OverflowBudget(0.10))."""
    return _default.get()


def set_default_tracker(value: Tracker | None) -> Tracker | None:
    """Replace the process-wide tracker (``None``: a fresh one on next use); returns the previous one."""
    return _default.set(value)
