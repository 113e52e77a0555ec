"""Subprocess used by reliability/test_crash.py: trains under attach and prints each finished step.

Usage: python crash_worker.py LOGDIR MODE  (MODE: loop = train until killed; raise = raise at step 5,
outside any `with` block)
"""

from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from zoo import batch, lm_loss, reference_gpt

import stabkit

torch.set_num_threads(1)
logdir, mode = sys.argv[1], sys.argv[2]
model = reference_gpt()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
mon = stabkit.attach(
    model, opt, logdir=logdir, config=stabkit.MonitorConfig(every=1, log_every=10_000, console=False)
)
for step in range(100_000):
    if mode == "raise" and step == 5:
        raise RuntimeError("user code failed")
    x, y = batch(step)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    mon.step(loss)
    opt.zero_grad()
    print(f"done {step}", flush=True)
    time.sleep(0.01)
