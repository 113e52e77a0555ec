"""STAND-IN for the ``transformer_engine`` package (pure PyTorch, tests only; see ``tests/standins/__init__.py``).

Only ``transformer_engine.pytorch.DotProductAttention`` exists, following NVIDIA/TransformerEngine @ d0067d0d
(2.20.0.dev0).
"""

__version__ = "2.20.0.dev0+standin"
__standin__ = True

from . import pytorch  # noqa: F401  (the real package imports its framework extension the same way)
