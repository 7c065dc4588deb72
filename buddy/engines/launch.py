"""How a kernel launch is laid out: blocks, threads and shared memory, by arithmetic alone.

Every launcher of the kernels reads its layout from here: CuPy's on a GPU
(:mod:`buddy.engines.cuda`, with the device's :class:`SharedMemory`), the
native build's on the CPU (:mod:`buddy.engines.native`: one warp's staging a
block), the block emulator's in the tests (:data:`HOPPER`). Nothing here
touches a device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..codecs.fpe_device import DECODE_ROWS_BYTES, FIELDS_BYTES
from .sources import TABLED_KERNELS

__all__ = [
    "MAX_BLOCKS", "COUNT_BLOCKS", "DRAIN_BLOCKS", "STAGING_BYTES", "ENDS_THREADS", "WARP", "SharedMemory", "HOPPER",
    "shared_table_layout", "shares_tables", "launch_config",
]  # fmt: skip

#: most blocks of one launch; warps stride over further entries
MAX_BLOCKS = 1 << 20
#: most blocks of a count launch: about as many blocks of 256 threads as a Hopper GPU (:data:`HOPPER`) holds at once.
#: Each block zeroes its histogram in shared memory and adds it to the tensor's once, so a block per entry would
#: spend more on its histogram than on counting (docs/gpu.md)
COUNT_BLOCKS = 1024
#: most blocks of a drain launch (an overflow ring's copy to buddy memory, :mod:`buddy.ring`): its stores cross the
#: bus, which a few SMs' worth of stores in flight keep busy, and the SMs are forward's (a guess a GPU run should tune)
DRAIN_BLOCKS = 32
#: shared memory (bytes) a block of pack or unpack stages payloads in: one entry per warp
STAGING_BYTES = 32 << 10
#: threads of the one block of an ends launch (``BUDDY_ENDS_THREADS``)
ENDS_THREADS = 256
#: threads of a warp
WARP = 32


@dataclass(frozen=True)
class SharedMemory:
    """What a device's shared memory allows a launch: its SMs, the most dynamic shared memory one block may ask
    for (opted in), an SM's, and what the runtime keeps of an SM's for each block resident on it."""

    sms: int
    per_block: int
    per_sm: int
    reserved: int = 1 << 10

    def blocks_per_sm(self, block_bytes: int, warps: int) -> int:
        """Blocks of ``warps`` warps and ``block_bytes`` of shared memory resident on an SM at once (64 warps and 32
        blocks an SM at most)."""
        return min(self.per_sm // (block_bytes + self.reserved), 64 // warps, 32)


#: a Hopper GPU's shared memory (an H100 SXM's, an H200's): the device the emulator's launches and the kernel
#: budget's estimates are laid out for
HOPPER = SharedMemory(sms=132, per_block=227 << 10, per_sm=228 << 10)


@functools.cache
def shared_table_layout(entry_bytes: int, shared: SharedMemory, most_an_sm: int = 64) -> tuple[int, int] | None:
    """``(warps a block, blocks an SM)`` of a table codec's unpack with its table in shared memory on a device
    of ``shared``: each block holds the table's decode rows (:data:`DECODE_ROWS_BYTES`) and ``2 E`` a warp; the
    most warps an SM (ties: the larger blocks, fewer copies of the rows), at most 24 warps a block at 4 KiB
    entries and more (the kernel's launch bounds), 8 below, ``most_an_sm`` warps (at most 64) and 32 blocks an
    SM. None where one warp's does not fit a block: the table stays in global memory."""
    most = min(24 if entry_bytes >= 4096 else 8, most_an_sm)
    best: tuple[int, int] | None = None
    for warps in range(1, most + 1):
        block = DECODE_ROWS_BYTES + warps * 2 * entry_bytes
        if block > shared.per_block:
            break
        per_sm = min(shared.blocks_per_sm(block, warps), most_an_sm // warps)
        if per_sm and (best is None or per_sm * warps >= best[0] * best[1]):
            best = warps, per_sm
    return best


def shares_tables(codec: str, entry_bytes: int, shared: SharedMemory) -> bool:
    """Whether ``codec``'s tables go into the shared memory of a device of ``shared`` (its module compiled so: every
    kernel of the codec comes from that one module). Unpack's needs the most room: where it fits, pack's does."""
    return codec in TABLED_KERNELS and shared_table_layout(entry_bytes, shared) is not None


def launch_config(
    op: str, entry_bytes: int, n_entries: int, codec: str = "", shared: SharedMemory | None = None,
    pack_fields: bool = False, unpack_warps: int | None = None,
) -> tuple[int, int, int]:  # fmt: skip
    """``(blocks, threads per block, dynamic shared bytes)`` of a launch of ``op`` over ``n_entries``.

    One warp per entry; pack and unpack give each warp ``E`` bytes of shared
    memory to stage a payload in (at most :data:`STAGING_BYTES` a block, at
    least one warp), and the unpack of a table codec (``codec`` in
    :data:`~buddy.engines.sources.TABLED_KERNELS`, whose lanes decode into shared memory) ``2 E``;
    measure, and sizes (measure, then the ends in its last block), stage
    nothing and run 8 warps a block (:data:`ENDS_THREADS` threads). A table codec's
    ``count`` runs 256 threads a block, a thread per 16 bytes
    (``n_entries``: the 8-byte units) up to :data:`COUNT_BLOCKS` blocks,
    which then loop; its ``fit`` is one warp. A ``drain`` runs 256 threads a block, at most
    :data:`DRAIN_BLOCKS` blocks, which loop.

    Given the device's ``shared`` memory, a table codec's tables go into
    each block's shared memory, before the warps' staging (the module
    compiled with ``compile_options(..., shared_tables=True)``): unpack's copy
    of the device table's decode rows, where :func:`shared_table_layout` finds room, and
    with ``pack_fields`` (:attr:`Tuning.pack_fields`) pack's table of whole fields
    (:data:`FIELDS_BYTES`), its warps as before. Either runs as many blocks as
    stay resident at once, their warps striding over the entries, so a block
    makes its table once. ``unpack_warps`` (:attr:`Tuning.unpack_warps`): that unpack at most so many warps an SM.
    """
    if op == "fit":
        return 1, WARP, 0
    if op == "ends":  # one block (csrc/buddy_kernels.cu: BUDDY_ENDS_THREADS)
        return 1, ENDS_THREADS, 0
    if op == "drain":  # a thread per 8 bytes of the worst case (every entry raw), 8 a round; the blocks then loop
        return max(1, min(DRAIN_BLOCKS, -(-n_entries * entry_bytes // (8 * 8 * 256)))), 256, 0
    if op == "count":  # a lane loads 16 bytes a round; the blocks loop, their histograms zeroed and added once
        return max(1, min(COUNT_BLOCKS, -(-n_entries // 512))), 256, 0
    tables = shared if codec in TABLED_KERNELS else None
    found = None
    if tables is not None and op == "unpack":
        found = shared_table_layout(entry_bytes, tables, unpack_warps or 64)
    if tables is not None and found is not None:
        warps, per_sm = found
        blocks = max(1, min(tables.sms * per_sm, -(-n_entries // warps)))
        return blocks, warps * WARP, DECODE_ROWS_BYTES + warps * 2 * entry_bytes
    staged = op not in ("measure", "sizes")
    per_warp = entry_bytes * (2 if op == "unpack" and codec in TABLED_KERNELS else 1)
    warps = max(1, min(8, STAGING_BYTES // per_warp)) if staged else 8
    blocks = max(1, min(MAX_BLOCKS, -(-n_entries // warps)))
    if tables is not None and pack_fields and op == "pack":  # the fields, then the warps' staging; resident blocks loop
        block = FIELDS_BYTES + warps * entry_bytes
        return max(1, min(tables.sms * max(1, tables.blocks_per_sm(block, warps)), blocks)), warps * WARP, block
    return blocks, warps * WARP, warps * per_warp if staged else 0
