"""A small, honest training loop for the reference GPT (used by `stabkit demo` and the recipes)."""

from .loop import TrainConfig, TrainResult, evaluate, lr_at, make_optimizer, train

__all__ = ["TrainConfig", "TrainResult", "evaluate", "lr_at", "make_optimizer", "train"]
