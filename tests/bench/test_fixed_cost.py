"""`stabkit bench` shows the fixed cost: milliseconds added per sampled and per unsampled step, a
paired (step by step) mode, the small-step preset, and which machine and thread count measured it.
Nothing here asserts a timing: the figures' arithmetic is checked on made-up step times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from stabkit.bench import BenchConfig, format_table, run_bench
from stabkit.bench.fixed_cost import added_ms
from stabkit.bench.machine import describe, line
from stabkit.bench.presets import size_batch, size_config
from stabkit.bench.runner import BenchResult, VariantResult, batch_size, model_config
from stabkit.cli import main


def _result(bare: list[list[float]], mine: list[list[float]], flags: list[list[bool]]) -> BenchResult:
    variants = {
        "bare": VariantResult(
            "bare", step_times=[1.0] * len(bare), cpu_times=[1.0] * len(bare), step_cpu=bare
        ),
        "default": VariantResult(
            "default",
            step_times=[1.0] * len(bare),
            cpu_times=[1.0] * len(bare),
            monitored=True,
            step_cpu=mine,
            step_sampled=flags,
        ),
    }
    cfg = {"device": "cpu", "size": "small-step", "steps": 4, "repeats": len(bare), "bf16": False}
    return BenchResult(config=cfg, variants=variants, model_bytes=1)


def test_added_ms_pairs_each_step_with_bare_and_splits_sampled_from_unsampled() -> None:
    bare = [[0.050, 0.050, 0.050, 0.050], [0.060, 0.060, 0.060, 0.060]]
    mine = [[0.060, 0.0505, 0.0505, 0.0505], [0.072, 0.0607, 0.0607, 0.0607]]
    flags = [[True, False, False, False]] * 2
    added = added_ms(_result(bare, mine, flags), "default")
    sampled, unsampled = added["sampled"], added["unsampled"]
    assert sampled is not None and unsampled is not None
    assert sampled.ms == pytest.approx(11.0)  # median of the rounds' +10 and +12 ms
    assert sampled.noise == pytest.approx(1.0)
    assert sampled.steps == 2
    assert unsampled.ms == pytest.approx(0.6)  # +0.5 and +0.7 ms
    assert unsampled.noise == pytest.approx(0.1)
    assert unsampled.steps == 6
    assert unsampled.text() == "+0.60±0.10"


def test_added_ms_is_none_without_a_monitor_or_a_kind_never_run() -> None:
    bare = [[0.05, 0.05]]
    result = _result(bare, [[0.051, 0.051]], [[False, False]])
    assert added_ms(result, "bare") == {"sampled": None, "unsampled": None}
    added = added_ms(result, "default")
    assert added["sampled"] is None and added["unsampled"] is not None
    assert added["unsampled"].noise is None  # one round: no band


def test_small_step_preset_is_small_on_512_tokens_with_rope_and_dropout() -> None:
    cfg = size_config("small-step")
    small = size_config("small")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads) == (small.d_model, small.n_layers, small.n_heads)
    assert cfg.context * size_batch("small-step") == 512
    assert cfg.positions == "rope" and cfg.dropout > 0
    bench = BenchConfig(size="small-step", d_model=256)
    assert model_config(bench).d_model == 256 and model_config(bench).context == 64
    assert batch_size(bench) == 8
    with pytest.raises(ValueError, match="unknown size"):
        BenchConfig(size="medium")


def test_machine_line_names_the_platform_cpu_and_threads() -> None:
    info = describe("cpu")
    assert info["threads"] == torch.get_num_threads()
    text = line({**info, "threads": 1})
    assert text.startswith("machine: ") and "1 thread" in text and str(info["cpu"]) in text


def test_a_paired_run_takes_turns_step_by_step_and_reports_the_fixed_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import stabkit.bench.runner as runner

    order: list[tuple[str, int]] = []
    real = runner._timed_block

    def spy(cfg: BenchConfig, tr: object, result: VariantResult, steps: int) -> tuple[float, float]:
        order.append((result.name, steps))
        return real(cfg, tr, result, steps)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "_timed_block", spy)
    torch.set_num_threads(1)
    cfg = BenchConfig(size="tiny", steps=4, repeats=2, warmup=1, variants=("bare", "every100"), paired=True)
    result = run_bench(cfg)
    assert all(steps == 1 for _, steps in order)  # slices of one step
    assert [name for name, _ in order[:4]] == ["bare", "every100", "bare", "every100"]
    v = result.variants["every100"]
    assert [len(r) for r in v.step_cpu] == [4, 4] and [len(r) for r in result.variants["bare"].step_cpu] == [
        4,
        4,
    ]
    assert not any(any(r) for r in v.step_sampled)  # every=100: steps 1..8 are unsampled
    assert added_ms(result, "every100")["unsampled"] is not None
    table = format_table(result)
    assert "paired" in table.splitlines()[0]
    assert table.splitlines()[1].startswith("machine: ") and "1 thread" in table.splitlines()[1]
    assert "+ms sampled" in table and "+ms unsampled" in table
    assert "(<= 1.01x)" in table  # every100's budget
    row = result.to_dict()["variants"]["every100"]
    assert row["added_ms_sampled"] is None and isinstance(row["added_ms_unsampled"], float)


def test_full_is_budgeted_from_d256_on_eager_and_reported_below() -> None:
    bare = [[0.05]]
    result = _result(bare, [[0.06]], [[True]])
    result.variants["full"] = result.variants.pop("default")
    result.variants["full"].name = "full"
    assert "(<= 1.12x)" not in format_table(result)
    assert "reported, not budgeted" in format_table(result)
    result.config["d_model"] = 256
    assert "(<= 1.12x)" in format_table(result)


def test_in_hook_timer_names_stabkits_entry_points_per_kind_of_step() -> None:
    from stabkit.bench.inhook import measure

    torch.set_num_threads(1)
    inside = measure(BenchConfig(size="tiny", warmup=2), "default")
    assert inside.sampled_ms is not None and inside.unsampled_ms is not None
    assert inside.sampled_ms > inside.unsampled_ms > 0  # per-layer statistics on the sampled steps
    for entry in ("GradProbe._after_backward", "Monitor.step", "Decisions.pre_update"):
        assert entry in inside.top
    assert list(inside.top.values()) == sorted(inside.top.values(), reverse=True)
    assert inside.text("default").startswith("in stabkit, default: ")
    # the sampled median is a reading, not six steps: the timer goes on to SAMPLED of them
    from stabkit.bench.inhook import SAMPLED, STEPS

    assert inside.sampled_steps == SAMPLED and inside.unsampled_steps >= STEPS - SAMPLED
    assert f"per sampled step (median of {SAMPLED})" in inside.text("default")
    assert f"per unsampled step (median of {inside.unsampled_steps})" in inside.text("default")


def test_in_hook_times_the_log_intervals_flush_apart() -> None:
    """The flush is one step in `log_every`: a median over steps never shows it, so it is timed
    apart — inside the timed window (default: a flush at step 50 of 60) or on the way to the next
    log interval (every100: past the window), never detach's own flush."""
    from stabkit.bench.inhook import STEPS, measure

    torch.set_num_threads(1)
    for variant, log_every in (("default", 50), ("every100", 100)):
        inside = measure(BenchConfig(size="tiny", warmup=2), variant)
        assert inside.log_every == log_every
        assert inside.flush_ms is not None and inside.flush_ms > 0
        text = inside.text(variant)
        assert f"log interval: {inside.flush_ms:.2f} ms a flush of {log_every} rows" in text
        assert f"({inside.flush_ms / log_every:.3f} ms a step)" in text
    assert STEPS < 100  # so every100 did run on to its first log interval
    assert inside.sampled_steps in (1, 2)  # every100: the extra steps end it (STEPS + EXTRA_STEPS < 200)


