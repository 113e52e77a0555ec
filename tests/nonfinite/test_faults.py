"""Fault injection: NaN/Inf put into one module's output, one module's gradient or the optimizer state
at a random step must yield an event at that step naming the module and the pass.

20 seeded trials per pass per model (reference GPT, HF LLaMA), run in one training loop per model
to stay fast; the `skip` action keeps the weights clean between trials, and the test repairs the
optimizer state itself after each optimizer trial.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, forward_logits, hf_llama, lm_loss, reference_gpt

import stabkit
from stabkit.detectors import DetectConfig
from stabkit.nonfinite.watch import NonfiniteWatch
from stabkit.stats.finite import floating_tensors

TRIALS = 20
VALUES = (float("nan"), float("inf"))


def poisoned(t: torch.Tensor, value: float, k: int) -> torch.Tensor:
    """`t` with element k (mod numel) replaced by `value`, out of place (autograd keeps working)."""
    mask = torch.zeros(t.numel(), dtype=torch.bool, device=t.device)
    mask[k % t.numel()] = True
    return torch.where(mask.view(t.shape), torch.full_like(t, value), t)


def poison_output(output: Any, value: float, k: int) -> Any:
    """Replace one element of the first floating tensor in a module output (tensor, tuple, ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return poisoned(output, value, k)
    if isinstance(output, tuple):
        items = list(output)
        i = next(i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.is_floating_point())
        items[i] = poisoned(items[i], value, k)
        return tuple(items)
    key = next(key for key, t in output.items() if isinstance(t, torch.Tensor) and t.is_floating_point())
    output[key] = poisoned(output[key], value, k)
    return output


class Rig:
    """One model trained step by step with the detectors on (nonfinite -> skip: decided per step)."""

    def __init__(self, build: Callable[[], nn.Module], **nonfinite: Any) -> None:
        torch.manual_seed(0)
        self.model = build()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.modules = dict(self.model.named_modules())
        self.forward_sites, self.grad_sites = self._candidates()
        detect_cfg = DetectConfig(actions={"nonfinite": "skip"}, options={"nonfinite": nonfinite})
        self.mon = stabkit.attach(
            self.model,
            self.opt,
            config=stabkit.MonitorConfig(console=False, log_every=10_000, detect=detect_cfg),
        )
        self.handle = self.mon.detectors  # installed by attach from MonitorConfig.detect

    def step(self, before_update: Callable[[], None] | None = None) -> int:
        s = self.mon.global_step
        x, y = batch(s)
        loss = lm_loss(forward_logits(self.model, x), y)
        loss.backward()
        if before_update is not None:
            before_update()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.mon.step(loss)
        return s

    def _candidates(self) -> tuple[list[str], list[str]]:
        """Modules whose forward yields a floating output, and modules whose grad_input holds a tensor."""
        fwd: set[str] = set()
        bwd: set[str] = set()
        handles = []
        for path, mod in self.modules.items():

            def f(m: nn.Module, a: Any, out: Any, path: str = path) -> None:
                if floating_tensors(out):
                    fwd.add(path)

            def b(m: nn.Module, gi: Any, go: Any, path: str = path) -> None:
                if any(g is not None for g in gi):
                    bwd.add(path)

            handles += [mod.register_forward_hook(f), mod.register_full_backward_hook(b)]
        with quiet():
            x, y = batch(999)
            lm_loss(forward_logits(self.model, x), y).backward()
        for h in handles:
            h.remove()
        self.model.zero_grad(set_to_none=True)
        return sorted(fwd), sorted(bwd)

    def events_at(self, step: int) -> list[stabkit.Event]:
        return [e for e in self.mon.events if e.step == step and e.kind == "nonfinite"]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hide PyTorch's notes about full backward hooks on modules with dict outputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run_trial(rig: Rig, kind: str, rng: random.Random) -> tuple[int, tuple[str, str, str]]:
    """Inject one fault of `kind` after 1-3 clean steps; (injected step, expected (module, pass, tensor))."""
    for _ in range(rng.randint(1, 3)):
        rig.step()
    s = rig.mon.global_step
    value, k = rng.choice(VALUES), rng.randrange(1 << 20)
    mon = rig.mon
    if kind == "forward":
        path = rng.choice(rig.forward_sites)

        def hook(m: nn.Module, a: Any, out: Any) -> Any:
            return poison_output(out, value, k) if mon.global_step == s else None

        handle = rig.modules[path].register_forward_hook(hook)
        with quiet():
            rig.step()
        handle.remove()
        return s, (path, "forward", "output")
    if kind == "grad_input":
        path = rng.choice(rig.grad_sites)

        def bhook(m: nn.Module, gi: Any, go: Any) -> Any:
            if mon.global_step != s:
                return None
            i = next(i for i, g in enumerate(gi) if g is not None)
            return tuple(poisoned(g, value, k) if j == i else g for j, g in enumerate(gi))

        handle = rig.modules[path].register_full_backward_hook(bhook)
        with quiet():
            rig.step()
        handle.remove()
        return s, (path, "backward", "grad_input")
    if kind == "param_grad":
        name, p = rng.choice(list(rig.model.named_parameters()))
        handle = p.register_hook(lambda g: poisoned(g, value, k) if mon.global_step == s else None)
        with quiet():
            rig.step()
        handle.remove()
        return s, (name.rsplit(".", 1)[0], "backward", f"grad of {name}")
    # optimizer state: poison one element of exp_avg or exp_avg_sq just before the update, repair after
    name, p = rng.choice(list(rig.model.named_parameters()))
    key = rng.choice(("exp_avg", "exp_avg_sq"))
    saved_p = p.detach().clone()
    saved_state = {kk: v.clone() for kk, v in rig.opt.state[p].items()}

    def poison_state() -> None:
        with torch.no_grad():
            rig.opt.state[p][key].view(-1)[k % p.numel()] = value

    rig.step(before_update=poison_state)
    with torch.no_grad():
        p.copy_(saved_p)
        for kk, v in saved_state.items():
            rig.opt.state[p][kk].copy_(v)
    return s, (name.rsplit(".", 1)[0], "optimizer", f"optimizer state {key} of {name}")


@pytest.mark.parametrize("family", ["reference", "hf_llama"])
@pytest.mark.parametrize("kind", ["forward", "backward", "optimizer"])
def test_injected_fault_is_localized(family: str, kind: str, rigs: dict[str, Rig]) -> None:
    rig = rigs[family]
    rng = random.Random(f"{family}-{kind}")
    misses = []
    for _ in range(TRIALS):
        sub = rng.choice(["grad_input", "param_grad"]) if kind == "backward" else kind
        step, (module, pass_, tensor) = run_trial(rig, sub, rng)
        events = rig.events_at(step)
        got = [(e.details.get("module"), e.details.get("pass"), e.details.get("tensor")) for e in events]
        if got != [(module, pass_, tensor)]:
            misses.append(f"step {step}: injected {(module, pass_, tensor)}, got {got}")
        assert all(e.advice for e in events)
    assert not misses, "\n".join(misses)


@pytest.fixture(scope="module")
def rigs() -> dict[str, Rig]:
    return {"reference": Rig(reference_gpt), "hf_llama": Rig(hf_llama)}


def test_backward_replay_with_a_loss_closure_instead_of_a_kept_gradient() -> None:
    targets: dict[str, torch.Tensor] = {}
    rig = Rig(reference_gpt, loss_fn=lambda out, idx: lm_loss(out, targets["y"]))
    watch = rig.handle.devices["nonfinite"]  # the device part of the kind (the detectors' extension point)
    assert isinstance(watch, NonfiniteWatch) and not watch.guard.keep_grad  # nothing output-sized is kept
    rig.step()
    s = rig.mon.global_step
    targets["y"] = batch(s)[1]
    poison = rig.modules["blocks.1.mlp"].register_full_backward_hook(
        lambda m, gi, go: (gi[0] * math.nan,) if rig.mon.global_step == s else None
    )
    with quiet():
        rig.step()
    poison.remove()
    [event] = rig.events_at(s)
    assert (event.where, event.details["pass"], event.details["tensor"]) == (
        "blocks.1.mlp",
        "backward",
        "grad_input",
    )


def test_the_faulty_micro_batch_of_an_accumulated_step_is_named() -> None:
    rig = Rig(reference_gpt)
    bad_ids = batch(1234)[0]
    rig.modules["tok_emb"].register_forward_hook(
        lambda m, args, out: out * math.nan if torch.equal(args[0], bad_ids) else None
    )
    s = rig.mon.global_step
    for ids in (batch(5)[0], bad_ids):  # two micro-batches, the second one poisoned
        lm_loss(rig.model(ids), batch(6)[1]).backward()
    rig.opt.step()
    rig.opt.zero_grad()
    rig.mon.step()
    [event] = rig.events_at(s)
    assert (event.where, event.details["pass"], event.details["micro_batch"]) == ("tok_emb", "forward", 1)


def test_non_finite_inputs_and_loss_are_told_apart_from_the_model() -> None:
    torch.manual_seed(0)
    model = hf_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(console=False, detect=None))
    mon.install_detectors(DetectConfig(actions={"nonfinite": "skip"}))
    for step in range(3):
        x, y = batch(step)
        embeds = model.model.embed_tokens(x).detach()
        if step == 1:
            embeds[0, 3, 5] = math.nan  # the data is broken, not the model
        loss = lm_loss(model(inputs_embeds=embeds).logits, y)
        if step == 2:
            loss = loss * math.inf  # the loss code is broken: the model output stays finite
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss)
    found = {e.step: (e.where, e.details["pass"]) for e in mon.events}
    assert found == {1: ("(input)", "input"), 2: ("(loss)", "loss")}
