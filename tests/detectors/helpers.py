"""Helpers shared by the detector tests (no tests here): real text batches and realistic stable series."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

_TEXT: torch.Tensor | None = None


def text_batches(steps: int, bsz: int, seq: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` random (x, y) byte batches of CPython's bundled pydoc topics (English text, vocab 256)."""
    global _TEXT
    if _TEXT is None:
        import pydoc_data.topics as topics

        _TEXT = torch.tensor(list("\n".join(topics.topics.values()).encode()), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ix = torch.randint(0, len(_TEXT) - seq - 1, (bsz,), generator=gen)
        x = torch.stack([_TEXT[i : i + seq] for i in ix])
        y = torch.stack([_TEXT[i + 1 : i + seq + 1] for i in ix])
        yield x, y


def realistic_rows(steps: int, seed: int, every: int = 10) -> list[tuple[int, dict[str, float]]]:
    """Host rows like the Monitor drains them for the tiny reference GPT (vocab 256, blocks.0/1).

    Shapes and noise follow 2000-step stable runs of that model measured with stabkit (AdamW
    1e-3..3e-3, 512-1024 tokens per batch): log-noise σ about 0.06 on the loss, 0.14 on the global
    grad norm (with heavy tails: single steps at 2× the median), 0.17 on per-block grad norms,
    0.045 on update ratios and attention max logits, 0.02 nats on log Z, 0.02 on residual RMS.
    Measured tails: the loss stays within ~3.5σ (Gaussian noise here); gradient norms reach
    ~5σ in 2000 steps (unit-variance Student-t(8) noise here, which matches that).
    """
    rng = np.random.default_rng(seed)

    def noise(scale: float, heavy: bool = False) -> float:
        return float(scale * (rng.standard_t(8) * math.sqrt(6 / 8) if heavy else rng.standard_normal()))

    rows = []
    for t in range(steps):
        warm = min(1.0, (t + 1) / 100)
        grad = 0.5 + 2.5 * math.exp(-t / 30) + 1.0 * (1 - math.exp(-t / 800))
        row = {
            "opt/lr": 3e-3 * warm,  # the monitor logs the optimizer's LR with the detectors on
            "loss": (2.0 + 4.0 * math.exp(-t / 60) + 0.5 * math.exp(-t / 800)) * math.exp(noise(0.06)),
            "grad/global_norm": grad * math.exp(noise(0.14, heavy=True)),
        }
        if t % every == 0:
            for b in (0, 1):
                row[f"grad/blocks.{b}/norm"] = 0.6 * grad * math.exp(noise(0.17, heavy=True))
                row[f"update/blocks.{b}/ratio"] = 0.0015 * warm * math.exp(noise(0.045))
                row[f"attn/blocks.{b}.attn/max_logit"] = (3 + 20 * (1 - math.exp(-t / 1000))) * math.exp(
                    noise(0.045)
                )
                row[f"act/blocks.{b}/rms"] = (1 + 1.0 * (1 - math.exp(-t / 100)) + t / 2000) * math.exp(
                    noise(0.02)
                )
            row["logits/logz_mean"] = 5.9 + 1.0 * (1 - math.exp(-t / 700)) + noise(0.02)
        rows.append((t, row))
    return rows


def train_with_fault(
    model: Any, opt: Any, mon: Any, steps: int, fault: Callable[[int, Any, Any], None]
) -> list[float]:
    """Train the tiny reference GPT (vocab 256, context 32) on text with `mon` attached, calling
    `fault(step, model, opt)` before each step's forward. Returns the losses."""
    losses = []
    for step, (x, y) in enumerate(text_batches(steps, 8, 32, seed=0)):
        fault(step, model, opt)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss)
        losses.append(loss.item())
    return losses


def train_with_logit_fault(model: Any, opt: Any, mon: Any, steps: int, fault_at: int | None) -> list[float]:
    """`train_with_fault` where step `fault_at` scales block 1's q and k weights ×10 (its attention
    logits ×100: the attention turns one-hot)."""

    def scale_qk(step: int, model: Any, opt: Any) -> None:
        if step == fault_at:
            with torch.no_grad():
                model.blocks[1].attn.q_proj.weight.mul_(10)
                model.blocks[1].attn.k_proj.weight.mul_(10)

    return train_with_fault(model, opt, mon, steps, scale_qk)
