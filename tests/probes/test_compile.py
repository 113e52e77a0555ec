"""Monitoring under torch.compile: no graph breaks, a fixed set of graphs, the eager numbers.

Graph counts come from ``torch._dynamo.explain`` and Dynamo's counters; the numbers are compared
under the ``aot_eager`` backend (Dynamo and AOT autograd, eager kernels: a compiled graph that runs
the same kernels as eager, so stabkit's own work is compared bit for bit in seconds). Inductor
itself — the compiled loss against a compiled bare loop — is the one slow test. Both ways of keeping
the graphs fixed are tested: the gated one graph of a CPU, and the guarded sampled/unsampled graphs
an accelerator gets (`stabkit.probes.phase`), forced here on the CPU.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from zoo import batch, forward_logits, hf_llama, lm_loss, reference_gpt, train_steps

import stabkit
import stabkit.probes.phase as phase
from stabkit.detectors import DetectConfig


class DenseMoE(nn.Module):
    """Top-2 of 4 experts computed densely (every expert on every token, weighted by the routing mask):
    a mixture Dynamo traces without a break (token dispatch by `nonzero` breaks the graph)."""

    def __init__(self, d: int, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        top = probs.topk(self.k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, top.indices, top.values)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[..., e : e + 1] * expert(x)
        return out


def dense_moe_gpt() -> nn.Module:
    """The reference GPT with `DenseMoE` MLPs (the MoE probe's opaque op, one per router)."""
    model = reference_gpt()
    for block in model.blocks:  # type: ignore[union-attr]
        block.mlp = DenseMoE(model.config.d_model)  # type: ignore[union-attr]
    return model


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "reference": reference_gpt,
    "hf_llama": hf_llama,
    "dense_moe": dense_moe_gpt,
}


@pytest.fixture(autouse=True)
def clean_dynamo(fresh_dynamo: None) -> Iterator[None]:
    """Each test starts and ends with no compiled code and empty counters (attach would warn), and
    with the phase's default gating."""
    yield
    phase.GATED = None


@pytest.fixture(params=[True, False], ids=["gated", "guarded"])
def gated(request: pytest.FixtureRequest) -> bool:
    phase.GATED = request.param
    return bool(request.param)


def config(name: str, **overrides: Any) -> stabkit.MonitorConfig:
    base: dict[str, Any] = dict(console=False, audit=False, log_every=1000)
    base.update(overrides)
    if name == "full":
        return stabkit.MonitorConfig.full(**base)
    return stabkit.MonitorConfig(**{"every": 2, **base})


def stabkit_ops(graphs: list[Any]) -> int:
    """How many stabkit ops the explained graphs call."""
    return sum(
        1
        for g in graphs
        for node in g.graph.nodes
        if node.op == "call_function"
        and "stabkit" in str(getattr(node.target, "__module__", "")) + str(node.target)
    )


@pytest.mark.parametrize(
    ("family", "name", "gated"),
    [
        ("reference", "default", True),
        ("reference", "full", True),
        ("hf_llama", "default", True),
        ("hf_llama", "full", True),
        ("reference", "default", False),
        ("dense_moe", "default", True),
    ],
    indirect=["gated"],
)
def test_one_graph_no_break_on_sampled_and_unsampled_steps(family: str, name: str, gated: bool) -> None:
    torch.manual_seed(0)
    model = BUILDERS[family]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(model, opt, config=config(name))
    ops = []
    for step in range(2):  # default: step 0 sampled, step 1 not; full: both sampled
        x, y = batch(step)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
        ops.append(stabkit_ops(explained.graphs))
        lm_loss(forward_logits(model, x), y).backward()
        opt.step()
        mon.step()
        opt.zero_grad()
    mon.detach()
    assert ops[0] > 0  # the statistics are in the graph
    if not gated and name == "default":
        assert ops[1] == 0  # the unsampled graph is the bare model's (and the output check)
    else:
        assert ops[1] == ops[0]  # one graph: the ops decide at run time


