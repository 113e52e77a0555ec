"""A ``torch.compile(flex_attention)`` made before `stabkit.attach` — the normal GPU path — is seen and
measured exactly, wherever the model keeps it: a module global, a class attribute, a module's own
attribute. Three training-mode steps on fresh batches, two layers, a block mask with partial blocks
(block size 8, 16 tokens); every statistic against the float64 reference of tests/standins/reference.py
over the q and k the kernel was given. The attention is frozen: FlexAttention's backward does not
run on a CPU. The compiled function still runs every call: losses equal those of an unmonitored run
bit for bit, and detaching puts the compiled function back where it was."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from standins.reference import reference_stats
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import stabkit

torch.set_num_threads(1)
D, H, T, V, BLOCK = 32, 4, 16, 50, 8
BACKEND = "aot_eager"
"""Dynamo + AOTAutograd without inductor's code generation: the same wrapper a GPU run calls, compiled
in a second rather than a minute on a CPU (inductor is the GPU check's job)."""

from stabkit.attention.kernels import entry_points  # noqa: E402

PLAIN = (getattr(flex_attention, "__stabkit_original__", flex_attention),)
"""The entry point itself, kept in a tuple: an install held by another test of this process (a monitor
or an intervention it never removed) rewires module globals that name the entry point, not this."""
FLEX = torch.compile(PLAIN[0], backend=BACKEND)
"""Held as a module global (as attention-gym and most training scripts do)."""
COMPILED = (FLEX,)
"""The compiled function itself (in a tuple, out of reach of the rewiring of globals)."""


def causal(b: Any, h: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q >= k


class Attn(nn.Module):
    kernel: Callable[..., torch.Tensor] = torch.compile(PLAIN[0], backend=BACKEND)
    """Held as a class attribute (torchtitan's ``_compiled_flex_attn``)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.where = where
        if where == "instance":
            self.flex = torch.compile(PLAIN[0], backend=BACKEND)
        self.seen: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        """q, k and the mask of each call (the step's own call is the last: discovery's traced forward
        runs on the first forward, before it)."""

    def run(self) -> Callable[..., torch.Tensor]:
        if self.where == "global":
            return FLEX
        return Attn.kernel if self.where == "class" else self.flex

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, -1).permute(2, 0, 3, 1, 4)
        mask = create_block_mask(causal, None, None, t, t, device="cpu", BLOCK_SIZE=BLOCK)
        self.seen.append((q.detach().double(), k.detach().double(), mask))
        return self.o(self.run()(q, k, v, block_mask=mask).transpose(1, 2).reshape(b, t, D))


class LM(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(D), "attn": Attn(where)}) for _ in range(2)
        )
        self.head = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block["attn"](block["ln"](x))
        return self.head(x)


def _train(
    where: str, monitored: bool
) -> tuple[list[float], list[dict[str, float]], list[list[tuple[Any, ...]]], LM]:
    torch.manual_seed(0)
    model = LM(where)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = stabkit.MonitorConfig.full(
        attn_sample_rows=None, attn_sample_queries=None, log_every=1, console=False, audit=False
    )
    mon = stabkit.attach(model, opt, config=cfg) if monitored else None
    gen = torch.Generator().manual_seed(1)
    losses, rows, calls = [], [], []
    for _ in range(3):
        idx = torch.randint(0, V, (2, T + 1), generator=gen)
        loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, V), idx[:, 1:].reshape(-1))
        calls.append([block["attn"].seen[-1] for block in model.blocks])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if mon is not None:
            mon.step(loss)
            rows.append(dict(mon.metrics))
    if mon is not None:
        mon.detach()
    return losses, rows, calls, model


def _expected(q: torch.Tensor, k: torch.Tensor, mask: Any) -> dict[str, float]:
    ref = reference_stats(q, k, block_mask=mask)
    entropy = ref["entropy"]  # (H,) per-head mean over rows; every row has keys: same row counts
    first = ref["probs"][..., 0].mean(dim=(0, 2))  # (H,)
    return {
        "max_logit": float(ref["max_logit"].amax()),
        "entropy": float(entropy.mean()),
        "min_head_entropy": float(entropy.amin()),
        "first_key_mass": float(first.amax()),
    }


@pytest.mark.parametrize("where", ["global", "class", "instance"])
def test_compiled_flex_made_before_attach_is_measured_exactly(where: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, rows, calls, model = _train(where, monitored=True)
    assert not [w for w in caught if "not measured" in str(w.message)]
    bare, _, _, _ = _train(where, monitored=False)
    assert losses == bare  # observation only
    if not entry_points.active():  # restored at detach (unless another holder in this process remains)
        assert FLEX is COMPILED[0] and "__stabkit_original__" not in vars(Attn.kernel)
        if where == "instance":
            assert "__stabkit_original__" not in vars(model.blocks[0]["attn"].flex)
    else:
        assert getattr(FLEX, "__stabkit_original__", FLEX) is COMPILED[0]
    for step, row in enumerate(rows):
        for i, (q, k, mask) in enumerate(calls[step]):
            for stat, want in _expected(q, k, mask).items():
                got = row[f"attn/blocks.{i}.attn/{stat}"]
                assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (where, step, i, stat)
    torch._dynamo.reset()
