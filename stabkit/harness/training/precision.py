"""`Amp`: what `TrainConfig.precision` means for the loop — autocast around the forward pass and the
loss, and for fp16 on a GPU a GradScaler on the backward pass and the optimizer step (nanoGPT's two
lines: ``torch.autocast(device_type, dtype)`` and ``torch.cuda.amp.GradScaler(enabled=dtype ==
float16)``, which is off without CUDA).

On a CPU, fp16 is autocast without a scaler, as the recipes were measured (low-precision: the fp16
q·kᵀ overflow, its localization and the fixes' numbers). Measured with a CPU GradScaler instead
(`Amp.of(..., scaler=True)`): the overflow still reproduces and is still localized to blocks.0.attn,
but the scaled fp16 backward rounds differently (fp32_softmax's held-out loss 3.56 instead of 3.68
after 20 steps at LR 0.45), so the recorded numbers would move. A run asks for one with
`TrainConfig.grad_scaler` (``train.grad_scaler`` in a recipe): low-precision does —
without it, unscaled fp16 gradients underflow and Adam's normalised steps grew the MLP until it
overflowed fp16 too, and attention was no longer the run's only overflow.

Built once per run (`TrainRun`), before the caller attaches a monitor, so the monitor can be given
the scaler (``attach(..., scaler=amp.scaler)``: gradient norms unscaled, skipped steps reported).
Evaluation runs under the same autocast (`stabkit.harness.training.evaluate`), so a held-out loss
is measured in the precision the model trains in.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .config import Precision

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Amp:
    """Autocast and (fp16) loss scaling of one run; fp32: nothing at all."""

    precision: Precision
    """fp32, bf16 or fp16 (`TrainConfig.precision`)."""
    device_type: str
    """``cpu`` or ``cuda`` (where autocast runs)."""
    scaler: torch.amp.GradScaler | None = None
    """fp16's loss scaler (None: the gradients are not scaled)."""

    @classmethod
    def of(cls, precision: Precision, device: torch.device | str, scaler: bool | None = None) -> Amp:
        """The run's precision on `device`. `scaler` None: a GradScaler for fp16 off the CPU (see the
        module docstring); True / False: with / without one for fp16. Raises ValueError when autocast
        is not available on the device."""
        device_type = torch.device(device).type
        if precision == "fp32":
            return cls(precision, device_type)
        if precision not in DTYPES:
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
        if not torch.amp.is_autocast_available(device_type):
            raise ValueError(f"train.precision = {precision!r}: autocast is not available on {device_type}")
        scaled = precision == "fp16" and (device_type != "cpu" if scaler is None else scaler)
        return cls(precision, device_type, torch.amp.GradScaler(device_type) if scaled else None)

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype (float32 for fp32)."""
        return DTYPES.get(self.precision, torch.float32)

    def autocast(self) -> AbstractContextManager[object]:
        """The context the forward pass and the loss run in (a no-op for fp32)."""
        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the GradScaler when there is one."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: Any, params: Iterable[torch.Tensor], clip: float | None) -> None:
        """Clip the (unscaled) gradients to `clip` and step `optimizer` (one, or a list stepped in
        order: Muon and AdamW); with a scaler, a step whose scaled gradients hold Inf/NaN is skipped
        and the scale backs off (``scaler.update``)."""
        opts = list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]
        if self.scaler is not None:
            for opt in opts:
                self.scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        if self.scaler is not None:
            for opt in opts:
                self.scaler.step(opt)
            self.scaler.update()
        else:
            for opt in opts:
                opt.step()
