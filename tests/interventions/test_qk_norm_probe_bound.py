"""With qk_norm switched on through attach, the attention probe's max logit stays under the bound
scale·‖g_q‖·‖g_k‖ that the per-head norms imply, at a learning rate where the baseline's logits grow."""

from __future__ import annotations

import torch

import stabkit
from stabkit.harness.data import load_corpus
from stabkit.harness.models import GPT, preset_config
from stabkit.interventions import qk_norm_logit_bounds


def run(
    interventions: list[str], steps: int = 60
) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    torch.manual_seed(0)
    cfg = preset_config("tiny")
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1e-8)
    mcfg = stabkit.MonitorConfig(
        every=5, attn_sample_rows=None, attn_sample_queries=None, console=False, audit=False
    )
    mon = stabkit.attach(model, opt, config=mcfg, interventions=interventions)
    corpus, gen = load_corpus(), torch.Generator().manual_seed(0)
    bounds: dict[int, dict[str, float]] = {}
    for step in range(steps):
        x, y = corpus.batch("train", 16, cfg.context, gen)
        if step % 5 == 0 and interventions:
            bounds[step] = qk_norm_logit_bounds(model)  # the gains this forward uses
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mon.step(loss)
        opt.zero_grad()
    mon.detach()
    return dict(mon.history), bounds


def test_probe_max_logit_respects_the_qk_norm_bound() -> None:
    history, bounds = run(["qk_norm"])
    checked = 0
    for step, per_module in bounds.items():
        for path, bound in per_module.items():
            observed = history[step][f"attn/{path}/max_logit"]
            assert observed <= bound * (1 + 1e-5), (step, path, observed, bound)
            checked += 1
    assert checked >= 20
    baseline, _ = run([])
    final_bound = max(bounds[max(bounds)].values())
    worst = max(v for k, v in baseline[55].items() if k.endswith("/max_logit"))
    assert worst > 2 * final_bound, (worst, final_bound)
