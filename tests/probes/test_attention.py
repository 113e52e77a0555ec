"""The attention probe against a materialised reference, for every model family and attention implementation.

The test's own forward pre-hooks capture each attention module's input; the test recomputes q and k
from the module's weights (its own RoPE, its own GQA repeat), builds QKᵀ·scale with the causal and
padding masks, and compares max |logit|, mean entropy, min per-head entropy and the per-head values
with what the probe reported (sampling off) to 1e-4 relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import stabkit
from stabkit import MonitorConfig

EXACT = MonitorConfig(
    every=1,
    attn_sample_rows=None,
    attn_sample_queries=None,
    attn_per_head=True,
    console=False,
    strict=True,
    families=frozenset({"attn"}),
)
QK = tuple[torch.Tensor, torch.Tensor]  # q (B, H, T, hd), k (B, H, T, hd) with kv heads repeated


# ------------------------------------------------------------------ reference statistics
def reference(
    q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, cap: float | None = None
) -> dict[str, Any]:
    """max |QKᵀ·scale| over allowed entries, mean/per-head entropy over rows with an allowed key (float64)."""
    q, k = q.double(), k.double()
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    allowed = allowed.expand_as(logits)
    top = logits.abs()[allowed].max()
    z = logits if cap is None else cap * torch.tanh(logits / cap)
    p = torch.softmax(z.masked_fill(~allowed, -math.inf), dim=-1)
    plogp = torch.where(allowed, p * torch.log(p.clamp_min(1e-300)), 0.0)
    row_h = -plogp.sum(-1)  # (B, H, T)
    rows = allowed.any(-1)  # (B, H, T)
    head_h = (row_h * rows).sum((0, 2)) / rows.sum((0, 2))
    head_max = logits.abs().masked_fill(~allowed, 0).amax((0, 2, 3))
    return dict(
        max_logit=top.item(),
        entropy=(row_h[rows].mean()).item(),
        min_head_entropy=head_h.min().item(),
        head_max=head_max.tolist(),
        head_entropy=head_h.tolist(),
    )


def causal_and_keys(T: int, key_valid: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, 1, T, T) bool: causal, and the key is not padding."""
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].bool()
    return allowed


def rope_half(x: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate (x[..., :hd/2], x[..., hd/2:]) of (B, H, T, hd) by position angles (the reference GPT's RoPE)."""
    T, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]  # (T, hd/2)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()), dim=-1)


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, n·hd) -> (B, n, T, hd)."""
    B, T, W = x.shape
    return x.view(B, T, n, W // n).transpose(1, 2)


# ------------------------------------------------------------------ q/k from each family's weights
def qk_reference_gpt(m: nn.Module, args: tuple, kwargs: dict) -> QK:
    x = args[0]
    q = rope_half(heads(F.linear(x, m.q_proj.weight, m.q_proj.bias), m.n_heads), 10000.0)
    k = rope_half(heads(F.linear(x, m.k_proj.weight, m.k_proj.bias), m.n_kv_heads), 10000.0)
    return q, k.repeat_interleave(m.n_heads // m.n_kv_heads, dim=1)


def qk_nanogpt(m: nn.Module, args: tuple, kwargs: dict) -> QK:
    q, k, _ = F.linear(args[0], m.c_attn.weight).split(m.n_embd, dim=2)
    return heads(q, m.n_head), heads(k, m.n_head)


def qk_hf_gpt2(m: nn.Module, args: tuple, kwargs: dict) -> QK:
    x = args[0] if args else kwargs["hidden_states"]
    q, k, _ = (x @ m.c_attn.weight + m.c_attn.bias).split(m.embed_dim, dim=2)  # Conv1D: x W + b
    return heads(q, m.num_heads), heads(k, m.num_heads)


def qk_hf_llama(m: nn.Module, args: tuple, kwargs: dict) -> QK:
    x = args[0] if args else kwargs["hidden_states"]
    cos, sin = kwargs["position_embeddings"]  # (B, T, hd) each
    cfg = m.config
    n_h, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads

    def rot(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        turned = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos[:, None] + turned * sin[:, None]

    q = rot(heads(m.q_proj(x), n_h))
    k = rot(heads(m.k_proj(x), n_kv))
    return q, k.repeat_interleave(n_h // n_kv, dim=1)


def qk_encoder(m: nn.Module, args: tuple, kwargs: dict) -> QK:
    x = args[0]  # (B, T, E), batch_first
    E = m.embed_dim
    w, b = m.in_proj_weight, m.in_proj_bias
    return heads(F.linear(x, w[:E], b[:E]), m.num_heads), heads(
        F.linear(x, w[E : 2 * E], b[E : 2 * E]), m.num_heads
    )


class PaddedEncoderLM(zoo.EncoderLM):
    """EncoderLM that also takes a key padding mask (True = padding), with boolean causal masks."""

    def forward(self, idx: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        T = idx.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = may not attend
        x = self.encoder(self.embed(idx) * math.sqrt(32), mask=causal, src_key_padding_mask=pad)
        return self.head(self.norm(x))


def sharpen(model: nn.Module, paths: list[str], factor: float) -> None:
    """Scale the attention modules' weights so the logits are not all near zero (HF init is tiny)."""
    with torch.no_grad():
        for p in paths:
            for w in model.get_submodule(p).parameters():
                if w.dim() >= 2:
                    w.mul_(factor)


