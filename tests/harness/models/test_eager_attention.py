"""The reference GPT's eager attention path: same maths as SDPA in fp32; under fp16 autocast its
logits live in fp16 (and overflow there), unless the fp32-softmax switch keeps them in float32."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from stabkit.harness.models import GPT, GPTConfig
from stabkit.harness.models.layers import eager_attention


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("switch", [{"attention": "eager"}, {"softmax_fp32": True}])
def test_eager_path_matches_sdpa_in_fp32(n_kv: int, switch: dict[str, object]) -> None:
    torch.manual_seed(0)
    sdpa = GPT(GPTConfig(n_kv_heads=n_kv))
    eager = GPT(GPTConfig(n_kv_heads=n_kv, **switch))  # type: ignore[arg-type]
    eager.load_state_dict(sdpa.state_dict())
    assert list(dict(sdpa.named_modules())) == list(dict(eager.named_modules()))  # names are stable
    idx = torch.randint(0, 256, (3, 64))
    torch.testing.assert_close(eager(idx), sdpa(idx), rtol=0, atol=1e-5)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, n_kv, 16, 8), torch.randn(2, n_kv, 16, 8)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != 4)
    torch.testing.assert_close(eager_attention(q, k, v), ref, rtol=0, atol=1e-6)


def big_qk() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q·k = 16 · 80² = 102400 > 65504 (fp16's max) for every pair; scaled by 1/4: 25600."""
    q = torch.full((1, 2, 4, 16), 80.0)
    return q, q.clone(), torch.randn(1, 2, 4, 16)


@contextlib.contextmanager
def softmax_inputs() -> Iterator[list[torch.Tensor]]:
    """The inputs of every torch.softmax call made inside (the eager path's logits)."""
    seen: list[torch.Tensor] = []
    real = torch.softmax

    def spy(x: torch.Tensor, dim: int) -> torch.Tensor:
        seen.append(x)
        return real(x, dim=dim)

    torch.softmax = spy  # type: ignore[assignment]
    try:
        yield seen
    finally:
        torch.softmax = real  # type: ignore[assignment]


def test_eager_logits_overflow_under_fp16_autocast_and_fp32_softmax_does_not() -> None:
    q, k, v = big_qk()
    with softmax_inputs() as seen, torch.autocast("cpu", dtype=torch.float16):
        low = eager_attention(q, k, v)
        safe = eager_attention(q, k, v, fp32=True)
        fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # CPU autocast runs the matmul in fp16 and leaves the softmax in fp16 too
    assert seen[0].dtype == torch.float16 and torch.isposinf(seen[0]).any()
    assert low.isnan().all()  # softmax(inf - inf)
    assert seen[1].dtype == torch.float32 and seen[1].amax() == pytest.approx(25600.0)
    assert safe.dtype == torch.float16 and safe.isfinite().all()
    assert fused.isfinite().all()  # why SDPA on a CPU cannot show it: it accumulates in fp32
    torch.testing.assert_close(safe.float(), fused.float(), rtol=0, atol=2e-2)


def test_bf16_autocast_keeps_the_eager_logits_in_bf16() -> None:
    q, k, v = torch.randn(1, 2, 8, 16) * 30, torch.randn(1, 2, 8, 16) * 30, torch.randn(1, 2, 8, 16)
    with softmax_inputs() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        low = eager_attention(q, k, v)
        eager_attention(q, k, v, fp32=True)
    assert low.isfinite().all()  # bf16 has fp32's range: no overflow, only rounding
    assert [x.dtype for x in seen] == [torch.bfloat16, torch.float32]
    exact = (q @ k.transpose(-2, -1)) / 4.0
    causal = torch.ones(8, 8, dtype=torch.bool).tril().expand_as(exact)
    assert (seen[0].float() - exact)[causal].abs().max() > 0.1  # bf16 rounding of logits ~ 100s
    assert (seen[1] - exact)[causal].abs().max() < 1e-3


def test_model_under_fp16_autocast_overflows_only_on_the_eager_path() -> None:
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 16))
    outs = {}
    for name, switch in {"sdpa": {}, "eager": {"attention": "eager"}, "fp32": {"softmax_fp32": True}}.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(context=16, **switch))  # type: ignore[arg-type]
        with torch.no_grad():
            for block in model.blocks:  # q and k large enough that q·k > 65504
                block.attn.q_proj.weight.mul_(200.0)
                block.attn.k_proj.weight.mul_(200.0)
        with torch.autocast("cpu", dtype=torch.float16):
            outs[name] = model(idx)
    assert outs["sdpa"].isfinite().all() and outs["fp32"].isfinite().all()
    assert outs["eager"].isnan().any()


def test_config_rejects_an_unknown_attention() -> None:
    with pytest.raises(
        ValueError, match=r"GPTConfig.attention must be one of \('sdpa', 'eager'\), got 'flash'"
    ):
        GPTConfig(attention="flash")  # type: ignore[arg-type]
    assert GPTConfig(attn_softcap=30.0).attention == "sdpa"  # a cap still takes the eager path
    assert GPT(GPTConfig(attn_softcap=30.0)).blocks[0].attn.eager
