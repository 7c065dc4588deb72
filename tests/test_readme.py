"""The README's commands and example are the ones that work."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    test_commands = [b.strip() for b in _bash_blocks() if "pytest" in b]
    assert len(test_commands) == 1, "the README holds exactly one test command"
    assert test_commands[0] in (ROOT / ".ci" / "run").read_text()


def test_quick_api_example_runs():
    block = re.search(r"## Quick API\n\n```python\n(.*?)```", README, flags=re.S).group(1)
    block = block.replace("torch.randn(64, 256, 56, 56)", "torch.randn(4, 16, 28, 28)")  # same code, smaller
    namespace: dict = {}
    torch.manual_seed(0)
    exec(compile(block, "README.md", "exec"), namespace)
    torch.manual_seed(0)  # the example's tensor again: it deletes its own
    t = torch.relu(torch.randn(4, 16, 28, 28))
    u = namespace["u"]
    assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u.view(torch.int32), t.view(torch.int32))
    assert namespace["bt"].freed


def test_training_example_runs():
    block = re.search(r"## Compressing activations in training\n.*?```python\n(.*?)```", README, flags=re.S).group(1)
    block = block.replace("torch.randn(32, 3, 64, 64)", "torch.randn(4, 3, 32, 32)")  # same code, smaller
    block = block.replace("(32,)", "(4,)")
    block = block.replace("as session:", "as session:\n        session.min_bytes = 4096")
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    stats = namespace["session"].stats()
    assert stats.rows and stats.effective_capacity > 0.9


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_points_to_an_existing_file_and_heading():
    checked = 0
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
            if fragment and linked.suffix == ".md":
                assert fragment in _anchors(linked), f"{page.relative_to(ROOT)} links to {target}: no such heading"
            checked += 1
    assert checked > 20, "the link pattern found (almost) no links: is it still right?"


def test_readme_stays_short():
    assert len(README.splitlines()) <= 300, "the README is for users: details go to docs/"