def train(
    family: str,
    cfg: stabkit.MonitorConfig,
    steps: int,
    backend: str | None,
    micro_batches: int = 1,
    monitored: bool = True,
) -> tuple[list[float], dict[int, dict[str, float]], list[int]]:
    """(losses, logged rows, Dynamo's unique-graph count after each step) of a short run."""
    torch.manual_seed(0)
    model = BUILDERS[family]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = stabkit.attach(model, opt, config=cfg) if monitored else None
    forward = torch.compile(model, backend=backend) if backend else model
    losses, graphs = [], []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(micro_batches):
            x, y = batch(step * micro_batches + m)
            loss = lm_loss(forward_logits(forward, x), y) / micro_batches
            loss.backward()
            total = total + loss.detach()
        opt.step()
        if mon is not None:
            mon.step(total)
        opt.zero_grad()
        losses.append(float(total))
        graphs.append(int(counters["stats"].get("unique_graphs", 0)))
    rows: dict[int, dict[str, float]] = {}
    if mon is not None:
        mon.flush()
        rows = dict(mon.history)
        mon.detach()
    return losses, rows, graphs


def assert_same_rows(
    compiled: dict[int, dict[str, float]], eager: dict[int, dict[str, float]], rel: float
) -> None:
    assert compiled.keys() == eager.keys()
    for step, row in eager.items():
        assert compiled[step].keys() == row.keys(), (step, compiled[step].keys() ^ row.keys())
        for key, value in row.items():
            got = compiled[step][key]
            if math.isnan(value):
                assert math.isnan(got), (step, key)
            else:
                assert got == pytest.approx(value, rel=rel, abs=1e-12), (step, key, got, value)


@pytest.mark.parametrize(
    ("family", "name", "micro_batches", "gated"),
    [
        ("reference", "default", 3, True),
        ("reference", "full", 1, True),
        ("hf_llama", "default", 1, True),
        ("reference", "default", 2, False),
        ("dense_moe", "default", 2, True),
        ("dense_moe", "default", 1, False),
    ],
    indirect=["gated"],
)
def test_compiled_statistics_equal_eager(family: str, name: str, micro_batches: int, gated: bool) -> None:
    cfg = config(name, attn_per_head=name == "full")
    steps = 3
    eager_losses, eager_rows, _ = train(family, cfg, steps, None, micro_batches)
    losses, rows, graphs = train(family, cfg, steps, "aot_eager", micro_batches)
    assert losses == eager_losses  # observation only: the training is bit for bit the same
    assert any(k.startswith("attn/") for k in rows[0]) and any(k.startswith("act/") for k in rows[0])
    assert family != "dense_moe" or "moe/blocks.1.mlp/max_vio" in rows[0]
    assert_same_rows(rows, eager_rows, rel=1e-6)
    assert graphs[-1] == graphs[1]  # no graph after the first sampling cycle (every 2)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "guarded"], indirect=True)
def test_whole_model_cadence_compiled_equals_eager_in_the_same_graphs(gated: bool) -> None:
    """`deep_every` (4, every 2): the outlier statistics on steps 0, 4, 8 only, equal to eager's; the
    gated graph asks its op with that cadence, the guarded sampled graph serves both kinds of sampled
    step (no graph after the first sampling cycle)."""
    cfg = config("default", deep_every=4)
    eager_losses, eager_rows, _ = train("reference", cfg, 9, None)
    losses, rows, graphs = train("reference", cfg, 9, "aot_eager")
    assert losses == eager_losses
    assert [s for s, row in rows.items() if "act/blocks.0/massive_ratio" in row] == [0, 4, 8]
    assert [s for s, row in rows.items() if "act/blocks.0/rms" in row] == [0, 2, 4, 6, 8]
    assert_same_rows(rows, eager_rows, rel=1e-6)
    assert graphs[-1] == graphs[1]


