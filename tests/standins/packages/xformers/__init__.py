"""STAND-IN for the ``xformers`` package (pure PyTorch, tests only; see ``tests/standins/__init__.py``).

Only ``xformers.ops.memory_efficient_attention`` and ``xformers.ops.fmha`` (with ``fmha.attn_bias``) exist,
following facebookresearch/xformers @ bed3978b (0.0.35).
"""

__version__ = "0.0.35+standin"
__standin__ = True
