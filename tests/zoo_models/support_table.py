"""Print the README's support table: per zoo entry, whether attach (no hints) monitors every attention
call, and what each intervention does (verified in effect, or refused and why).

Run from the repository root: ``python tests/zoo_models/support_table.py``. It runs the same checks
as ``tests/discovery/test_zoo.py`` (a few minutes on a CPU); the table groups an architecture's sdpa and
eager entries when they agree.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "discovery"))
torch.set_num_threads(1)

import test_zoo as checks  # noqa: E402
from zoo_models import ZOO  # noqa: E402

from stabkit.interventions import InterventionError, apply  # noqa: E402

SHORT = [
    (r"already has QK-norm", "has it"),
    (r"soft-capped already|soft-caps its output logits already", "has it"),
    (r"sandwich-norm already", "has it"),
    (r"not plain slices", "own QK-norm"),
    (r"residual wiring|no norm guarding", "post-norm"),
    (r"no mlp module", "no MLP in unit"),
    (r"block without attention", "hybrid layer"),
    (r"no nn\.LayerNorm", "no LayerNorm"),
    (r"bias", "LN bias"),
    (r"no final logits", "no logits"),
]


def outcome(name: str, intervention: str) -> str:
    zoo = ZOO[name]()
    with torch.no_grad():
        before = checks._final(zoo, zoo.forward()).float()
    import stabkit

    stabkit.inspect_model(zoo.model, example=(zoo.args, zoo.inputs))
    try:
        handle = apply(zoo.model, intervention, **checks.OPTIONS.get(intervention, {}))
    except InterventionError as exc:
        text = str(exc)
        switching = re.search(r"switching (\w+)-norm", text)
        if switching:
            return f"{switching.group(1)}-norm"
        return next((short for pattern, short in SHORT if re.search(pattern, text)), "refused")
    try:
        checks._verify(intervention, zoo, handle, before, name)
    except Exception:
        return "FAIL"
    finally:
        handle.remove()
    return "✓"


def monitored(name: str) -> str:
    try:
        checks.test_attach_without_hints_monitors_every_attention_call(name)
    except Exception:
        return "FAIL"
    return "✓"


def main() -> None:
    warnings.simplefilter("ignore")
    rows: dict[str, list[str]] = {}
    for name in sorted(ZOO):
        try:
            ZOO[name]()
        except ImportError:
            continue
        cells = [monitored(name)] + [outcome(name, i) for i in checks.INTERVENTIONS]
        key = re.sub(r"-(sdpa|eager|fused|flash)$", "", name)
        impl = name[len(key) + 1 :] or "-"
        if key in rows and rows[key][1:] == cells:
            rows[key][0] += f", {impl}"
        else:
            rows[key if key not in rows else name] = [impl, *cells]
    header = ["model", "attention", "probe", *checks.INTERVENTIONS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key, cells in rows.items():
        print("| " + " | ".join([key, *cells]) + " |")


if __name__ == "__main__":
    main()
