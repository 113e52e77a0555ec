"""Discovery by behaviour over the zoo: attach with no hints to third-party and odd hand-written
Transformers; every attention call is monitored and equals an independent float64 reference, the
logit statistics are the final output's, training is bitwise unchanged, and each intervention is
either verified in effect (and removed exactly) or refused for a reason listed here.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from zoo_models import ZOO, ZooModel
from zoo_models.reference import AttentionLogitRecorder

import stabkit
from stabkit.interventions import InterventionError, apply

torch.set_num_threads(1)
pytestmark = pytest.mark.zoo

NAMES = sorted(ZOO)
INTERVENTIONS = ["qk_norm", "attn_softcap", "logit_softcap", "z_loss", "norm_placement", "rmsnorm"]

EXPECTED_REFUSALS: dict[tuple[str, str], str] = {}
"""(entry-name regex, intervention) -> regex of the reason; filled in `refusal` below."""


def refusal(entry: str, intervention: str) -> str | None:
    """The reason an intervention may be refused on a zoo entry (a true reason, or None)."""
    rules = [
        # the model has the fix already
        (
            r"hf-olmo2|hf-gemma2|hf-gemma3|hf-olmoe|hf-qwen3|hf-persimmon|hf-stablelm|hf-lfm2|hf-llama4",
            "qk_norm",
            r"already has QK-norm",
        ),  # Llama 4: its RoPE layers have an L2 QK-norm (its NoPE layers do not)
        (r"xt-decoder-features", "qk_norm", r"not plain slices"),  # x-transformers' own l2 QK-norm
        (r"xt-decoder-features", "norm_placement", r"sandwich-norm already"),
        # the layer list interleaves attention and feed-forward entries: no MLP inside the attention unit
        (r"xt-|hand-interleaved", "norm_placement", r"no mlp module"),
        (r"hf-gemma2", "attn_softcap", r"soft-capped already"),
        (r"hf-gemma2", "logit_softcap", r"soft-caps its output logits already"),
        (r"hf-gemma2|hf-gemma3", "norm_placement", r"sandwich-norm already"),
        # hybrids whose Mamba layers have no MLP (Zamba 2), or whose MLP is a MoE plus a shared MLP summed
        (
            r"hf-zamba2|hf-granitemoehybrid",
            "norm_placement",
            r"block without attention .*placement is unknown|no mlp module",
        ),
        # SigLIP's pooling head: one nn.MultiheadAttention without a residual connection
        (r"hf-siglip", "norm_placement", r"needs the block's residual wiring"),
        # post-norm / output-norm blocks: sandwich needs a pre-norm block
        (
            r"hf-bert|hf-roberta|hf-distilbert|hf-electra|hf-bart|torch-transformer$|torch-decoder|torch-encoder-post"
            r"|hf-olmo2",
            "norm_placement",
            r"needs the block's residual wiring|norm already|no norm guarding",
        ),
        # attention computed inline in the block: no sub-layer module to hang a sandwich norm on
        (r"hand-inline|hand-interleaved", "norm_placement", r"inline|no mlp module|no norm guarding"),
        # rmsnorm: models with LayerNorm biases refuse unless drop_bias
        (r".*", "rmsnorm", r"bias|no nn\.LayerNorm found"),
        # bare encoders without logits
        (r".*", "z_loss", r"no final logits"),
        (r".*", "logit_softcap", r"no final logits"),
    ]
    for pattern, name, reason in rules:
        if name == intervention and re.match(pattern, entry):
            return reason
    return None


def build(name: str) -> ZooModel:
    try:
        return ZOO[name]()
    except ImportError as exc:
        pytest.skip(str(exc))


def _tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    for value in output.values() if isinstance(output, dict) else output:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise TypeError(type(output))


def _final(zoo: ZooModel, output: Any) -> torch.Tensor:
    return zoo.logits_fn(output) if zoo.logits_fn is not None else _tensor(output)


# ----------------------------------------------------------------------------------------- monitoring
@pytest.mark.parametrize("name", NAMES)
def test_attach_without_hints_monitors_every_attention_call(name: str) -> None:
    zoo = build(name)
    cfg = stabkit.MonitorConfig.full(
        attn_sample_rows=None, attn_sample_queries=None, log_every=1, console=False, audit=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = stabkit.attach(zoo.model, None, config=cfg)
        reference = AttentionLogitRecorder(True)
        with reference:
            output = zoo.forward()
        zoo.loss_fn(output).backward()
        mon.step()
        mon.detach()
    maxima = {k: v for k, v in mon.metrics.items() if k.startswith("attn/") and k.endswith("/max_logit")}
    # when stabkit can make no input for the model, discovery traced the first forward's own inputs
    # just before it ran (a second pass the reference saw too): the monitored pass is the last one
    ref = reference.maxima[-zoo.n_attention_calls :]
    assert len(reference.maxima) in (zoo.n_attention_calls, 2 * zoo.n_attention_calls)
    sites = mon.model_map.attention_paths
    assert len(maxima) == len(sites), f"call sites {sites} vs metrics {sorted(maxima)}"
    if len(sites) == zoo.n_attention_calls:  # one call per site: compare call by call
        assert sorted(maxima.values()) == pytest.approx(sorted(ref), rel=2e-5, abs=1e-5)
    assert max(maxima.values()) == pytest.approx(max(ref), rel=2e-5, abs=1e-5)
    if zoo.logits_fn is not None:
        logits = zoo.logits_fn(output).detach().float()
        assert mon.metrics["logits/max_abs"] == pytest.approx(float(logits.abs().max()), rel=1e-5)
        lse = torch.logsumexp(logits, dim=-1)
        assert mon.metrics["logits/logz_mean"] == pytest.approx(float(lse.mean()), rel=1e-4, abs=1e-5)
        assert mon.model_map.logits is not None


@pytest.mark.parametrize("name", NAMES)
def test_attaching_changes_no_bit_of_training(name: str) -> None:
    def train(attached: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        zoo = build(name)
        opt = torch.optim.AdamW(zoo.model.parameters(), lr=1e-2)
        mon = None
        if attached:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mon = stabkit.attach(
                    zoo.model, opt, config=stabkit.MonitorConfig.full(console=False, audit=False)
                )
        torch.manual_seed(1)
        losses = []
        for _ in range(2):
            loss = zoo.loss_fn(zoo.forward())
            loss.backward()
            opt.step()
            if mon is not None:
                mon.step(loss)
            opt.zero_grad()
            losses.append(loss.detach())
        if mon is not None:
            mon.detach()
        return losses, [p.detach().clone() for p in zoo.model.parameters()] + [torch.rand(3)]

    bare, watched = train(False), train(True)
    for a, b in zip(bare[0] + bare[1], watched[0] + watched[1], strict=True):
        assert torch.equal(a, b)


# -------------------------------------------------------------------------------------- interventions
_MATMULS = (
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.bmm,
    torch.baddbmm,
    torch.Tensor.baddbmm,
)
_SOFTMAXES = (F.softmax, torch.softmax, torch.Tensor.softmax)


class _Capture(TorchFunctionMode):
    """Records q and k at every SDPA call, and the operands of each product of two activations that
    (through elementwise ops) feeds a 4-d softmax: eager attention's q and k."""

    def __init__(self) -> None:
        super().__init__()
        self.qk: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.products: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keep: list[Any] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.keep.append(out)
        if func is F.scaled_dot_product_attention:
            self.qk.append((args[0].detach(), args[1].detach()))
        elif func is torch.einsum and len(args) == 3 and _keys_last(str(args[0])):
            self.products[id(out)] = (args[1].detach(), args[2].detach())  # "...id,...jd->...ij"
        elif func in _MATMULS:
            if func in (torch.baddbmm, torch.Tensor.baddbmm):  # Bloom passes batch1=q, batch2=kᵀ by keyword
                a = kwargs.get("batch1", args[1] if len(args) > 1 else None)
                b = kwargs.get("batch2", args[2] if len(args) > 2 else None)
            else:
                a, b = args[0], args[1]
            activations = not isinstance(a, nn.Parameter) and not isinstance(b, nn.Parameter)
            if isinstance(out, torch.Tensor) and out.dim() >= 3 and activations:
                self.products[id(out)] = (a.detach(), b.detach().transpose(-2, -1))
        elif func in _SOFTMAXES and isinstance(args[0], torch.Tensor):
            if args[0].dim() == 4 and id(args[0]) in self.products:
                self.qk.append(self.products[id(args[0])])
        else:  # follow the logits through any op (lists included: GPT-OSS concatenates sink columns)
            flat = [x for a in args for x in (a if isinstance(a, list | tuple) else (a,))]
            src = next((id(a) for a in flat if isinstance(a, torch.Tensor) and id(a) in self.products), None)
            if src is not None and isinstance(out, torch.Tensor):
                self.products[id(out)] = self.products[src]
        return out


