"""The table `stabkit bench` prints."""

from __future__ import annotations

from .runner import BenchConfig, BenchResult

BUDGET = {"default": 1.03, "full": 1.25}
"""Step-time budget on the CPU reference benchmark (DESIGN.md; issue 7)."""
MEMORY_BUDGET = 0.01
"""Memory overhead budget: fraction of parameters + gradients + optimizer state."""


def format_table(result: BenchResult, noise: int | None = None) -> str:
    """Median ms/step (wall), min–max, ratio to bare (wall and CPU time), memory, budget verdicts."""
    cfg = result.config
    judged = "CPU-time" if cfg["device"] == "cpu" else "wall-clock"
    shape = "" if cfg.get("seq_len") is None else f" seq_len={cfg['seq_len']} batch={cfg.get('batch')}"
    head = (
        f"stabkit bench: size={cfg['size']}{shape} device={cfg['device']} steps={cfg['steps']} "
        f"repeats={cfg['repeats']} bf16={cfg['bf16']}  (model+grads+optimizer: {result.model_bytes / 2**20:.1f} MiB)"
    )
    lines = [
        head,
        f"{'variant':<9} {'median ms':>10} {'min-max ms':>17} {'x bare':>7} {'cpu x':>7} {'noise':>7} {'memory':>20}"
        + (f" {'rss':>10}" if result.memory_rss else "")
        + f"  budget ({judged} ratio)",
    ]
    for name, v in result.variants.items():
        mem = result.memory.get(name)
        mem_txt = "-" if mem is None else f"{_size(mem)} ({mem / result.model_bytes:+.2%})"
        rss = result.memory_rss.get(name)
        rss_txt = (" " + f"{_size(rss) if rss is not None else '-':>10}") if result.memory_rss else ""
        band = result.noise(name)
        band_txt = "-" if band is None or name == "bare" else f"±{band:.3f}"
        verdict = ""
        if name in BUDGET:
            verdict = (
                f"time {time_verdict(result.budget_ratio(name), BUDGET[name], band)} (<= {BUDGET[name]:.2f}x)"
            )
            if mem is not None:
                verdict += f", memory {memory_verdict(mem, result.model_bytes, noise)}"
        lines.append(
            f"{name:<9} {v.median * 1e3:>10.2f} {min(v.step_times) * 1e3:>8.2f}-{max(v.step_times) * 1e3:<8.2f} "
            f"{result.ratio(name):>7.3f} {result.cpu_ratio(name):>7.3f} {band_txt:>7} {mem_txt:>20}{rss_txt}  {verdict}"
        )
    lines.append(
        f"noise: half the spread of the per-round {judged} ratios over {cfg['repeats']} round(s); "
        "a time verdict past the budget by less than it reads 'within noise'"
    )
    if cfg.get("quick"):
        cpu = cfg["device"] == "cpu"
        lines.append(
            f"quick: {cfg['repeats']} rounds of {cfg['steps']} steps{' and no memory phase' if cpu else ''}, so "
            f"the noise band is wider than a full run's; run without --quick (default {BenchConfig.repeats} "
            f"rounds of {BenchConfig.steps} steps{', memory measured' if cpu else ''}) before trusting a "
            "verdict near the budget"
        )
    if result.memory_method:
        extra = (
            f"; memory noise ±{_size(noise, sign=False)} (bare measured twice)" if noise is not None else ""
        )
        lines.append(f"memory: {result.memory_method}{extra}")
    return "\n".join(lines)


def time_verdict(ratio: float, budget: float, band: float | None) -> str:
    """'ok' within the budget, 'within noise' when only the round-to-round noise could put it over, else 'OVER'."""
    if ratio <= budget:
        return "ok"
    if band is not None and ratio - band <= budget:
        return "within noise"
    return "OVER"


def memory_verdict(overhead: int, model_bytes: int, noise: int | None) -> str:
    """'ok' within the budget, 'within noise' when only the measurement noise could put it over, else 'OVER'."""
    allowed = MEMORY_BUDGET * model_bytes
    if overhead <= allowed:
        return "ok"
    if noise is not None and overhead <= allowed + noise:
        return "within noise"
    return "OVER"


def _size(n: int, sign: bool = True) -> str:
    """Bytes as KiB below 1 MiB, else MiB."""
    fmt = "+" if sign else ""
    if abs(n) < 2**20:
        return f"{n / 2**10:{fmt}.1f} KiB"
    return f"{n / 2**20:{fmt}.2f} MiB"
