"""Workloads for the experiments: real data available offline, and activations built from it.

Nothing here is downloaded and nothing is random noise: images are
scikit-learn's bundled sample photographs and handwritten digits, text is
this Python's own standard library: its source, and the English of its
docstrings. Random choices (which crops,
where the text starts, the networks' initial weights) are seeded, so a given
``seed`` gives the same tensors on the same software versions.

    >>> from experiments.data import activation_tensors
    >>> acts = activation_tensors("quick")   # name -> tensor, ~8-16 MiB each
"""

from __future__ import annotations

import ast
import functools
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "Scale",
    "SCALES",
    "sample_image_crops",
    "digit_images",
    "stdlib_text_bytes",
    "stdlib_docstrings",
    "activation_tensors",
]

_EXTRAS_HINT = "pip install 'buddy[experiments]'"


@dataclass(frozen=True)
class Scale:
    """How much data :func:`activation_tensors` pushes through its networks."""

    crops: int  # image crops through the CNN (batch size)
    crop_size: int  # pixels per side of a crop
    tokens: int  # text bytes through the MLP (a multiple of SEQ_LEN)


#: per-tensor sizes: tiny well under 1 MiB (tests), quick 8-16 MiB, full 64-128 MiB
SCALES: dict[str, Scale] = {
    "tiny": Scale(crops=2, crop_size=32, tokens=64),
    "quick": Scale(crops=32, crop_size=64, tokens=4096),
    "full": Scale(crops=256, crop_size=64, tokens=32768),
}

#: sequence length of the byte-level MLP's input
SEQ_LEN = 64


# ---- real data ---------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _sample_images() -> tuple[np.ndarray, ...]:
    """scikit-learn's bundled photographs (china.jpg, flower.jpg) as HxWx3 uint8."""
    try:
        from sklearn.datasets import load_sample_images

        images = load_sample_images().images
    except ImportError as exc:  # scikit-learn, or pillow to decode its JPEGs
        raise ImportError(
            f"the image workloads need scikit-learn and pillow ({exc}); install them: {_EXTRAS_HINT}"
        ) from exc
    return tuple(images)


def sample_image_crops(n: int, size: int = 64, seed: int = 0) -> torch.Tensor:
    """``n`` random ``size`` x ``size`` crops of the sample photographs.

    Returns a float32 tensor ``(n, 3, size, size)``: pixels scaled to [0, 1],
    then normalised per channel with the mean and standard deviation of the
    two source images (not of the crops, so a crop's values do not depend on
    ``n``). Deterministic for a given ``seed``.
    """
    images = _sample_images()
    height = min(img.shape[0] for img in images)
    width = min(img.shape[1] for img in images)
    if n < 1 or not 0 < size <= min(height, width):
        raise ValueError(f"need n >= 1 and 0 < size <= {min(height, width)}, got n={n}, size={size}")
    rng = np.random.default_rng(seed)
    which = rng.integers(len(images), size=n)
    ys = rng.integers(height - size + 1, size=n)
    xs = rng.integers(width - size + 1, size=n)
    crops = np.stack([images[i][y : y + size, x : x + size] for i, y, x in zip(which, ys, xs)])

    pixels = np.concatenate([img.reshape(-1, 3) for img in images]) / 255.0
    mean, std = pixels.mean(0), pixels.std(0)
    normalised = (crops / 255.0 - mean) / std
    return torch.from_numpy(normalised.astype(np.float32)).permute(0, 3, 1, 2).contiguous()


@functools.lru_cache(maxsize=4)
def digit_images(size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), labelled.

    Returns ``(images, labels)``: ``images`` float32 ``(1797, 3, size, size)``,
    bilinearly upsampled, normalised to zero mean and unit standard deviation
    over the whole set, the grey channel repeated to 3 (an expanded view: index
    it to get a batch); ``labels`` int64 in 0..9. Always the same tensors: they
    are cached and shared, so do not modify them in place.
    """
    if size < 8:
        raise ValueError(f"size must be >= 8 (the digits are 8x8), got {size}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ImportError(f"the digit workloads need scikit-learn ({exc}); install it: {_EXTRAS_HINT}") from exc
    digits = load_digits()
    grey = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1)
    grey = F.interpolate(grey, size=(size, size), mode="bilinear", align_corners=False)
    grey = (grey - grey.mean()) / grey.std()
    return grey.expand(-1, 3, -1, -1), torch.from_numpy(digits.target.astype(np.int64))


@functools.lru_cache(maxsize=1)
def _stdlib_sources() -> tuple[str, ...]:
    """Paths of the standard library's ``.py`` files, sorted.

    Third-party packages installed under the stdlib folder (site-packages)
    are skipped: they differ between machines, the standard library does not.
    """
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths: list[str] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        paths.extend(os.path.join(folder, f) for f in files if f.endswith(".py"))
    return tuple(sorted(paths))


def stdlib_text_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    """The first ``nbytes`` of the standard library's source, as a uint8 tensor.

    Files are read in sorted path order, starting at a file picked by
    ``seed`` and wrapping around; raises ``ValueError`` if the whole
    standard library holds fewer than ``nbytes`` bytes.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    paths = _stdlib_sources()
    if not paths:
        raise ValueError(f"no .py files under {sysconfig.get_paths()['stdlib']!r}")
    start = int(np.random.default_rng(seed).integers(len(paths)))
    data = bytearray()
    for path in paths[start:] + paths[:start]:
        if len(data) >= nbytes:
            break
        with open(path, "rb") as f:
            data += f.read(nbytes - len(data))
    if len(data) < nbytes:
        raise ValueError(f"the standard library holds only {len(data)} bytes of source, {nbytes} asked")
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


