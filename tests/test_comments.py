"""Comments state contracts and reasons; measurements live in results and docs, history in git.

A date in the package's or the kernels' sources marks a comment that records when something was measured: it goes
stale with the next run. This keeps them out (docs/ and experiments/results/ hold the dated figures).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*(ROOT / "buddy").rglob("*.py"), *(ROOT / "csrc").rglob("*.h"), *(ROOT / "csrc").rglob("*.cu"),
           *(ROOT / "csrc").rglob("*.cpp")]  # fmt: skip
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def test_no_dated_measurements_in_the_package_or_the_kernels():
    assert len(SOURCES) > 40
    dated = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SOURCES
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if DATE.search(line)
    ]
    assert not dated, "dated figures belong in docs/ or experiments/results/:\n" + "\n".join(dated)
