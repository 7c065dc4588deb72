"""Training workloads for the capacity experiments, and what autograd saves in them.

Every workload trains a small network on real data available offline (nothing
is downloaded, nothing is random noise): the CNNs classify scikit-learn's
bundled handwritten digits, the language models predict the next byte of this
Python's standard library source. Everything is seeded: on the CPU a given
``seed`` gives the same losses and tensors on the same software versions and
thread count, and the caller's global RNG state is left untouched.

    >>> run = make_run("resnet-fp32", size="tiny")
    >>> with buddy.compressed_activations(min_bytes=1024):
    ...     loss = run.forward_loss()  # saved activations are compressed here
    >>> run.step(loss)  # backward (decompressing), optimizer step, zero_grad
    >>> caps = capture("resnet-fp32", size="tiny", points=(0, 2))
    >>> [(c.point, len(c.tensors)) for c in caps]
    [(0, 18), (2, 18)]
    >>> saved = caps[1].tensors[2]  # keyed as buddy keys it
    >>> saved.key, saved.op, saved.tensor.device.type
    ('2:float32[8, 8, 32, 32]', 'ReluBackward0', 'cpu')

Sizes: ``tiny`` for tests (a capture of one workload in a few seconds),
``quick`` for the main job (all default workloads at three points in about a
minute on 2 CPU cores, MiBs of saved activations each), ``full`` for the
record (minutes per workload on a CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn
from torch.nn import functional as F

import buddy
from buddy import DEFAULT_MIN_BYTES, RecordedTensor
from buddy.deps import require

from .data import digit_images, stdlib_text_bytes

__all__ = [
    "ImageSize",
    "TextSize",
    "Workload",
    "WORKLOADS",
    "DEFAULT_WORKLOADS",
    "SIZES",
    "POINTS",
    "MIN_BYTES",
    "Run",
    "make_run",
    "SavedTensor",
    "Capture",
    "capture",
]

#: size names, smallest first
SIZES = ("tiny", "quick", "full")

#: default capture points (training steps done before each capture) per size
POINTS: Mapping[str, tuple[int, ...]] = MappingProxyType({"tiny": (0, 2), "quick": (0, 10, 30), "full": (0, 30, 100)})

#: default ``min_bytes`` per size: buddy's own default, except on tiny models
#: whose activations are all smaller than that
MIN_BYTES: Mapping[str, int] = MappingProxyType({"tiny": 1024, "quick": DEFAULT_MIN_BYTES, "full": DEFAULT_MIN_BYTES})

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), on the run's device


# ---- sizes -------------------------------------------------------------------
@dataclass(frozen=True)
class ImageSize:
    """How big a digit-classification workload is."""

    batch: int
    width: int = 16  # channels of the first stage; later stages double it
    depth: int = 1  # residual blocks per stage (ResNet) or convolutions per stage (VGG)
    resolution: int = 32  # pixels per side the 8x8 digits are upsampled to


@dataclass(frozen=True)
class TextSize:
    """How big a byte-level language-modelling workload is."""

    batch: int
    seq_len: int
    width: int  # model dimension (GPT) or hidden size (LSTM)
    layers: int
    heads: int = 4
    corpus_bytes: int = 1 << 20  # stdlib source the batches are cut from


# ---- image data and models -----------------------------------------------------
def _digit_batches(size: ImageSize, device, seed: int) -> Iterator[Batch]:
    """Shuffled digits, ``size.batch`` at a time, a fresh permutation per epoch; forever."""
    images, labels = digit_images(size.resolution)
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(labels), generator=gen)
        for start in range(0, len(order) - size.batch + 1, size.batch):
            idx = order[start : start + size.batch]
            yield images[idx].to(device), labels[idx].to(device)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
    )


class _ResidualBlock(nn.Module):
    """conv-BN-ReLU, conv-BN, plus the (projected when the shape changes) input, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = _conv_bn(cin, cout, 3, stride)
        self.conv2 = _conv_bn(cout, cout, 3)
        self.shortcut = _conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))


