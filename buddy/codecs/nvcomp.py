"""nvcomp chunk codecs: every entry is one nvcomp chunk, inside buddy's slot format.

``nvcomp-lz4``, ``nvcomp-ans``, ``nvcomp-bitcomp``, ``nvcomp-cascaded``,
``nvcomp-gdeflate`` and ``nvcomp-zstd`` run nvcomp's batched GPU compressors
(through its Python API, the ``nvidia-nvcomp-cu12`` / ``-cu13`` wheels) with
one entry per chunk, so a tensor keeps buddy's layout: a fixed slot per entry
on the device, the rest of the entry's stream in buddy memory, the sector
count in the metadata. They are meant for entries of 4-64 KiB (nvcomp's
chunk sizes; at 128 B a chunk's own framing costs more than it saves), run on
CUDA tensors only, and raise :class:`~buddy.errors.MissingDependencyError`
anywhere else, before any work.

Payload of an entry (``0 < k < E/32``): the stream's length as a
little-endian ``uint32``, then nvcomp's raw stream (no nvcomp header), then
zero padding to ``k`` sectors. ``k = 0`` is an all-zero entry and
``k = E/32`` the entry itself, as for every codec. One metadata mode (0).
nvcomp has no size-only pass, so sizing encodes.

They are registered with their own implementation (backend ``"nvcomp"``,
CUDA tensors only; see :mod:`buddy.dispatch`); where nvcomp or a CUDA device
is missing, :func:`buddy.get_codec` refuses their names and says why.
"""

from __future__ import annotations

import torch

from .. import spec
from ..deps import available, require, require_cuda
from ..engine import BlockEngine
from ..errors import CorruptDataError, MissingDependencyError
from .base import Analysis, Codec

__all__ = ["NvcompCodec", "NvcompEngine", "ALGORITHMS", "NAMES", "usable", "why_unusable"]

#: nvcomp algorithm names (as its Python API spells them) by buddy codec name
ALGORITHMS = {
    "nvcomp-lz4": "LZ4",
    "nvcomp-ans": "ANS",
    "nvcomp-bitcomp": "Bitcomp",
    "nvcomp-cascaded": "Cascaded",
    "nvcomp-gdeflate": "GDeflate",
    "nvcomp-zstd": "Zstd",
}
NAMES = tuple(ALGORITHMS)
_LENGTH_BYTES = 4


def why_unusable() -> str | None:
    """Why the nvcomp codecs cannot run here, or ``None`` when they can."""
    if not torch.cuda.is_available():
        return "they run on CUDA tensors and PyTorch sees no CUDA device"
    if not available("nvidia.nvcomp"):
        return "nvcomp is not installed: pip install 'buddy[cuda12]' or 'buddy[cuda13]'"
    return None


def usable() -> bool:
    """Whether nvcomp and a CUDA device are both present."""
    return why_unusable() is None


