"""The import graphs of the package and of the experiments: no cycles inside ``buddy/`` or ``experiments/``;
the experiments share public names only, and nothing outside ``experiments/lab/`` imports the lab.

Every ``buddy/**/*.py`` (and ``experiments/**/*.py`` but the results) is
parsed with :mod:`ast`; every import of a module of the same tree counts, at
module level or inside a function (``from . import x``, ``from .x import y``,
``from .. import z``, ``import buddy.x``), except those under ``if
TYPE_CHECKING:``. Importing ``buddy.a.b`` also runs ``buddy.a``'s
``__init__``: that edge counts too, unless ``buddy.a`` is a package the
importer lives in (it is already being imported then).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "buddy"
EXPERIMENTS = ROOT / "experiments"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(tree: Path = PACKAGE) -> dict[str, Path]:
    """Every module of ``tree`` (buddy's by default) by dotted name (a package by its own name); not the results a
    GPU session brought back (``experiments/results/``: kept as they ran)."""
    return {
        module_name(p): p
        for p in sorted(tree.rglob("*.py"))
        if "results" not in p.relative_to(ROOT).parts
    }  # fmt: skip


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """The import nodes of ``tree``, at any depth, leaving out ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` the package
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        for target in targets:
            while target and target not in known:  # ``import buddy.x.y`` where y is not a module
                target = target.rpartition(".")[0]
            if not target or target == name:
                continue
            found.add(target)
            mine = set(_ancestors(name)) | ({name} if is_package else set())
            found.update(a for a in _ancestors(target) if a not in mine and a != name)
    return found


def import_graph(tree: Path = PACKAGE) -> dict[str, set[str]]:
    mods = modules(tree)
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (``[a, b, ..., a]``), or ``None``."""
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per edge that closes one, found by removing the edges of each cycle found (for the report)."""
    graph = {k: set(v) for k, v in graph.items()}
    cycles = []
    while (cycle := find_cycle(graph)) is not None:
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return cycles


def test_the_checker_sees_every_kind_of_import():
    graph = import_graph()
    assert "buddy.codecs.base" in graph["buddy.codecs.zvc"]  # from .base import ...
    assert "buddy.errors" in graph["buddy.codecs.zvc"]  # from ..errors import ...
    assert "buddy.spec" in graph["buddy.engines.reference"]  # from .. import format, spec
    assert "buddy.engines" in graph["buddy.engines.reference"]  # from . import Engine, ...
    assert "buddy" in graph["buddy.env"]  # a function-level ``from . import __version__``
    assert "buddy.codecs.base" not in graph["buddy.format"]  # under TYPE_CHECKING
    assert "buddy.codecs" in graph["buddy.engines.kernel_engine"]  # from ..codecs.auto import ...: runs codecs/__init__
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycles = all_cycles(import_graph())
    assert not cycles, "import cycles in buddy/:\n" + "\n".join(" -> ".join(c) for c in cycles)


# ---------------------------------------------------------------------------
# experiments/: no cycle, public names only between scripts, the lab apart
# ---------------------------------------------------------------------------
LAB = "experiments.lab"


def _in_lab(name: str) -> bool:
    return name == LAB or name.startswith(LAB + ".")


def private_names_used(name: str, path: Path, known: set[str]) -> list[str]:
    """The underscore names of other modules of ``known`` that module ``name`` (at ``path``) takes: ``from m import
    _x`` (``_x`` not itself a module), or ``m._x`` on a name bound to a module ``m`` by an import."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    found, bound = [], {}  # bound: local name -> the module it names
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        for a in node.names:
            if f"{stem}.{a.name}" in known:
                bound[a.asname or a.name] = f"{stem}.{a.name}"
            elif stem in known and stem != name and private(a.name):
                found.append(f"{name} imports {stem}.{a.name}")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if private(node.attr) and bound[node.value.id] != name:
                found.append(f"{name} uses {bound[node.value.id]}.{node.attr}")
    return found


def test_the_experiments_checks_see_what_they_must(tmp_path):
    graph = import_graph(EXPERIMENTS)
    assert "experiments.common" in graph["experiments.cli"]  # from experiments.common import ...
    assert "experiments.data" in graph["experiments.workloads"]  # from .data import ...
    assert "experiments.step_time" in graph["experiments.max_batch"]  # a function-level import
    assert "experiments.lab.fpe_lanes" in graph["experiments.lab.kernel_budget"]
    assert "experiments" not in graph["experiments.lab.kernel_budget"]  # its own package: already importing
    known = set(modules(EXPERIMENTS))
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from experiments.plot import _open, save_figure\nfrom experiments import max_batch, lab\n"
        "from .analysis import _FLOAT_FIELDS\nimport experiments.workloads as w\n"
        "max_batch._peak(); w._GPT; lab.fpe_lanes; max_batch.__name__\n"
    )
    assert sorted(private_names_used("experiments.probe", probe, known)) == [
        "experiments.probe imports experiments.analysis._FLOAT_FIELDS",
        "experiments.probe imports experiments.plot._open",
        "experiments.probe uses experiments.max_batch._peak",
        "experiments.probe uses experiments.workloads._GPT",
    ]
    assert {"experiments.lab", "experiments.max_batch"} <= imports_of("experiments.probe", probe, known)  # lab: seen


def test_no_import_cycle_among_the_experiments():
    cycles = all_cycles(import_graph(EXPERIMENTS))
    assert not cycles, "import cycles in experiments/:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_experiment_takes_another_modules_underscore_name():
    """What two scripts share is a public name of one module (``experiments.common``, ``experiments.cli`` or the
    module it belongs to), documented there."""
    mods = modules(EXPERIMENTS)
    found = [use for name, path in mods.items() for use in private_names_used(name, path, set(mods))]
    assert not found, "make these public where they are defined:\n" + "\n".join(found)


def test_nothing_outside_the_lab_imports_the_lab():
    """experiments/lab/ (the GPU runbook, the kernel budget, the lane and codec studies) may import what a user
    runs; what a user runs, and the package, never import the lab."""
    mods = {**modules(PACKAGE), **modules(EXPERIMENTS)}
    known = set(mods)
    assert any(_in_lab(m) for m in known) and not _in_lab("experiments.labs")
    found = [
        f"{name} imports {dep}"
        for name, path in sorted(mods.items())
        if not _in_lab(name)
        for dep in sorted(imports_of(name, path, known))
        if _in_lab(dep)
    ]
    assert not found, "the lab is imported from outside it:\n" + "\n".join(found)


def test_the_kernel_lists_agree_with_the_kernels_source():
    """The kernel codecs are listed once in Python (buddy.engines.sources) and once in C++ (csrc/): the two agree."""
    from buddy import selftest
    from buddy.codecs.auto import AUTO_MEMBERS
    from buddy.engines import sources

    source = (ROOT / "csrc" / "buddy_kernels.cu").read_text()
    kernels = re.findall(r"^BUDDY_FORMAT_KERNELS\((\w+),", source, re.M)
    fitted = re.findall(r"^BUDDY_FIT_KERNELS\((\w+)\)", source, re.M)
    assert kernels == list(sources.KERNEL_CODECS)
    assert set(fitted) == sources.TABLED_KERNELS == {"fpe", "auto2"}
    assert set(selftest.SOURCES) == set(sources.KERNEL_CODECS)
    assert set(AUTO_MEMBERS) == {name for name, cls in sources.KERNEL_CODECS.items() if cls.__name__ == "AutoCodec"}


# ---------------------------------------------------------------------------
# docs/architecture.md against the code
# ---------------------------------------------------------------------------
DOC = ROOT / "docs" / "architecture.md"


def doc_layers() -> list[tuple[str, list[str]]]:
    """The doc's ``layers`` block, top to bottom: ``(layer, [dotted module, ...])``."""
    block = re.search(r"^```layers\n(.*?)^```", DOC.read_text(), re.M | re.S)
    assert block, "docs/architecture.md has no ```layers block"
    layers = []
    for line in block.group(1).splitlines():
        layer, _, names = line.partition(":")
        mods = [n.strip() for n in names.split(",") if n.strip()]
        layers.append((layer.strip(), [m if m == "buddy" else f"buddy.{m}" for m in mods]))
    return layers


def test_the_doc_names_every_module_once_and_only_modules_that_exist():
    named = [m for _, mods in doc_layers() for m in mods]
    assert len(named) == len(set(named)), "a module is in two layers"
    assert set(named) == set(modules()), (
        f"missing from the doc: {sorted(set(modules()) - set(named))}; "
        f"in the doc, not in buddy/: {sorted(set(named) - set(modules()))}"
    )
    text = DOC.read_text()
    paths = set(re.findall(r"\b((?:buddy|csrc)/[\w/]+\.(?:py|cu|h))\b", text))
    assert paths and not [p for p in sorted(paths) if not (ROOT / p).exists()]


def test_imports_respect_the_doc_layers():
    rank = {m: i for i, (_, mods) in enumerate(reversed(doc_layers())) for m in mods}  # 0 the bottom
    names = {m: layer for layer, mods in doc_layers() for m in mods}
    upward = [
        f"{mod} ({names[mod]}) imports {dep} ({names[dep]})"
        for mod, deps in sorted(import_graph().items())
        for dep in sorted(deps)
        if rank[dep] > rank[mod]
    ]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_doc_is_linked():
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()
    assert "(architecture.md)" in (ROOT / "docs" / "internals.md").read_text()