class _ResNet(nn.Module):
    """A CIFAR-style ResNet: stem, three stages (stride 1, 2, 2), global average pool, linear head."""

    def __init__(self, size: ImageSize, classes: int = 10):
        super().__init__()
        widths = [size.width, 2 * size.width, 4 * size.width]
        layers: list[nn.Module] = [_conv_bn(3, widths[0], 3), nn.ReLU()]
        cin = widths[0]
        for stage, cout in enumerate(widths):
            for block in range(size.depth):
                layers.append(_ResidualBlock(cin, cout, stride=2 if stage and not block else 1))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class _VGG(nn.Module):
    """A VGG-style plain CNN: stages of 3x3 conv-ReLU, each ending in a 2x2 max-pool; two linear layers."""

    def __init__(self, size: ImageSize, classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        cin, side = 3, size.resolution
        for stage in range(4):
            cout = size.width << min(stage, 2)  # VGG doubles the width per stage, up to a cap
            for _ in range(size.depth):
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
                cin = cout
            layers.append(nn.MaxPool2d(2))
            side //= 2
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(cin * side * side, 4 * size.width), nn.ReLU(), nn.Linear(4 * size.width, classes)
        )
        # without batch norm a deep plain stack needs He initialisation to train at all
        for m in self.features:
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def _classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def _sgd(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)


# ---- text data and models -------------------------------------------------------
def _text_batches(size: TextSize, device, seed: int) -> Iterator[Batch]:
    """Random windows of the stdlib source: ``(bytes, next bytes)``, ``(batch, seq_len)`` int64; forever."""
    corpus = stdlib_text_bytes(size.corpus_bytes, seed=seed).long()
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(size.seq_len + 1)
    while True:
        starts = torch.randint(0, corpus.numel() - size.seq_len, (size.batch, 1), generator=gen)
        windows = corpus[starts + offsets]
        yield windows[:, :-1].to(device), windows[:, 1:].to(device)


class _Attention(nn.Module):
    """Multi-head causal self-attention (PyTorch's fused scaled-dot-product kernel)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with a GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    """A GPT-style byte-level decoder: token + position embeddings, pre-LN blocks, head tied to the embedding."""

    def __init__(self, size: TextSize, vocab: int = 256):
        super().__init__()
        self.tokens = nn.Embedding(vocab, size.width)
        self.positions = nn.Embedding(size.seq_len, size.width)
        self.blocks = nn.Sequential(*(_GPTBlock(size.width, size.heads) for _ in range(size.layers)))
        self.ln = nn.LayerNorm(size.width)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.blocks(self.tokens(tokens) + self.positions(positions))
        return F.linear(self.ln(x), self.tokens.weight)


class _LSTMModel(nn.Module):
    """Byte embedding, a 2-layer LSTM, a linear head: a small BigLSTM."""

    def __init__(self, size: TextSize, vocab: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, size.width)
        self.lstm = nn.LSTM(size.width, size.width, num_layers=size.layers, batch_first=True)
        self.head = nn.Linear(size.width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        with _without_onednn():
            x = self.lstm(x)[0]
        return self.head(x)


@contextlib.contextmanager
def _without_onednn():
    """PyTorch's own CPU kernels instead of oneDNN's while the block runs (no effect on CUDA).

    oneDNN's LSTM saves a workspace of which about two thirds is never
    written: its bytes are whatever the allocator last held there, so what is
    saved (and how well it compresses) would change from run to run. The flag
    is process-wide: do not run other CPU work in other threads meanwhile.
    """
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def _next_byte(model: nn.Module, batch: Batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _adamw(lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


# ---- optional workloads: torchvision and transformers models ----------------------
def _torchvision_resnet50(size: ImageSize) -> nn.Module:
    models = require("torchvision.models", "the tv-resnet50 workload")
    return models.resnet50(weights=None, num_classes=10)


class _HFGPT2(nn.Module):
    """transformers' GPT2LMHeadModel (random init, no dropout) returning logits."""

    def __init__(self, size: TextSize):
        super().__init__()
        tf = require("transformers", "the hf-gpt2 workload")
        config = tf.GPT2Config(
            vocab_size=256,
            n_positions=size.seq_len,
            n_embd=size.width,
            n_layer=size.layers,
            n_head=size.heads,
            resid_pdrop=0.0,  # dropout would draw from the global RNG and make runs differ
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,  # bytes have no special tokens
            eos_token_id=None,
        )
        self.gpt2 = tf.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=tokens).logits


