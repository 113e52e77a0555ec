"""Monitoring models whose attention runs in a kernel: discovery finds the call sites, the probe measures
them exactly (against the float64 reference on the q and k the kernel received), training is unchanged;
a kernel stabkit does not know never stops a run.

The kernels are the pure-PyTorch stand-ins of `tests/standins` (flash-attn, Transformer Engine) with their
real APIs and op names, Hugging Face's own flash-attention-2 code on top of them, and in-house custom ops.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from standins import installed
from standins.hf import hf_model_with_flash_standin
from standins.reference import reference_stats
from torch import nn
from torch.overrides import TorchFunctionMode

import stabkit
from stabkit.attention import kernels

torch.set_num_threads(1)
VOCAB, D, HEADS, KV = 64, 32, 4, 2


class KernelAttention(nn.Module):
    """GQA attention calling a kernel on (B, T, H, D) tensors: 'flash' (flash_attn_func), 'varlen'
    (flash_attn_varlen_func on the flattened batch, one document per row), or 'te' (a DotProductAttention)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D // HEADS * KV, bias=False)
        self.v_proj = nn.Linear(D, D // HEADS * KV, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        if kind == "te":
            from transformer_engine.pytorch import DotProductAttention

            self.core = DotProductAttention(HEADS, D // HEADS, num_gqa_groups=KV, qkv_format="bshd")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, -1)
        k = self.k_proj(x).view(b, t, KV, -1)
        v = self.v_proj(x).view(b, t, KV, -1)
        if self.kind == "flash":
            import flash_attn

            y = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(5, 0))
        elif self.kind == "varlen":
            import flash_attn

            cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
            y = flash_attn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, t, t,
                                                  causal=True).view(b, t, HEADS, -1)  # fmt: skip
        else:
            y = self.core(q, k, v)
        return self.o_proj(y.reshape(b, t, D))


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = KernelAttention(kind)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class KernelLM(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(kind), Block(kind)])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Record(TorchFunctionMode):
    """The reference's inputs: q and k (as (B, H, T, E)) and the masks of every known-kernel call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kernel = kernels.lookup(func)
        if kernel is not None:
            with torch.no_grad():
                self.calls.append(kernels.read_call(kernel, func, args, kwargs))
        return func(*args, **kwargs)


def _want(call: Any) -> float:
    pos = call.positions
    ref: dict[str, Any] = {}
    if pos is not None:
        ref = {"causal": pos.causal, "causal_align": "bottom_right", "window": pos.window or (-1, -1)}
        if pos.q_doc is not None:
            ref["cu_seqlens_q"] = ref["cu_seqlens_k"] = call.extra.get("cu")
    return float(reference_stats(call.q, call.k, scale=call.scale, **ref)["max_logit"].max())


def _train(model: nn.Module, steps: int, attached: bool) -> tuple[list[torch.Tensor], Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = stabkit.MonitorConfig.full(
        attn_sample_rows=None, attn_sample_queries=None, log_every=1, console=False
    )
    mon = stabkit.attach(model, opt, config=cfg) if attached else None
    gen = torch.Generator().manual_seed(1)
    losses, records = [], []
    for _ in range(steps):
        data = torch.randint(0, VOCAB, (2, 13), generator=gen)
        rec = Record()
        with rec:
            logits = model(data[:, :-1])
        records.append(rec)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step(loss)
        losses.append(loss.detach())
    if mon is not None:
        mon.detach()
    return losses, (mon, records)


@pytest.mark.parametrize("kind", ["flash", "varlen", "te"])
def test_kernel_attention_is_discovered_measured_exactly_and_training_unchanged(kind: str) -> None:
    with installed(), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: every call site is readable
        warnings.filterwarnings("ignore", message=".*torch.compile had compiled code")  # an earlier test's
        torch.manual_seed(0)
        bare, _ = _train(KernelLM(kind), 3, attached=False)
        torch.manual_seed(0)
        model = KernelLM(kind)
        watched, (mon, records) = _train(model, 3, attached=True)
    assert all(torch.equal(a, b) for a, b in zip(bare, watched, strict=True))
    a = mon.model_map.blocks[0].attention
    name = "transformer_engine" if kind == "te" else "flash_attn"
    assert a.impl == f"kernel:{name}" and (a.n_heads, a.n_kv_heads, a.head_dim) == (HEADS, KV, D // HEADS)
    assert (a.q, a.k) == (
        "blocks.0.attn.q_proj",
        "blocks.0.attn.k_proj",
    )  # q/k rows traced through the kernel
    last = records[-1].calls
    for i, call in enumerate(last):
        if kind == "varlen":
            call.extra["cu"] = torch.arange(0, 3 * 12, 12)
        got = mon.metrics[f"attn/blocks.{i}.attn/max_logit"]
        assert got == pytest.approx(_want(call), rel=1e-5, abs=1e-6)


def test_hugging_face_flash_attention_2_path_is_measured_packed_per_document() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    with installed():
        torch.manual_seed(0)
        model = hf_model_with_flash_standin(
            LlamaConfig, LlamaForCausalLM, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        )  # fmt: skip
        ids = torch.randint(0, VOCAB, (1, 14))
        position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8]])  # two packed documents
        cfg = stabkit.MonitorConfig.full(attn_sample_rows=None, attn_sample_queries=None, console=False)
        mon = stabkit.attach(
            model, None, config=cfg, example={"input_ids": ids, "position_ids": position_ids}
        )
        rec = Record()
        with rec:
            model(input_ids=ids, position_ids=position_ids).logits.sum().backward()
        mon.step()
        mon.detach()
    assert [a.impl for a in mon.model_map.attentions] == ["kernel:flash_attn"] * 2
    assert len(rec.calls) == 2 and all(
        c.positions is not None and c.positions.q_doc is not None for c in rec.calls
    )
    for i, call in enumerate(rec.calls):
        call.extra["cu"] = torch.tensor([0, 5, 14])
        got = mon.metrics[f"attn/model.layers.{i}.self_attn/max_logit"]
        assert got == pytest.approx(_want(call), rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------------------------------------- never stop
@torch.library.custom_op("stabkit_test::secret_attention", mutates_args=())
def secret_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An in-house attention kernel stabkit does not know."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@secret_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)


secret_attention.register_autograd(
    _backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs)
)


class SecretBlock(Block):
    def __init__(self) -> None:
        super().__init__("flash")
        attn = self.attn

        def forward(x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q = attn.q_proj(x).view(b, t, HEADS, -1).transpose(1, 2)
            k = attn.k_proj(x).view(b, t, KV, -1).transpose(1, 2).repeat_interleave(HEADS // KV, 1)
            v = attn.v_proj(x).view(b, t, KV, -1).transpose(1, 2).repeat_interleave(HEADS // KV, 1)
            y = torch.ops.stabkit_test.secret_attention(q, k, v)
            return attn.o_proj(y.transpose(1, 2).reshape(b, t, D))

        attn.forward = forward  # type: ignore[method-assign]


def _secret_lm() -> KernelLM:
    model = KernelLM("flash")
    model.blocks = nn.ModuleList([SecretBlock(), SecretBlock()])
    return model


def test_unknown_custom_op_attention_trains_to_the_end_with_the_rest_logged_and_one_warning() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, (mon, _) = _train(_secret_lm(), 4, attached=True)
    said = [
        str(w.message)
        for w in caught
        if "stabkit" in str(w.message) and "torch.compile" not in str(w.message)
    ]
    assert len(said) == 1, said
    assert "stabkit_test::secret_attention" in said[0] and "register_kernel" in said[0]
    assert len(losses) == 4 and all(torch.isfinite(x) for x in losses)
    families = {k.split("/")[0] for k in mon.metrics}
    assert {"loss", "act", "grad", "update", "logits"} <= families and "attn" not in families
    assert mon.model_map.block_paths == ["blocks.0", "blocks.1"]
    assert [a.impl for a in mon.model_map.attentions] == ["opaque", "opaque"]


def test_registering_the_unknown_kernel_measures_it() -> None:
    kernel = kernels.register_kernel("stabkit_test::secret_attention", causal=True)
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", message=".*torch.compile had compiled code")
            _, (mon, records) = _train(_secret_lm(), 2, attached=True)
        assert [a.impl for a in mon.model_map.attentions] == [f"kernel:{kernel.name}"] * 2
        for i, call in enumerate(records[-1].calls):
            want = float(reference_stats(call.q, call.k, causal=True)["max_logit"].max())
            assert mon.metrics[f"attn/blocks.{i}.attn/max_logit"] == pytest.approx(want, rel=1e-5)
    finally:
        kernels.forget_kernel(kernel.name)


def test_strict_mode_stops_at_attach_on_the_unknown_kernel() -> None:
    with pytest.raises(stabkit.DiscoveryError, match=r"secret_attention.*strict mode"):
        stabkit.attach(_secret_lm(), config=stabkit.MonitorConfig(strict=True, console=False))


class LossOnly(nn.Module):
    """Returns only its loss: the logits are the head's output that feeds it."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = KernelLM("te")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(idx)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def test_a_loss_only_model_gets_its_logits_and_a_submodule_called_first_waits_for_the_model() -> None:
    with installed():
        model = LossOnly()
        mon = stabkit.attach(model, config=stabkit.MonitorConfig(console=False, log_every=1))
        idx, tgt = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
        model.lm.wte(idx)  # a script touching a submodule first: discovery waits for the model's forward
        loss = model(idx, tgt)
        loss.backward()
        mon.step(loss)
        mon.detach()
    assert mon.model_map.logits is not None and mon.model_map.logits.path == "lm.head"
    assert mon.model_map.block_paths == ["lm.blocks.0", "lm.blocks.1"]
    assert "logits/logz_mean" in mon.metrics and "attn/lm.blocks.0.attn/max_logit" in mon.metrics
