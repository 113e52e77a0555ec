"""One rank of the torchtitan test; launched by tests/distributed/test_torchtitan.py.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 torchtitan_worker.py tp OUT
       python torchtitan_worker.py single OUT        (the one-process reference)

torchtitan's own Llama 3 (``torchtitan.models.llama3``: `Llama3Model` with FlexAttention, a tiny
config) parallelised by its own ``parallelize_llama`` (TP 2, FSDP2 over a data-parallel mesh of 1)
on gloo CPU processes, monitored by stabkit, against the same model in one process. What CPU
processes needed (torchtitan 0.3.0):

- its device mesh takes ``torchtitan.tools.utils.device_type``, "cuda" without an accelerator:
  set to "cpu" in ``torchtitan.distributed.parallel_dims`` before the mesh is built;
- ``spmd_backend="partial_dtensor"`` (the default "spmd_types" makes FSDP2 refuse the plain
  parameters it leaves) and ``mixed_precision_param="float32"`` (bf16 by default);
- FlexAttention refuses inputs that require grad on CPU (no CPU backward): stabkit is attached to the
  trainable model, then the parameters are frozen, so the forward is still a training forward
  (training mode, grad enabled) but nothing needs grad. Forward statistics only: no backward, no
  optimizer.

Each rank writes OUT/rank<r>.json (mode, history, losses); rank 0's logdir is OUT/run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from entry import worker_main

import stabkit

VOCAB, DIM, HEADS, LAYERS, HIDDEN = 256, 64, 4, 2, 128
BATCH, SEQ, STEPS = 2, 16, 2
ROLES = {"blocks": "layers.*", "attention": "attention", "mlp": "feed_forward", "output_head": "lm_head"}
"""The model_map of docs/guide/distributed.md's torchtitan how-to."""
CONFIG: dict[str, Any] = dict(every=1, log_every=1, console=False, audit=False)


def make_model(enable_sp: bool = False) -> torch.nn.Module:
    """torchtitan's Llama 3, tiny (2 layers, dim 64, 4 heads, vocab 256), FlexAttention, the same
    weights on every process; its sharding config set as its trainer's `update_from_config` does."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init={"weight": torch.nn.init.normal_}
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            hidden_dim=HIDDEN,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4 * SEQ, theta=10000.0),
            attn_backend="flex",
        ),
    )
    set_llama3_sharding_config(config, enable_sp=enable_sp)
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def parallelize(model: torch.nn.Module, world: int, enable_sp: bool) -> None:
    """torchtitan's own ``parallelize_llama`` with TP over every rank."""
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    pd.device_type = "cpu"  # its default without an accelerator is "cuda"
    parallelism = ParallelismConfig(
        tensor_parallel_degree=world,
        data_parallel_shard_degree=1,
        enable_sequence_parallel=enable_sp,
        spmd_backend="partial_dtensor",
    )
    dims = ParallelDims.from_config(parallelism, world)
    parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def run(scenario: str, out: str) -> dict[str, Any]:
    enable_sp = scenario.endswith("_sp")
    model = make_model(enable_sp)
    if scenario != "single":
        parallelize(model, torch.distributed.get_world_size(), enable_sp)
    mon = stabkit.attach(
        model, None, logdir=os.path.join(out, "run"), config=stabkit.MonitorConfig(**CONFIG), model_map=ROLES
    )  # attached as for training: trainable (DTensor) parameters, so stabkit sees a sharded model
    model.requires_grad_(False)  # FlexAttention has no CPU backward: nothing may require grad
    model.train()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    masks = model.get_attention_masks(positions)
    wqkv = model.get_parameter("layers.0.attention.qkv_linear.wqkv.weight")
    local = wqkv.to_local() if isinstance(wqkv, torch.distributed.tensor.DTensor) else wqkv
    losses = []
    with mon:
        for s in range(STEPS):
            x, y = batch(s)
            assert torch.is_grad_enabled() and model.training  # a training forward
            logits = model(x, positions, masks)
            if isinstance(logits, torch.distributed.tensor.DTensor):
                logits = logits.full_tensor()
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
            mon.step(loss)
            losses.append(loss.item())
    return {
        "mode": mon.dist.mode,
        "history": list(mon.history),
        "losses": losses,
        "wqkv": [type(wqkv).__name__, list(local.shape)],
    }


def main() -> None:
    worker_main(run, single=lambda scenario: scenario == "single")


if __name__ == "__main__":
    main()