#: test folders inside stdlib packages: their docstrings describe tests, not the package
_TEST_DIRS = {"test", "tests", "idle_test"}


@functools.lru_cache(maxsize=8)
def stdlib_docstrings(packages: tuple[str, ...], max_bytes: int) -> dict[str, str]:
    """English prose: the docstrings of standard library packages, per package.

    For each name in ``packages`` (a package folder of the standard library,
    e.g. ``"email"``), the module, class and function docstrings of its
    ``.py`` files (test folders skipped), files in sorted path order, each
    docstring as :func:`inspect.cleandoc` leaves it, joined by blank lines
    and cut at whole docstrings once ``max_bytes`` (UTF-8) are reached.
    Deterministic; raises ``ValueError`` for a package that is missing or has
    no docstrings.
    """
    root = sysconfig.get_paths()["stdlib"]
    out = {}
    for package in packages:
        folder = os.path.join(root, package)
        if not os.path.isdir(folder):
            raise ValueError(f"the standard library has no package {package!r} (looked in {folder!r})")
        paths: list[str] = []
        for sub, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d not in _TEST_DIRS and d != "__pycache__"]
            paths.extend(os.path.join(sub, f) for f in files if f.endswith(".py"))
        docs, size = [], 0
        for path in sorted(paths):
            if size >= max_bytes:
                break
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and size < max_bytes:
                        docs.append(doc)
                        size += len(doc.encode()) + 2
        if not docs:
            raise ValueError(f"no docstrings in the standard library's {package!r}")
        out[package] = "\n\n".join(docs)
    return out


# ---- activations -------------------------------------------------------------
class _ConvNet(nn.Module):
    """conv-BN-ReLU, max-pool, conv-BN-ReLU: the first stage of a small CNN."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.conv2 = nn.Conv2d(64, 128, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(128)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        pool = F.max_pool2d(F.relu(self.bn1(self.conv1(images))), 2)
        conv = self.conv2(pool)
        return {"conv": conv, "relu": F.relu(self.bn2(conv)), "maxpool": pool}


class _ByteMLP(nn.Module):
    """Byte and position embeddings, LayerNorm, the up-projection of a transformer MLP, GELU."""

    def __init__(self, width: int = 256, hidden: int = 1024):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Embedding(SEQ_LEN, width)
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return F.gelu(self.up(self.norm(self.embed(tokens) + self.position(positions))))


def activation_tensors(scale: str = "quick", seed: int = 0) -> dict[str, torch.Tensor]:
    """Activations of small untrained networks run on real data, on the CPU.

    Returns ``name -> contiguous CPU tensor``, always in this order:

    * ``cnn.conv`` (float32, dense): second conv's output, before BN;
    * ``cnn.relu`` (float32, ~half zeros): its BN-ReLU output, train mode;
    * ``cnn.maxpool`` (float32, sparse): the max-pooled first ReLU;
    * ``cnn.relu.bf16``: ``cnn.relu`` cast to bfloat16;
    * ``mlp.gelu`` (float32, dense): GELU of a byte-level MLP on stdlib text;
    * ``mlp.gelu.bf16``: ``mlp.gelu`` cast to bfloat16.

    ``scale`` is a key of :data:`SCALES`. Deterministic for a given ``seed``;
    the caller's torch RNG state is left untouched.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose from {', '.join(SCALES)}")
    size = SCALES[scale]
    images = sample_image_crops(size.crops, size.crop_size, seed=seed)
    text = stdlib_text_bytes(size.tokens, seed=seed).long().view(-1, SEQ_LEN)

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)  # the networks' initial weights
        # train mode: BN normalises with batch statistics, as when activations
        # are saved for the backward pass
        cnn = _ConvNet().train()
        mlp = _ByteMLP().train()
        acts = cnn(images)
        gelu = mlp(text)

    # bf16 copies are casts rather than autocast runs: same zero pattern, so a
    # fp32/bf16 pair isolates the effect of the word width on the codecs
    out = {
        "cnn.conv": acts["conv"],
        "cnn.relu": acts["relu"],
        "cnn.maxpool": acts["maxpool"],
        "cnn.relu.bf16": acts["relu"].to(torch.bfloat16),
        "mlp.gelu": gelu,
        "mlp.gelu.bf16": gelu.to(torch.bfloat16),
    }
    return {name: t.contiguous() for name, t in out.items()}
