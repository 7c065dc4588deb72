"""A pytest plugin: the curated GPU subsets a lent GPU machine runs, and shards of them.

The suite holds thousands of GPU cases (every dtype, entry size, data kind
and slot); a lent machine gives minutes. These subsets keep what a first GPU
run must show -- every kernel at entry sizes 512 and 4096 on fp32, bf16, u8
and f64, every slot at 512, the CUDA path of every codec, nvcomp's codecs,
streams, autograd on the GPU, memory hygiene, the kernels' self-test, a
session inside CUDA graph capture -- and drop the rest of the
cross product. Only tests marked ``gpu`` are kept (the CPU suite runs in CI).

    PYTHONPATH=tests python -m pytest -p gpu_subset --gpu-subset tests --shard 1/3 tests/
    PYTHONPATH=tests python -m pytest -p gpu_subset --gpu-subset sanitize tests/test_gpu_cuda.py

``--shard I/N`` keeps every N-th selected case starting at the I-th, in
collection order, so each parametrized test is spread over the shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

__all__ = ["SUBSETS", "selected", "parse_shard"]

Params = dict[str, Any]
Rule = Callable[[Params], bool]
_FOUR = (torch.float32, torch.bfloat16, torch.uint8, torch.float64)


def _every(params: Params) -> bool:
    return True


#: subset -> test file -> test function -> which of its cases (by parameter value); "*": the file's other
#: GPU tests. A file not named is not in the subset.
SUBSETS: dict[str, dict[str, dict[str, Rule]]] = {
    "tests": {
        "test_gpu_cuda.py": {
            "test_kernels_write_the_reference_buffers": lambda p: p["e"] in (512, 4096) and p["dtype"] in _FOUR,
            "test_every_slot_same_buffers": lambda p: p["e"] == 512,
            "*": _every,
        },
        "test_gpu.py": {
            "test_cuda_roundtrip": lambda p: p["n"] == 98433 and p["dtype"] in _FOUR,
            "test_cuda_buffers_match_cpu": lambda p: p["e"] == 512 and p["dtype"] in _FOUR,
            "*": _every,
        },
        "test_codec_nvcomp.py": {"test_gpu_round_trip": lambda p: p["entry_bytes"] == 4096, "*": _every},
        "test_concurrency.py": {"*": _every},
        "test_rederive.py": {"*": _every},
        "test_experiments.py": {"*": _every},
        "test_workloads.py": {"*": _every},
        "test_api.py": {"*": _every},
        # the kernels' self-test on the real device, and a step captured into a CUDA graph inside a session
        "test_selftest.py": {"*": _every},
        "test_autograd_checks.py": {"*": _every},
    },
    # compute-sanitizer runs every launch tens of times slower: the default entry size, one dtype and data
    # kind per codec, the fit kernel, and the error paths of a damaged buffer
    "sanitize": {
        "test_gpu_cuda.py": {
            "test_kernels_write_the_reference_buffers": lambda p: (
                p["e"] == 4096 and p["dtype"] == torch.bfloat16 and p["kind"] == "relu"
            ),
            "test_table_fitted_on_the_gpu": lambda p: p["word"] == 2,
            "test_damaged_buffers_are_flagged": _every,
        },
    },
}


def selected(subset: str, item: pytest.Item) -> bool:
    """Whether ``item`` is in ``subset``."""
    if item.get_closest_marker("gpu") is None:
        return False
    rules = SUBSETS[subset].get(item.path.name)
    if rules is None:
        return False
    name = getattr(item, "originalname", item.name)
    rule = rules.get(name, rules.get("*"))
    if rule is None:
        return False
    callspec = getattr(item, "callspec", None)
    return rule(dict(callspec.params) if callspec is not None else {})


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``1 <= I <= N``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes I/N (e.g. 1/3), got {text!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard I/N needs 1 <= I <= N, got {text!r}")
    return i, n


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu_subset", "curated GPU subsets (tests/gpu_subset.py)")
    group.addoption("--gpu-subset", choices=sorted(SUBSETS), default=None, help="run only this curated GPU subset")
    group.addoption("--shard", default=None, metavar="I/N", help="run the I-th of N shards of the selected cases")


@pytest.hookimpl(trylast=True)  # after the suite's own hook has marked what skips
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    subset = config.getoption("gpu_subset")
    shard = config.getoption("shard")
    if subset is None and shard is None:
        return
    kept = [item for item in items if subset is None or selected(subset, item)]
    if shard is not None:
        i, n = parse_shard(shard)
        kept = kept[i - 1 :: n]
    keep = {id(item) for item in kept}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in keep])
    items[:] = kept
