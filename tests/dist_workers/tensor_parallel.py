"""One rank of the tensor-parallel tests; launched by tests/distributed/test_tensor_parallel.py.

Usage: python -m torch.distributed.run --standalone --nproc_per_node N tensor_parallel.py SCENARIO OUT
       python tensor_parallel.py single OUT        (the one-process reference, whole batch)

Scenarios (the tiny torchtitan-style Llama of `tiny_llama`, torchtitan's TP plan, gloo on CPU):
- tp: tensor parallel over 2 ranks, norms and residual stream replicated;
- tp_sp: tensor parallel with sequence parallel over 2 ranks (the residual stream sharded by sequence);
- fsdp_tp: FSDP2 (2) x TP (2) on a 2 x 2 mesh, 4 ranks; fsdp_tp_sp: the same with sequence parallel.
Add ``+clip`` for the clip action (ZClip with a ceiling the gradients exceed), ``+nan`` (e.g. ``tp+nan``) to write a NaN into rank 1's shard of one projection's output at step
NAN_STEP, with per-module non-finite checks on and the action "skip".

Each rank writes OUT/rank<r>.json (mode, history, events, losses); rank 0's logdir is OUT/run.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from entry import worker_main
from tiny_llama import SEQ, VOCAB, apply_fsdp, apply_tp, apply_tp_hf, make_model

import stabkit
from stabkit.detectors import DetectConfig

GLOBAL_BATCH = 4
STEPS = 3
CONFIG: dict[str, Any] = dict(every=1, log_every=2, console=False, audit=False)
INTERVENTIONS: dict[str, Any] = {
    "softcap": ("attn_softcap", {"cap": 1.2}),
    "zloss": ("z_loss", {"coef": 0.05}),
}
"""Interventions a scenario may switch on at attach (``tp+hf+softcap``). With ``+qk_norm`` the worker
first tries ``interventions.apply(model, "qk_norm")`` and records the refusal."""
ROLES = {"blocks": "layers.*", "attention": "attention", "mlp": "feed_forward", "output_head": "output"}
"""The roles of the tiny Llama, for interventions (a sharded model is mapped by names; see attach)."""
CLIP = 0.5
"""The clip action's ceiling (``+clip``): below the gradient norm (~0.78), so every step after the first is clipped."""
NAN_STEP = 1
NAN_MODULE = "layers.1.attention.wq"


def make_hf() -> torch.nn.Module:
    """The zoo's tiny Hugging Face Llama (4 heads, 2 KV heads), the same weights on every process."""
    from zoo import hf_llama

    torch.manual_seed(0)
    return hf_llama()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def config(scenario: str) -> stabkit.MonitorConfig:
    options = dict(CONFIG)
    if "+heads" in scenario:  # per-head attention statistics, numbered by global head under TP
        options["attn_per_head"] = True
    if "+clip" in scenario:  # ZClip with a ceiling below the gradient norm: it clips from step 1 on
        options["detect"] = DetectConfig(
            actions={"spike": ["warn", "clip"]}, options={"clip": {"warmup": 1, "max_norm": CLIP}}
        )
    if "+nan" in scenario:
        options["detect"] = DetectConfig(
            actions={"nonfinite": "skip"}, options={"nonfinite": {"per_module": True}}
        )
    return stabkit.MonitorConfig(**options)


def poison(model: torch.nn.Module, step: dict[str, int], rank: int) -> None:
    """On rank 1 (or the one process), NaN into one value of NAN_MODULE's output in the forward of
    NAN_STEP: under TP it is in rank 1's shard of the q projection only, and reaches rank 0 through
    the o projection's all-reduce; the module that produced it is NAN_MODULE on every rank."""
    if rank != 1:
        return

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if step["now"] != NAN_STEP:
            return output
        output = output.clone()
        output[0, 0, 0] = math.nan
        return output

    model.get_submodule(NAN_MODULE).register_forward_hook(hook)


def run(scenario: str, out: str) -> dict[str, Any]:
    base, *extras = scenario.split("+")
    lp = "lp" in extras
    hf = "hf" in extras
    model = make_hf() if hf else make_model(flat="flat" in extras)
    rank, rows = 0, slice(0, GLOBAL_BATCH)
    if base != "single":
        from torch.distributed.device_mesh import init_device_mesh

        rank = torch.distributed.get_rank()
        if base.startswith("fsdp_tp"):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            share = GLOBAL_BATCH // 2
            dp = mesh["dp"].get_local_rank()
            rows = slice(dp * share, (dp + 1) * share)
            apply_tp(model, mesh["tp"], sequence_parallel=base == "fsdp_tp_sp", loss_parallel=lp)
            apply_fsdp(model, mesh["dp"])
        else:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            if hf:
                apply_tp_hf(model, mesh)
            else:
                apply_tp(model, mesh, sequence_parallel=base == "tp_sp", loss_parallel=lp)
    step = {"now": 0}
    if "nan" in extras:
        poison(model, step, rank if base != "single" else 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    if lp:
        from torch.distributed.tensor.parallel import loss_parallel
    refused = ""
    if "qk_norm" in extras:  # it adds parameters: refused on a model whose parameters are DTensors
        try:
            stabkit.interventions.apply(model, "qk_norm", model_map=None if hf else ROLES)
        except stabkit.interventions.InterventionError as exc:
            refused = str(exc)
    fixes = [INTERVENTIONS[e] for e in extras if e in INTERVENTIONS]
    mon = stabkit.attach(
        model,
        opt,
        logdir=os.path.join(out, "run"),
        config=config(scenario),
        interventions=fixes or None,
        model_map=ROLES if fixes and not hf else None,  # a map by names is trusted for known families
    )
    losses = []
    with mon:
        for s in range(STEPS):
            step["now"] = s
            x, y = batch(s)
            logits = model(x[rows])
            logits = logits.logits if hf else logits
            with loss_parallel() if lp else contextlib.nullcontext():
                loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y[rows].reshape(-1))
                loss.backward()
            opt.step()
            mon.step(loss)
            opt.zero_grad()
            losses.append(loss.item())
    events = [[e.step, e.kind, e.where, e.details.get("skipped_update")] for e in mon.events]
    return {
        "mode": mon.dist.mode,
        "history": list(mon.history),
        "losses": losses,
        "events": events,
        "refused": refused,
    }


def main() -> None:
    worker_main(run, single=lambda scenario: scenario.startswith("single"))


if __name__ == "__main__":
    main()
