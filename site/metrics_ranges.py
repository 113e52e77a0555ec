"""The healthy ranges of docs/guide/metrics.md: five tiny healthy runs with full monitoring, each
metric's range over steps 30 to the end (and over steps 0-29 apart).

    python docs/metrics_ranges.py            # ~5 min on one CPU thread

The reference GPT on the embedded text (vocabulary 256), AdamW (0.9, 0.95), warmup 15, cosine,
clip 1, `MonitorConfig.full()`: tiny (d 64, 2 layers, T 64) at LR 3e-3 and 1e-3, tiny with 4 layers,
tiny Llama-style (RMSNorm, SwiGLU, RoPE), small (d 128, 4 layers, T 128) at LR 1e-3.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict

import torch

from stabkit import MonitorConfig, attach
from stabkit.harness.data import load_corpus
from stabkit.harness.models import GPT, PRESET_BATCH, preset_config
from stabkit.harness.training import Callbacks, TrainConfig, TrainRun, train

RUNS = {
    "tiny-lr3e-3": ("tiny", 3e-3, 300, 0, {}),
    "tiny-lr1e-3": ("tiny", 1e-3, 300, 1, {}),
    "tiny-l4": ("tiny", 3e-3, 300, 2, {"n_layers": 4}),
    "tiny-llama-style": ("tiny", 3e-3, 300, 3, {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope"}),
    "small-lr1e-3": ("small", 1e-3, 200, 0, {}),
}
BLOCK = re.compile(r"^act/blocks\.\d+/")


def run(
    size: str, lr: float, steps: int, seed: int, model: dict[str, object]
) -> list[tuple[int, dict[str, float]]]:
    """One run's logged rows (every step)."""
    torch.manual_seed(seed)
    cfg = preset_config(size)
    for key, value in model.items():
        setattr(cfg, key, value)
    net = GPT(cfg)
    tcfg = TrainConfig(steps=steps, lr=lr, batch_size=PRESET_BATCH[size], seed=seed)
    trainer = TrainRun(net, load_corpus(None), tcfg, cfg.context)
    mon = attach(net, trainer.optimizer, config=MonitorConfig.full(console=False, history=None), lr=lr)
    train(trainer, Callbacks(after_update=mon.step, on_end=mon.detach))
    assert not [e for e in mon.events if e.severity != "info"], mon.events  # healthy: no warning
    return list(mon.history)


def family(name: str) -> str:
    """``act/<block>/rms`` for a block output, ``act/<sub-module>/rms`` for the others, ``grad/*/norm``..."""
    parts = name.split("/")
    if len(parts) <= 2:
        return name
    if parts[0] == "act":
        return f"act/<{'block' if BLOCK.match(name) else 'sub-module'}>/{parts[-1]}"
    return f"{parts[0]}/*/{parts[-1]}"


def main() -> None:
    torch.set_num_threads(1)
    late: dict[str, list[float]] = defaultdict(list)
    early: dict[str, list[float]] = defaultdict(list)
    for spec in RUNS.values():
        for step, values in run(*spec):
            out = late if step >= 30 else early
            for name, value in values.items():
                if value == value:
                    out[family(name)].append(value)
            if "logits/logz_mean" in values:
                out["|logz_mean - log V|"].append(abs(values["logits/logz_mean"] - math.log(256)))
    for key in sorted(late):
        v, e = late[key], early.get(key, [])
        q = statistics.quantiles(v, n=20) if len(v) >= 20 else [min(v)] * 19
        tail = f"  steps 0-29: [{min(e):.3g}, {max(e):.3g}]" if e else ""
        print(f"{key:32s} [{min(v):.3g}, {max(v):.3g}]  p5-p95 [{q[0]:.3g}, {q[-1]:.3g}]{tail}")


if __name__ == "__main__":
    main()
