"""qk_norm and attn_softcap against independent references: hand-written attention from the modules'
weights, the reference GPT built with the same switch, and eager vs SDPA implementations."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

from stabkit.attention import SDPA, SOFTMAXES, attach_scope
from stabkit.interventions import InterventionError, apply
from stabkit.interventions.mha import decomposed_forward


def _loud(model: nn.Module, std: float = 0.3) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model


def _random_gains(handle: Any) -> None:
    with torch.no_grad():
        for p in handle.new_parameters():
            p.uniform_(0.5, 2.0)


def _capture(module: nn.Module) -> dict[str, Any]:
    """Input args/kwargs and output of one call of `module`."""
    seen: dict[str, Any] = {}

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
        seen["args"], seen["kwargs"] = args, kwargs

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        seen["out"] = out[0] if isinstance(out, tuple) else out

    seen["handles"] = [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post),
    ]
    return seen


def _hand_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, written out."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float | None = None
):
    """softmax(mask(cap·tanh(q kᵀ·scale / cap))) v for (B, H, T, hd) tensors, written out."""
    logits = q @ k.transpose(-2, -1) * scale
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    t = q.shape[-2]
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, -1) @ v


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    return x.view(*x.shape[:2], -1, hd).transpose(1, 2)  # (B, H, T, hd)


# ---------------------------------------------------------------- qk_norm
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_qk_norm_hf_llama_equals_hand_attention(impl: str) -> None:
    torch.manual_seed(0)
    model = _loud(zoo.hf_llama(impl, kv_heads=2)).eval()
    handle = apply(model, "qk_norm", eps=1e-5)
    _random_gains(handle)
    attn = model.model.layers[1].self_attn
    seen = _capture(attn)
    idx, _ = zoo.batch(0)
    model(idx)
    x = seen["kwargs"]["hidden_states"]  # (B, T, d)
    cos, sin = (t.unsqueeze(1) for t in seen["kwargs"]["position_embeddings"])  # (B, 1, T, hd)
    hd, gains = 8, attn.stabkit_qk_norm
    q = _hand_norm((x @ attn.q_proj.weight.T).view(4, 16, 4, hd), gains.q.weight, 1e-5).transpose(1, 2)
    k = _hand_norm((x @ attn.k_proj.weight.T).view(4, 16, 2, hd), gains.k.weight, 1e-5).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(4, 16, 2, hd).transpose(1, 2)

    def rope(t: torch.Tensor) -> torch.Tensor:  # rotate_half convention of HF LLaMA
        return t * cos + torch.cat((-t[..., hd // 2 :], t[..., : hd // 2]), -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # GQA: 2 kv heads -> 4
    y = _causal_attention(q, k, v, hd**-0.5).transpose(1, 2).reshape(4, 16, 32) @ attn.o_proj.weight.T
    torch.testing.assert_close(seen["out"], y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_qk_norm_hf_gpt2_fused_equals_hand_attention(impl: str) -> None:
    torch.manual_seed(0)
    model = _loud(zoo.hf_gpt2(impl)).eval()
    handle = apply(model, "qk_norm", eps=1e-5)
    _random_gains(handle)
    attn = model.transformer.h[0].attn
    seen = _capture(attn)
    idx, _ = zoo.batch(0)
    model(idx)
    x = seen["args"][0]
    qkv = x @ attn.c_attn.weight + attn.c_attn.bias  # Conv1D: (in, out) weight
    q, k, v = qkv.split(32, dim=-1)
    g = attn.stabkit_qk_norm
    q = _hand_norm(q.view(4, 16, 4, 8), g.q.weight, 1e-5).transpose(1, 2)
    k = _hand_norm(k.view(4, 16, 4, 8), g.k.weight, 1e-5).transpose(1, 2)
    y = _causal_attention(q, k, _heads(v, 8), 8**-0.5).transpose(1, 2).reshape(4, 16, 32)
    y = y @ attn.c_proj.weight + attn.c_proj.bias
    torch.testing.assert_close(seen["out"], y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("overrides", [{}, {"positions": "rope", "n_kv_heads": 2}])
def test_qk_norm_reference_gpt_equals_config_built(kind: str, overrides: dict) -> None:
    torch.manual_seed(0)
    mine = zoo.reference_gpt(norm=kind, **overrides)
    handle = apply(mine, "qk_norm", kind=kind)
    _random_gains(handle)
    built = zoo.reference_gpt(norm=kind, qk_norm=True, **overrides)
    built.load_state_dict(mine.state_dict())  # same keys: blocks.i.attn.q_norm.weight ...
    idx, _ = zoo.batch(0)
    torch.testing.assert_close(mine(idx), built(idx), rtol=1e-6, atol=1e-6)


def test_qk_norm_encoder_equals_hand_mha_also_on_the_fast_path() -> None:
    torch.manual_seed(0)
    model = zoo.EncoderLM().eval()
    handle = apply(model, "qk_norm", eps=1e-5)
    _random_gains(handle)
    mha = model.encoder.layers[0].self_attn
    seen = _capture(mha)
    idx, _ = zoo.batch(0)
    with torch.no_grad():  # eval + no_grad: PyTorch's fused encoder path, which must be bypassed
        model(idx)
    x = seen["args"][0]  # (B, T, d), batch_first
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q, k, v = (x @ w[i * 32 : (i + 1) * 32].T + b[i * 32 : (i + 1) * 32] for i in range(3))
    g = mha.stabkit_qk_norm
    q = _hand_norm(q.view(4, 16, 4, 8), g.q.weight, 1e-5).transpose(1, 2)
    k = _hand_norm(k.view(4, 16, 4, 8), g.k.weight, 1e-5).transpose(1, 2)
    y = _causal_attention(q, k, _heads(v, 8), 8**-0.5).transpose(1, 2).reshape(4, 16, 32)
    y = y @ mha.out_proj.weight.T + mha.out_proj.bias
    torch.testing.assert_close(seen["out"], y, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool", "float+padding", "unbatched"])
def test_decomposed_mha_forward_equals_torch(batch_first: bool, masks: str) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=12, vdim=10).train(False)
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(3, 5, 16, generator=g),
        torch.randn(3, 7, 12, generator=g),
        torch.randn(3, 7, 10, generator=g),
    )
    if not batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    kwargs: dict[str, Any] = {}
    if masks == "bool":
        kwargs["attn_mask"] = torch.rand(5, 7, generator=g) > 0.7  # True = not allowed
    elif masks == "float+padding":
        kwargs["attn_mask"] = torch.randn(3 * 4, 5, 7, generator=g)
        kwargs["key_padding_mask"] = torch.tensor([[0.0] * 6 + [float("-inf")]] * 3)
        kwargs["average_attn_weights"] = False
    elif masks == "unbatched":
        q, k, v = (
            q[:, 0] if not batch_first else q[0],
            k[:, 0] if not batch_first else k[0],
            v[:, 0] if not batch_first else v[0],
        )
    want_out, want_w = mha(q, k, v, **kwargs)
    got_out, got_w = decomposed_forward(mha, q, k, v, **kwargs)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- attn_softcap
@pytest.mark.parametrize("overrides", [{}, {"positions": "rope", "n_kv_heads": 2}])
def test_attn_softcap_reference_gpt_equals_config_built(overrides: dict) -> None:
    torch.manual_seed(0)
    mine = zoo.reference_gpt(init_std=0.5, **overrides)
    built = zoo.reference_gpt(attn_softcap=0.7, **overrides)
    built.load_state_dict(mine.state_dict())
    idx, _ = zoo.batch(0)
    base = mine(idx)
    handle = apply(mine, "attn_softcap", cap=0.7)
    assert all(b.attn._stabkit_attn_softcap == 0.7 for b in mine.blocks)
    capped = mine(idx)
    assert (capped - base).abs().max() > 1e-3
    expected = built(idx)
    torch.testing.assert_close(capped, expected, rtol=1e-5, atol=1e-5)
    capped.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(mine.named_parameters(), built.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    handle.remove()
    assert not hasattr(mine.blocks[0].attn, "_stabkit_attn_softcap")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_attn_softcap_eager_equals_sdpa_with_padding(family: str) -> None:
    build = (lambda impl: zoo.hf_llama(impl, kv_heads=2)) if family == "llama" else zoo.hf_gpt2
    torch.manual_seed(0)
    eager = _loud(build("eager")).eval()
    sdpa = build("sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    idx, _ = zoo.batch(0)
    mask = torch.ones_like(idx)
    mask[1, :5] = 0  # left padding in one row: eager adds finfo.min, SDPA gets a mask tensor
    keep = mask.bool()
    plain = eager(idx, attention_mask=mask).logits
    apply(eager, "attn_softcap", cap=0.3)
    apply(sdpa, "attn_softcap", cap=0.3)
    a, b = eager(idx, attention_mask=mask).logits, sdpa(idx, attention_mask=mask).logits
    assert (a - plain)[keep].abs().max() > 1e-3
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-4, atol=1e-5)


def test_attn_softcap_eager_caps_only_unmasked_entries() -> None:
    torch.manual_seed(0)
    model = _loud(zoo.hf_llama("eager")).eval()
    seen: list[torch.Tensor] = []

    def record(path: str, func: Any, args: tuple, kwargs: dict) -> Any:
        seen.append(args[0].detach().clone())
        return func(*args, **kwargs)

    paths = [f"model.layers.{i}.self_attn" for i in range(2)]
    idx, _ = zoo.batch(0)
    mask = torch.ones_like(idx)
    mask[0, :3] = 0
    with attach_scope(model, paths, dict.fromkeys(SOFTMAXES, record), outer=False):
        model(idx, attention_mask=mask)
        raw = list(seen)
        apply(model, "attn_softcap", cap=0.3)
        seen.clear()  # the apply-time check ran one forward; only the next one counts
        model(idx, attention_mask=mask)
    assert len(raw) == len(seen) == 2
    for x, y in zip(raw[:1], seen[:1], strict=True):  # layer 0's softmax input without and with the cap
        masked = x <= torch.finfo(x.dtype).min / 2
        assert masked.any() and (~masked).any()
        assert torch.equal(y[masked], x[masked])  # masked entries untouched (not -cap)
        torch.testing.assert_close(y[~masked], 0.3 * torch.tanh(x[~masked] / 0.3))
        assert y[~masked].abs().max() <= 0.3
        assert x[~masked].abs().max() > 0.3  # the cap did bite


def test_attn_softcap_caps_before_an_additive_bias_in_eager_as_in_sdpa() -> None:
    """T5 adds a relative-position bias to q·kᵀ: the cap sits before it on both paths."""
    outs = []
    for impl in ("eager", "sdpa"):
        torch.manual_seed(0)
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(
            vocab_size=zoo.VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, attn_implementation=impl,
        )  # fmt: skip
        model = _loud(T5ForConditionalGeneration(cfg), 2.0).eval()
        idx, _ = zoo.batch(0)
        example = {"input_ids": idx, "decoder_input_ids": idx[:, :6], "use_cache": False}
        with torch.no_grad():
            before = model(**example).logits
            handle = apply(model, "attn_softcap", cap=0.5, example=example)
            outs.append((before, model(**example).logits))
        handle.remove()
    (eager_before, eager), (sdpa_before, sdpa) = outs
    torch.testing.assert_close(eager_before, sdpa_before, rtol=1e-3, atol=1e-3)  # fused vs eager rounding
    assert (eager - eager_before).abs().max() > 1e-1  # the cap bites
    torch.testing.assert_close(eager, sdpa, rtol=1e-6, atol=1e-6)  # capped before the bias on both paths


@pytest.mark.parametrize("family", ["nanogpt", "encoder"])
def test_attn_softcap_sdpa_route_equals_capped_materialised_logits(family: str) -> None:
    torch.manual_seed(0)
    model = _loud(zoo.NanoGPT() if family == "nanogpt" else zoo.EncoderLM(), 0.5).eval()
    attn_path = "transformer.h.0.attn" if family == "nanogpt" else "encoder.layers.0.self_attn"
    calls: list[tuple[Any, torch.Tensor]] = []

    def observe(path: str, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)  # passed on outwards: the soft cap replaces the call
        calls.append((args, out))
        return out

    apply(model, "attn_softcap", cap=0.5)
    probe = attach_scope(model, [attn_path], {SDPA: observe}, outer=False)
    idx, _ = zoo.batch(0)
    model(idx)
    probe.remove()
    ((args, out),) = calls
    q, k, v = args[:3]
    assert (q @ k.transpose(-2, -1) * 8**-0.5).abs().max() > 0.5  # raw logits exceed the cap
    torch.testing.assert_close(out, _causal_attention(q, k, v, 8**-0.5, cap=0.5), rtol=1e-5, atol=1e-6)


def test_attn_softcap_refuses_what_it_cannot_reach() -> None:
    model = zoo.hf_llama("sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(InterventionError, match=r"attn_softcap.*model\.layers\.0\.self_attn.*flex_attention"):
        apply(model, "attn_softcap")  # FlexAttention cannot run a gradient forward on a CPU: names
    assert not hasattr(model.model.layers[0].self_attn, "_stabkit_attn_softcap")
    with pytest.raises(InterventionError, match="soft-capped already"):
        apply(zoo.reference_gpt(attn_softcap=20.0), "attn_softcap")


class _NoSoftmaxAttention(zoo.NanoAttention):
    """Claims flash (SDPA) but normalises with exp/sum: the cap cannot be applied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            t.view(*x.shape[:2], self.n_head, -1).transpose(1, 2)
            for t in self.c_attn(x).split(self.n_embd, 2)
        )
        w = (q @ k.transpose(-2, -1)).exp()
        y = (w / w.sum(-1, keepdim=True)) @ v
        return self.c_proj(y.transpose(1, 2).reshape(x.shape))


