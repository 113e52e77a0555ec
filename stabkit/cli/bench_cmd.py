"""`stabkit bench`: monitoring overhead against a bare loop (see stabkit.bench).

Two phases, each with its progress on stderr (`Phase`): the interleaved timed rounds, then (CPU)
one fresh process per variant for memory, with an estimate of the time left.
"""

from __future__ import annotations

import json
import time

import click

from .app import main
from .progress import Phase, duration
from .run_cmd import SHARED_OPTIONS, model_spec

VARIANT_NAMES = ("bare", "default", "full", "anomaly")
"""`stabkit.bench.VARIANTS`, repeated here so that `--help` does not import torch (a test keeps them equal)."""
SIZES = ("tiny", "tiny-moe", "small", "gpt2", "1b", "small-step")
"""Sizes `bench` offers: the reference GPT's presets (`stabkit.harness.models.PRESETS`), then the
bench's own shapes (`stabkit.bench.presets.BENCH_PRESETS`); a test keeps them equal."""


@main.command()
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option(
    "--size",
    default="small",
    show_default=True,
    type=click.Choice(SIZES),
    help="Model preset; small-step is small's width and depth on 8 x 64 tokens with RoPE and dropout "
    "(~55 ms a step on one CPU thread), where the fixed per-step cost shows.",
)
@click.option(
    "--steps",
    default=None,
    type=click.IntRange(1),
    help="Timed steps per round.  [default: 40; 10 with --quick]",
)
@click.option(
    "--repeats",
    default=None,
    type=click.IntRange(1),
    help="Interleaved rounds.  [default: 5; 3 with --quick]",
)
@click.option(
    "--seq-len",
    default=None,
    type=click.IntRange(1),
    help="Sequence length of the benchmarked model (its context); a step keeps the preset's tokens "
    "(at least one sequence), e.g. --size tiny --seq-len 8192 for long-context memory.  [default: the preset's]",
)
@click.option(
    "--batch-size",
    default=None,
    type=click.IntRange(1),
    help="Sequences per step.  [default: the preset's; with --seq-len, the preset's tokens per step]",
)
@click.option(
    "--d-model",
    default=None,
    type=click.IntRange(1),
    help="Model width: the preset with this d_model, its head dimension kept (more heads), e.g. "
    "--d-model 256 for how monitoring's share falls with width.  [default: the preset's]",
)
@click.option("--bf16", is_flag=True, help="bf16 autocast (CUDA).")
@click.option(
    "--variants",
    default=",".join(VARIANT_NAMES),
    show_default=True,
    help="Comma-separated; also every100 (default monitoring sampling and logging every 100 steps) and "
    "qk_clip (the bare loop with QK-Clip at tau 100: what its exact per-head max costs).",
)
@click.option("--no-memory", is_flag=True, help="Skip the CPU memory subprocesses.")
@click.option(
    "--in-hook",
    "in_hook",
    is_flag=True,
    help="Also time stabkit's own calls (its hooks, the end-of-backward callback, Monitor.step) per sampled "
    "and unsampled step of each monitored variant, and the log interval's flush apart, on a fresh model "
    "after the rounds.",
)
@click.option(
    "--paired",
    is_flag=True,
    help="Variants take turns step by step instead of in slices of 10 steps: each monitored step runs "
    "next to a bare one (resolves 1-2 points of the ratio on a noisy machine; use more --steps).",
)
@click.option(
    "--compile",
    "compiled",
    is_flag=True,
    help="Compiled bare against compiled monitored (torch.compile, Inductor; variants bare,default,full): "
    "graphs compiled, graph breaks, recompiles after warm-up and compile time (a fresh process per "
    "variant, cold cache) in the table.",
)
@click.option(
    "--quick",
    is_flag=True,
    help="About a minute (size small, CPU): fewer, shorter rounds and no memory phase; the table "
    "states the wider noise band.",
)
@click.option(
    "--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write results here."
)
@click.option(
    "--model",
    default=None,
    metavar="SPEC",
    help="Measure on this model instead of the reference GPT: hf:<model_type> or module:callable, built "
    "at --size's shape (a preset name is the same as --size).",
)
@SHARED_OPTIONS["model_option"]
def bench(
    device: str,
    size: str,
    steps: int | None,
    repeats: int | None,
    seq_len: int | None,
    batch_size: int | None,
    d_model: int | None,
    bf16: bool,
    variants: str,
    no_memory: bool,
    in_hook: bool,
    paired: bool,
    compiled: bool,
    quick: bool,
    json_path: str | None,
    model: str | None,
    model_option: tuple[str, ...],
) -> None:
    """Time a bare loop against stabkit's default and full-detail monitoring and detect_anomaly
    (with --compile: all under torch.compile)."""
    loading = time.perf_counter()
    import torch

    from ..bench import QUICK, BenchConfig, format_table, run_bench
    from ..bench.memory import ProcessClock, cpu_memory_overheads, memory_plan
    from ..bench.runner import total_steps

    startup = time.perf_counter() - loading
    spec = model_spec(model, model_option)
    if spec is not None and spec.is_reference:
        size, spec = spec.target, None
    if device == "cpu":
        torch.set_num_threads(1)
    cfg = BenchConfig(
        size=size,
        device=device,
        steps=steps or (QUICK["steps"] if quick else BenchConfig.steps),
        repeats=repeats or (QUICK["repeats"] if quick else BenchConfig.repeats),
        warmup=QUICK["warmup"] if quick else BenchConfig.warmup,
        bf16=bf16,
        seq_len=seq_len,
        batch_size=batch_size,
        d_model=d_model,
        variants=tuple(v.strip() for v in variants.split(",") if v.strip()),
        quick=quick,
        compile=compiled,
        paired=paired,
        model=spec.text if spec is not None else None,
        model_options=dict(spec.options) if spec is not None else {},
    )
    label = f"timing {cfg.repeats} rounds x {len(cfg.variants)} variants"
    with Phase(label, total_steps(cfg), unit="steps") as phase:
        result = run_bench(cfg, progress=phase)
    noise = None
    if compiled and not quick:
        from ..bench.compiled import compile_plan, measure_compile

        runs = compile_plan(cfg)
        click.echo(
            f"compile time: {len(runs)} fresh processes, one per variant (bare twice), each compiling cold",
            err=True,
        )
        with Phase("compile", len(runs), unit="processes", log_units=True) as phase:
            measure_compile(cfg, result, progress=phase)
    if device == "cpu" and not no_memory and not quick and not compiled:
        clock = ProcessClock(cfg, {n: v.median for n, v in result.variants.items()}, startup)
        plan = memory_plan(cfg)
        click.echo(
            f"memory: {len(plan)} fresh processes, one per variant (bare twice), "
            f"about {duration(clock.remaining(0))} (estimate)",
            err=True,
        )
        with Phase("memory", len(plan), unit="processes", log_units=True, eta=clock.remaining) as phase:
            measured = cpu_memory_overheads(cfg, progress=phase, clock=clock)
        noise = measured["tensor"].pop("noise")
        rss_noise = measured["rss"].pop("noise")
        result.memory, result.memory_rss = measured["tensor"], measured["rss"]
        result.memory_method = (
            "CPU peak tensor memory (torch profiler memory timeline, fresh process per variant) against bare; "
            f"rss = peak resident set size delta, incl. Python objects (noise ±{(rss_noise or 0) / 2**20:.2f} MiB)"
        )
    click.echo(format_table(result, noise))
    timed_inside: dict[str, dict[str, object]] = {}
    if in_hook:
        from ..bench.inhook import measure

        for name, v in result.variants.items():
            if v.monitored and not compiled:
                inside = measure(cfg, name)
                click.echo(inside.text(name))
                timed_inside[name] = vars(inside)
    if json_path:
        data = result.to_dict()
        data["memory_noise_bytes"] = noise
        if timed_inside:
            data["in_hook_ms"] = timed_inside
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
