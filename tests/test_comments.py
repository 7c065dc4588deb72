"""Comments state contracts and reasons; measurements live in results and docs, history in git.

A date in the package's or the kernels' sources marks a comment that records when something was measured, and a GPU's
name or a timing one that records where and how fast: it goes stale with the next run. This keeps them out (docs/ and
experiments/results/ hold the figures, with their command, machine and date).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*(ROOT / "buddy").rglob("*.py"), *(ROOT / "csrc").rglob("*.h"), *(ROOT / "csrc").rglob("*.cu"),
           *(ROOT / "csrc").rglob("*.cpp")]  # fmt: skip
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
#: a machine's name or a timing: a figure that held on one machine, on one day
MACHINE_FIGURE = re.compile(r"H200|H100|GB/s|[0-9.]+ ?(->|\u2192) ?[0-9.]+ ?ms|[0-9]+ ?ms\b")
#: buddy/engines/launch.py names the devices its shared-memory table describes (HOPPER): a contract, not a figure
NAMES_DEVICES = {"buddy/engines/launch.py"}


def test_no_dated_measurements_in_the_package_or_the_kernels():
    assert len(SOURCES) > 40
    dated = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SOURCES
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if DATE.search(line)
    ]
    assert not dated, "dated figures belong in docs/ or experiments/results/:\n" + "\n".join(dated)


def test_no_machine_figures_in_the_package_or_the_kernels():
    """A comment says why (fewer instructions on the critical path), not what one machine measured once (a time, a
    rate, a GPU's name): the figure goes stale; it belongs in a results file with its command and machine."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SOURCES
        if str(path.relative_to(ROOT)) not in NAMES_DEVICES
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if MACHINE_FIGURE.search(line)
    ]
    assert not found, "state the reason, not the figure (results go to docs/ or experiments/results/):\n" + "\n".join(
        found
    )
