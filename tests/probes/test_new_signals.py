"""Issue 25's statistics against hand computations: attention sinks (first-key mass, sink heads),
massive activations and outlier features of block outputs, and the Adam update norm."""

from __future__ import annotations

import math

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.attention.call import LogitsCall, QKCall
from stabkit.attention.measure.measure import measure
from stabkit.attention.measure.op import layout, summary_values
from stabkit.attention.measure.stats import EXACT, Sampling
from stabkit.stats import outlier_stats
from stabkit.stats.opaque import outlier_stats_packed

# ---------------------------------------------------------------- attention sinks


def planted_sink(heads: int = 4, sink_heads: tuple[int, ...] = (1, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B 2, H, L 12, E 8) where the `sink_heads` put a large logit on key 0."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 12, 8, generator=g)
    k = torch.randn(2, heads, 12, 8, generator=g)
    for h in sink_heads:
        q[:, h, :, 0] = 3.0  # every query of head h points at key 0's direction
        k[:, h, 0, 0] = 6.0
        k[:, h, 1:, 0] = 0.0
    return q, k


def hand_first_key_mass(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """(H,) mean over (batch, query) of softmax(q·kᵀ/√E)[..., 0]."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    if causal:
        n = logits.shape[-1]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return logits.softmax(-1)[..., 0].mean(dim=(0, 2))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("budget", [None, 4096])  # one block / many key blocks (online log-sum-exp)
def test_first_key_mass_and_sink_heads_by_hand(causal: bool, budget: int | None) -> None:
    q, k = planted_sink()
    expected = hand_first_key_mass(q, k, causal)
    assert expected[[1, 3]].min() > 0.9 and expected[[0, 2]].max() < 0.3  # the planted sinks
    stats = measure(QKCall(q, k, None, causal=causal), EXACT, budget=budget)
    torch.testing.assert_close(stats.first_key_mass(), expected, rtol=1e-5, atol=1e-6)
    frac, top = stats.attention_sinks()
    assert float(frac) == 0.5
    assert float(top) == pytest.approx(float(expected.max()), rel=1e-5)


def test_first_key_mass_on_the_eager_softmax_path() -> None:
    q, k = planted_sink(sink_heads=(0,))
    logits = q @ k.transpose(-1, -2) / math.sqrt(8)
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)
    x = logits.masked_fill(mask, torch.finfo(torch.float32).min)  # an additive mask, as eager models make
    stats = measure(LogitsCall(x), EXACT, budget=4096)
    torch.testing.assert_close(stats.first_key_mass(), hand_first_key_mass(q, k, True), rtol=1e-5, atol=1e-6)
    expected = hand_first_key_mass(q, k, True)
    assert float(expected[0]) > 0.9  # the planted sink head
    # short causal rows put mass on key 0 by themselves (query 0 sees only it): count by the hand values
    assert float(stats.attention_sinks()[0]) == float((expected > 0.3).float().mean())


def test_learned_sinks_give_their_mass() -> None:
    """With learned sink logits the sink-head fraction and the largest mass read the sinks' mass."""
    q, k = planted_sink(sink_heads=())
    sinks = torch.tensor([4.0, -4.0, 4.0, -4.0])
    stats = measure(QKCall(q, k, None, causal=True, sinks=sinks), EXACT)
    logits = q @ k.transpose(-1, -2) / math.sqrt(8)
    logits = logits.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)
    full = torch.cat([logits, sinks.view(1, 4, 1, 1).expand(2, 4, 12, 1)], dim=-1).softmax(-1)
    sink_mass = full[..., -1].mean(dim=(0, 2))
    torch.testing.assert_close(stats.sink_mass(), sink_mass, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.first_key_mass(), full[..., 0].mean(dim=(0, 2)), rtol=1e-5, atol=1e-6)
    frac, top = stats.attention_sinks()
    assert float(frac) == 0.5 and float(top) == pytest.approx(float(sink_mass.max()), rel=1e-5)


def test_sampled_rows_measure_the_sample() -> None:
    """On a sample of rows and queries the mass is that of the sampled rows (a mean: unbiased)."""
    q, k = planted_sink()
    stats = measure(QKCall(q, k, None), Sampling(1, 6, 0))
    mass = stats.first_key_mass()
    assert mass[[1, 3]].min() > 0.9 and mass[[0, 2]].max() < 0.3


def test_summary_layout_names_the_sink_statistics() -> None:
    q, k = planted_sink()
    stats = measure(QKCall(q, k, None, causal=True), EXACT)
    entries = layout(4, False, False, True)
    values = dict(zip((e[0] for e in entries), summary_values(stats, None, None, True), strict=True))
    assert float(values["sink_heads"]) == 0.5
    assert float(values["first_key_mass"]) == pytest.approx(float(stats.first_key_mass().max()))
    assert float(values["head.1/first_key_mass"]) > 0.9


# ---------------------------------------------------------------- massive activations, outlier features


def planted_hidden() -> torch.Tensor:
    """(B 2, T 40, D 32) residual stream: one massive entry (token (1, 7), channel 5) and two
    outlier channels (11, 20) with 8× the scale of the rest."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 32, generator=g)
    x[..., 11] *= 8.0
    x[..., 20] *= 8.0
    x[1, 7, 5] = 900.0
    return x


def hand_outliers(x: torch.Tensor) -> tuple[float, float, float]:
    flat = x.reshape(-1, x.shape[-1]).double()
    ratios, tops = [], []
    for row in flat.abs():
        srt = row.sort().values
        median = srt[(len(srt) - 1) // 2]  # the lower median
        ratios.append(float(srt[-1] / median))
        tops.append(float(srt[-1]))
    token = max(range(len(tops)), key=tops.__getitem__)
    dim = int(flat[token].abs().argmax())
    c = (flat.pow(2).mean(0)).sqrt().tolist()
    mean = sum(c) / len(c)
    var = sum((v - mean) ** 2 for v in c) / len(c)
    kurt = sum((v - mean) ** 4 for v in c) / len(c) / var**2 - 3
    return max(ratios), float(dim), kurt


@pytest.mark.parametrize("candidates", [64, 4])  # every token, or the candidate tokens only
def test_massive_activation_and_kurtosis_by_hand(monkeypatch: pytest.MonkeyPatch, candidates: int) -> None:
    import stabkit.stats.outliers as outliers

    monkeypatch.setattr(outliers, "CANDIDATES", candidates)
    x = planted_hidden()
    ratio, dim, kurt = (float(v) for v in outlier_stats(x))
    want_ratio, want_dim, want_kurt = hand_outliers(x)
    assert ratio == pytest.approx(want_ratio, rel=1e-5)
    assert ratio > 900  # the planted entry against a median |x| below 1
    assert dim == want_dim == 5.0
    assert kurt == pytest.approx(want_kurt, rel=1e-4)
    clean = torch.randn(4000, 32, generator=torch.Generator().manual_seed(2))
    assert abs(float(outlier_stats(clean)[2])) < 1.5  # no outlier channels: small excess kurtosis
    assert float(outlier_stats(clean)[0]) < 60


def test_outlier_op_packs_the_eager_values_and_obeys_its_gate() -> None:
    x = planted_hidden()
    packed = outlier_stats_packed(x, -1, 1)
    torch.testing.assert_close(packed[:3], torch.stack(outlier_stats(x)))
    assert float(packed[3]) == 1.0
    from stabkit.stats.opaque import close_gate, open_gate

    key = open_gate(lambda every: False)
    assert torch.equal(outlier_stats_packed(x, key, 1), torch.zeros(4))
    close_gate(key)


def test_constant_channels_and_zero_tokens() -> None:
    assert float(outlier_stats(torch.ones(3, 5, 8))[2]) == 0.0  # equal channel RMS: kurtosis 0, not NaN
    ratio, dim, kurt = outlier_stats(torch.zeros(2, 6))
    assert (float(ratio), float(dim), float(kurt)) == (0.0, 0.0, 0.0)


# ---------------------------------------------------------------- through the monitor


def test_monitor_logs_the_new_statistics_by_hand() -> None:
    """One AdamW step of the reference GPT: the outlier statistics of each block output equal the
    hand computation on the captured output; update norms equal ‖θ_new − θ_old‖ (per block, in all)."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = stabkit.MonitorConfig(
        every=1, console=False, audit=False, detect=None, tensorboard=False, jsonl=False
    )
    mon = stabkit.attach(model, opt, config=cfg)
    seen = {}
    hooks = [
        model.get_submodule(p).register_forward_hook(
            lambda m, a, out, p=p: seen.__setitem__(p, out.detach().clone())
        )
        for p in ("blocks.0", "blocks.1")
    ]
    for step in range(2):
        x, y = batch(step)
        lm_loss(model(x), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        mon.step()
        opt.zero_grad()
    mon.flush()
    row = mon.metrics
    for h in hooks:
        h.remove()
    mon.detach()
    for path, out in seen.items():
        ratio, dim, kurt = hand_outliers(out)
        assert row[f"act/{path}/massive_ratio"] == pytest.approx(ratio, rel=1e-5)
        assert row[f"act/{path}/massive_dim"] == dim
        assert row[f"act/{path}/kurtosis"] == pytest.approx(kurt, rel=1e-4, abs=1e-5)
    delta = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    block0 = torch.cat([d.flatten() for n, d in delta.items() if n.startswith("blocks.0.")])
    assert row["update/blocks.0/norm"] == pytest.approx(float(block0.norm()), rel=1e-4)
    every = torch.cat([d.flatten() for d in delta.values()])
    assert row["update/norm"] == pytest.approx(float(every.norm()), rel=1e-4)
    attn = "attn/blocks.0.attn"
    assert 0.0 <= row[f"{attn}/first_key_mass"] <= 1.0 and row[f"{attn}/sink_heads"] in (
        0.0,
        0.25,
        0.5,
        0.75,
        1.0,
    )


def test_new_statistics_get_per_layer_charts() -> None:
    from stabkit.sinks import custom_scalar_layout

    names = [
        f"{fam}/blocks.{i}{sub}/{stat}"
        for i in range(2)
        for fam, sub, stat in (
            ("attn", ".attn", "sink_heads"),
            ("attn", ".attn", "first_key_mass"),
            ("act", "", "massive_ratio"),
            ("act", "", "massive_dim"),
            ("act", "", "kurtosis"),
            ("update", "", "norm"),
        )
    ]
    charts = custom_scalar_layout(names)
    for fam, stat in (
        ("attn", "sink_heads"),
        ("attn", "first_key_mass"),
        ("act", "massive_ratio"),
        ("act", "massive_dim"),
        ("act", "kurtosis"),
        ("update", "norm"),
    ):
        assert charts[fam][f"{stat} per layer"] == ["Multiline", [f"^{fam}/.*/{stat}$"]]
