"""The healthy-run corpus covers what real runs vary, and its entries reject impossible setups."""

from __future__ import annotations

import pytest
import torch

from stabkit.detectors import CollapseOptions, DeadOptions
from stabkit.harness.alarms.corpus import CORPUS, HealthyConfig, by_name, select
from stabkit.harness.alarms.families import FAMILIES, MOE_FAMILIES, balancing_loss
from stabkit.harness.alarms.inits import INITS
from stabkit.harness.alarms.optim import OPTIMIZERS, SCHEDULES, schedule


def test_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 30
    assert len({c.name for c in CORPUS}) == len(CORPUS)
    assert {c.family for c in CORPUS} == set(FAMILIES)
    assert {c.optimizer for c in CORPUS} == set(OPTIMIZERS)
    assert {c.schedule for c in CORPUS} == set(SCHEDULES)
    assert {c.init for c in CORPUS} == set(INITS)
    assert {c.placement for c in CORPUS} == {"pre", "post", "sandwich"}
    assert {c.data for c in CORPUS} == {"text", "zipf"} and {c.monitor for c in CORPUS} == {"default", "full"}
    assert min(c.depth for c in CORPUS) == 2 and max(c.depth for c in CORPUS) == 24
    assert min(c.batch for c in CORPUS) == 4 and max(c.batch for c in CORPUS) == 64
    assert {c.clip is None for c in CORPUS} == {True, False}
    assert any(c.accum > 1 for c in CORPUS) and any(c.bf16 for c in CORPUS)
    assert any(c.kv_heads and c.kv_heads < c.heads for c in CORPUS if c.family == "hf_llama")
    assert all(c.warmup > 0 for c in CORPUS if c.placement == "post")
    assert 4 <= len(select(tag="ci")) <= 6
    moe = [c for c in CORPUS if c.family in MOE_FAMILIES]
    assert {c.family for c in moe} == set(MOE_FAMILIES) and any("ci" in c.tags for c in moe)
    assert {c.monitor for c in moe} == {"default", "full"}


def test_moe_runs_last_long_enough_for_the_moe_detectors_to_judge() -> None:
    """A healthy MoE run shorter than the collapse hold could never raise it: its silence would prove nothing."""
    hold = CollapseOptions().hold_steps
    assert all(
        c.steps >= 2 * hold and c.steps >= 4 * DeadOptions().window
        for c in CORPUS
        if c.family in MOE_FAMILIES
    )


def test_balancing_loss_by_hand() -> None:
    # 4 tokens, 4 experts, top-1: tokens 0-2 pick expert 0 (logit 2), token 3 picks expert 3
    logits = torch.zeros(4, 4)
    logits[:3, 0] = 2.0
    logits[3, 3] = 2.0
    p = torch.tensor([2.0, 0, 0, 0]).softmax(0)  # a token's probabilities over its experts
    mean_p = torch.stack([p, p, p, p.flip(0)]).mean(0)
    share = torch.tensor([0.75, 0, 0, 0.25])
    assert balancing_loss(logits, 1).item() == pytest.approx(4 * (share * mean_p).sum().item())
    assert balancing_loss(torch.zeros(6, 8), 2).item() == pytest.approx(1.0)  # uniform: 1 whatever the choice


def test_select_and_by_name() -> None:
    assert [c.name for c in select("gpt2-*")] == [c.name for c in CORPUS if c.name.startswith("gpt2-")]
    assert len(select("tiny-pre-l2-*, gpt2-l4")) == 3
    assert select("nothing-like-this") == []
    with pytest.raises(KeyError, match="--list"):
        by_name("nope")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"family": "bert"}, "family"),
        ({"placement": "post", "warmup": 0}, "warmup"),
        ({"width": 30, "heads": 4}, "divide"),
        ({"optimizer": "lion"}, "optimizer"),
        ({"steps": 0}, "steps"),
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"name": "x", "family": "tiny_gpt"}
    with pytest.raises(ValueError, match=match):
        HealthyConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_with_steps_scales_the_warmup() -> None:
    c = HealthyConfig("x", "tiny_gpt", warmup=20, steps=200)
    assert (c.with_steps(100).steps, c.with_steps(100).warmup) == (100, 10)
    assert c.with_steps(5).warmup == 1
    assert HealthyConfig("y", "tiny_gpt", warmup=0).with_steps(50).warmup == 0


def test_schedules_by_hand() -> None:
    cos = schedule("cosine", 110, 10)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    wsd = schedule("wsd", 100, 10)
    assert wsd(50) == 1.0 and wsd(79) == 1.0 and wsd(90) == pytest.approx(0.5)
    inv = schedule("invsqrt", 100, 4)
    assert inv(3) == 1.0 and inv(16) == pytest.approx((4 / 16) ** 0.5)
    assert schedule("warmup", 100, 10)(50) == 1.0 and schedule("constant", 100, 0)(0) == 1.0