# ---- the registry -----------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A model, its optimizer, its data and its loss, at three sizes.

    ``sizes`` maps each of :data:`SIZES` to an :class:`ImageSize` or a
    :class:`TextSize`. The factories are plain functions of that size; use
    the methods, which add seeding, devices and autocast.
    """

    name: str
    description: str
    autocast_dtype: torch.dtype | None  # None: full precision; torch.bfloat16: bf16 autocast
    sizes: Mapping[str, ImageSize | TextSize]
    model_fn: Callable[[ImageSize | TextSize], nn.Module] = field(repr=False)
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] = field(repr=False)
    batches_fn: Callable[[ImageSize | TextSize, torch.device, int], Iterator[Batch]] = field(repr=False)
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] = field(repr=False)

    def size(self, size: str) -> ImageSize | TextSize:
        """The configuration of ``size`` (one of :data:`SIZES`)."""
        if size not in self.sizes:
            raise ValueError(f"unknown size {size!r} for {self.name}; choose from {', '.join(self.sizes)}")
        return self.sizes[size]

    def build_model(self, size: str = "quick", device="cpu", seed: int = 0) -> nn.Module:
        """The model in train mode on ``device``, initialised from ``seed`` (global RNG untouched)."""
        config = self.size(size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.model_fn(config)  # initialised on the CPU: same weights on every device
        return model.to(device).train()

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """A fresh optimizer over ``model``'s parameters (deterministic: it draws no random numbers)."""
        return self.optimizer_fn(model)

    def batches(self, size: str = "quick", device="cpu", seed: int = 0) -> Iterator[Batch]:
        """An endless, deterministic stream of ``(inputs, targets)`` on ``device``, shuffled from ``seed``."""
        return self.batches_fn(self.size(size), torch.device(device), seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Forward pass and loss (a scalar float32 tensor) under this workload's autocast."""
        device_type = batch[0].device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return self.loss_fn(model, batch)


def _image_workload(name, description, autocast_dtype, model_fn, lr, sizes) -> Workload:
    return Workload(
        name, description, autocast_dtype, MappingProxyType(sizes), model_fn, _sgd(lr), _digit_batches, _classify
    )


def _text_workload(name, description, autocast_dtype, model_fn, lr, sizes) -> Workload:
    return Workload(
        name, description, autocast_dtype, MappingProxyType(sizes), model_fn, _adamw(lr), _text_batches, _next_byte
    )


# quick tensors reach buddy's 1 MiB min_bytes; bf16 sizes are bounded by CPUs without native
# bf16, where its convolutions and matmuls run about ten times slower than fp32
_RESNET_SIZES = {
    "tiny": ImageSize(batch=8, width=8, depth=1),
    "quick": ImageSize(batch=32, width=16, depth=1),
    "full": ImageSize(batch=64, width=16, depth=2),
}
_VGG_SIZES = {
    "tiny": ImageSize(batch=8, width=8, depth=1),
    "quick": ImageSize(batch=32, width=16, depth=2),
    "full": ImageSize(batch=64, width=32, depth=2),
}
_GPT_SIZES = {
    "tiny": TextSize(batch=4, seq_len=32, width=32, layers=2, corpus_bytes=1 << 16),
    "quick": TextSize(batch=16, seq_len=128, width=64, layers=2),
    "full": TextSize(batch=16, seq_len=256, width=64, layers=4, corpus_bytes=8 << 20),
}
_LSTM_SIZES = {
    "tiny": TextSize(batch=4, seq_len=32, width=32, layers=2, corpus_bytes=1 << 16),
    "quick": TextSize(batch=16, seq_len=64, width=256, layers=2),
    "full": TextSize(batch=32, seq_len=128, width=256, layers=2, corpus_bytes=8 << 20),
}
_TV_RESNET50_SIZES = {  # torchvision's architecture: only batch and resolution apply
    "tiny": ImageSize(batch=2, resolution=64),
    "quick": ImageSize(batch=32, resolution=64),
    "full": ImageSize(batch=128, resolution=64),
}
_HF_GPT2_SIZES = {
    "tiny": TextSize(batch=4, seq_len=32, width=32, layers=2, corpus_bytes=1 << 16),
    "quick": TextSize(batch=8, seq_len=128, width=256, layers=4),
    "full": TextSize(batch=32, seq_len=512, width=768, layers=12, heads=12, corpus_bytes=8 << 20),
}


def _importable(module: str, name: str) -> bool:
    """Whether ``module.name`` can be imported; a broken install counts as absent.

    ``name`` is looked up because transformers imports its models lazily:
    ``import transformers`` succeeds even where its models cannot load.
    """
    try:
        getattr(importlib.import_module(module), name)
    except Exception:  # not only ImportError: binaries built for another torch raise RuntimeError, OSError, ...
        return False
    return True


def _registry() -> dict[str, Workload]:
    digits = "scikit-learn's handwritten digits upsampled to 32x32"
    text = "next-byte prediction on the standard library's source"
    workloads = [
        _image_workload("resnet-fp32", f"ResNet-style CNN, {digits}, fp32", None, _ResNet, 0.05, _RESNET_SIZES),
        _image_workload(
            "resnet-bf16", f"ResNet-style CNN, {digits}, bf16 autocast", torch.bfloat16, _ResNet, 0.05, _RESNET_SIZES
        ),
        _image_workload("vgg-fp32", f"VGG-style plain CNN, {digits}, fp32", None, _VGG, 0.01, _VGG_SIZES),
        _text_workload("gpt-bf16", f"GPT-style decoder, {text}, bf16 autocast", torch.bfloat16, _GPT, 3e-3, _GPT_SIZES),
        _text_workload("lstm-fp32", f"2-layer LSTM language model, {text}, fp32", None, _LSTMModel, 3e-3, _LSTM_SIZES),
    ]
    if _importable("torchvision.models", "resnet50"):
        workloads.append(
            _image_workload(
                "tv-resnet50",
                "torchvision ResNet-50 (random init), handwritten digits upsampled to 64x64, fp32",
                None,
                _torchvision_resnet50,
                0.05,
                _TV_RESNET50_SIZES,
            )
        )
    if _importable("transformers", "GPT2LMHeadModel"):
        workloads.append(
            _text_workload(
                "hf-gpt2",
                f"transformers GPT-2 (random init), {text}, bf16 autocast",
                torch.bfloat16,
                _HFGPT2,
                1e-3,
                _HF_GPT2_SIZES,
            )
        )
    return {w.name: w for w in workloads}


#: every workload this machine can build, by name
WORKLOADS: dict[str, Workload] = _registry()

#: the workloads that need nothing beyond torch and scikit-learn
DEFAULT_WORKLOADS: tuple[str, ...] = ("resnet-fp32", "resnet-bf16", "vgg-fp32", "gpt-bf16", "lstm-fp32")


def _workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


# ---- running ------------------------------------------------------------------------
def _progress(total: int, desc: str, enabled: bool):
    tqdm = require("tqdm", "the progress bar").tqdm
    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False)