# name -> (build, qk, sharpen factor)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., QK], float]] = {
    "reference-rope-gqa": (lambda: zoo.reference_gpt(positions="rope", n_kv_heads=2), qk_reference_gpt, 2.0),
    "reference-mqa": (
        lambda: zoo.reference_gpt(positions="rope", n_kv_heads=1, bias=True),
        qk_reference_gpt,
        2.0,
    ),
    "reference-eager-gqa": (
        lambda: zoo.reference_gpt(positions="rope", n_kv_heads=2, attention="eager"),
        qk_reference_gpt,
        2.0,
    ),
    "reference-fp32-softmax": (
        lambda: zoo.reference_gpt(positions="rope", softmax_fp32=True),
        qk_reference_gpt,
        2.0,
    ),
    "nanogpt": (zoo.NanoGPT, qk_nanogpt, 3.0),
    "hf_gpt2-sdpa": (lambda: zoo.hf_gpt2("sdpa"), qk_hf_gpt2, 10.0),
    "hf_gpt2-eager": (lambda: zoo.hf_gpt2("eager"), qk_hf_gpt2, 10.0),
    "hf_llama-sdpa-gqa": (lambda: zoo.hf_llama("sdpa", kv_heads=2), qk_hf_llama, 10.0),
    "hf_llama-eager-gqa": (lambda: zoo.hf_llama("eager", kv_heads=2), qk_hf_llama, 10.0),
    "hf_llama-sdpa-mqa": (lambda: zoo.hf_llama("sdpa", kv_heads=1), qk_hf_llama, 10.0),
    "encoder-post": (lambda: PaddedEncoderLM(norm_first=False), qk_encoder, 1.0),
    "encoder-pre": (lambda: PaddedEncoderLM(norm_first=True), qk_encoder, 1.0),
}


def padding(bsz: int, T: int) -> torch.Tensor:
    """(B, T) 1 = token, 0 = padding: row 1 left-padded, row 2 right-padded."""
    valid = torch.ones(bsz, T, dtype=torch.long)
    valid[1, :3] = 0
    valid[2, -5:] = 0
    return valid


def run_forward(model: nn.Module, idx: torch.Tensor, valid: torch.Tensor | None) -> None:
    if isinstance(model, PaddedEncoderLM):
        model(idx, None if valid is None else valid == 0)
    elif valid is not None:
        model(idx, attention_mask=valid)
    else:
        zoo.forward_logits(model, idx)


def assert_close(got: float, want: float, what: str) -> None:
    assert got == pytest.approx(want, rel=1e-4, abs=1e-7), f"{what}: probe {got} vs reference {want}"


RUNS = [(c, False) for c in CASES] + [(c, True) for c in CASES if c.startswith(("hf_", "encoder"))]


@pytest.mark.parametrize(("case", "padded"), RUNS, ids=[f"{c}-{'padded' if p else 'full'}" for c, p in RUNS])
def test_exact_stats_match_materialised_reference(case: str, padded: bool) -> None:
    build, qk_of, factor = CASES[case]
    torch.manual_seed(0)
    model = build()
    model.train()
    paths = stabkit.inspect_model(model).attention_paths
    sharpen(model, paths, factor)
    idx, _ = zoo.batch(1, bsz=4)
    valid = padding(4, idx.shape[1]) if padded else None
    if case.startswith("encoder") and padded:
        valid[1] = 1  # left padding would leave fully masked query rows (NaN in torch's MHA); right only
    captured: dict[str, QK] = {}
    hooks = []
    for p in paths:

        def hook(m: nn.Module, args: tuple, kwargs: dict, _p: str = p) -> None:
            with torch.no_grad():
                captured[_p] = qk_of(m, args, kwargs)

        hooks.append(model.get_submodule(p).register_forward_pre_hook(hook, with_kwargs=True))
    mon = stabkit.attach(model, None, config=EXACT, logdir=None)
    run_forward(model, idx, valid)
    mon.step()
    mon.flush()
    mon.detach()
    for h in hooks:
        h.remove()
    got = mon.metrics
    assert len(captured) == len(paths) == 2
    for p in paths:
        q, k = captured[p]
        want = reference(q, k, causal_and_keys(idx.shape[1], valid))
        for stat in ("max_logit", "entropy", "min_head_entropy"):
            assert_close(got[f"attn/{p}/{stat}"], want[stat], f"{case} {p} {stat}")
        for h, (hm, he) in enumerate(zip(want["head_max"], want["head_entropy"], strict=True)):
            assert_close(got[f"attn/{p}/head.{h}/max_logit"], hm, f"{case} {p} head {h} max")
            assert_close(got[f"attn/{p}/head.{h}/entropy"], he, f"{case} {p} head {h} entropy")
        assert f"attn/{p}/max_logit_capped" not in got
    # the reference is not trivial: logits well away from zero, attention not uniform
    assert max(got[f"attn/{p}/max_logit"] for p in paths) > 0.5
