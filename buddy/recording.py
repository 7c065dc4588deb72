"""Recording what a session would compress, changing nothing: :func:`record_activations`.

:func:`record_activations` opens the same hooks with the same skip, dedup
and key rules, but only records a copy of each tensor a session would
compress and changes nothing (the capacity experiments measure on what it
records).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .hooks import DEFAULT_MIN_BYTES, _SavedTensorHooks
from .layout import dense_strides
from .saved import _AsIs
from .stats import SessionStats

__all__ = ["record_activations", "Recorder", "RecordedTensor"]


@dataclass
class RecordedTensor:
    """One tensor a session would have compressed: its key, a copy of it, and the op that made it.

    ``tensor`` is a detached copy on the recorder's device with the
    original's strides when they were dense (its bytes in memory order are
    the ones a session compresses); ``op`` is the name of the autograd node
    that produced it (e.g. ``"ReluBackward0"``; ``""`` for inputs and
    tensors made without grad).
    """

    key: str
    tensor: torch.Tensor = field(repr=False)
    op: str


class Recorder(_SavedTensorHooks):
    """Records what a :class:`Session` with the same settings would compress; changes nothing.

    After the block, :attr:`tensors` lists the :class:`RecordedTensor` s in
    saving order and :meth:`stats` counts as a session's would
    (``original_bytes``: the unique storages behind them; ``skipped_bytes``:
    every save a session would not compress). Autograd keeps the original
    tensors, so training goes on exactly as without the block.
    """

    _what = "record_activations block"

    def __init__(
        self,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        exclude=None,
        key_prefix: str = "",
        device="cpu",
        rederive_casts: bool = True,
    ):
        self.device = torch.device(device)
        super().__init__(
            min_bytes=min_bytes, exclude=exclude, key_prefix=key_prefix, enabled=True, rederive_casts=rederive_casts
        )

    def _reset(self) -> None:
        super()._reset()
        self.tensors: list[RecordedTensor] = []

    def _take(self, t: torch.Tensor, key: str):
        op = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
        x = t.detach().resolve_conj().resolve_neg()
        # the bytes a session compresses: memory order for a dense layout, C order for one with gaps
        layout = torch.preserve_format if dense_strides(x.shape, x.stride()) else torch.contiguous_format
        self.tensors.append(RecordedTensor(key, x.to(self.device, memory_format=layout, copy=True), op))
        return _AsIs(t), None  # a new object a save: a dedup hit can check it is still held

    def _rederived(self, t: torch.Tensor, source: torch.Tensor):
        return _AsIs(t)  # a parameter's copy a session makes again in backward: counted as such, not recorded

    def stats(self) -> SessionStats:
        """What a session would have seen (no rows: nothing was compressed)."""
        with self._lock:
            return SessionStats(**{k: v for k, v in vars(self._stats).items() if k != "rows"})


def record_activations(
    *, min_bytes: int = DEFAULT_MIN_BYTES, exclude=None, key_prefix: str = "", device="cpu", rederive_casts: bool = True
):
    """A context manager that records, without compressing, what a session would compress.

    The same skip, dedup and key rules as :func:`compressed_activations`
    (``min_bytes``, ``exclude``, ``key_prefix``, ``rederive_casts`` as
    there: a parameter's copy a session makes again is not recorded); each
    tensor taken is copied to ``device``. Returns a :class:`Recorder`.
    """
    return Recorder(
        min_bytes=min_bytes, exclude=exclude, key_prefix=key_prefix, device=device, rederive_casts=rederive_casts
    )