def _keys_last(equation: str) -> bool:
    lhs = equation.replace(" ", "").split("->")[0].split(",")
    return len(lhs) == 2 and lhs[0][-1] == lhs[1][-1]


def _rms_per_head(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).mean(-1).sqrt()  # (..., positions)


class _CapEverything(TorchFunctionMode):
    """Reference soft cap: SDPA as math attention with cap·tanh on q·kᵀ·scale before the mask; eager
    softmax inputs capped on their unmasked entries, unless capped already before a bias (Bloom's
    ``baddbmm`` with ALiBi: the q·kᵀ part) or before a sink column (GPT-OSS's ``cat``)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap
        self.done: set[int] = set()
        self.keep: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        cap = self.cap
        if func is F.scaled_dot_product_attention:
            names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
            a = dict(zip(names, args, strict=False)) | kwargs
            q, k, v = a["query"], a["key"], a["value"]
            if a.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
                k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
                v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
            scale = a.get("scale") or 1 / math.sqrt(q.shape[-1])
            s = cap * torch.tanh((q @ k.transpose(-2, -1)) * scale / cap)
            mask = a.get("attn_mask")
            if a.get("is_causal"):
                mask = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
            if mask is not None:
                s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
            return torch.softmax(s, -1) @ v
        if func is F.multi_head_attention_forward:
            return _capped_mha(cap, args, kwargs)
        if func in (
            torch.baddbmm,
            torch.Tensor.baddbmm,
        ):  # Bloom: beta·alibi + alpha·q·kᵀ, capped before alibi
            a = dict(zip(("input", "batch1", "batch2"), args, strict=False)) | kwargs
            logits = torch.bmm(a["batch1"], a["batch2"]) * a.get("alpha", 1.0)
            out = cap * torch.tanh(logits / cap) + a["input"] * a.get("beta", 1.0)
            self.done.add(id(out))
            self.keep.append(out)
            return out
        if func is torch.cat and isinstance(args[0], list | tuple) and len(args[0]) == 2:
            x, sink = args[0]  # GPT-OSS: cat([logits + mask, sinks], -1), then a row-max shift
            square = x.dim() == 4 and x.shape[-1] == x.shape[-2] > 1  # self-attention logits, not RoPE halves
            if (
                square
                and sink.shape == (*x.shape[:-1], 1)
                and (args[1:] or [kwargs.get("dim")])[0] in (-1, 3)
            ):
                x = torch.where(x > torch.finfo(x.dtype).min / 2, cap * torch.tanh(x / cap), x)
                out = func([x, sink], *args[1:], **kwargs)
                self.done.add(id(out))
                self.keep.append(out)
                return out
        if func in (F.softmax, torch.softmax, torch.Tensor.softmax):
            x = args[0]
            if isinstance(x, torch.Tensor) and x.dim() == 4 and id(x) not in self.done:
                x = torch.where(x > torch.finfo(x.dtype).min / 2, cap * torch.tanh(x / cap), x)
                return func(x, *args[1:], **kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        flat = [x for a in args for x in (a if isinstance(a, list | tuple) else (a,))]
        if isinstance(out, torch.Tensor) and any(
            isinstance(a, torch.Tensor) and id(a) in self.done for a in flat
        ):
            self.done.add(id(out))  # capped already (before the bias, or before the sink column)
            self.keep.append(out)
        return out


_MHA = inspect.signature(F.multi_head_attention_forward)


def _capped_mha(cap: float, args: tuple, kwargs: dict) -> tuple[torch.Tensor, None]:
    """nn.MultiheadAttention's computation by hand (no bias_k/v, zero attn), with the cap on q·kᵀ·scale."""
    a = _MHA.bind(*args, **kwargs)
    a.apply_defaults()
    p = a.arguments
    query, key, value = p["query"], p["key"], p["value"]  # (L, B, E), (S, B, E)
    e, heads = query.shape[-1], p["num_heads"]
    w, b = p["in_proj_weight"], p["in_proj_bias"]
    q = F.linear(query, w[:e], b[:e] if b is not None else None)
    k = F.linear(key, w[e : 2 * e], b[e : 2 * e] if b is not None else None)
    v = F.linear(value, w[2 * e :], b[2 * e :] if b is not None else None)

    def split(x: torch.Tensor) -> torch.Tensor:  # (T, B, E) -> (B, H, T, hd)
        return x.reshape(x.shape[0], x.shape[1], heads, -1).permute(1, 2, 0, 3)

    q, k, v = split(q), split(k), split(v)
    s = cap * torch.tanh((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) / cap)
    blocked = torch.zeros(s.shape, dtype=torch.bool)
    mask, kpm = p["attn_mask"], p["key_padding_mask"]
    if p["is_causal"] and mask is None:
        blocked |= ~torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            blocked |= mask
        else:
            s = s + mask
    if kpm is not None:
        blocked |= kpm[:, None, None, :] if kpm.dtype == torch.bool else (kpm[:, None, None, :] < -1e30)
    y = torch.softmax(s.masked_fill(blocked, -math.inf), -1) @ v  # (B, H, L, hd)
    y = y.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], e)
    return F.linear(y, p["out_proj_weight"], p["out_proj_bias"]), None


