"""The standing GPU checks (`tests/device/run_checks.sh` runs them where a CUDA device is lent), each
with its CPU twin: the same assertions on the CPU, so that the checks themselves run in CI.

- real SDPA backends (flash, memory-efficient, cuDNN, math; bf16 on CUDA) and real FlexAttention,
  read at their entry points and measured, against the float64 reference that materialises the
  masked logits (`tests/standins/reference.py`);
- observation only on the device: an attached training run loses exactly what the bare run loses
  (bitwise, where the bare run repeats itself bitwise);
- compiled (Inductor) full monitoring on the device: one graph, the compiled bare loss, and the
  statistics of eager monitoring within float rounding.

Real flash-attn is checked when it is installed, and must be when ``STABKIT_EXPECT`` names it (`require`);
the CPU runs its stand-in (`tests/attention/test_kernels.py`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from standins.reference import reference_stats
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode
from zoo import reference_gpt, train_steps

import stabkit
from stabkit.attention import kernels
from stabkit.attention.measure.measure import measure
from stabkit.attention.measure.stats import HeadStats
from stabkit.attention.readers import read_sdpa

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Measure(TorchFunctionMode):
    """Measures, exactly, every known attention kernel called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: list[HeadStats] = []
        self.kernels: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kernel = kernels.lookup(func)
        if kernel is not None or func is F.scaled_dot_product_attention:
            with torch.no_grad():
                if kernel is None:  # what the attention probe reads of an SDPA call, whatever its backend
                    call = read_sdpa(args, kwargs)
                else:
                    call = kernels.read_call(kernel, func, args, kwargs)
                self.kernels.append(call.kernel)
                self.stats.append(measure(call))
        return func(*args, **kwargs)


def measured(run: Callable[[], Any]) -> _Measure:
    with kernels.install(), _Measure() as m:
        run()
    return m


def check(got: HeadStats, want: dict[str, torch.Tensor]) -> None:
    """The probe's float32 statistics of the call's (bf16) inputs against the float64 reference."""
    torch.testing.assert_close(got.max_logit.double().cpu(), want["max_logit"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.head_entropy().double().cpu(), want["entropy"], rtol=1e-5, atol=1e-5)


def qkv(device: str, dtype: torch.dtype, shape: tuple[int, ...] = (2, 4, 32, 16)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=g) * 2).to(device, dtype).requires_grad_() for _ in range(3)]


SDPA_BACKENDS = ["math", "flash", "efficient", "cudnn"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_sdpa_backend_measured_exactly(device: str, backend: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device == "cpu" and backend in ("efficient", "cudnn"):
        pytest.skip(f"{backend} attention is a CUDA backend")
    chosen = {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[backend]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = qkv(device, dtype)
    out: list[torch.Tensor] = []
    with sdpa_kernel(chosen):
        m = measured(lambda: out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    out[0].float().sum().backward()  # the backend really ran, with its backward
    (got,) = m.stats
    check(got, reference_stats(q.detach().double().cpu(), k.detach().double().cpu(), causal=True))


@pytest.mark.parametrize("device", DEVICES)
def test_flex_attention_measured_exactly(device: str) -> None:
    import torch.nn.attention.flex_attention as flex

    documents = torch.tensor([0] * 12 + [1] * 20, device=device)

    def doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return 5.0 * torch.tanh(score / 5.0)

    # FlexAttention runs no gradient on a CPU
    q, k, v = (t.detach().requires_grad_(device == "cuda") for t in qkv(device, torch.float32))
    block_mask = flex.create_block_mask(doc_causal, None, None, 32, 32, device=device, BLOCK_SIZE=16)
    m = measured(lambda: flex.flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask))
    (got,) = m.stats
    assert m.kernels == ["flex_attention"]
    cpu_mask = flex.create_block_mask(
        lambda b, h, i, j: (documents.cpu()[i] == documents.cpu()[j]) & (i >= j),
        None,
        None,
        32,
        32,
        device="cpu",
        BLOCK_SIZE=16,
    )
    want = reference_stats(
        q.detach().double().cpu(), k.detach().double().cpu(), score_mod=softcap, block_mask=cpu_mask
    )
    check(got, want)


def expected(library: str) -> bool:
    """True when the device check was told the library is installed there (``STABKIT_EXPECT``, a comma
    list, set by `tests/device/run_checks.sh` from its ``EXPECT``): then its absence fails, not skips."""
    return library in os.environ.get("STABKIT_EXPECT", "").split(",")


def require(library: str) -> Any:
    """Import `library`; skip when it is absent and not expected, fail when it is expected."""
    if expected(library):
        return importlib.import_module(library)
    return pytest.importorskip(library)


@CUDA
def test_real_flash_attn_measured_exactly() -> None:
    flash_attn = require("flash_attn")
    q, k, v = (t.transpose(1, 2).contiguous() for t in qkv("cuda", torch.bfloat16))  # (B, L, H, E)
    m = measured(lambda: flash_attn.flash_attn_func(q, k, v, causal=True))
    (got,) = m.stats
    assert m.kernels and "flash" in m.kernels[0]
    want = reference_stats(
        q.detach().double().cpu().transpose(1, 2), k.detach().double().cpu().transpose(1, 2), causal=True
    )
    check(got, want)


def _train(
    device: str, monitored: bool, steps: int = 4, backend: str | None = None
) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = reference_gpt().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = stabkit.MonitorConfig.full(console=False, audit=False, log_every=1000)
    mon = stabkit.attach(model, opt, config=config) if monitored else None
    forward = torch.compile(model, backend=backend) if backend else model
    losses = train_steps(forward, opt, mon, steps, device=device)
    rows: dict = {}
    if mon is not None:
        mon.flush()
        rows = dict(mon.history)
        mon.detach()
    return losses, rows


@pytest.mark.parametrize("device", DEVICES)
def test_attached_training_loses_what_the_bare_training_loses(device: str) -> None:
    bare, again = _train(device, False)[0], _train(device, False)[0]
    monitored, rows = _train(device, True)
    if bare == again:  # the device's kernels repeat themselves bitwise: so must the monitored run
        assert monitored == bare
    else:  # non-deterministic kernels: no further from bare than bare from itself
        spread = max(abs(a - b) for a, b in zip(bare, again, strict=True))
        assert max(abs(a - b) for a, b in zip(bare, monitored, strict=True)) <= 2 * spread
    assert any(k.startswith("attn/") for k in rows[0]) and any(k.startswith("act/") for k in rows[0])


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_full_monitoring_on_the_device(device: str) -> None:
    bare, _ = _train(device, False, backend="inductor")
    torch._dynamo.reset()
    counters.clear()
    losses, rows = _train(device, True, backend="inductor")
    graphs = int(counters["stats"].get("unique_graphs", 0))
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()  # attach after compiled code resets Dynamo, with a warning: do it here
    _, eager_rows = _train(device, True)
    assert losses == pytest.approx(bare, abs=1e-4)
    assert breaks == 0 and graphs >= 1
    assert rows.keys() == eager_rows.keys()
    for step, row in eager_rows.items():
        assert rows[step].keys() == row.keys()
        for key, value in row.items():
            assert rows[step][key] == pytest.approx(value, rel=1e-3, abs=1e-4), (step, key)


def test_an_expected_library_that_is_missing_fails_instead_of_skipping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STABKIT_EXPECT", "")
    with pytest.raises(pytest.skip.Exception):
        require("stabkit_no_such_library")
    monkeypatch.setenv("STABKIT_EXPECT", "flash_attn,stabkit_no_such_library")
    with pytest.raises(ModuleNotFoundError):
        require("stabkit_no_such_library")
