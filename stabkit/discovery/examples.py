"""A small example input for the one traced forward of discovery, when the user gives none.

Runs once at discovery time. Token models get random token ids, image models random pixels; the
values come from a private generator, so the global RNG stream is untouched. Returns None when no
example can be made (then discovery traces the first training forward instead, or uses names).
"""

from __future__ import annotations

from inspect import signature
from typing import Any

import torch
from torch import nn

Example = tuple[tuple[Any, ...], dict[str, Any]]
"""(args, kwargs) of one forward call."""

SEQ = 8
BATCH = 2


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _ids(vocab: int, device: torch.device, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, max(vocab, 1), (BATCH, seq), generator=gen).to(device)


def _max_positions(model: nn.Module, config: Any) -> int:
    limits = [
        getattr(config, n, None)
        for n in ("max_position_embeddings", "n_positions", "max_seq_len", "block_size", "seq_len")
    ]
    limits += [getattr(model, n, None) for n in ("max_seq_len", "block_size", "ctx", "seq_len")]
    ints = [v for v in limits if isinstance(v, int) and v > 1]
    return min([SEQ, *ints])


def _image_size(model: nn.Module, config: Any) -> tuple[int, int, int] | None:
    for obj in (config, getattr(model, "patch_embed", None), model):
        size = getattr(obj, "image_size", None) or getattr(obj, "img_size", None)
        if size is not None:
            hw = (size, size) if isinstance(size, int) else tuple(size)[-2:]
            channels = getattr(config, "num_channels", None) or getattr(obj, "in_chans", None) or 3
            return int(channels), int(hw[0]), int(hw[1])
    return None


def _hf_example(model: nn.Module, config: Any, device: torch.device) -> Example | None:
    main = getattr(model, "main_input_name", None)
    if main == "pixel_values":
        shape = _image_size(model, config)
        if shape is None:
            return None
        gen = torch.Generator().manual_seed(0)
        return (), {main: torch.randn(BATCH, *shape, generator=gen).to(device)}
    if main != "input_ids":
        return None
    vocab = getattr(config, "vocab_size", None) or 2
    seq = _max_positions(model, config)
    kwargs: dict[str, Any] = {"input_ids": _ids(vocab, device, seq)}
    if getattr(config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = _ids(vocab, device, seq)
    if "use_cache" in signature(model.forward).parameters:
        kwargs["use_cache"] = False
    return (), kwargs


def synthesize_example(model: nn.Module) -> Example | None:
    """Token ids (for a model whose first module is an embedding) or pixels (a patch convolution),
    shaped (2, 8) / (2, C, H, W); None when the model's input cannot be guessed."""
    device = _device(model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "main_input_name"):
        return _hf_example(model, config, device)
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding | nn.Conv2d)), None)
    if isinstance(first, nn.Embedding):
        return (_ids(first.num_embeddings, device, _max_positions(model, config)),), {}
    if isinstance(first, nn.Conv2d):
        shape = _image_size(model, config)
        if shape is None:
            return None
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(BATCH, *shape, generator=gen).to(device),), {}
    return None


def as_example(example: Any) -> Example:
    """Normalise what a user passes as ``example=``: a tensor, a tuple of args, a dict of kwargs, or
    an (args, kwargs) pair."""
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(example)
    if (
        isinstance(example, tuple)
        and len(example) == 2
        and isinstance(example[0], tuple)
        and isinstance(example[1], dict)
    ):
        return example[0], example[1]
    if isinstance(example, tuple | list):
        return tuple(example), {}
    raise TypeError(
        f"example must be a tensor, a tuple of positional inputs, a dict of keyword inputs or an "
        f"(args, kwargs) pair; got {type(example).__name__}"
    )
