"""The command line the experiment scripts share: their common options, the start of a run and its ending."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import buddy
from experiments.common import DEFAULT_POINTS, SIZES, add_backend_argument, capture_all, start, write_results

__all__ = [
    "add_size_argument",
    "add_workloads_argument",
    "add_codec_arguments",
    "add_points_argument",
    "add_methods_argument",
    "add_cache_argument",
    "add_common_arguments",
    "begin",
    "capture_workloads",
    "finish",
]


def add_size_argument(
    parser: argparse.ArgumentParser, *, default: str | None = "quick", help: str | None = None
) -> None:
    """``--size``: the workloads' size."""
    parser.add_argument("--size", choices=SIZES, default=default, help=help)


def add_workloads_argument(
    parser: argparse.ArgumentParser,
    default: Sequence[str],
    *,
    flag: str = "--workloads",
    nargs: str = "+",
    help: str | None = None,
) -> None:
    """``--workloads`` (or another ``flag`` naming workloads): any this machine can build."""
    from experiments.workloads import WORKLOADS

    parser.add_argument(flag, nargs=nargs, choices=sorted(WORKLOADS), default=list(default), help=help)


def add_codec_arguments(
    parser: argparse.ArgumentParser,
    *,
    default: str | None = None,
    choices: Sequence[str] | None = None,
    help: str | None = None,
) -> None:
    """``--codec`` (default: buddy's default codec) and ``--entry-bytes`` (default: buddy's default entry size)."""
    parser.add_argument("--codec", default=default or buddy.defaults().codec, choices=choices, help=help)
    parser.add_argument("--entry-bytes", type=int, default=buddy.defaults().entry_bytes)


def add_points_argument(parser: argparse.ArgumentParser) -> None:
    """``--points``: the training steps before each capture (default: the size's, :data:`DEFAULT_POINTS`)."""
    parser.add_argument("--points", type=int, nargs="+", default=None, help="training steps before each capture")


def add_methods_argument(parser: argparse.ArgumentParser, methods: Iterable[str]) -> None:
    """``--methods``: any of ``methods`` (names, or a mapping by name), all of them by default."""
    names = list(methods)
    parser.add_argument("--methods", nargs="+", choices=names, default=list(names))


def add_cache_argument(parser: argparse.ArgumentParser, *, help: str = "keep captures here between runs") -> None:
    """``--cache``: a folder that keeps captures between runs (see :func:`capture_workloads`); none by default."""
    parser.add_argument("--cache", type=Path, default=None, help=help)


def add_common_arguments(
    parser: argparse.ArgumentParser,
    *,
    out: str,
    device: str | None = None,
    backend: bool = False,
    seed: bool = True,
    plot: bool = False,
) -> None:
    """The options the scripts end with, in this order: ``--device`` (where ``device`` names its default),
    ``--backend``, ``--seed``, ``--out`` (default ``out``), ``--no-plot`` and ``--no-progress``."""
    if device is not None:
        parser.add_argument("--device", default=device)
    if backend:
        add_backend_argument(parser)
    if seed:
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(out))
    if plot:
        parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def begin(
    script: str, parse_args: Callable[[list[str]], argparse.Namespace], argv: Sequence[str] | None
) -> tuple[argparse.Namespace, dict]:
    """A script's arguments (``argv``, else the command line's) and its run's header (see :func:`start`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    return args, start(script, argv)


def capture_workloads(
    args: argparse.Namespace,
    names: Sequence[str] | None = None,
    *,
    size: str | None = None,
    points: Sequence[int] | None = None,
    device: str = "cpu",
    cache: Path | str | None = None,
) -> tuple[Sequence[int], dict]:
    """``(points, captures)``: :func:`capture_all` of ``names`` (default ``args.workloads``) with the script's
    ``--size`` (unless ``size``), ``--seed`` and ``--no-progress``, at ``points`` (default: the size's)."""
    size = size or args.size
    points = points or DEFAULT_POINTS[size]
    names = args.workloads if names is None else names
    show = not args.no_progress
    return points, capture_all(names, size=size, points=points, device=device, seed=args.seed, show=show, cache=cache)


def finish(
    args: argparse.Namespace,
    header: dict,
    rows: Sequence[dict],
    *,
    plot: Callable[[Path, Path], list[Path]] | None = None,
    mention_csv: bool = True,
    **extra,
) -> Path:
    """A script's ending: :func:`write_results` under ``args.out``, then ``plot(results, args.out)`` unless
    ``--no-plot``, saying what it wrote. Returns the path of ``results.json``."""
    path = write_results(args.out, header, rows, **extra)
    print(f"\nwrote {path} and {path.with_suffix('.csv')}" if mention_csv else f"\nwrote {path}")
    if plot is not None and not args.no_plot:
        for png in plot(path, args.out):
            print(f"wrote {png}")
    return path
