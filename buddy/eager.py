"""What TorchDynamo never traces: buddy's hooks, finalizers and callbacks run eagerly, even from compiled code.

Backward called inside a compiled train step, an eager op at a graph break or a session opened inside a compiled
function would otherwise run the hooks -- and the BuddyTensor finalizers -- under the frame evaluator, which
compiles the codec and the store piece by piece (slow, recompiled per tensor size, and the codec's integer work
handed to another compiler).
"""

from __future__ import annotations

import functools
import sys

import torch

__all__ = ["eager_only"]


def eager_only(fn):
    """``fn``, never traced by TorchDynamo (called from compiled code, it runs eagerly).

    Applied when a session opens. If the compiler is not loaded by then,
    nothing in this process has been compiled, and it is not loaded for this
    (importing it takes seconds).
    """
    if "torch._dynamo" not in sys.modules:
        return fn
    disabled = torch.compiler.disable(fn)
    frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    skip_code = getattr(sys.modules["torch._dynamo"].eval_frame, "skip_code", None)
    if frame_callback is None or skip_code is None:  # (a torch without them: always through the compiler's wrapper)
        return disabled

    def eager(*args):
        # Where no compiled code runs (TorchDynamo's frame callback unset: most calls), fn as it is -- the
        # compiler's wrapper costs a few microseconds a call, on every save and unpack -- else through it.
        return fn(*args) if frame_callback() is None else disabled(*args)

    skip_code(eager.__code__)  # TorchDynamo runs this frame as it is, never traces it
    return functools.wraps(fn)(eager)