def test_attn_softcap_raises_when_nothing_was_intercepted() -> None:
    model = zoo.NanoGPT()
    for block in model.transformer.h:
        block.attn = _NoSoftmaxAttention(32, 4)
    with pytest.raises(InterventionError, match=r"attn_softcap.*transformer\.h\.0\.attn.*cannot see"):
        apply(model, "attn_softcap")  # refused at apply: the traced forward made no call to cap
    assert not hasattr(model.transformer.h[0].attn, "_stabkit_attn_softcap")
    assert torch._C._len_torch_function_stack() == 0


class _EagerNanoAttention(zoo.NanoAttention):
    """nanoGPT's non-flash path: masked_fill(-inf) then F.softmax."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__(d, n_head)
        self.flash = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            t.view(*x.shape[:2], self.n_head, -1).transpose(1, 2)
            for t in self.c_attn(x).split(self.n_embd, 2)
        )
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.shape[-1] ** 0.5)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(x.shape))


def test_attn_softcap_nanogpt_eager_equals_flash() -> None:
    torch.manual_seed(0)
    flash = _loud(zoo.NanoGPT(), 0.5)
    eager = zoo.NanoGPT()
    for block in eager.transformer.h:
        block.attn = _EagerNanoAttention(32, 4)
    eager.load_state_dict(flash.state_dict())
    idx, _ = zoo.batch(0)
    torch.testing.assert_close(eager(idx), flash(idx), rtol=1e-5, atol=1e-5)
    base = flash(idx)
    apply(flash, "attn_softcap", cap=0.5)
    apply(eager, "attn_softcap", cap=0.5)
    out = flash(idx)
    assert (out - base).abs().max() > 1e-3
    torch.testing.assert_close(eager(idx), out, rtol=1e-5, atol=1e-5)