def test_bench_cli_small_step_paired_in_hook(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--size", "tiny", "--steps", "2", "--repeats", "1", "--variants", "bare,default"]
    args += ["--no-memory", "--paired", "--in-hook", "--json", str(out)]
    result = CliRunner().invoke(main, args, standalone_mode=False)
    assert result.exit_code == 0, result.output
    assert "in stabkit, default: " in result.output and "paired" in result.output
    data = json.loads(out.read_text())
    assert data["in_hook_ms"]["default"]["unsampled_ms"] > 0
    assert data["in_hook_ms"]["default"]["flush_ms"] > 0 and data["in_hook_ms"]["default"]["log_every"] == 50
    assert data["config"]["machine"]["threads"] >= 1


def test_in_hook_summary_falls_back_to_sampled_steps_when_every_step_is_sampled() -> None:
    from stabkit.bench.inhook import _summary

    inside = _summary([(True, {"a": 0.002, "b": 0.001}), (True, {"a": 0.004, "b": 0.001})])
    assert inside.unsampled_ms is None and inside.sampled_ms == pytest.approx(4.0)
    assert inside.top_of == "sampled" and list(inside.top) == ["a", "b"]
    assert "sampled, by entry point (ms): a 3.000, b 1.000" in inside.text("full")


def test_in_hook_timer_counts_the_attention_measurement_inside_the_forward() -> None:
    """The attention probe measures inside the attention module's forward (its handler of the call),
    not in a hook: it is timed as an entry point of its own, so a sampled step's total holds it."""
    from stabkit.bench.inhook import measure

    torch.set_num_threads(1)
    inside = measure(BenchConfig(size="tiny", warmup=2), "full")  # every step sampled: top is theirs
    assert inside.top_of == "sampled"
    assert inside.top.get("AttentionProbe._measure", 0.0) > 0.0


def test_in_hook_clock_counts_a_nested_entry_point_for_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapped call made inside another (a probe's method called from a hook that is timed too)
    counts for its own entry point: each second once. A fake clock ticks one second per read."""
    from stabkit.bench import inhook

    ticks = iter(range(100))
    monkeypatch.setattr(inhook.time, "perf_counter", lambda: float(next(ticks)))
    clock = inhook._Clock()
    inner = clock.wrap(lambda: None, "inner")  # reads at 1 and 2: 1 s

    def outer_body() -> None:
        inner()
        inner()  # reads at 3 and 4

    outer = clock.wrap(outer_body, "outer")  # reads at 0 and 5: 5 s, 2 of them the inner calls'
    outer()
    assert clock.spent == {"inner": 2.0, "outer": 3.0}


def test_op_timer_times_only_the_ops_called_inside_stabkit() -> None:
    from stabkit.bench.inhook import _OpTimer

    inside = [False]
    x = torch.ones(8)
    timer = _OpTimer(lambda: inside[0])
    with timer:
        for _ in range(50):
            x.mul(2.0).add_(1.0)
    assert timer.seconds == 0.0  # no op was called inside an entry point
    with timer:
        inside[0] = True
        y = x.mul(2.0)
    assert timer.seconds > 0.0 and torch.equal(y, torch.full((8,), 2.0))  # timed, and passed through


def test_in_hook_splits_stabkits_python_from_its_torch_ops() -> None:
    from stabkit.bench.inhook import measure

    torch.set_num_threads(1)
    inside = measure(BenchConfig(size="tiny", warmup=2), "every100")
    assert inside.unsampled_ms is not None and inside.ops_ms is not None and inside.python_ms is not None
    assert inside.ops_ms > 0  # the gradient norms' _foreach_norm, at least
    assert inside.python_ms == pytest.approx(max(0.0, inside.unsampled_ms - inside.ops_ms))
    assert f"(Python {inside.python_ms:.3f} ms, torch ops {inside.ops_ms:.3f} ms)" in inside.text("every100")
