"""qk_clip against a hand computation: the logits each attention call sees, recomputed in float64 from
the call's own q and k, before and after one clip — fused, interleaved, GQA, MLA (Hugging Face
DeepSeek-V2/V3), nn.MultiheadAttention and HF GPT-2's Conv1D — and the exact per-head max against a
materialised float64 reference."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stabkit.attention.call import LogitsCall, Positions, QKCall
from stabkit.attention.math import SDPAArgs
from stabkit.interventions import InterventionError, apply, attach_optimizer
from stabkit.interventions.qkclip_max import head_max

D, H, T = 32, 4, 12


class Attention(nn.Module):
    """Causal SDPA attention in one of four layouts: fused [Q|K|V], interleaved per head (GPT-NeoX),
    separate q/k/v projections (with GQA when kv_heads < heads), each optionally with biases."""

    def __init__(self, layout: str, heads: int = H, kv_heads: int = H, bias: bool = True) -> None:
        super().__init__()
        self.layout, self.heads, self.kv, self.hd = layout, heads, kv_heads, D // heads
        if layout in ("fused", "interleaved"):
            self.qkv = nn.Linear(D, 3 * D, bias=bias)
        else:
            self.q_proj = nn.Linear(D, heads * self.hd, bias=bias)
            self.k_proj = nn.Linear(D, kv_heads * self.hd, bias=bias)
            self.v_proj = nn.Linear(D, kv_heads * self.hd, bias=bias)
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.layout == "fused":
            q, k, v = (y.view(b, t, self.heads, self.hd).transpose(1, 2) for y in self.qkv(x).split(D, dim=2))
        elif self.layout == "interleaved":
            qkv = self.qkv(x).view(b, t, self.heads, 3 * self.hd)
            q, k, v = (y.transpose(1, 2) for y in qkv.split(self.hd, dim=-1))
        else:
            q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)
            k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
            v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, D))


class LM(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, D)
        self.ln = nn.LayerNorm(D)
        self.attn = attn
        self.head = nn.Linear(D, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        return self.head(x + self.attn(self.ln(x)))


class Calls(torch.overrides.TorchFunctionMode):
    """The q, k and scale of every SDPA call made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor, float | None]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            call = SDPAArgs.from_call(args, kwargs or {})
            self.calls.append((call.query.detach().clone(), call.key.detach().clone(), call.scale))
        return func(*args, **(kwargs or {}))


