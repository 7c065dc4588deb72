"""Streams and events: where buddy's copies run, and how every other stream is ordered against them.

Every cross-stream use in buddy goes through one :class:`StreamOps`, chosen
by the tensor's own device (:func:`for_device`) -- never the current
device's:

* CUDA tensors: :class:`CudaStreams`. Overflow copies run on one **copy
  stream per device**, made once; an event orders them after the kernels
  that wrote what they read, and the compute stream waits for a copy only
  where it reads its result, so forward never waits for its own offload.
  With overlap on (:mod:`buddy.overlap`) packing runs on one **pack stream
  per device**, beside forward's kernels;
* CPU tensors: :class:`HostStreams`: one "stream", nothing asynchronous,
  every event already complete.

Tests that check the ordering and bookkeeping without a GPU install a
stand-in with :func:`use` (never for claims about speed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["StreamOps", "CudaStreams", "HostStreams", "for_device", "use"]


class StreamOps:
    """What buddy needs of streams and events on one kind of device.

    ``stream`` arguments are what :meth:`current` and :meth:`copy_stream`
    return; events what :meth:`record` returns (``None``: already complete).
    """

    #: whether nothing is asynchronous (the host's tensors): what a kernel writes is written when it returns, so an
    #: engine may write the overflow straight into buddy memory instead of staging it for a copy
    synchronous = False

    def current(self, device: torch.device):
        """The stream work for ``device`` is issued on now."""
        raise NotImplementedError

    def copy_stream(self, device: torch.device):
        """The stream buddy's copies of ``device``'s tensors run on (one per device)."""
        raise NotImplementedError

    def pack_stream(self, device: torch.device):
        """The stream buddy packs ``device``'s tensors on when packing overlaps forward (one per device)."""
        raise NotImplementedError

    def activate(self, stream) -> contextlib.AbstractContextManager:
        """Issue the work of the ``with`` block on ``stream``."""
        raise NotImplementedError

    def record(self, stream):
        """An event that completes when the work issued on ``stream`` so far has."""
        raise NotImplementedError

    def wait(self, stream, event) -> None:
        """Make ``stream``'s later work wait for ``event`` (no host wait)."""
        raise NotImplementedError

    def keep_for(self, tensor: torch.Tensor, stream) -> None:
        """``tensor``'s memory is used on ``stream``: the allocator must not reuse it before that work ends."""
        raise NotImplementedError

    def done(self, event) -> bool:
        """Whether ``event`` has completed (never waits)."""
        raise NotImplementedError

    def synchronize(self, event) -> None:
        """Wait on the host until ``event`` has completed."""
        raise NotImplementedError


class HostStreams(StreamOps):
    """CPU tensors: everything runs in order, at once; no event is ever pending."""

    synchronous = True

    def current(self, device):
        return None

    copy_stream = pack_stream = current

    def activate(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        return None

    def wait(self, stream, event) -> None:
        pass

    def keep_for(self, tensor, stream) -> None:
        pass

    def done(self, event) -> bool:
        return True

    def synchronize(self, event) -> None:
        pass


class CudaStreams(StreamOps):
    """CUDA: torch's streams and events, each on the tensor's own device."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, int], torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def current(self, device):
        return torch.cuda.current_stream(device)

    def _side(self, device, role: str) -> torch.cuda.Stream:
        """The device's stream for ``role``, made at its first use."""
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        with self._lock:
            stream = self._made.get((role, index))
            if stream is None:
                stream = self._made[role, index] = torch.cuda.Stream(device=index)
        return stream

    def copy_stream(self, device):
        return self._side(device, "copy")

    def pack_stream(self, device):
        return self._side(device, "pack")

    def activate(self, stream):
        return torch.cuda.stream(stream)

    def record(self, stream):
        return stream.record_event()  # on the stream's own device

    def wait(self, stream, event) -> None:
        if event is not None:
            stream.wait_event(event)

    def keep_for(self, tensor, stream) -> None:
        if tensor.is_cuda:  # buddy memory on the host is kept by the store's own events
            tensor.record_stream(stream)

    def done(self, event) -> bool:
        return event is None or event.query()

    def synchronize(self, event) -> None:
        if event is not None:
            event.synchronize()


_HOST = HostStreams()
_CUDA = CudaStreams()
_override: dict[str, StreamOps] = {}


def for_device(device: torch.device | str) -> StreamOps:
    """The stream operations of ``device``'s kind (CUDA or host), or what :func:`use` installed for it."""
    kind = torch.device(device).type
    if kind in _override:
        return _override[kind]
    return _CUDA if kind == "cuda" else _HOST


@contextlib.contextmanager
def use(ops: StreamOps, device_type: str = "cpu") -> Iterator[StreamOps]:
    """Use ``ops`` for tensors on ``device_type`` inside the block (tests of the bookkeeping)."""
    previous = _override.get(device_type)
    _override[device_type] = ops
    try:
        yield ops
    finally:
        if previous is None:
            _override.pop(device_type, None)
        else:
            _override[device_type] = previous
