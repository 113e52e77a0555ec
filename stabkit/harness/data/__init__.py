"""Training data for the recipes, made or embedded in-process (no download): byte-level text
(`text`) and a synthetic Zipf language with local structure (`synthetic`)."""

from .synthetic import SyntheticCorpus, SyntheticSpec, synthetic_corpus
from .text import ByteCorpus, load_corpus

__all__ = ["ByteCorpus", "SyntheticCorpus", "SyntheticSpec", "load_corpus", "synthetic_corpus"]