def logits64(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """(B, H, L, S) causal logits in float64, masked entries −inf, kv heads repeated for GQA."""
    q, k = q.double(), k.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.shape[-1] ** -0.5 if scale is None else scale
    out = q @ k.transpose(-1, -2) * s
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return out.masked_fill(~mask, -math.inf)


def first_call(
    model: nn.Module, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    mode = Calls()
    with torch.no_grad(), mode:
        model(*args, **kwargs)
    return mode.calls[0]


def loud(model: nn.Module, factor: float = 3.0) -> nn.Module:
    """Scale the q/k-making weights up so that heads' max logits spread over a wide range."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(
                s in name for s in ("qkv", "q_proj", "k_proj", "q_b_proj", "kv_b_proj", "kv_a", "c_attn")
            ):
                p.mul_(factor)
    return model


def clip_once(model: nn.Module, handle: Any, *args: Any, **kwargs: Any) -> None:
    """One training forward (measured) and the clip, without an optimizer step."""
    model.train()
    model(*args, **kwargs)
    handle.clip()
    model.eval()


def between(top: torch.Tensor) -> float:
    """A threshold with heads on both sides of it."""
    ordered = top.sort().values
    return float((ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2)


@pytest.mark.parametrize("layout", ["fused", "interleaved", "separate"])
def test_clipped_heads_reach_tau_exactly_and_the_others_stay_bitwise(layout: str) -> None:
    torch.manual_seed(0)
    model = loud(LM(Attention(layout))).eval()
    idx = torch.randint(0, 50, (3, T))
    q0, k0, scale = first_call(model, idx)
    top = logits64(q0, k0, scale).amax(dim=(0, 2, 3))  # (H,)
    tau = between(top)
    handle = apply(model, "qk_clip", tau=tau)
    clip_once(model, handle, idx)
    q1, k1, _ = first_call(model, idx)
    after = logits64(q1, k1, scale).amax(dim=(0, 2, 3))
    clipped = top > tau
    assert 0 < int(clipped.sum()) < H
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5, atol=0)
    for h in range(H):
        if not clipped[h]:
            assert torch.equal(q1[:, h], q0[:, h]) and torch.equal(k1[:, h], k0[:, h])
    metrics = handle.metrics()
    assert float(metrics["qk_clip/attn/heads_clipped"]) == int(clipped.sum())
    assert float(metrics["qk_clip/attn/min_gamma"]) == pytest.approx(tau / float(top.max()), rel=1e-5)
    assert float(metrics["qk_clip/attn/max_logit"]) == pytest.approx(float(top.max()), rel=1e-5)


def test_gqa_groups_follow_their_largest_head() -> None:
    torch.manual_seed(1)
    model = loud(LM(Attention("separate", heads=4, kv_heads=2))).eval()
    idx = torch.randint(0, 50, (3, T))
    q0, k0, scale = first_call(model, idx)
    top = logits64(q0, k0, scale).amax(dim=(0, 2, 3))  # (4,) query heads
    groups = top.view(2, 2).amax(dim=1)  # max over each kv group's query heads
    tau = float((groups.min() + groups.max()) / 2)  # one group clips, the other does not
    if float(groups.min()) >= tau or float(groups.max()) <= tau:
        pytest.skip("both groups on one side of tau")
    handle = apply(model, "qk_clip", tau=tau)
    clip_once(model, handle, idx)
    q1, k1, _ = first_call(model, idx)
    after = logits64(q1, k1, scale).amax(dim=(0, 2, 3))
    g = int(groups.argmax())
    lead = 2 * g + int(top[2 * g : 2 * g + 2].argmax())
    assert float(after[lead]) == pytest.approx(tau, rel=1e-5)  # the head that decides its group's keys
    assert float(after[2 * g : 2 * g + 2].max()) <= tau * (1 + 1e-5)
    other = 1 - g
    assert torch.equal(q1[:, 2 * other : 2 * other + 2], q0[:, 2 * other : 2 * other + 2])
    assert torch.equal(k1[:, other], k0[:, other])


def test_nothing_changes_while_every_head_is_below_tau() -> None:
    torch.manual_seed(2)
    model = LM(Attention("fused"))
    idx = torch.randint(0, 50, (2, T))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = apply(model, "qk_clip", tau=1e4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    handle.watch(opt)
    for _ in range(3):
        model(idx).sum().backward()
        opt.step()
        opt.zero_grad()
    assert handle.clips == 3
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert float(handle.metrics()["qk_clip/heads_clipped"]) == 0.0
    assert float(handle.metrics()["qk_clip/attn/min_gamma"]) == 1.0


def test_biases_and_an_optimizers_master_copy_are_scaled_like_the_weights() -> None:
    torch.manual_seed(3)
    model = loud(LM(Attention("separate"))).eval()
    idx = torch.randint(0, 50, (2, T))
    q_w, q_b = model.attn.q_proj.weight.detach().clone(), model.attn.q_proj.bias.detach().clone()
    v_w = model.attn.v_proj.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    master = q_w.double().clone()
    opt.state[model.attn.q_proj.weight]["master_param"] = master
    handle = apply(model, "qk_clip", tau=1e-3)  # every head clips
    handle.watch(opt)
    model.train()
    model(idx).sum().backward()
    opt.step()
    factors = model.attn.q_proj.weight.detach() / q_w  # per row: γ_h^α
    rows = factors[:, 0]
    assert torch.all(rows < 1)
    torch.testing.assert_close(factors, rows[:, None].expand_as(factors))
    torch.testing.assert_close(model.attn.q_proj.bias.detach() / q_b, rows)
    torch.testing.assert_close(
        (master / q_w.double()).float(), rows[:, None].expand_as(factors), rtol=1e-5, atol=0
    )
    assert torch.equal(model.attn.v_proj.weight, v_w)  # v is never touched


def test_multihead_attention_in_projection() -> None:
    torch.manual_seed(4)

    class MHALM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, D)
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)
            self.head = nn.Linear(D, 50)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx)
            mask = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool).triu(1)
            return self.head(x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0])

    model = MHALM()
    with torch.no_grad():
        model.attn.in_proj_weight[: 2 * D].mul_(4)
    idx = torch.randint(0, 50, (2, T))

    def logits() -> torch.Tensor:
        x = model.emb(idx).detach().double()
        w, b = model.attn.in_proj_weight.detach().double(), model.attn.in_proj_bias.detach().double()
        q = (x @ w[:D].T + b[:D]).view(2, T, H, -1).transpose(1, 2)
        k = (x @ w[D : 2 * D].T + b[D : 2 * D]).view(2, T, H, -1).transpose(1, 2)
        return logits64(q, k, None)

    top = logits().amax(dim=(0, 2, 3))
    tau = between(top)
    v_rows = model.attn.in_proj_weight[2 * D :].detach().clone()
    handle = apply(model, "qk_clip", tau=tau)
    clip_once(model, handle, idx)
    after = logits().amax(dim=(0, 2, 3))
    clipped = top > tau
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[~clipped], top[~clipped], rtol=0, atol=0)
    assert torch.equal(model.attn.in_proj_weight[2 * D :], v_rows)


@pytest.mark.parametrize("name", ["hf-deepseek-v2-sdpa", "hf-deepseek-v3-sdpa"])
def test_latent_attention_parts(name: str) -> None:
    """MLA: a clipped head's nope q and k rows take √γ, its rotary q rows γ; the rotary key shared
    by every head is left alone; other heads are bitwise unchanged."""
    pytest.importorskip("transformers")
    from zoo_models.hf_modern import BUILDERS

    z = BUILDERS[name]()
    model = loud(z.model, 6.0).eval()
    q0, k0, scale = first_call(model, **z.inputs)
    top = logits64(q0, k0, scale).amax(dim=(0, 2, 3))
    tau = between(top)
    handle = apply(model, "qk_clip", tau=tau, example=((), z.inputs))
    site = next(iter(handle.sites.values()))
    a_parts = [t for t in site.plan.targets]
    assert any("kv_b_proj" in t for t in a_parts) and not any("kv_a_proj" in t for t in a_parts)
    clip_once(model, handle, **z.inputs)
    q1, k1, _ = first_call(model, **z.inputs)
    after = logits64(q1, k1, scale).amax(dim=(0, 2, 3))
    clipped = top > tau
    assert 0 < int(clipped.sum()) < top.numel()
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5, atol=0)
    rope = list(range(8, 12))  # qk_nope_head_dim 8, qk_rope_head_dim 4 (the zoo's config)
    assert torch.equal(k1[..., rope], k0[..., rope])  # the shared rotary key: untouched
    for h in range(top.numel()):
        if not clipped[h]:
            assert torch.equal(q1[:, h], q0[:, h]) and torch.equal(k1[:, h], k0[:, h])


def test_muon_and_adamw_training_and_remove_stops_clipping() -> None:
    torch.manual_seed(5)
    model = loud(LM(Attention("separate", bias=False)), 2.0)
    idx = torch.randint(0, 50, (4, T))
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("attn.")]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and n.startswith("attn."))]
    opts = [torch.optim.Muon(matrices, lr=0.05), torch.optim.AdamW(rest, lr=1e-2)]
    handle = apply(model, "qk_clip", tau=5.0)
    attach_optimizer(handle, opts)  # a list: clipped after the last one steps
    tops = []
    for _ in range(6):
        model.train()
        F.cross_entropy(model(idx).reshape(-1, 50), idx.reshape(-1)).backward()
        for o in opts:
            o.step()
            o.zero_grad()
        tops.append(float(handle.metrics()["qk_clip/attn/max_logit"]))
    assert handle.clips == 6
    q, k, scale = first_call(model.eval(), idx)
    assert float(logits64(q, k, scale).amax()) < 5.0 * 1.5  # held near tau by the clips
    handle.remove()
    weights = model.attn.q_proj.weight.detach().clone()
    model.train()
    model(idx).sum().backward()
    opts[0].zero_grad()
    for o in opts:
        o.step()
    assert handle.clips == 6 and torch.equal(model.attn.q_proj.weight, weights)


def test_refuses_attention_whose_queries_and_keys_are_normalised() -> None:
    from stabkit.harness.models import GPT, GPTConfig

    model = GPT(GPTConfig(qk_norm=True))
    with pytest.raises(InterventionError, match="normalised"):
        apply(model, "qk_clip")


# ------------------------------------------------------------------------------- the exact max
def reference_max(call: QKCall) -> torch.Tensor:
    """(H,) float64 signed max over the allowed entries of the materialised logits."""
    q, k = call.q.double(), call.k.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    logits = q @ k.transpose(-1, -2) * s
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if call.allowed is not None:
        allowed = allowed & call.allowed
    if call.causal:
        allowed = allowed & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if call.positions is not None:
        p = call.positions
        i, j = p.q_pos[:, None], p.k_pos[None, :]
        left, _right = p.window or (-1, -1)
        if p.causal:
            allowed = allowed & (j <= i)
        if left >= 0:
            allowed = allowed & (j >= i - left)
    return logits.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("budget", [1 << 30, 2048])
def test_exact_max_matches_a_float64_reference(budget: int) -> None:
    torch.manual_seed(6)
    b, heads, kv, n, e = 3, 6, 2, 37, 8
    q = torch.randn(b, heads, n, e) * 3
    k = torch.randn(b, kv, n, e) * 3
    q[1, 4, 20] *= 9  # one far query: a sample of rows/queries would likely miss it
    calls = [
        QKCall(q, k, None, causal=True),
        QKCall(q, k, 0.3, allowed=torch.rand(b, 1, n, n) > 0.4),
        QKCall(
            q,
            k,
            None,
            positions=Positions.aligned(n, n, q.device, bottom_right=False, causal=True, window=(5, 0)),
        ),
    ]
    for call in calls:
        got = head_max(call, budget)
        torch.testing.assert_close(got.double(), reference_max(call), rtol=1e-5, atol=1e-5)


def test_exact_max_of_materialised_logits() -> None:
    torch.manual_seed(7)
    x = torch.randn(2, 3, 9, 11) * 5
    x[..., 7:] = torch.finfo(x.dtype).min  # masked columns (and a sink column beyond them)
    x = torch.cat([x, torch.full((2, 3, 9, 1), 1e3)], dim=-1)
    got = head_max(LogitsCall(x, sink_columns=1), 256)
    want = x[..., :7].double().amax(dim=(0, 2, 3))
    torch.testing.assert_close(got.double(), want)
