"""Which implementation of a codec runs: the torch reference or CUDA kernels.

The one place where the pipeline (:mod:`buddy.tensor`) chooses.
:func:`implementation` returns an object with the codec's ``sizes``,
``encode`` and ``decode`` (same arguments, same bytes out):

* ``"reference"`` -- the codec itself: batched torch ops, on any device.
* ``"cuda"`` -- the codec's CUDA kernels (:mod:`buddy.cuda`); raises when
  that is impossible: ``ValueError`` for a tensor that is not on a CUDA
  device or a codec without kernels, :class:`~buddy.errors.MissingDependencyError`
  without CuPy or a usable GPU.
* ``"auto"`` (also what ``None`` means) -- the process default
  (:func:`buddy.set_defaults`, ``backend=``): with the default
  ``"reference"``, the reference; with ``"cuda"``, the kernels wherever they
  apply (a CUDA tensor, a codec with kernels, CuPy installed) and the
  reference elsewhere.

The CUDA kernels are **off by default** until they have been validated on a
GPU; both implementations write the same bytes, so a tensor compressed by
one decompresses with the other.

Kernels are registered per codec name (:func:`register_cuda`); ``zvc`` has
them.
"""

from __future__ import annotations

import warnings

import torch

from . import config
from ._deps import available
from .codecs import Codec, get_codec
from .cuda import ZVCCuda

__all__ = ["BACKENDS", "implementation", "backend_name", "check_backend", "register_cuda", "cuda_codecs"]

#: values of ``backend=`` (``None`` means ``"auto"``)
BACKENDS = ("auto", "reference", "cuda")

# codec name -> class of its CUDA implementation; the class has
# supports(codec) -> bool, check_device(device) (raises when unusable) and is
# constructed with the codec.
_CUDA: dict[str, type] = {}
_warned = False


def register_cuda(codec_name: str, implementation_class: type, *, replace: bool = False) -> None:
    """Make ``implementation_class`` the CUDA implementation of codec ``codec_name``."""
    if codec_name in _CUDA and not replace:
        raise ValueError(f"codec {codec_name!r} already has a CUDA implementation (pass replace=True to override)")
    _CUDA[codec_name] = implementation_class


def cuda_codecs() -> list[str]:
    """Names of the codecs that have CUDA kernels."""
    return sorted(_CUDA)


def check_backend(backend: str | None) -> str:
    """``backend`` validated (``None`` -> ``"auto"``)."""
    if backend is None:
        return "auto"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} (or None), got {backend!r}")
    return backend


def backend_name(impl) -> str:
    """``"cuda"`` or ``"reference"``: which kind of implementation ``impl`` is."""
    return "reference" if isinstance(impl, Codec) else getattr(impl, "backend", "reference")


def implementation(codec: str | Codec | None, device: torch.device | str, backend: str | None = None):
    """The implementation of ``codec`` to run on ``device`` for ``backend`` (see the module doc)."""
    backend = check_backend(backend)
    codec = get_codec(codec)
    device = torch.device(device)
    if backend == "reference":
        return codec
    if backend == "cuda":
        return _cuda(codec, device)
    # auto: the process default decides, and falls back where CUDA does not apply
    if config.defaults().backend == "reference" or device.type != "cuda" or _cuda_class(codec) is None:
        return codec
    if not available("cupy"):
        _warn_fallback()
        return codec
    return _cuda(codec, device)


def _cuda_class(codec: Codec) -> type | None:
    cls = _CUDA.get(codec.name)
    return cls if cls is not None and cls.supports(codec) else None


def _cuda(codec: Codec, device: torch.device):
    cls = _cuda_class(codec)
    if cls is None:
        have = ", ".join(cuda_codecs()) or "none"
        raise ValueError(
            f"codec {codec.name!r} has no CUDA kernels (codecs with kernels: {have}); use backend='reference' or 'auto'"
        )
    if device.type != "cuda":
        raise ValueError(
            f"backend='cuda' needs a tensor on a CUDA device, got one on {device}; use backend='reference' or 'auto'"
        )
    cls.check_device(device)  # CuPy importable, a GPU PyTorch can use
    return cls(codec)


def _warn_fallback() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "buddy's default backend is 'cuda' but CuPy is not importable: using the torch reference "
        "codecs. Install CuPy (pip install 'buddy[cuda12]' or 'buddy[cuda13]') to use the CUDA kernels.",
        RuntimeWarning,
        stacklevel=3,
    )


register_cuda("zvc", ZVCCuda)