@dataclass
class Run:
    """One training run of a workload: model, optimizer and batch stream, stepped by hand.

    A compressed step is ``with buddy.compressed_activations(): loss =
    run.forward_loss()`` followed by ``run.step(loss)``; :meth:`train` takes
    plain steps.
    """

    workload: Workload
    size: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterator[Batch] = field(repr=False)
    steps_done: int = 0  # optimizer steps taken so far

    def forward_loss(self) -> torch.Tensor:
        """The next batch's forward pass (under the workload's autocast) and its loss."""
        return self.workload.loss(self.model, next(self.batches))

    def step(self, loss: torch.Tensor) -> None:
        """Backward from ``loss``, an optimizer step, and gradients reset to None."""
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1

    def train(self, n_steps: int, progress: bool = False) -> list[float]:
        """``n_steps`` plain training steps; returns their losses."""
        losses = []
        with _progress(n_steps, f"{self.workload.name} {self.size}", progress) as bar:
            for _ in range(n_steps):
                loss = self.forward_loss()
                self.step(loss)
                losses.append(loss.item())
                bar.update()
        return losses


def make_run(name: str, size: str = "quick", device="cpu", seed: int = 0) -> Run:
    """A fresh run of workload ``name`` at ``size`` on ``device``; deterministic for ``seed`` on the CPU."""
    workload = _workload(name)
    model = workload.build_model(size, device, seed)
    return Run(workload, size, model, workload.build_optimizer(model), workload.batches(size, device, seed))


