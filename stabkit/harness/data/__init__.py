"""Embedded training text (no download) and byte-level batching."""

from .text import ByteCorpus, load_corpus

__all__ = ["ByteCorpus", "load_corpus"]
