"""QK-norm bounds the attention logits as the maths says, even after training at a high learning rate:
|logit| <= scale · head_dim · max|g_q| · max|g_k| (`qk_norm_logit_bound`), while the same model without
QK-norm grows logits well beyond that bound."""

from __future__ import annotations

import pytest
import torch
import zoo
from torch import nn

from stabkit.interventions import InterventionError, apply, qk_norm_logit_bound, qk_norm_logit_bounds


def _train(
    model: nn.Module, extra_params: list[nn.Parameter], steps: int = 100, lr: float = 0.1
) -> torch.Tensor:
    """AdamW at LR 0.1 on a copy task (second half repeats the first), so attention has a use."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if extra_params:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        assert all(id(p) in ids for p in extra_params)  # registered on the model: already included
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        half = torch.randint(0, zoo.VOCAB, (16, zoo.SEQ // 2 + 1), generator=g)
        data = torch.cat([half, half], 1)[:, : zoo.SEQ + 1]
        optimizer.zero_grad()
        zoo.lm_loss(model(data[:, :-1]), data[:, 1:]).backward()
        optimizer.step()
    return data[:, :-1]


def _max_logit(model: nn.Module, idx: torch.Tensor, qk_norm: bool) -> float:
    """Materialise q kᵀ·scale per layer from q and k captured by hooks (after any QK-norm)."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        for role in ("q", "k"):
            src = getattr(attn, f"{role}_norm") if qk_norm else getattr(attn, f"{role}_proj")
            handles.append(
                src.register_forward_hook(lambda m, a, out, key=(role, i): seen.__setitem__(key, out))
            )
    with torch.no_grad():
        model(idx)
    for h in handles:
        h.remove()
    worst = 0.0
    for i, block in enumerate(model.blocks):
        hd = block.attn.head_dim
        q, k = seen[("q", i)], seen[("k", i)]
        if not qk_norm:  # projection outputs (B, T, H·hd) -> (B, H, T, hd)
            q, k = (t.view(*t.shape[:2], -1, hd).transpose(1, 2) for t in (q, k))
        worst = max(worst, float((q @ k.transpose(-2, -1) * hd**-0.5).abs().max()))
    return worst


def test_qk_norm_bounds_attention_logits_under_high_lr() -> None:
    torch.manual_seed(0)
    model = zoo.reference_gpt()
    handle = apply(model, "qk_norm")
    idx = _train(model, handle.new_parameters())
    bound = qk_norm_logit_bound(model)
    gains = [float(p.detach().abs().max()) for p in handle.new_parameters()]
    assert max(gains) > 1.2, "the gains should have moved at LR 0.1"
    with_norm = _max_logit(model, idx, qk_norm=True)
    assert with_norm <= bound

    torch.manual_seed(0)
    baseline = zoo.reference_gpt()
    idx = _train(baseline, [])
    without = _max_logit(baseline, idx, qk_norm=False)
    assert without > 3 * bound, f"baseline max logit {without:.1f} vs bound {bound:.1f}"


def test_bound_formula_per_module() -> None:
    model = zoo.reference_gpt()
    with pytest.raises(InterventionError, match="no attention module with QK-norm"):
        qk_norm_logit_bound(model)
    handle = apply(model, "qk_norm")
    with torch.no_grad():
        model.blocks[1].attn.q_norm.weight[3] = -2.5
        model.blocks[1].attn.k_norm.weight[0] = 1.5
    bounds = qk_norm_logit_bounds(model)
    hd = 8
    assert bounds["blocks.0.attn"] == pytest.approx(hd**-0.5 * hd)
    assert bounds["blocks.1.attn"] == pytest.approx(hd**-0.5 * hd * 2.5 * 1.5)
    handle.remove()
    hf = zoo.hf_llama()
    apply(hf, "qk_norm")
    assert qk_norm_logit_bound(hf) == pytest.approx(8 * hf.model.layers[0].self_attn.scaling)
