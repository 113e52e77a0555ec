"""Random training windows from a token sequence: what every corpus's ``batch`` returns."""

from __future__ import annotations

import torch


def random_windows(
    data: torch.Tensor, what: str, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` windows at random starts of the int64 sequence `data`: inputs (B, T) and next-token
    targets (B, T) on the CPU. `what` names the split in the error raised when `data` is too short."""
    if len(data) <= context + 1:
        raise ValueError(f"{what} is shorter than context {context} + 1")
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + context + 1] for s in starts.tolist()])  # (B, T+1)
    return windows[:, :-1], windows[:, 1:]
