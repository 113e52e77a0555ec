"""The action 'clip' against hand computations on recorded norm series (ZClip's reference algorithm and
Levanter's update-norm clip, written out in plain Python), and on a training loop."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

import stabkit
from stabkit.actions.clip import ClipOptions, UpdateNormClip, ZClip
from stabkit.detect_config import DetectConfig

SERIES = [1.0, 1.2, 0.9, 1.1, 1.05, 0.95, 1.0, 1.3, 0.8, 1.1, 9.0, 1.0, 1.1, 0.9, 30.0, 1.2, 1.0, 0.7]


def zclip_reference(
    norms: list[float], z_thresh: float, alpha: float, warmup: int, clip_to: str
) -> list[float]:
    """The norm each step is clipped to (ZClip's zscore mode, written out)."""
    out, buffer, mean, var = [], [], None, None
    for g in norms:
        if mean is None:
            buffer.append(g)
            if len(buffer) >= warmup:
                mean = sum(buffer) / len(buffer)
                var = sum((x - mean) ** 2 for x in buffer) / len(buffer)
            out.append(g)
            continue
        std = var**0.5
        z = (g - mean) / (std + 1e-6)
        value = g
        if z > z_thresh:
            value = mean + z_thresh * std / (z / z_thresh) if clip_to == "adaptive" else mean
        out.append(min(g, value))
        mean = alpha * mean + (1 - alpha) * value
        var = alpha * var + (1 - alpha) * (value - mean) ** 2
    return out


@pytest.mark.parametrize("clip_to", ["adaptive", "mean"])
def test_zclip_follows_the_reference_algorithm(clip_to: str) -> None:
    o = ClipOptions(z_threshold=2.5, alpha=0.9, warmup=5, clip_to=clip_to)
    rule = ZClip(o)
    got = []
    for g in SERIES:
        norm = torch.tensor(g, dtype=torch.float32)
        seen = rule.step(norm)
        got.append(float(norm * seen["scale"]))
    want = zclip_reference(SERIES, 2.5, 0.9, 5, clip_to)
    assert got == pytest.approx(want, rel=1e-5)
    assert got[10] < 9.0 and got[14] < 30.0  # the outliers were clipped
    assert got[:5] == pytest.approx(SERIES[:5])  # the warm-up is not


def update_reference(norms: list[float], sigma: float, window: int, min_history: int) -> list[float]:
    out, history = [], []
    for u in norms:
        if len(history) >= min_history:
            mean, std = statistics.fmean(history), statistics.pstdev(history)
            limit = mean + sigma * max(std, 1e-6)
            out.append(min(u, limit))
        else:
            out.append(u)
        history = ([*history, u])[-window:]  # unclipped norms
    return out


def test_update_norm_clip_follows_levanter() -> None:
    o = ClipOptions(method="update_norm", sigma=3.0, window=8, min_history=4)
    rule = UpdateNormClip(o)
    got = []
    for u in SERIES:
        norm = torch.tensor(u)
        seen = rule.step(norm)
        got.append(float(norm * seen["scale"]))
    assert got == pytest.approx(update_reference(SERIES, 3.0, 8, 4), rel=1e-5)
    assert got[10] < 9.0 and got[14] < 30.0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.fc = nn.Linear(16, 20)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


@pytest.mark.filterwarnings("ignore:stabkit. the traced forward made no attention call")
@pytest.mark.parametrize("method", ["zclip", "update_norm"])
def test_clips_a_training_loop_and_logs_what_it_did(tmp_path, method: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"method": method, "warmup": 5, "window": 10, "min_history": 5}
    cfg = stabkit.MonitorConfig(
        console=False,
        log_every=1,
        detect=DetectConfig(actions={"spike": ["warn", "clip"]}, options={"clip": options}),
    )
    mon = stabkit.attach(
        model, opt, logdir=str(tmp_path), config=cfg, example=torch.zeros(2, 4, dtype=torch.long)
    )
    idx = torch.randint(0, 20, (8, 4))
    for step in range(20):
        scale = 50.0 if step == 15 else 1.0  # one outlier batch: its loss (and gradient) scaled up
        loss = scale * nn.functional.cross_entropy(model(idx).reshape(-1, 20), idx.reshape(-1))
        loss.backward()
        opt.step()
        mon.step(loss)
        opt.zero_grad()
    mon.detach()
    rows = dict(mon.history)
    assert all("clip/did_clip" in rows[s] for s in range(20))
    assert rows[15]["clip/did_clip"] == 1.0
    assert rows[15]["clip/post_norm"] < rows[15]["clip/pre_norm"]
    if method == "update_norm":  # clipped to the threshold itself
        assert rows[15]["clip/post_norm"] == pytest.approx(rows[15]["clip/threshold"], rel=1e-4)
    else:  # ZClip's adaptive scaling: below its trigger level
        assert rows[15]["clip/post_norm"] < rows[15]["clip/threshold"]
    assert sum(rows[s]["clip/did_clip"] for s in range(5)) == 0  # nothing before its statistics exist
    assert not math.isnan(rows[19]["clip/threshold"])


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="min_history"):
        DetectConfig(actions={"spike": "clip"}, options={"clip": {"window": 8, "min_history": 9}})
    with pytest.raises(ValueError, match="method"):
        DetectConfig(actions={"spike": "clip"}, options={"clip": {"method": "percentile"}})
