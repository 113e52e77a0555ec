"""The model families of the healthy-run corpus, built the way their users build them (no download):
the reference GPT (`stabkit.harness.models`), Hugging Face GPT-2, Llama (GQA) and the mixtures of experts
Qwen2-MoE (top-2 of 4, a shared expert), Mixtral (top-2 of 8) and OLMoE (top-4 of 16) from their config
classes at tiny sizes, `nn.TransformerEncoder` with a causal mask, and `TinyGPT`, a small pre-norm GPT
written here with PyTorch's default init (what a user's own script looks like).

The MoE models train as real runs do, with a balancing loss on: they return their router logits
(``output_router_logits=True``) and the loop adds the Switch / GShard loss E·Σ f_e·P_e of *each layer*
(`balancing_loss`), times 1e-2 (`MOE_AUX_COEF`: Switch Transformer's, OLMoE's), summed over the layers
as Megatron-LM and DeepSeek do. Not Hugging Face's own ``aux_loss``: it pools the layers' tokens into
one global balance, which hides a layer that collapses (Qwen3 #1418) — trained with it (1e-2), tiny
Mixtral / Qwen2-MoE / OLMoE runs of this corpus collapsed or starved experts in one layer while the
pooled balance held (`expert_collapse` and `dead_experts` found them: top-2 of 8 at MaxVio 2.9 of 3).

Each builder runs once per corpus run, before `stabkit.attach`; `outputs_of(model, idx)` is the forward
the training loop calls every step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES: tuple[str, ...] = (
    "ref_gpt", "tiny_gpt", "torch_encoder", "hf_gpt2", "hf_llama", "hf_qwen2_moe", "hf_mixtral", "hf_olmoe",
)  # fmt: skip
"""Family names a `HealthyConfig` may use."""

MOE_FAMILIES: tuple[str, ...] = ("hf_qwen2_moe", "hf_mixtral", "hf_olmoe")
"""The mixture-of-experts families (each trains with its balancing loss on)."""

MOE_AUX_COEF = 1e-2
"""The balancing loss's coefficient in the MoE families' training loss (Switch Transformer, OLMoE: 1e-2)."""


class TinyBlock(nn.Module):
    """A pre-norm block (or post-norm / sandwich): causal SDPA attention and a GELU MLP."""

    def __init__(self, d: int, heads: int, placement: str) -> None:
        super().__init__()
        self.heads, self.placement = heads, placement
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln_a = nn.LayerNorm(d) if placement == "sandwich" else None
        self.ln_m = nn.LayerNorm(d) if placement == "sandwich" else None

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.out(y.transpose(1, 2).reshape(b, t, d))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.placement == "post":
            x = self.ln1(x + self.attn(x))
            return self.ln2(x + self.mlp(x))
        a = self.attn(self.ln1(x))
        x = x + (self.ln_a(a) if self.ln_a is not None else a)
        m = self.mlp(self.ln2(x))
        return x + (self.ln_m(m) if self.ln_m is not None else m)


class TinyGPT(nn.Module):
    """A small GPT as a user writes it: embeddings, blocks, final LayerNorm, head; PyTorch default init."""

    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int, placement: str) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(TinyBlock(d, heads, placement) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class EncoderLM(nn.Module):
    """`nn.TransformerEncoder` as a causal language model: embedding, encoder with a causal mask, head."""

    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int, placement: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=placement == "pre"
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.emb(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def build_model(
    family: str, vocab: int, context: int, d: int, layers: int, heads: int, kv_heads: int, placement: str
) -> nn.Module:
    """A fresh model of `family` (seed the global RNG first: the init draws from it)."""
    if family == "ref_gpt":
        from ..models import GPT, GPTConfig

        cfg = GPTConfig(
            vocab_size=vocab, context=context, d_model=d, n_layers=layers, n_heads=heads,
            n_kv_heads=kv_heads if kv_heads != heads else None, norm_placement=placement,  # type: ignore[arg-type]
        )  # fmt: skip
        return GPT(cfg)
    if family == "tiny_gpt":
        return TinyGPT(vocab, context, d, layers, heads, placement)
    if family == "torch_encoder":
        return EncoderLM(vocab, context, d, layers, heads, placement)
    if family.startswith("hf_"):
        return _hf_model(family, vocab, context, d, layers, heads, kv_heads)
    raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")


def _hf_model(
    family: str, vocab: int, context: int, d: int, layers: int, heads: int, kv_heads: int
) -> nn.Module:
    import transformers as tf

    common: dict[str, Any] = {"vocab_size": vocab, "tie_word_embeddings": False}
    model: nn.Module
    cfg: Any
    if family == "hf_gpt2":
        cfg = tf.GPT2Config(
            n_embd=d, n_layer=layers, n_head=heads, n_positions=context,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )  # fmt: skip
        model = tf.GPT2LMHeadModel(cfg)
    elif family == "hf_llama":
        cfg = tf.LlamaConfig(
            hidden_size=d, intermediate_size=_ff(d), num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, max_position_embeddings=context, **common,
        )  # fmt: skip
        model = tf.LlamaForCausalLM(cfg)
    elif family in MOE_FAMILIES:
        model = _hf_moe(family, d, layers, heads, kv_heads, context, common)
        cfg = model.config
    else:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    cfg.use_cache = False
    return model


def _hf_moe(
    family: str, d: int, layers: int, heads: int, kv_heads: int, context: int, common: dict[str, Any]
) -> nn.Module:
    import transformers as tf

    shape: dict[str, Any] = {
        "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": context,
        "output_router_logits": True, **common,
    }  # fmt: skip
    cfg: Any
    if family == "hf_qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            intermediate_size=_ff(d), moe_intermediate_size=d, shared_expert_intermediate_size=_ff(d),
            num_experts=4, num_experts_per_tok=2, **shape,
        )  # fmt: skip
        return tf.Qwen2MoeForCausalLM(cfg)
    if family == "hf_mixtral":
        cfg = tf.MixtralConfig(intermediate_size=d, num_local_experts=8, num_experts_per_tok=2, **shape)
        return tf.MixtralForCausalLM(cfg)
    cfg = tf.OlmoeConfig(intermediate_size=d // 2, num_experts=16, num_experts_per_tok=4, **shape)
    return tf.OlmoeForCausalLM(cfg)


def _ff(d: int) -> int:
    """SwiGLU hidden width ≈ 8/3·d, a multiple of 8."""
    return int(math.ceil(8 * d / 3 / 8) * 8)


def outputs_of(model: nn.Module, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the (B, T, V) logits, the balancing loss times `MOE_AUX_COEF` — None for a dense model) of any
    corpus model: what the training loop adds to its cross-entropy."""
    out = model(idx)
    if isinstance(out, torch.Tensor):
        return out, None
    routers = getattr(out, "router_logits", None)
    if not routers:
        return out.logits, None
    k = int(getattr(model, "config").num_experts_per_tok)  # noqa: B009 (an HF model's config)
    total = torch.stack([balancing_loss(r, k) for r in routers]).sum()
    return out.logits, MOE_AUX_COEF * total


def balancing_loss(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of one layer: E·Σ_e f_e·P_e, with f_e the share of the
    layer's top-k choices that went to expert e and P_e its mean router probability (1 when balanced)."""
    logits = router_logits.float().reshape(-1, router_logits.shape[-1])  # (T, E)
    n = logits.shape[-1]
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, dim=-1).indices  # (T, k)
    share = torch.zeros(n, device=logits.device).index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
    return n * (share / chosen.numel() * probs.mean(0)).sum()
