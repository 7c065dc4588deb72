"""Write the self-test's vectors, a subset of the golden vectors: ``python tests/golden/make_selftest.py``.

The kernels' self-test (:mod:`buddy.selftest`) ships them as package data
(``buddy/selftest_vectors.npz``): the inputs ``buddy.selftest.INPUTS``,
each with every kernel codec's metadata, table and the slot and overflow
bytes of a slot of ``buddy.selftest.SLOT`` sectors, copied from the set
``buddy.selftest.SOURCES`` names for the codec. ``tests/test_selftest.py``
checks the shipped file holds exactly :func:`subset`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from buddy import selftest  # noqa: E402

OUT = ROOT / "buddy" / selftest.VECTORS


def subset() -> dict[str, np.ndarray]:
    """The arrays of the self-test's vectors, by the names the shipped file gives them."""
    sets = {name: np.load(HERE / f"{name}.npz") for name in sorted(set(selftest.SOURCES.values()))}
    try:
        out = {}
        for name in selftest.INPUTS:
            inputs = {s: data[f"{name}/input"] for s, data in sets.items()}
            first = next(iter(inputs.values()))
            assert all(np.array_equal(first, x) for x in inputs.values()), f"{name}: the sets' inputs differ"
            out[f"{name}/input"] = first
            for codec, source in selftest.SOURCES.items():
                data, key = sets[source], f"{name}/{codec}"
                for buffer in ("meta", "table", f"s{selftest.SLOT}/slots", f"s{selftest.SLOT}/overflow"):
                    if f"{key}/{buffer}" in data.files:
                        out[f"{key}/{buffer}"] = data[f"{key}/{buffer}"]
        return out
    finally:
        for data in sets.values():
            data.close()


def main() -> None:
    arrays = subset()
    np.savez_compressed(OUT, **arrays)
    print(f"{OUT.relative_to(ROOT)}: {len(arrays)} arrays, {OUT.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
