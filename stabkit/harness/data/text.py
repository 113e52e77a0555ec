"""Byte-level text data for the recipes: CPython's bundled `pydoc_data.topics` by default.

Loaded once when a run starts; batches are drawn with a private generator, so drawing data never
touches the global RNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .synthetic import SyntheticSpec, synthetic_corpus
from .windows import random_windows

VAL_FRACTION = 0.1
MIN_TEXT_BYTES = 1000
"""The shortest training text a corpus accepts (also checked when a recipe loads)."""


def embedded_text() -> bytes:
    """~465 KB of English (the Python docs' topics) that ships with every CPython."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


class ByteCorpus:
    """A byte sequence split into train (first 90 %) and validation (last 10 %)."""

    def __init__(self, data: bytes, name: str = "text") -> None:
        if len(data) < MIN_TEXT_BYTES:
            raise ValueError(f"training text {name!r} has {len(data)} bytes; need at least {MIN_TEXT_BYTES}")
        self.name = name
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = int(len(tokens) * (1 - VAL_FRACTION))
        self.train, self.val = tokens[:cut], tokens[cut:]

    def batch(
        self, split: str, batch_size: int, context: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs (B, T) and next-byte targets (B, T), int64 on the CPU."""
        data = self.train if split == "train" else self.val
        return random_windows(data, f"{split} split of {self.name!r}", batch_size, context, generator)


def load_corpus(path: str | Path | SyntheticSpec | None = None) -> Any:
    """The user's text file as bytes, the embedded default when `path` is None, or the synthetic
    language of a `SyntheticSpec` (`stabkit.harness.data.synthetic`, made once per process)."""
    if isinstance(path, SyntheticSpec):
        return synthetic_corpus(path)
    if path is None:
        return ByteCorpus(embedded_text(), "pydoc_data.topics")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {str(p)!r} does not exist")
    return ByteCorpus(p.read_bytes(), p.name)