# ---- capturing saved activations ----------------------------------------------------------
#: one unique tensor autograd saved in a step, as buddy would compress it: ``key`` is buddy's key
#: for it (``"<index>:<dtype><shape>"``), ``tensor`` a detached CPU copy with the original's
#: strides when they were dense (its bytes in memory order are the ones buddy compresses), ``op``
#: the name of the autograd node that produced it (e.g. ``"ReluBackward0"``; ``""`` for inputs and
#: tensors made without grad). See :class:`buddy.RecordedTensor`.
SavedTensor = RecordedTensor


@dataclass(frozen=True)
class Capture:
    """What one training step saved for backward, ``point`` steps into training.

    ``saved_bytes`` and ``skipped_bytes`` are what a buddy session's
    ``stats()`` reports as ``original_bytes`` and ``skipped_bytes``.
    """

    point: int  # training steps done before this one
    loss: float  # this step's loss
    tensors: list[SavedTensor] = field(repr=False)  # unique saved tensors, in saving order
    saved_bytes: int  # bytes of the unique storages behind ``tensors``
    skipped_bytes: int  # bytes of every save buddy would not compress (one count per save)


def _capture_step(run: Run, min_bytes: int) -> Capture:
    """One training step of ``run`` whose saved tensors are recorded (buddy's own skip, dedup and key rules)."""
    point = run.steps_done
    with buddy.record_activations(min_bytes=min_bytes) as recorder:
        loss = run.forward_loss()
    run.step(loss)
    stats = recorder.stats()
    return Capture(point, loss.item(), recorder.tensors, stats.original_bytes, stats.skipped_bytes)


def capture(
    name: str,
    size: str = "quick",
    points: Sequence[int] | None = None,
    device="cpu",
    seed: int = 0,
    min_bytes: int | None = None,
    progress: bool = False,
) -> list[Capture]:
    """Train workload ``name`` and record what autograd saves at each of ``points``.

    ``points`` are strictly increasing step counts (default :data:`POINTS`
    of ``size``); at each, one training step records the unique tensors a
    ``buddy.compressed_activations(min_bytes=min_bytes)`` session would
    compress (``min_bytes`` default: :data:`MIN_BYTES` of ``size``), then
    completes its backward and optimizer step, so training goes on exactly as
    without recording. Between points the run takes plain steps.
    """
    _workload(name).size(size)  # unknown names and sizes fail before any work
    points = tuple(POINTS[size] if points is None else points)
    if not points or points[0] < 0 or any(b <= a for a, b in itertools.pairwise(points)):
        raise ValueError(f"points must be non-negative and strictly increasing, got {points!r}")
    min_bytes = MIN_BYTES[size] if min_bytes is None else min_bytes
    if min_bytes < 0:
        raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
    run = make_run(name, size, device, seed)
    captures = []
    with _progress(points[-1] + 1, f"{name} {size}", progress) as bar:
        for point in points:
            for _ in range(point - run.steps_done):
                run.train(1)
                bar.update()
            captures.append(_capture_step(run, min_bytes))
            bar.update()
    return captures
