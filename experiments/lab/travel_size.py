"""Bytes that travel to a lent GPU machine: the working tree a call sends, plus the wheels it carries.

A call to the lent machine sends the tracked files and the untracked files
git does not ignore, plus the ignored folders the call names to carry
(``.whl/``, the wheels the machine lacks); the whole must stay under the
machine's limit of 64 MiB. This script adds them up as git sees them
(``git ls-files``, ``git ls-files --others --exclude-standard``) and fails
above ``--limit-mib`` (default 48: room to spare). Outside a git checkout --
on the GPU machine, which receives the tree without ``.git`` -- it adds up
every file under the root: what arrived.

    python experiments/lab/travel_size.py                 # tracked + untracked + .whl/, fails above 48 MiB
    python experiments/lab/travel_size.py --carry .whl .gl --limit-mib 48 --top 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["LIMIT_MIB", "travelling_files", "sizes", "main"]

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
#: the size the GPU session keeps the travelling tree under (the machine takes 64 MiB)
LIMIT_MIB = 48


def _git(root: Path, *args: str) -> list[str] | None:
    """``git -C root args`` output lines (NUL separated), or ``None`` outside a git checkout."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args, "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [p for p in done.stdout.decode().split("\0") if p]


def _walk(folder: Path) -> list[Path]:
    return [Path(d) / f for d, _, files in os.walk(folder) for f in files]


def travelling_files(root: Path = ROOT, carry: tuple[str, ...] = (".whl",)) -> dict[str, list[Path]]:
    """``{"tracked", "untracked", "carried"}`` -> files; outside git every file under ``root`` is "tracked"."""
    tracked = _git(root, "ls-files")
    if tracked is None:
        return {
            "tracked": [p for p in _walk(root) if ".git" not in p.relative_to(root).parts],
            "untracked": [],
            "carried": [],
        }
    untracked = _git(root, "ls-files", "--others", "--exclude-standard") or []
    carried = [
        p for c in carry if (root / c).exists() for p in ([root / c] if (root / c).is_file() else _walk(root / c))
    ]
    return {
        "tracked": [root / p for p in tracked if (root / p).is_file()],  # a deleted file no longer travels
        "untracked": [root / p for p in untracked],
        "carried": carried,
    }


def sizes(files: dict[str, list[Path]]) -> dict[str, int]:
    """Bytes per group."""
    return {group: sum(p.stat().st_size for p in paths if p.is_file()) for group, paths in files.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="travel_size", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT)
    p.add_argument("--carry", nargs="*", default=[".whl"], help="ignored paths the call carries (default .whl)")
    p.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    p.add_argument("--top", type=int, default=5, help="list the largest files")
    args = p.parse_args(argv)
    files = travelling_files(args.root.resolve(), tuple(args.carry))
    by_group = sizes(files)
    total = sum(by_group.values())
    for group, n in by_group.items():
        print(f"  {group:>9}: {len(files[group]):5d} files {n / MiB:8.2f} MiB")
    everything = [p for paths in files.values() for p in paths if p.is_file()]
    for path in sorted(everything, key=lambda q: q.stat().st_size, reverse=True)[: args.top]:
        print(f"  {path.stat().st_size / MiB:8.2f} MiB  {path.relative_to(args.root.resolve())}")
    verdict = "fits" if total <= args.limit_mib * MiB else "TOO LARGE"
    print(f"travelling: {total / MiB:.2f} MiB of {args.limit_mib:g} MiB allowed: {verdict}")
    return 0 if total <= args.limit_mib * MiB else 1


if __name__ == "__main__":
    sys.exit(main())
