"""Framework integrations: thin callbacks over `stabkit.attach`.

Import the one you use (each needs its framework installed):
`stabkit.integrations.hf.StabkitCallback` (transformers.Trainer, extra ``hf``) and
`stabkit.integrations.lightning.StabkitCallback` (Lightning, extra ``lightning``).
"""

from .session import Session, inner_optimizer

__all__ = ["Session", "inner_optimizer"]
