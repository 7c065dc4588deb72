"""Rules the source keeps: short functions in the library, experiments on its public names only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def _functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_in_the_library_is_longer_than_60_lines():
    """Whole definitions, ``def`` line and docstring included."""
    long = [
        f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for path in sorted((ROOT / "buddy").rglob("*.py"))
        for fn in _functions(path)
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "split these:\n" + "\n".join(long)


def _private_uses(path: Path) -> dict[int, str]:
    """Lines where an experiment reaches a private ``buddy`` name (a ``_x`` module or attribute)."""
    found = {}
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "buddy":
            for alias in node.names:
                if _private([*node.module.split("."), alias.name]):
                    found[node.lineno] = f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _private(alias.name.split(".")):
                    found[node.lineno] = f"import {alias.name}"
    dotted = re.compile(r"\bbuddy(?:\.\w+)*\.(_\w+)")
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = dotted.search(line.split("#")[0])
        if match and not match.group(1).startswith("__"):
            found.setdefault(number, match.group(0))
    return found


def _private(parts: list[str]) -> bool:
    return parts[0] == "buddy" and any(p.startswith("_") and not p.startswith("__") for p in parts)


EXPERIMENTS = sorted(p for p in (ROOT / "experiments").rglob("*.py") if "results" not in p.relative_to(ROOT).parts)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(ROOT / "experiments")))
def test_experiments_use_only_public_names_of_the_library(path):
    uses = _private_uses(path)
    assert not uses, f"{path.name} reaches into buddy's private names:\n" + "\n".join(
        f"line {n}: {what}" for n, what in sorted(uses.items())
    )


def test_the_private_name_check_sees_what_it_must(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import buddy\nfrom buddy import spec\nfrom buddy.autograd import is_parameter\nbuddy.compress(x)  # buddy._x\n"
    )
    assert not _private_uses(probe)
    probe.write_text(
        "from buddy._deps import require\nfrom buddy.autograd import _tensor_key\nimport buddy._deps\n"
        "tracker._hold(1)\nbuddy.tracker._hold\nbuddy.codecs._REGISTRY\n"
    )
    assert sorted(_private_uses(probe)) == [1, 2, 3, 5, 6]  # tracker._hold is not reached through "buddy."
