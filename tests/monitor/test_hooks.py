"""Every hook stabkit puts on a model or optimizer to *observe* it goes through the Monitor's
HookSet, in the documented order, and is gone after detach."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from zoo import reference_gpt

import stabkit

PACKAGE = Path(stabkit.__file__).parent
REGISTERS = re.compile(
    r"\.register_(forward_pre_hook|forward_hook|full_backward_pre_hook|full_backward_hook|"
    r"post_accumulate_grad_hook|step_pre_hook|step_post_hook|hook)\("
)
ALLOWED = {
    "hooks.py": "the HookSet itself",
    "optimizers.py": "OptimizerSet forwards register_step_*_hook to the optimizers it wraps",
    "interventions": "interventions change the model on purpose (their Handle removes them)",
    "discovery/trace.py": "the one traced forward at discovery (removed before it returns)",
    "faults.py": "the stress-test harness's injected faults are part of the fault, not monitoring",
    "nonfinite/guard.py": "a tensor hook on the step's output (keeps dL/d(output)); dies with the tensor",
}


def test_no_module_registers_hooks_except_through_the_hookset() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if any(rel == key or rel.startswith(key + "/") or rel.endswith("/" + key) for key in ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if REGISTERS.search(line) and not line.lstrip().startswith(("#", '"')):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == [], "register hooks through Monitor.hooks / ctx.hooks:\n" + "\n".join(offenders)


def test_hooks_are_registered_in_the_documented_order_and_removed_at_detach() -> None:
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters())

    def counts() -> tuple[int, int, int, int]:
        modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        params = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
        return modules, params, len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)

    before = counts()
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(console=False))
    owners = mon.hooks.owners()
    assert owners == [
        "training-forwards",
        "act",
        "logits",
        "grad",
        "attn",
        "outliers",
        "step-guard",
        "detectors",
    ]
    text = mon.describe_hooks()
    assert text.index("grad: optimizer step pre-hook") < text.index("detectors: optimizer step pre-hook")
    assert counts() != before
    mon.detach()
    assert counts() == before
