"""Faults injected on purpose (nan-injection, loss-spike).

Installed on a variant's model or corpus before training starts; they act at the known step only.
`StepClock` is advanced by the runner after each completed step, so a detector that replays a step
sees the fault again (which is what lets it localize the module).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...data import ByteCorpus
from ..spec.schema import FaultSpec


class StepClock:
    """The index of the training step in progress (completed steps so far)."""

    def __init__(self) -> None:
        self.step = 0

    def active(self, fault: FaultSpec) -> bool:
        """True while the step in progress lies in the fault's window."""
        return fault.step <= self.step < fault.step + fault.length


GPT_FAULT_PATH = re.compile(r"^blocks\.(\d+)\.(mlp|attn)(?:\.\w+)*$")
"""A reference-GPT module path a recipe's [fault] names: ``blocks.<i>.mlp.fc``, ``blocks.<i>.attn...``."""


def fault_module(model: nn.Module, path: str) -> str:
    """`path` when `model` has that module; else, for a reference-GPT path (``blocks.1.mlp.fc``) on
    another model, the same place found by discovery: block i's MLP (or attention), its first Linear
    (the block index clamped to the model's depth). Runs once per variant, when the fault is injected.
    Otherwise `path` unchanged (`inject_output_fault` then names the modules that exist)."""
    names = {n for n, _ in model.named_modules()}
    match = GPT_FAULT_PATH.match(path)
    if path in names or match is None:
        return path
    from ....discovery import inspect_model

    blocks = inspect_model(model).blocks
    if not blocks:
        return path
    block = blocks[min(int(match.group(1)), len(blocks) - 1)]
    role = block.mlp if match.group(2) == "mlp" else (block.attention.path if block.attention else None)
    if role is None:
        return path
    sub = model.get_submodule(role)
    first = next((f"{role}.{n}" for n, m in sub.named_modules() if n and isinstance(m, nn.Linear)), role)
    return first


def inject_output_fault(model: nn.Module, fault: FaultSpec, clock: StepClock) -> RemovableHandle:
    """Forward hook that writes one NaN (or Inf) into `fault.module`'s output on the fault's steps
    (training-mode forwards only). Raises KeyError naming the modules when the path does not exist."""
    try:
        module = model.get_submodule(fault.module)
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        raise KeyError(
            f"fault.module {fault.module!r} is not a module of the model; e.g. {', '.join(names[:8])}, ..."
        ) from None
    bad = float("nan") if fault.kind == "nan" else float("inf")

    def hook(mod: nn.Module, args: Any, output: Any) -> Any:
        first = output[0] if isinstance(output, tuple) and output else output  # (hidden, router logits)
        if not (mod.training and isinstance(first, torch.Tensor) and clock.active(fault)):
            return None
        out = first.clone()
        out.view(-1)[0] = bad  # one element of (B, T, d) is enough to poison the step
        return (out, *output[1:]) if isinstance(output, tuple) else out

    return module.register_forward_hook(hook)


class FaultyCorpus:
    """A corpus whose training batches are random bytes on the fault's steps (a "bad batch").

    The normal batch is still drawn (and thrown away), so the data order after the fault is the
    same as in a run without it. The random bytes come from their own seeded generator.
    """

    def __init__(self, corpus: ByteCorpus, fault: FaultSpec, grad_accum: int, seed: int) -> None:
        self.corpus = corpus
        self.name = corpus.name
        self.fault = fault
        self.grad_accum = grad_accum
        self.calls = 0
        self.noise = torch.Generator().manual_seed(seed + 7919)

    def batch(
        self, split: str, batch_size: int, context: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `ByteCorpus.batch`; on the fault's steps the training windows are random bytes."""
        x, y = self.corpus.batch(split, batch_size, context, generator)
        if split != "train":
            return x, y
        step = self.calls // self.grad_accum
        self.calls += 1
        if not self.fault.step <= step < self.fault.step + self.fault.length:
            return x, y
        windows = torch.randint(0, 256, (batch_size, context + 1), generator=self.noise)  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]
