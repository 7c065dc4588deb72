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
    exec(compile(block, "README.md", "exec"), namespace)
    assert isinstance(namespace["u"], torch.Tensor) and namespace["bt"].freed


def test_training_example_runs():
    block = re.search(r"## Compressing activations in training\n.*?```python\n(.*?)```", README, flags=re.S).group(1)
    block = block.replace("torch.randn(32, 3, 64, 64)", "torch.randn(4, 3, 32, 32)")  # same code, smaller
    block = block.replace("(32,)", "(4,)")
    block = block.replace("as session:", "as session:\n        session.min_bytes = 4096")
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    stats = namespace["session"].stats()
    assert stats.rows and stats.effective_capacity > 0.9
