"""One rank of the distributed tests; launched by tests/distributed/test_torchrun.py under torchrun (gloo, CPU).

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 train.py SCENARIO OUT

Scenarios:
- ddp: DistributedDataParallel, stabkit attached to the DDP wrapper;
- ddp_moe: the same on the reference GPT with mixture-of-experts MLPs (routers found, loads summed);
- fsdp: FSDP2 `fully_shard` on every block and on the root;
- nan: FSDP2 with the detectors' non-finite action "skip"; at step NAN_STEP rank 1 writes a NaN
  into its own shard of one gradient, so only rank 1 sees it unless the decision is agreed;
- reduce: `reduce_stacked` (both strategies) and `agree` on known per-rank values.

Each rank writes OUT/rank<r>.json (mode, history, per-step facts); rank 0's logdir is OUT/run.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIG, GLOBAL_BATCH, make_model, train

import stabkit
from stabkit.distributed import GATHER_LIMIT, agree, init_from_env, reduce_stacked, shard_rows

NAN_STEP = 2
NAN_PARAM = "blocks.1.mlp.fc.weight"


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)


def local_copy(model: torch.nn.Module) -> list[torch.Tensor]:
    return [stabkit.distributed.local(p.detach()).clone() for p in model.parameters()]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN equals NaN)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def run_training(scenario: str, out: str, rank: int, rows: slice) -> dict:
    model = make_model(moe=scenario == "ddp_moe")
    facts: dict = {"changed": [], "finite_end": None}
    if scenario in ("ddp", "ddp_moe"):
        from torch.nn.parallel import DistributedDataParallel

        # a rank's tokens may pick no token for an expert: its weights then get no gradient there
        wrapped: torch.nn.Module = DistributedDataParallel(
            model, find_unused_parameters=scenario == "ddp_moe"
        )
    else:
        shard(model)
        wrapped = model
    step = {"now": 0}
    if scenario == "nan" and rank == 1:  # registered before attach: runs before stabkit's hook

        def poison(p: torch.Tensor) -> None:
            if step["now"] == NAN_STEP:
                stabkit.distributed.local(p.grad)[0, 0] = math.nan  # type: ignore[arg-type]

        dict(model.named_parameters())[NAN_PARAM].register_post_accumulate_grad_hook(poison)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    options = dict(CONFIG)
    if scenario == "nan":
        from stabkit.detectors import DetectConfig

        options["detect"] = DetectConfig(actions={"nonfinite": "skip"})
    elif scenario == "fsdp":
        options["detect"] = None  # the norms alone; detectors under FSDP2 are the nan scenario's
    config = stabkit.MonitorConfig(**options)  # type: ignore[arg-type]
    mon = stabkit.attach(wrapped, opt, logdir=os.path.join(out, "run"), config=config)
    before: list[list[torch.Tensor]] = []
    opt.register_step_post_hook(
        lambda *_: facts["changed"].append(
            any(not same(a, b) for a, b in zip(before[-1], local_copy(model), strict=True))
        )
    )

    def before_step(s: int) -> None:
        before.append(local_copy(model))
        step["now"] = s + 1  # the next backward belongs to the next step

    with mon:
        losses = train(wrapped, opt, mon, rows, before_step=before_step)
    facts["finite_end"] = all(bool(torch.isfinite(t).all()) for t in local_copy(model))
    return {"mode": mon.dist.mode, "history": list(mon.history), "losses": losses, **facts}


def run_reduce(rank: int) -> dict:
    """Known per-rank values: rank r holds [r+1, 2r+1, ...]; rank 1 puts a NaN in one max entry."""
    reductions = ["mean", "sum", "max", "min", "l2", "rms", "max", "min"]
    values = torch.tensor(
        [rank + 1.0, 2.0 * rank + 1, 3.0 - rank, rank + 5.0, 3.0 * rank + 4, rank + 1.0, 0.0, -1.0]
    )
    if rank == 1:
        values[6] = math.nan
        values[7] = math.inf
    gathered = reduce_stacked(values, reductions).tolist()
    summed = reduce_stacked(values, reductions, gather_limit=0).tolist()  # the SUM + MAX path
    flag = agree(torch.tensor(rank == 1))
    mismatched = []
    for limit in (GATHER_LIMIT, 0):  # ranks declare different layouts: each keeps its own values
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            own = reduce_stacked(values[:2], ["mean", "sum"][:: 1 - 2 * rank], gather_limit=limit)
        mismatched.append([own.tolist(), [str(w.message)[:60] for w in caught]])
    return {
        "gather": gathered,
        "sum_max": summed,
        "agree": bool(flag),
        "agree_dtype": str(flag.dtype),
        "mismatched": mismatched,
        "values": values.tolist(),
    }


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(float(os.environ.get("STABKIT_TEST_HANG_S", "90")), exit=True)
    torch.set_num_threads(1)
    ctx = init_from_env("cpu")
    rows = shard_rows(GLOBAL_BATCH, ctx)
    result = run_reduce(ctx.rank) if scenario == "reduce" else run_training(scenario, out, ctx.rank, rows)
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as fh:
        json.dump({"rank": ctx.rank, "world": ctx.world_size, **result}, fh, default=str)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # as `entry.worker_main`: leave without the interpreter's teardown, where a gloo run aborts once in
    # a while after its work is written ("terminate called without an active exception", exit -6; seen
    # in CI on the ddp_moe scenario too, not reproducible at will)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