def _verify(name: str, zoo: ZooModel, handle: Any, before: torch.Tensor, zoo_name: str = "") -> None:
    """The intervention `name` is in effect on `zoo.model` (each against an independent expectation)."""
    model = zoo.model
    if name == "qk_norm":
        capture = _Capture()
        with capture:
            zoo.forward()
        assert len(capture.qk) >= zoo.n_attention_calls
        for q, k in capture.qk:
            for x in (q, k):
                # gain 1 at init: every head of every position has the same RMS — 1, or the logit scale
                # when the model multiplies q by it after the projection (OPT, timm); an all-zero
                # input (a zero-initialised CLS token) stays zero under any norm
                rms = _rms_per_head(x).flatten()
                rms = rms[rms > 1e-6]
                torch.testing.assert_close(rms / rms.max(), torch.ones_like(rms), atol=1e-2, rtol=0)
    elif name == "attn_softcap":
        with torch.no_grad():
            got = _final(zoo, zoo.forward()).float()
        handle.remove()
        twin = next((zoo_name[:-6] + t for t in ("-sdpa", "-fused") if zoo_name[:-6] + t in ZOO), None)
        if zoo_name.endswith("-eager") and twin is not None:
            # eager attention may add a bias (T5's relative positions) after q·kᵀ: the cap sits before
            # it, as on the SDPA path, so the reference is the SDPA twin (same weights) capped by hand
            sdpa = build(twin)
            with torch.no_grad(), _CapEverything(OPTIONS["attn_softcap"]["cap"]):
                want = _final(sdpa, sdpa.forward()).float()
        else:
            with torch.no_grad(), _CapEverything(OPTIONS["attn_softcap"]["cap"]):
                want = _final(zoo, zoo.forward()).float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert (got - before).abs().max() > 1e-6  # the cap changed the output
    elif name == "logit_softcap":
        with torch.no_grad():
            got = _final(zoo, zoo.forward()).float()
        torch.testing.assert_close(got, 0.5 * torch.tanh(before / 0.5), rtol=1e-5, atol=1e-6)
    elif name == "z_loss":
        coef = 0.1
        zoo.loss_fn(zoo.forward()).backward()
        implicit = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        handle.remove()
        out = zoo.forward()
        (zoo.loss_fn(out) + stabkit.z_loss(_final(zoo, out), coef)).backward()
        for g, p in zip(implicit, model.parameters(), strict=True):
            if g is None:
                assert p.grad is None or not p.grad.any()
            else:
                torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
        model.zero_grad(set_to_none=True)
    elif name == "norm_placement":
        new = {id(p) for p in handle.new_parameters()}
        with torch.no_grad():
            for module in model.modules():  # zero every new output norm's output
                weight = getattr(module, "weight", None)
                if isinstance(weight, nn.Parameter) and id(weight) in new:
                    for p in module.parameters():
                        p.zero_()
                    if module(torch.randn(3, weight.shape[-1])).abs().max() > 0:  # a (1 + weight) norm
                        weight.fill_(-1.0)
        mmap = stabkit.inspect_model(model)
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        hooks = [
            model.get_submodule(b.path).register_forward_hook(
                lambda m, a, kw, o: seen.append(
                    (_first(a, kw), _tensor(o) if not isinstance(o, torch.Tensor) else o)
                ),
                with_kwargs=True,
            )
            for b in mmap.blocks
        ]
        with torch.no_grad():
            zoo.forward()
        for h in hooks:
            h.remove()
        assert seen
        for x, y in seen:  # zero output gains: every sub-layer adds 0, the block is the identity
            torch.testing.assert_close(y, x)
    elif name == "rmsnorm":
        assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())