class _Compressed(Analysis):
    """nvcomp has no size-only pass: the analysis of a block is its compressed streams."""

    def __init__(self, codec: NvcompCodec, entries: torch.Tensor):
        n, e = entries.shape
        spe = spec.sectors_per_entry(e)
        self.entry_bytes = e
        self.sectors = torch.full((n,), spe, dtype=torch.int32, device=entries.device)
        self.modes = torch.zeros_like(self.sectors)
        self._streams: dict[int, torch.Tensor] = {}
        rows = (entries != 0).any(dim=1).nonzero().view(-1).tolist()
        if not rows:
            return
        nvcomp, coder = codec._nvcomp(entries)
        coded, ks = [], []
        for i, stream in zip(rows, coder.encode([nvcomp.as_array(entries[i]) for i in rows])):
            data = torch.as_tensor(stream, device=entries.device).reshape(-1).view(torch.uint8)
            k = -(-(data.numel() + _LENGTH_BYTES) // spec.SECTOR_BYTES)
            if k < spe:
                self._streams[i] = data
                coded.append(i)
                ks.append(k)
        if coded:  # the sector counts in one transfer
            self.sectors[torch.tensor(coded, device=entries.device)] = torch.tensor(ks, dtype=torch.int32).to(
                entries.device
            )

    def streams(self, rows=None):
        rows = list(range(self.sectors.numel())) if rows is None else rows.tolist()
        device = self.sectors.device
        payload = torch.zeros(len(rows), self.entry_bytes, dtype=torch.uint8, device=device)
        lengths = []
        for j, i in enumerate(rows):
            data = self._streams[i]
            payload[j, _LENGTH_BYTES : _LENGTH_BYTES + data.numel()] = data
            lengths.append(data.numel())
        if lengths:  # the length headers in one transfer
            heads = torch.tensor(lengths, dtype=torch.int32).view(torch.uint8).view(-1, _LENGTH_BYTES)
            payload[:, :_LENGTH_BYTES] = heads.to(device)
        return payload


class NvcompCodec(Codec):
    """One nvcomp algorithm as a buddy codec (entry = chunk); CUDA tensors only, run by :class:`NvcompEngine`."""

    def __init__(self, name: str):
        if name not in ALGORITHMS:
            raise ValueError(f"unknown nvcomp codec {name!r}; one of {', '.join(NAMES)}")
        self.name = name
        self.algorithm = ALGORITHMS[name]
        self._codecs: dict[tuple, object] = {}

    # -- nvcomp plumbing ---------------------------------------------------------
    def _check(self, entries: torch.Tensor) -> None:
        if entries.device.type != "cuda":
            require_cuda(f"codec {self.name!r}")  # a clear diagnosis on a machine without a GPU
            raise MissingDependencyError(
                f"codec {self.name!r} runs nvcomp on the GPU: move the tensor to CUDA first "
                f"(got a {entries.device.type} tensor), or use a reference codec such as 'auto' on the CPU"
            )

    def _nvcomp(self, entries: torch.Tensor):
        """nvcomp's module and a Codec for this algorithm and chunk size on the current stream."""
        nvcomp = require("nvidia.nvcomp", f"codec {self.name!r}")
        stream = torch.cuda.current_stream(entries.device)
        key = (entries.device.index, stream.cuda_stream, entries.shape[1])
        codec = self._codecs.get(key)
        if codec is None:
            codec = nvcomp.Codec(
                algorithm=self.algorithm,
                device_id=entries.device.index,
                cuda_stream=stream.cuda_stream,
                uncomp_chunk_size=entries.shape[1],
                bitstream_kind=nvcomp.BitstreamKind.RAW,
            )
            self._codecs[key] = codec
        return nvcomp, codec

    # -- the codec interface -------------------------------------------------------
    def analyse(self, entries: torch.Tensor, word_bytes: int) -> Analysis:
        self._check(entries)
        return _Compressed(self, entries)

    def decode(self, payload, sectors, modes, word_bytes):
        self._check(payload)
        n, e = payload.shape
        heads = payload[:, :_LENGTH_BYTES].contiguous().view(torch.int32).view(-1)
        lengths = heads.tolist()
        for length, k in zip(lengths, sectors.tolist()):
            if not 0 < length <= k * spec.SECTOR_BYTES - _LENGTH_BYTES:
                raise CorruptDataError(f"codec {self.name!r}: stream length {length} does not fit {k} sectors")
        nvcomp, codec = self._nvcomp(payload)
        streams = [nvcomp.as_array(payload[i, _LENGTH_BYTES : _LENGTH_BYTES + m]) for i, m in enumerate(lengths)]
        try:
            decoded = codec.decode(streams)
        except Exception as exc:  # nvcomp reports a bad stream by raising; say which codec and why
            raise CorruptDataError(f"codec {self.name!r}: nvcomp could not decode an entry ({exc})") from exc
        out = torch.empty_like(payload)
        for i, entry in enumerate(decoded):
            data = torch.as_tensor(entry, device=payload.device).reshape(-1).view(torch.uint8)
            if data.numel() != e:
                raise CorruptDataError(f"codec {self.name!r}: an entry decoded to {data.numel()} bytes, not {e}")
            out[i] = data
        return out


class NvcompEngine(BlockEngine):
    """nvcomp's codecs under the format layer (entry = chunk), on CUDA tensors."""

    backend = "nvcomp"

    def __init__(self, codec: Codec):
        if not isinstance(codec, NvcompCodec):
            raise ValueError(f"the nvcomp engine runs nvcomp codecs, not {codec!r}")
        super().__init__(codec)
