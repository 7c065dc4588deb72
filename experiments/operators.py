"""Counting the torch operators a piece of work dispatches: what a compressed tensor costs the host.

:class:`OperatorCount` is a ``TorchDispatchMode`` that counts, by name, the operators that allocate or compute --
views and detaches apart, which neither allocate nor compute (autograd detaches every saved tensor anyway).
``experiments.host_cost`` reports a compressed tensor's operators with it, and the tests bound them.
"""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OperatorCount", "VIEWS"]

#: parts of the names of the operators that neither allocate nor compute: views, and detaches
VIEWS = ("detach", "slice", "view", "as_strided", "alias", "expand", ".t.", "transpose", "squeeze", "permute")


class OperatorCount(TorchDispatchMode):
    """While it is entered, every operator dispatched that allocates or computes, counted by name (:attr:`ops`)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    @property
    def count(self) -> int:
        """Operators counted, all names together."""
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not any(v in name for v in VIEWS):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
