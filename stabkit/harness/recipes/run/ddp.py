"""Data-parallel variants for `stabkit run --nproc N` (and `torchrun ... -m stabkit run`).

Used by the worker on every rank when the CLI runs under torchrun with the process group set up
(`stabkit.distributed.init_from_env`). Each rank builds the same model (same seed), applies the
variant's interventions, wraps it in DDP and draws the same global batch from the same generator,
keeping only its own rows (`shard_rows`): the gradients DDP averages are those of the whole batch,
so a run on N processes follows the single-process run up to rounding. Once per step the ranks
agree, in one collective, on the loss the worker records (the mean over ranks) and on whether
to stop (Ctrl-C reached some rank), so every rank ends a variant at the same step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ....distributed import DistContext, process_group_active, shard_rows
from ...data import ByteCorpus
from ...models import PRESET_BATCH
from ..spec.recipe import Recipe


def rank_context() -> DistContext:
    """This process's place in the running process group (not sharded: DDP replicates)."""
    if not process_group_active():
        raise RuntimeError(
            "a data-parallel job needs an initialised torch.distributed process group with more than "
            "one rank (stabkit run --nproc N sets it up)"
        )
    return DistContext(True, dist.get_rank(), dist.get_world_size())


class RankRows:
    """A corpus whose training batches are this rank's rows of the global batch.

    The global batch is drawn in full (same generator state on every rank), then sliced, so the
    data order is the single-process one. Validation batches are returned whole.
    """

    def __init__(self, corpus: ByteCorpus, rows: slice) -> None:
        self.corpus = corpus
        self.name = getattr(corpus, "name", "")
        self.rows = rows
        self.drawn = 0
        """Training rows handed out so far (this rank's share of every global batch)."""

    @classmethod
    def for_rank(cls, corpus: ByteCorpus, batch_size: int, ctx: DistContext) -> RankRows:
        """This rank's share of `batch_size`-row global batches (ValueError when it does not split evenly)."""
        return cls(corpus, shard_rows(batch_size, ctx))

    def batch(
        self, split: str, batch_size: int, context: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `ByteCorpus.batch`; training batches keep rows `self.rows` only: (B/N, T) each."""
        x, y = self.corpus.batch(split, batch_size, context, generator)  # (B, T), (B, T)
        if split != "train":
            return x, y
        x, y = x[self.rows], y[self.rows]  # (B/N, T) each
        self.drawn += x.shape[0]
        return x, y


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """`model` (already on `device`, interventions applied) in DistributedDataParallel.

    The constructor broadcasts rank 0's weights (identical anyway: same seed).
    """
    from torch.nn.parallel import DistributedDataParallel

    ids = None
    if device.type == "cuda":
        ids = [device.index if device.index is not None else torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=ids)


class StepAgreement:
    """Called once per step on every rank (after the optimizer step): one all-reduce of
    [loss, stop request] returns the mean loss over ranks and whether any rank asked to stop."""

    def __init__(self, device: torch.device, should_stop: Callable[[], bool] | None = None) -> None:
        self.device = device
        self.should_stop = should_stop
        self.world = dist.get_world_size()

    def __call__(self, loss: float) -> tuple[float, bool]:
        asked = bool(self.should_stop()) if self.should_stop is not None else False
        both = torch.tensor([loss, float(asked)], dtype=torch.float64, device=self.device)  # (2,)
        dist.all_reduce(both)
        total, stops = both.tolist()
        return total / self.world, stops > 0


def check_split(recipe: Recipe, nproc: int) -> None:
    """Raise ValueError (one line) when a variant's global batch does not split evenly over `nproc`
    processes. Called by the CLI before anything starts."""
    for v in recipe.variants:
        rows = v.train.batch_size or PRESET_BATCH[recipe.size]
        if rows % nproc:
            raise ValueError(
                f"--nproc {nproc}: variant {v.name!r} trains on batches of {rows} sequences, which do not "
                f"split evenly over {nproc} processes; use a process count that divides {rows} "
                "(or set train.batch_size in the recipe)"
            )
