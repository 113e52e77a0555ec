"""The attention probe's memory is bounded by `MonitorConfig.attn_chunk_bytes`, whatever the sequence
length, and blocking changes no result.

- Equality: every kind of call measured in blocks as small as one key gives the one-block result
  and the float64 materialised reference, including an online log-sum-exp across key blocks whose
  maxima differ by far more than the −80 clamp.
- Budget: the peak of live allocations while the probe measures a long call (torch profiler memory
  events: deterministic, no timing) stays within the budget, while one block holding the whole
  sample (the former behaviour) peaks at many times it; in a monitored model, every block of logits
  the probe makes (counted through a patched method) fits the configured budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from zoo import batch, hf_llama, lm_loss, reference_gpt

import stabkit
from stabkit.attention.call import LogitsCall, QKCall
from stabkit.attention.measure import blocks as attention_blocks
from stabkit.attention.measure.measure import measure
from stabkit.attention.measure.stats import HeadStats, Sampling
from stabkit.attention.readers import read_mha, read_sdpa, read_softmax

G = torch.Generator().manual_seed(0)
B, H, L, D = 3, 4, 11, 8
HUGE = 1 << 40


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * scale


def reference(logits: torch.Tensor, allowed: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
    """float64 (per-head max |logit| over allowed, per-head mean entropy over rows with a key)."""
    logits, allowed = logits.double(), allowed.expand(logits.shape)
    z = logits + (0 if bias is None else bias.double())
    p = torch.softmax(z.masked_fill(~allowed, -math.inf), dim=-1)
    row_h = -torch.where(allowed, p * torch.log(p.clamp_min(1e-300)), 0.0).sum(-1)
    rows = allowed.any(-1)
    return logits.abs().masked_fill(~allowed, 0).amax((0, 2, 3)), (row_h * rows).sum((0, 2)) / rows.sum(
        (0, 2)
    )


def call_cases() -> dict[str, tuple[Callable[[], Any], Callable[[], tuple] | None]]:
    """name -> (make the call, its float64 reference or None)."""
    q, k, v = randn(B, H, L, D, scale=3), randn(B, H, L, D, scale=3), randn(B, H, L, D)
    kv = randn(B, 2, L, D, scale=3)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    pad = torch.ones(B, 1, 1, L, dtype=torch.bool)
    pad[1, ..., -4:] = False
    bias = randn(1, H, L, L)
    bias[..., 2] = -math.inf
    allowed_bias = torch.isfinite(bias)
    wide = randn(1, 1, L, D, scale=1.0)
    wide[..., 0, :] *= 60  # the first query's logits span hundreds: key blocks with very different maxima
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).train()
    x = randn(B, L, 16)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[2, :3] = True
    eager = randn(B, H, L, L, scale=4).masked_fill(~causal, torch.finfo(torch.float32).min)

    def mha_call() -> QKCall:
        from torch.overrides import TorchFunctionMode

        seen: list[Any] = []

        class Spy(TorchFunctionMode):
            def __torch_function__(self, func, types, a=(), kw=None):  # type: ignore[no-untyped-def]
                if func is F.multi_head_attention_forward:
                    seen.append((a, kw or {}))
                return func(*a, **(kw or {}))

        with Spy():
            mha(x, x, x, key_padding_mask=kpm, need_weights=False)
        return read_mha(*seen[0])

    return {
        "sdpa-causal": (
            lambda: read_sdpa((q, k, v), {"is_causal": True}),
            lambda: reference(q @ k.transpose(-1, -2) / math.sqrt(D), causal),
        ),
        "sdpa-gqa-padding-scale": (
            lambda: read_sdpa((q, kv, kv), {"attn_mask": pad & causal, "enable_gqa": True, "scale": 0.2}),
            lambda: reference(q @ kv.repeat_interleave(2, 1).transpose(-1, -2) * 0.2, pad & causal),
        ),
        "sdpa-additive-bias": (
            lambda: read_sdpa((q, k, v, bias), {}),
            lambda: reference(
                q @ k.transpose(-1, -2) / math.sqrt(D), allowed_bias, bias.masked_fill(~allowed_bias, 0)
            ),
        ),
        "sdpa-wide-range": (
            lambda: read_sdpa((wide, wide, wide), {"is_causal": False}),
            lambda: reference(
                wide @ wide.transpose(-1, -2) / math.sqrt(D), torch.ones(L, L, dtype=torch.bool)
            ),
        ),
        "mha-key-padding": (mha_call, None),
        "eager-softmax": (
            lambda: read_softmax((eager, -1), {}),
            lambda: reference(eager.masked_fill(~causal, 0), causal),
        ),
    }


CASES = call_cases()
SAMPLINGS = {"exact": Sampling(None, None), "sampled": Sampling(rows=2, queries=3, round=1)}


def assert_same(got: HeadStats, want: HeadStats) -> None:
    torch.testing.assert_close(got.max_logit, want.max_logit, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.head_entropy(), want.head_entropy(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.rows, want.rows, rtol=0, atol=0)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("budget", [64, 4096])
def test_blocks_give_the_one_block_result_and_the_reference(case: str, sampling: str, budget: int) -> None:
    make, ref = CASES[case]
    call = make()
    one_block = measure(call, SAMPLINGS[sampling], None, HUGE)
    blocked = measure(call, SAMPLINGS[sampling], None, budget)
    assert_same(blocked, one_block)
    if ref is not None and sampling == "exact":
        want_max, want_entropy = ref()
        torch.testing.assert_close(blocked.max_logit.double(), want_max, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(blocked.head_entropy().double(), want_entropy, rtol=1e-5, atol=1e-5)


def test_capped_entropy_and_nan_propagate_across_blocks() -> None:
    q, k = randn(1, 2, 9, 4, scale=4), randn(1, 2, 9, 4, scale=4)
    call = QKCall(q, k, None, causal=True)
    assert_same(measure(call, cap=5.0, budget=64), measure(call, cap=5.0, budget=HUGE))
    k[0, 1, 6] = math.nan  # one key of head 1: its rows from query 6 on are NaN
    got = measure(QKCall(q, k, None, causal=True), budget=64)
    assert torch.isnan(got.max_logit[1]) and torch.isnan(got.entropy_sum[1])
    assert torch.isfinite(got.max_logit[0]) and torch.isfinite(got.entropy_sum[0])


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of live CPU allocations made while `fn` runs (profiler memory events, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(
    ("kind", "sampling"),
    [("sdpa", Sampling(4, 64)), ("sdpa", Sampling(None, None)), ("eager", Sampling(4, 64))],
    ids=["sdpa-sampled", "sdpa-exact", "eager-sampled"],
)
def test_long_call_peaks_within_the_budget(kind: str, sampling: Sampling) -> None:
    T, heads, dim, budget = 1024, 8, 16, 256 * 1024
    qkv = randn(1, T, 3, heads, dim)  # (B, T, 3, H, E): q and k as a model makes them (strided views)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    call: QKCall | LogitsCall = QKCall(q, k, None, causal=True)
    if kind == "eager":
        logits = (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        call = LogitsCall(logits)  # the model's own (B, H, T, T) logits: resident, not the probe's
    bounded = peak_bytes(lambda: measure(call, sampling, None, budget))
    unbounded = peak_bytes(lambda: measure(call, sampling, None, HUGE))
    assert bounded <= budget, f"peak {bounded} bytes over the {budget}-byte budget"
    assert unbounded > 8 * budget  # the measurement sees what one block of the whole sample costs
    assert_same(measure(call, sampling, None, budget), measure(call, sampling, None, HUGE))


@pytest.mark.parametrize(
    "build", [reference_gpt, lambda: hf_llama("eager", kv_heads=2)], ids=["sdpa", "eager-gqa"]
)
def test_monitor_blocks_fit_the_configured_budget(
    build: Callable[[], torch.nn.Module], monkeypatch: Any
) -> None:
    budget = 4096
    sizes: list[int] = []
    original = attention_blocks.QKBlocks.logits

    def spy(self: attention_blocks.QKBlocks, *spans: slice) -> torch.Tensor:
        out = original(self, *spans)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(attention_blocks.QKBlocks, "logits", spy)
    metrics = []
    for chunk in (budget, stabkit.MonitorConfig.attn_chunk_bytes):
        torch.manual_seed(0)
        model = build()
        cfg = stabkit.MonitorConfig(
            every=1, console=False, audit=False, attn_chunk_bytes=chunk, attn_per_head=True
        )
        mon = stabkit.attach(model, None, config=cfg)
        idx, tgt = batch(0)
        out = model(idx)
        lm_loss(out if isinstance(out, torch.Tensor) else out.logits, tgt).backward()
        mon.step()
        mon.detach()
        metrics.append({k: v for k, v in mon.metrics.items() if k.startswith("attn/")})
        if chunk == budget:
            small = list(sizes)
    assert metrics[0] and metrics[0].keys() == metrics[1].keys()
    for key, value in metrics[1].items():
        assert metrics[0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if small:  # q/k calls: every block of logits fits (eager calls are measured on the model's own logits)
        assert max(small) * attention_blocks.LOGIT_BYTES <= budget
        assert len(small) > 2 * len(sizes[len(small) :])  # and the small budget did split the work


def test_attn_chunk_bytes_is_validated() -> None:
    assert stabkit.MonitorConfig().attn_chunk_bytes == 4 << 20
    for bad in (0, 4095, 2.5, True, "1MiB"):
        with pytest.raises(ValueError, match="attn_chunk_bytes must be an integer >= 4096"):
            stabkit.MonitorConfig(attn_chunk_bytes=bad)  # type: ignore[arg-type]


def test_bench_seq_len_sets_the_context_and_keeps_the_tokens_per_step() -> None:
    from stabkit.bench.runner import BenchConfig, batch_size, make_batches, model_config

    cfg = BenchConfig(size="tiny", seq_len=512)
    assert model_config(cfg).context == 512
    assert batch_size(cfg) == 16 * 64 // 512
    (x, y), *_ = make_batches(cfg, n=1)
    assert x.shape == y.shape == (2, 512)
    assert batch_size(BenchConfig(size="tiny", seq_len=8192)) == 1
    assert batch_size(BenchConfig(size="tiny", seq_len=8192, batch_size=3)) == 3
    assert model_config(BenchConfig(size="tiny")).context == 64
    with pytest.raises(ValueError, match="seq-len"):
        BenchConfig(seq_len=0)
