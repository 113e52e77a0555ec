"""The zoo's attention-logit reference (`zoo_models.reference`) against hand computations on the cases
`hf_modern` added: attention sinks (GPT-OSS), latent attention (MLA: DeepSeek-V2 / V3) and sliding /
chunked windows (Gemma 3, Cohere2, Llama 4, GPT-OSS). The hand side never reads a softmax input or a mask
the model built: it recomputes q·kᵀ·scale from weights, or from the q and k the model hands its attention
function, and applies the window rule itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from zoo_models import ZOO, ZooModel, attention_logit_maxima
from zoo_models.reference import AttentionLogitRecorder

torch.set_num_threads(1)
pytestmark = pytest.mark.zoo

transformers = pytest.importorskip("transformers")


def build(name: str) -> ZooModel:
    try:
        return ZOO[name]()
    except ImportError as exc:
        pytest.skip(str(exc))


def _window_max(logits: torch.Tensor, allowed: torch.Tensor) -> float:
    return float(logits.masked_fill(~allowed, -math.inf).max())


def _allowed(rule: str, n: int, size: int) -> torch.Tensor:
    """(n, n) keys query i may see: causal, and inside the window / chunk of `size` (transformers' rules)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = j <= i
    if rule == "sliding":
        allowed &= i - j < size
    elif rule == "chunked":
        allowed &= i // size == j // size
    return allowed


# ------------------------------------------------------------------------------------------ attention sinks
def test_sink_attention_call_records_the_logits_not_the_shifted_softmax_input() -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    b, h, kv, n, d, window = 2, 4, 2, 6, 8, 3
    q = torch.randn(b, h, n, d)
    k = torch.randn(b, kv, n, d)
    v = torch.randn(b, kv, n, d)
    allowed = _allowed("sliding", n, window)
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min).expand(b, 1, n, n)
    module = torch.nn.Module()
    module.num_key_value_groups = h // kv
    module.training = False
    module.sinks = torch.nn.Parameter(torch.full((h,), 5.0))  # a sink above every logit: it is each row's max
    scale = d**-0.5

    with AttentionLogitRecorder() as recorder:
        eager_attention_forward(module, q, k, v, mask, scaling=scale)
    with AttentionLogitRecorder(absolute=True) as absolute:
        eager_attention_forward(module, q, k, v, mask, scaling=scale)

    logits = q.double() @ k.double().repeat_interleave(h // kv, dim=1).transpose(-2, -1) * scale
    assert recorder.kinds == ["sink-softmax"]
    assert recorder.maxima == [pytest.approx(_window_max(logits, allowed), rel=1e-6)]
    assert absolute.maxima == [pytest.approx(_window_max(logits.abs(), allowed), rel=1e-6)]
    # what a softmax-input reading gives instead: every shifted row peaks at 0, its |max| is a row's range
    shifted = torch.cat([logits.masked_fill(~allowed, -math.inf), torch.full((b, h, n, 1), 5.0).double()], -1)
    shifted = shifted - shifted.amax(-1, keepdim=True)
    assert float(shifted.max()) == 0.0
    assert recorder.maxima[0] < 5.0


def test_a_cat_that_reaches_no_softmax_records_nothing_and_a_wide_cat_is_no_sink() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 2, 3, 4)
    with AttentionLogitRecorder() as recorder:
        torch.cat([x, x[..., :1]], dim=-1) * 2  # a sink-shaped cat, never softmaxed
        rope_like = torch.cat([x, x], dim=-1)  # (.., 8): not a (.., 1) sink column
        torch.softmax(rope_like - 1.0, dim=-1)
    assert recorder.kinds == ["softmax"]
    assert recorder.maxima == [pytest.approx(float(x.max()) - 1.0, rel=1e-6)]


# --------------------------------------------------------------- q and k as the model hands them over


