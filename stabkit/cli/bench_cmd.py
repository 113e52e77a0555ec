"""`stabkit bench`: monitoring overhead against a bare loop (see stabkit.bench)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import torch

from ..bench import BenchConfig, format_table, run_bench
from ..bench.memory import cpu_memory_overheads
from .app import main


@main.command()
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]))
@click.option(
    "--size", default="small", show_default=True, type=click.Choice(["tiny", "small", "gpt2", "1b"])
)
@click.option("--steps", default=40, show_default=True, type=click.IntRange(1), help="Timed steps per round.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1), help="Interleaved rounds.")
@click.option("--bf16", is_flag=True, help="bf16 autocast (CUDA).")
@click.option("--variants", default="bare,default,full,anomaly", show_default=True, help="Comma-separated.")
@click.option("--no-memory", is_flag=True, help="Skip the CPU memory subprocesses.")
@click.option(
    "--json", "json_path", default=None, type=click.Path(dir_okay=False), help="Write results here."
)
def bench(
    device: str,
    size: str,
    steps: int,
    repeats: int,
    bf16: bool,
    variants: str,
    no_memory: bool,
    json_path: str | None,
) -> None:
    """Time a bare loop against stabkit's default and full-detail monitoring and detect_anomaly."""
    if device == "cpu":
        torch.set_num_threads(1)
    cfg = BenchConfig(
        size=size,
        device=device,
        steps=steps,
        repeats=repeats,
        bf16=bf16,
        variants=tuple(v.strip() for v in variants.split(",") if v.strip()),
    )
    rounds = repeats * len(cfg.variants)
    progress: Any = click.progressbar(length=rounds, label="benchmarking", file=sys.stderr)
    with progress as bar:
        result = run_bench(cfg, progress=bar)
    noise = None
    if device == "cpu" and not no_memory:
        measured = cpu_memory_overheads(cfg)
        noise = measured["tensor"].pop("noise")
        rss_noise = measured["rss"].pop("noise")
        result.memory, result.memory_rss = measured["tensor"], measured["rss"]
        result.memory_method = (
            "CPU peak tensor memory (torch profiler memory timeline, fresh process per variant) against bare; "
            f"rss = peak resident set size delta, incl. Python objects (noise ±{(rss_noise or 0) / 2**20:.2f} MiB)"
        )
    click.echo(format_table(result, noise))
    if json_path:
        data = result.to_dict()
        data["memory_noise_bytes"] = noise
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