def _first(args: tuple, kwargs: dict) -> torch.Tensor:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    raise TypeError("no tensor input")


OPTIONS = {"attn_softcap": {"cap": 0.02}, "logit_softcap": {"cap": 0.5}, "z_loss": {"coef": 0.1}}


@pytest.mark.parametrize("intervention", INTERVENTIONS)
@pytest.mark.parametrize("name", NAMES)
def test_intervention_in_effect_or_refused_for_a_true_reason(name: str, intervention: str) -> None:
    zoo = build(name)
    model = zoo.model
    with torch.no_grad():
        before = _final(zoo, zoo.forward()).float()
    keys = list(model.state_dict())
    params = list(model.parameters())
    options = OPTIONS.get(intervention, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # discovery traces this model's own inputs once (stabkit cannot guess every forward signature);
        # `apply` reuses that map while the model is unchanged
        stabkit.inspect_model(model, example=(zoo.args, zoo.inputs))
        try:
            handle = apply(model, intervention, **options)
        except InterventionError as exc:
            reason = refusal(name, intervention)
            assert reason is not None and re.search(reason, str(exc)), f"refused: {exc}"
            return
        _verify(intervention, zoo, handle, before, name)
    handle.remove()
    with torch.no_grad():
        after = _final(zoo, zoo.forward()).float()
    assert torch.equal(after, before)
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(list(model.parameters()), params, strict=True))