def _capture_attention(monkeypatch: pytest.MonkeyPatch, modeling: Any) -> list[tuple[torch.Tensor, ...]]:
    """(query, key, scaling) of every call of `modeling`'s eager attention function and of transformers' SDPA."""
    from transformers.modeling_utils import AttentionInterface

    calls: list[tuple[torch.Tensor, ...]] = []

    def wrap(fn: Callable) -> Callable:
        def wrapped(module, query, key, value, attention_mask, *args, **kwargs):
            scaling = kwargs.get("scaling", args[0] if args else None)
            calls.append((query.detach().double(), key.detach().double(), scaling))
            return fn(module, query, key, value, attention_mask, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(modeling, "eager_attention_forward", wrap(modeling.eager_attention_forward))
    sdpa = AttentionInterface._global_mapping["sdpa"]
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", wrap(sdpa))
    return calls


@pytest.mark.parametrize(
    ("name", "modeling", "rules"),
    [
        ("hf-gpt-oss-eager", "gpt_oss", [("sliding", 4), ("causal", 0)]),
        ("hf-gemma3-sdpa", "gemma3", [("sliding", 4), ("causal", 0)]),
        ("hf-gemma3-eager", "gemma3", [("sliding", 4), ("causal", 0)]),
        ("hf-cohere2-sdpa", "cohere2", [("sliding", 4), ("causal", 0)]),
        ("hf-cohere2-eager", "cohere2", [("sliding", 4), ("causal", 0)]),
        ("hf-llama4-sdpa", "llama4", [("chunked", 4), ("causal", 0)]),
        ("hf-llama4-eager", "llama4", [("chunked", 4), ("causal", 0)]),
    ],
)
def test_windowed_and_sink_attention_maxima_by_hand(
    monkeypatch: pytest.MonkeyPatch, name: str, modeling: str, rules: list[tuple[str, int]]
) -> None:
    import importlib

    zoo = build(name)
    calls = _capture_attention(
        monkeypatch, importlib.import_module(f"transformers.models.{modeling}.modeling_{modeling}")
    )
    with torch.no_grad():
        maxima = attention_logit_maxima(zoo.model, zoo.args, zoo.inputs)
    assert len(calls) == len(maxima) == len(rules) == zoo.n_attention_calls
    for (q, k, scaling), (rule, size), got in zip(calls, rules, maxima, strict=True):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = q @ k.transpose(-2, -1) * scaling
        want = _window_max(logits, _allowed(rule, q.shape[-2], size))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        # the window matters here: some query's max over all earlier keys is another number
        if rule != "causal":
            inside = logits.masked_fill(~_allowed(rule, q.shape[-2], size), -math.inf).amax(-1)
            causal = logits.masked_fill(~_allowed("causal", q.shape[-2], 0), -math.inf).amax(-1)
            assert (causal > inside).any()


# ---------------------------------------------------------------------------------------------------- MLA
def _mla_logits_by_hand(attn: torch.nn.Module, x: torch.Tensor, config: Any) -> torch.Tensor:
    """q·kᵀ·scale of one MLA module from its weights, in float64: q = [q_nope | rope(q_rope)] per head,
    k = [k_nope (per head, from the kv latent) | rope(k_rope) (one head, shared)], interleaved-pair RoPE
    as complex rotations by position · base^(-2i / rope_dim)."""
    x = x.double()
    lin = lambda m, t: F.linear(t, m.weight.double(), None if m.bias is None else m.bias.double())  # noqa: E731

    def rms(m: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
        return m.weight.double() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)

    b, n, _ = x.shape
    heads, nope, rope, vdim = (
        config.num_attention_heads,
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
    )
    if config.q_lora_rank is None:
        q = lin(attn.q_proj, x)
    else:
        q = lin(attn.q_b_proj, rms(attn.q_a_layernorm, lin(attn.q_a_proj, x)))
    q = q.view(b, n, heads, nope + rope).transpose(1, 2)  # (b, h, n, 12)
    latent = lin(attn.kv_a_proj_with_mqa, x)
    kv, k_rope = latent[..., : config.kv_lora_rank], latent[..., config.kv_lora_rank :]
    kv = lin(attn.kv_b_proj, rms(attn.kv_a_layernorm, kv)).view(b, n, heads, nope + vdim).transpose(1, 2)
    k_nope = kv[..., :nope]

    inv_freq = config.rope_parameters["rope_theta"] ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    turn = torch.polar(torch.ones(n, rope // 2, dtype=torch.float64), torch.arange(n)[:, None] * inv_freq)

    def rotate(t: torch.Tensor) -> torch.Tensor:  # (..., n, rope) -> complex (..., n, rope/2)
        return torch.view_as_complex(t.contiguous().view(*t.shape[:-1], rope // 2, 2)) * turn

    q_rot = rotate(q[..., nope:])  # (b, h, n, r/2)
    k_rot = rotate(k_rope)[:, None]  # (b, 1, n, r/2)
    rope_part = (q_rot[..., :, None, :] * k_rot[..., None, :, :].conj()).real.sum(-1)
    return (q[..., :nope] @ k_nope.transpose(-2, -1) + rope_part) * (nope + rope) ** -0.5


@pytest.mark.parametrize(
    "name", ["hf-deepseek-v3-sdpa", "hf-deepseek-v3-eager", "hf-deepseek-v2-sdpa", "hf-deepseek-v2-eager"]
)
def test_mla_maxima_by_hand(name: str) -> None:
    zoo = build(name)
    model = zoo.model
    inputs: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw: inputs.append(kw.get("hidden_states", a[0] if a else None).detach()),
            with_kwargs=True,
        )
        for layer in model.model.layers
    ]
    with torch.no_grad():
        maxima = attention_logit_maxima(model, zoo.args, zoo.inputs)
    for h in hooks:
        h.remove()
    assert len(inputs) == len(maxima) == 2
    for layer, x, got in zip(model.model.layers, inputs, maxima, strict=True):
        with torch.no_grad():
            logits = _mla_logits_by_hand(layer.self_attn, x, model.config)
        want = _window_max(logits, _allowed("causal", x.shape[1], 0))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
