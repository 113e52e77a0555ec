"""A small, honest training loop for the reference GPT (used by `stabkit demo` and the recipes).

``run = TrainRun(model, corpus, config, context)`` bundles what trains with its optimizer and its
precision (`Amp`: autocast, and a GradScaler for fp16 on a GPU); ``train(run, Callbacks(...))``
returns the losses; ``evaluate(...)`` measures the held-out loss in the same precision.
"""

from .config import MAX_BATCH_SIZE, Precision, TrainConfig
from .evaluate import EVAL_SEED, Heldout, evaluate
from .loop import Callbacks, Corpus, TrainResult, TrainRun, lr_at, make_optimizer, train
from .precision import Amp

__all__ = [
    "EVAL_SEED",
    "MAX_BATCH_SIZE",
    "Amp",
    "Callbacks",
    "Corpus",
    "Heldout",
    "Precision",
    "TrainConfig",
    "TrainResult",
    "TrainRun",
    "evaluate",
    "lr_at",
    "make_optimizer",
    "train",
]
