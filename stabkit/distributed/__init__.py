"""torch.distributed support: DDP and FSDP2 (`fully_shard`) under torchrun, gloo or NCCL.

At `attach` each rank reads its place in the job (`detect`); statistics are reduced across
ranks by their declared reduction in one collective per log interval (`reduce_stacked`, the
Recorder's reducer); norms are taken on each rank's own piece and combine into the norm of the
whole tensor; only rank 0 writes the sinks (`rank_sinks`); per-step decisions use one agreed
value on every rank (`agree`, `reduce_now`).

The names below load with their submodule on first use (PEP 562), so importing this package
alone imports neither torch nor torch.distributed.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from ..lazy import lazy_names

if TYPE_CHECKING:
    from .context import (
        ENV_SWITCH,
        SINGLE,
        DistContext,
        detect,
        is_dtensor,
        like_param,
        local,
        plain,
        process_group_active,
        replicas,
        unwrap_data_parallel,
    )
    from .launch import init_from_env, launched_by_torchrun, shard_rows, torchrun_command
    from .reduce import (
        CODES,
        GATHER_LIMIT,
        ReductionMismatchError,
        agree,
        combine,
        first_across_ranks,
        host_values,
        reduce_now,
        reduce_stacked,
    )
    from .sinks import RATIO_PARTS, RankEventEcho, finish_ratios, rank_sinks

_LAZY = MappingProxyType(
    {
        **dict.fromkeys(
            (
                "ENV_SWITCH",
                "SINGLE",
                "DistContext",
                "detect",
                "is_dtensor",
                "like_param",
                "local",
                "plain",
                "process_group_active",
                "replicas",
                "unwrap_data_parallel",
            ),
            "context",
        ),
        **dict.fromkeys(
            ("init_from_env", "launched_by_torchrun", "shard_rows", "torchrun_command"), "launch"
        ),
        **dict.fromkeys(
            (
                "CODES",
                "GATHER_LIMIT",
                "ReductionMismatchError",
                "agree",
                "combine",
                "first_across_ranks",
                "host_values",
                "reduce_now",
                "reduce_stacked",
            ),
            "reduce",
        ),
        **dict.fromkeys(("RATIO_PARTS", "RankEventEcho", "finish_ratios", "rank_sinks"), "sinks"),
    }
)
"""Public name -> the submodule that defines it."""


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "CODES",
    "ENV_SWITCH",
    "GATHER_LIMIT",
    "RATIO_PARTS",
    "SINGLE",
    "DistContext",
    "RankEventEcho",
    "ReductionMismatchError",
    "agree",
    "combine",
    "detect",
    "finish_ratios",
    "first_across_ranks",
    "host_values",
    "init_from_env",
    "is_dtensor",
    "launched_by_torchrun",
    "like_param",
    "local",
    "plain",
    "process_group_active",
    "rank_sinks",
    "reduce_now",
    "reduce_stacked",
    "replicas",
    "shard_rows",
    "torchrun_command",
    "unwrap_data_parallel",
]
