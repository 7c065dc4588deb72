"""Keys of saved activations, and what the session leaves to autograd: parameters and excluded storages.

Keys: a saved tensor's key names the model that saved it, then the tensor:
``"<model>/<index>:<dtype><shape>"``, the index counting the model's tensors
in the step. ``<model>`` is derived from what the session sees, never from a
name the user must remember: the outermost ``nn.Module`` whose forward is
running when the tensor is saved, as its class name and a fingerprint of its
module tree (every submodule's name and class, every parameter's name, shape
and dtype) -- ``"ResNet-1a2b3c4d"``; a tensor saved outside any module's
forward (the loss, after the model returned) takes the model of the step's
previous tensor, and a step with no module at all takes the place in the
code that opened the session (``"train.py:42"``). So the same model gets the
same keys step after step -- its history is shared on purpose -- while two
different models (a teacher and a student, a GAN's two nets, two models of
a sweep), or the same class built with other sizes or parameter dtypes,
never share a key, even on one tracker; an activation dtype or shape that
changes (autocast on, another batch size) is another key too. The tracker
plans each model from its own keys (a key's group is its model: see
:mod:`buddy.tracker`). ``key_prefix="name/"`` replaces the derived model
name (``"name/<index>:..."``) for explicit control: sessions that give the
same prefix share history.
"""

from __future__ import annotations

import hashlib
import os
import sys
from types import FrameType

import torch

__all__ = ["cast_source", "is_parameter", "module_name", "node_sequence_now"]


def is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter, a view of one, or a leaf that requires grad (never compressed)."""
    base = t._base
    base = t if base is None else base
    if base.is_leaf and base.requires_grad:
        return True
    if type(base) is torch.Tensor:  # what isinstance(base, Parameter) says of a plain tensor (torch's _ParameterMeta:
        return bool(getattr(base, "_is_param", False))  # its _is_param flag), without the metaclass's Python call
    return isinstance(base, torch.nn.Parameter)


def node_sequence_now() -> int:
    """The sequence number the next autograd node made on this thread will have, or more (numbers grow per thread):
    a node numbered at least this was made after the call. ``sys.maxsize`` where none can be made here (inference
    mode), so that no node counts as made after."""
    try:
        with torch.enable_grad():
            node = torch.empty(0, requires_grad=True).view(0).grad_fn
    except RuntimeError:
        return sys.maxsize
    return sys.maxsize if node is None else node._sequence_nr() + 1


def cast_source(t: torch.Tensor, since: int) -> torch.Tensor | None:
    """The parameter ``t`` is an exact copy of, or a view of one, where the copy was made on this thread after
    ``since`` (:func:`node_sequence_now`); ``None`` for any other tensor.

    What qualifies is what autocast saves for a weight, and ``.to(dtype)`` of a parameter: a ``_to_copy`` of a leaf
    that requires grad (its ``grad_fn`` a ``ToCopyBackward0`` whose one input is the leaf's ``AccumulateGrad``), on
    the leaf's device, with its shape and strides, at offset 0. ``source.to(t.dtype)`` then makes the copy's very
    bytes again -- as long as the leaf is not changed in place, which its version says. Made after ``since`` (in the
    step): a copy made before, autocast's cache kept over an optimizer's step, may hold values the leaf no longer
    has.
    """
    base = t if t._base is None else t._base
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or fn._sequence_nr() < since:
        return None
    inputs = fn.next_functions
    if len(inputs) != 1 or inputs[0][0] is None:
        return None
    source = getattr(inputs[0][0], "variable", None)  # (an AccumulateGrad's leaf)
    if (
        source is None or type(source) not in (torch.Tensor, torch.nn.Parameter) or type(base) is not torch.Tensor
        or source.layout is not torch.strided or source.is_nested or source.is_quantized
        or not source.dtype.is_floating_point or not base.dtype.is_floating_point
        or base.is_conj() or base.is_neg() or source.is_conj() or source.is_neg()
        or source.device != base.device or source.shape != base.shape or source.stride() != base.stride()
        or base.storage_offset() != 0
    ):  # fmt: skip
        return None
    return source


def _tensor_key(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype}{list(t.shape)}"

#: the code objects of ``nn.Module.__call__``'s frames, whose ``self`` is the module being called
_CALL_CODES = frozenset(
    fn.__code__
    for fn in (getattr(torch.nn.Module, "_call_impl", None), getattr(torch.nn.Module, "_wrapped_call_impl", None))
    if fn is not None
)


def _outermost_call(known: dict[FrameType, str]) -> tuple[FrameType | None, str | None]:
    """The frame of the outermost module call on this thread's stack (``None``: no module's forward is running),
    and its prefix where ``known`` holds it.

    ``known`` maps outermost call frames to their prefixes, the frames held (so none is freed and another made at
    its address while it is a key). A known frame met on the way up is still running, so everything above it is
    as it was when it was found outermost: the walk stops there, reading no frame's locals. A model is then named
    once per call (a step's forward), not once per tensor.
    """
    frame: FrameType | None = sys._getframe(2)
    outer = None
    while frame is not None:
        hit = known.get(frame)
        if hit is not None:
            return frame, hit
        if frame.f_code in _CALL_CODES:
            outer = frame
        frame = frame.f_back
    return outer, None


def module_name(module: torch.nn.Module) -> str:
    """A model's name in keys: its class and a fingerprint of its module tree (see "Keys" in the module doc).

    The fingerprint covers every submodule's name and class and every
    parameter's name, shape and dtype, so it is the same for the same model
    step after step and differs between models that differ in any of these.
    """
    h = hashlib.blake2b(digest_size=4)
    for name, sub in module.named_modules():
        h.update(f"{name}:{type(sub).__qualname__};".encode())
    for name, p in module.named_parameters():
        h.update(f"{name}:{p.dtype}{tuple(p.shape)};".encode())
    return f"{type(module).__name__}-{h.hexdigest()}"


def _call_site() -> str:
    """``"file.py:line"`` of the first frame outside buddy: where the user opened the block."""
    here = os.path.dirname(__file__)  # (the package's folder: this module lies at its top)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame = frame.f_back
    if frame is None:
        return "session"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _storages_of(exclude) -> frozenset[int]:
    if exclude is None:
        return frozenset()
    items = exclude if isinstance(exclude, (list, tuple, set)) else [exclude]
    tensors = []
    for item in items:
        if isinstance(item, torch.nn.Module):
            tensors += list(item.parameters()) + list(item.buffers())
        elif isinstance(item, torch.Tensor):
            tensors.append(item)
        else:
            raise TypeError(f"exclude takes modules and tensors, got {type(item).__name__}")
    return frozenset(t.untyped_storage()._cdata for t in tensors)