def test_no_recompile_over_sampling_cycles(gated: bool) -> None:
    """Two cadences (every 3, attention every 2) and gradient accumulation: the set of graphs is
    complete after the first cycle (6 steps) and nothing recompiles over the next one."""
    cfg = config("default", every=3, attn_every=2)
    _, rows, graphs = train("reference", cfg, 12, "eager", micro_batches=2)
    after_warm_up = graphs[5]
    assert graphs[-1] == after_warm_up
    # gated: one graph per micro-batch position (the first, the later ones); guarded: also per phase
    assert after_warm_up == (2 if gated else 8)
    assert "attn/blocks.0.attn/max_logit" in rows[4] and "act/blocks.0/rms" not in rows[4]
    assert "act/blocks.0/rms" in rows[3] and "attn/blocks.0.attn/max_logit" not in rows[3]
    assert "act/blocks.0/rms" not in rows[1] and "attn/blocks.0.attn/max_logit" not in rows[1]


def test_fault_under_compile_is_named_by_module() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detect = DetectConfig(actions={"nonfinite": "skip"})
    mon = stabkit.attach(model, opt, config=config("default", detect=detect))
    fault = {"on": False}
    model.blocks[1].mlp.fc.register_forward_hook(lambda m, a, out: out * math.nan if fault["on"] else None)
    forward = torch.compile(model, backend="aot_eager")
    train_steps(forward, opt, mon, 4, before_step=lambda step: fault.update(on=step == 2))
    fault["on"] = False
    [event] = mon.events
    assert (event.step, event.kind, event.where, event.details["pass"]) == (
        2,
        "nonfinite",
        "blocks.1.mlp.fc",
        "forward",
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the step was skipped
    mon.detach()


class Opaque(nn.Module):
    """Attention whose logits no probe can read (a hand-written kernel stabkit does not know)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).tanh()


def test_a_probe_warning_under_compile_comes_at_the_step_without_a_break() -> None:
    torch.manual_seed(0)
    model = reference_gpt(n_layers=1)
    mon = stabkit.attach(model, config=config("default", detect=None))
    model.blocks[0].attn.forward = Opaque(32).forward  # type: ignore[method-assign]
    x, _ = batch(0)
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    with pytest.warns(RuntimeWarning, match="attention logits of 'blocks.0.attn'"):
        mon.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon.step()  # said once
    mon.detach()


@pytest.mark.slow
def test_inductor_training_unchanged_and_statistics_close() -> None:
    """Inductor: compiled monitored loss within 1e-5 of compiled bare, statistics within float
    rounding of eager monitoring (Inductor's own kernels reorder the model's float sums: its losses
    already differ from eager in the last bits, bare or monitored)."""
    cfg = config("default")
    bare, _, _ = train("reference", cfg, 4, "inductor", monitored=False)
    torch._dynamo.reset()
    counters.clear()
    losses, rows, graphs = train("reference", cfg, 4, "inductor")
    _, eager_rows, _ = train("reference", cfg, 4, None)
    assert losses == pytest.approx(bare, abs=1e-5)
    assert graphs == [1, 1, 1, 1]
    assert_same_rows(rows, eager_rows, rel=1e-4)


def test_a_traced_statistic_that_fails_warns_once_and_training_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Full monitoring traces the outlier statistics into the graph: when they cannot be computed for
    a model's block outputs, the probe warns once, stops, and the compiled training and the other
    statistics go on."""
    import stabkit.probes.outliers as outlier_probe

    def unreadable(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a block output these statistics cannot read")

    monkeypatch.setattr(outlier_probe, "outlier_values", unreadable)
    torch.manual_seed(0)
    model = reference_gpt(n_layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = stabkit.attach(model, opt, config=config("full", detect=None))
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(RuntimeWarning, match="probe 'outliers' failed") as caught:
        losses = train_steps(compiled, opt, mon, 3)
    assert sum("probe 'outliers' failed" in str(w.message) for w in caught) == 1
    mon.flush()
    row = dict(mon.history)[2]
    assert all(math.isfinite(v) for v in losses)
    assert any(k.endswith("/rms") for k in row) and not any("massive" in k for k in row)
    mon.detach()
