"""The table `stabkit bench` prints."""

from __future__ import annotations

from .fixed_cost import added_ms
from .machine import line as machine_line
from .runner import BenchConfig, BenchResult

BUDGET = {"default": 1.02, "every100": 1.01, "full": 1.12}
"""Step-time budget on the CPU reference benchmark (docs/architecture.md, "Performance budget").
Full monitoring's is judged at d_model >= 256 (`FULL_BUDGET_MIN_WIDTH`); narrower, its figure is
reported without a verdict."""
FULL_BUDGET_MIN_WIDTH = 256
"""Full monitoring reads each activation a fixed number of times per token while the model's matrix
products grow with d: its eager budget holds from this width on (docs/guide/cost.md); compiled, on every size."""
COMPILED_BUDGET = {"default": 1.03, "full": 1.15}
"""Step-time budget against a compiled bare loop (`stabkit bench --compile`)."""
COMPILE_TIME_BUDGET = 1.3
"""Compile time of the default monitoring against the compiled bare loop's."""
MEMORY_BUDGET = 0.01
"""Memory overhead budget: fraction of parameters + gradients + optimizer state."""


def format_table(result: BenchResult, noise: int | None = None) -> str:
    """Median ms/step (wall), min–max, ratio to bare (wall and CPU time), memory, budget verdicts."""
    cfg = result.config
    judged = "CPU-time" if cfg["device"] == "cpu" else "wall-clock"
    shape = "" if cfg.get("d_model") is None else f" d_model={cfg['d_model']}"
    if cfg.get("seq_len") is not None or cfg.get("batch_size") is not None or cfg.get("d_model") is not None:
        shape += f" seq_len={cfg.get('seq_len') or 'preset'} batch={cfg.get('batch')}"
    if cfg.get("model"):
        options = ", ".join(f"{k}={v!r}" for k, v in sorted((cfg.get("model_options") or {}).items()))
        shape = f" model={cfg['model']}{f' ({options})' if options else ''}" + shape
    compiled = bool(cfg.get("compile"))
    budget = dict(COMPILED_BUDGET if compiled else BUDGET)
    if not compiled and _width(cfg) < FULL_BUDGET_MIN_WIDTH:
        budget.pop("full", None)
    head = (
        f"stabkit bench: size={cfg['size']}{shape} device={cfg['device']} steps={cfg['steps']} "
        f"repeats={cfg['repeats']} bf16={cfg['bf16']}{' compile=inductor' if compiled else ''}"
        f"{' paired' if cfg.get('paired') else ''}"
        f"  (model+grads+optimizer: {result.model_bytes / 2**20:.1f} MiB)"
    )
    lines = [head] + ([machine_line(cfg["machine"])] if cfg.get("machine") else [])
    lines += [
        f"{'variant':<9} {'median ms':>10} {'min-max ms':>17} {'x bare':>7} {'cpu x':>7} {'noise':>7}"
        f" {'+ms sampled':>12} {'+ms unsampled':>13} {'memory':>20}"
        + (f" {'rss':>10}" if result.memory_rss else "")
        + (f" {'graphs':>6} {'breaks':>6} {'recomp':>6} {'compile s':>9} {'x bare':>6}" if compiled else "")
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
        if name in budget:
            verdict = (
                f"time {time_verdict(result.budget_ratio(name), budget[name], band)} (<= {budget[name]:.2f}x)"
            )
            if mem is not None:
                verdict += f", memory {memory_verdict(mem, result.model_bytes, noise)}"
        compile_txt = _compile_columns(result, name) if compiled else ""
        added = added_ms(result, name)
        samp, unsamp = (("-" if a is None else a.text()) for a in (added["sampled"], added["unsampled"]))
        if compiled and name == "default" and result.compile_ratio(name) is not None:
            verdict += f", compile {compile_verdict(result)} (<= {COMPILE_TIME_BUDGET:.1f}x)"
        lines.append(
            f"{name:<9} {v.median * 1e3:>10.2f} {min(v.step_times) * 1e3:>8.2f}-{max(v.step_times) * 1e3:<8.2f} "
            f"{result.ratio(name):>7.3f} {result.cpu_ratio(name):>7.3f} {band_txt:>7} {samp:>12} {unsamp:>13}"
            f" {mem_txt:>20}{rss_txt}"
            f"{compile_txt}  {verdict}"
        )
    lines.append(
        f"noise: {_noise_basis(result, judged)}; a time verdict past the budget by less than it reads 'within noise'"
    )
    clock = "CPU" if cfg["device"] == "cpu" else "wall, each step synchronized,"
    lines.append(
        f"+ms: {clock} milliseconds a monitor adds per sampled step (per-layer statistics) and per "
        "unsampled step (the every-step scalars), each step paired with bare's at the same place of its "
        f"round{' (paired: the two ran next to each other)' if cfg.get('paired') else ''}; median over "
        "rounds ± its noise, estimated as the noise column's"
    )
    if not compiled and "full" in result.variants and "full" not in budget:
        lines.append(
            f"full: reported, not budgeted below d_model {FULL_BUDGET_MIN_WIDTH} (its budget, "
            f"<= {BUDGET['full']:.2f}x, is judged with --d-model {FULL_BUDGET_MIN_WIDTH} or wider)"
        )
    if "qk_clip" in result.variants:
        lines.append(
            "qk_clip: the bare loop with QK-Clip at tau 100 and no monitor: the exact per-head max (one extra "
            "float32 q·kᵀ per attention call per training forward) and the clip after each step"
        )
    if cfg.get("quick"):
        cpu = cfg["device"] == "cpu"
        lines.append(
            f"quick: {cfg['repeats']} rounds of {cfg['steps']} steps{' and no memory phase' if cpu else ''}, so "
            f"the noise band is wider than a full run's; run without --quick (default {BenchConfig.repeats} "
            f"rounds of {BenchConfig.steps} steps{', memory measured' if cpu else ''}) before trusting a "
            "verdict near the budget"
        )
    if compiled:
        lines.append(
            "compiled: torch.compile(model) (Inductor) in every variant; graphs and breaks: Dynamo's counters "
            "over the warm-up (a sampled and an unsampled step); recomp: graphs compiled during the timed rounds"
        )
        if result.compile_method:
            compile_band = (
                ""
                if result.compile_noise is None
                else f" (noise ±{result.compile_noise:.1f} s: bare measured twice)"
            )
            lines.append(f"compile s: {result.compile_method}{compile_band}")
        else:
            lines.append("compile s: not measured (--quick)")
        if not result.memory_method:
            lines.append("memory: not measured with --compile (run without it)")
    if result.memory_method:
        extra = (
            f"; memory noise ±{_size(noise, sign=False)} (bare measured twice)" if noise is not None else ""
        )
        lines.append(f"memory: {result.memory_method}{extra}")
    return "\n".join(lines)


def _width(cfg: dict[str, object]) -> int:
    """The benchmarked model's d_model (`--d-model`, else the size's)."""
    from .presets import size_config

    width = cfg.get("d_model")
    return int(width) if isinstance(width, int) else size_config(str(cfg["size"])).d_model


def _compile_columns(result: BenchResult, name: str) -> str:
    """graphs, breaks, recompiles, compile seconds and their ratio to bare's, for one variant."""
    v = result.variants[name]

    def num(x: int | None) -> str:
        return "-" if x is None else str(x)

    secs = "-" if v.compile_s is None else f"{v.compile_s:.1f}"
    ratio = result.compile_ratio(name)
    return f" {num(v.graphs):>6} {num(v.breaks):>6} {num(v.recompiles):>6} {secs:>9} {'-' if ratio is None else f'{ratio:.2f}':>6}"


def compile_verdict(result: BenchResult) -> str:
    """'ok' within `COMPILE_TIME_BUDGET`, 'within noise' when only bare's compile-time noise could put
    the default variant over, else 'OVER'."""
    ratio = result.compile_ratio("default")
    bare = result.variants["bare"].compile_s
    if ratio is None or not bare:
        return "-"
    if ratio <= COMPILE_TIME_BUDGET:
        return "ok"
    if result.compile_noise is not None and ratio - result.compile_noise / bare <= COMPILE_TIME_BUDGET:
        return "within noise"
    return "OVER"


def _noise_basis(result: BenchResult, judged: str) -> str:
    """The footnote's account of the noise column: what each variant's band was estimated from."""
    bands = {}
    for name in result.variants:
        found = None if name == "bare" else result.noise_band(name)
        if found is not None:
            bands[name] = found
    what = f"of the {judged} ratio"
    if not bands:
        return f"{what}: none (one round)"
    hint = (
        " (a block: whole cycles of the variant's monitor)" if any(b.blocks for b in bands.values()) else ""
    )
    bases = {name: b.basis() for name, b in bands.items()}
    if len(set(bases.values())) == 1:
        return f"{what}, {next(iter(bases.values()))}{hint}"
    return f"{what} — " + "; ".join(f"{name}: {basis}" for name, basis in bases.items()) + hint


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
