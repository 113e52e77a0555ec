"""`stabkit bench`: the cost of monitoring, as ratios against a bare loop in the same process.

Variants (same seed, same batches, same model init): ``bare`` (no stabkit), ``default``
(`stabkit.attach` with the default MonitorConfig), ``full`` (`MonitorConfig.full()`: every module,
every step, exact attention statistics), ``anomaly`` (`torch.autograd.detect_anomaly`, a peer).
Repetitions are interleaved (the variant order rotates each round, and within a round the variants
take turns in slices of `SLICE_STEPS` steps) so that machine noise hits every variant alike; the
figure per variant is the median over rounds of the mean step time, and the ratio the budget is
judged on (CPU time) the median over rounds of the paired ratio variant / bare.

With ``compile`` (`stabkit bench --compile`) every variant runs ``torch.compile(model)`` (Inductor)
and the monitors attach before anything is compiled (attach resets Dynamo's caches when code was
compiled before); Dynamo guards on module hooks there, so each variant's model gets its own graphs. Per variant, Dynamo's counters give the graphs compiled and the graph breaks met
during the warm-up (which runs a sampled and an unsampled step) and the recompiles during the timed
rounds (0: the set of graphs is fixed after warm-up); `stabkit.bench.compiled` measures the compile
time itself in a fresh process per variant.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..attaching import attach
from ..config import MonitorConfig
from ..harness.data import load_corpus
from ..harness.models import GPTConfig
from ..harness.models.build import build
from ..harness.models.spec import parse_model_spec
from ..monitor import Monitor
from .fixed_cost import added_ms
from .interventions import INTERVENTION_VARIANTS, apply_variant
from .machine import describe
from .noise import Band, band, cycle
from .presets import bench_sizes, size_batch, size_config

VARIANTS = ("bare", "default", "full", "anomaly")
SPARSE_VARIANTS = ("every100",)
"""Monitored variants not run unless asked for: ``every100`` samples per-layer statistics and logs every
100 steps (``MonitorConfig(every=100, log_every=100)``): nearly every step is an unsampled one."""
COMPILED_VARIANTS = ("bare", "default", "full")
"""The variants of ``--compile`` (detect_anomaly is an eager-mode peer)."""

QUICK = {"steps": 10, "repeats": 3, "warmup": 2}
"""`stabkit bench --quick`: shorter, fewer rounds (about a minute for `small` on a CPU) and no memory
phase; per-round ratios then spread more, and the table states that wider noise band."""


class Progress(Protocol):
    """What `run_bench` reports to (the CLI's `Phase`): units are training steps."""

    def begin(self, item: str) -> None: ...

    def update(self, n: int = 1) -> None: ...


@dataclass
class BenchConfig:
    """What to measure."""

    size: str = "small"
    """Reference GPT preset, or a bench shape (`stabkit.bench.presets`: ``small-step``)."""
    device: str = "cpu"
    """'cpu' or 'cuda'."""
    steps: int = 40
    """Timed steps per variant per round."""
    repeats: int = 5
    """Rounds (each runs every variant once)."""
    warmup: int = 5
    """Untimed steps per variant before the first round."""
    bf16: bool = False
    """bf16 autocast (CUDA)."""
    batch_size: int | None = None
    """Sequences per step (None = the preset's; with `seq_len`, the preset's tokens per step)."""
    seq_len: int | None = None
    """Sequence length T: the model's context (None = the preset's). Without `batch_size`, a step keeps
    the preset's tokens (batch × context) in T-long sequences, at least one (long-context memory)."""
    d_model: int | None = None
    """Model width (None = the preset's): the preset with this d_model, its head dimension kept (more
    heads), everything else the same — how monitoring's share changes with width."""
    variants: tuple[str, ...] = VARIANTS
    """Which variants to run (bare is always run)."""
    seed: int = 0
    quick: bool = False
    """Quick mode (`QUICK`): the table says its noise band is wider and memory was not measured."""
    compile: bool = False
    """Every variant trains ``torch.compile(model)``; graphs, breaks, recompiles and compile time reported."""
    model: str | None = None
    """A model spec (`stabkit.harness.models.spec`: ``hf:llama``, ``my_pkg:build``) built at `size`'s
    shape instead of the reference GPT, so the overhead is measured on the user's architecture."""
    model_options: dict[str, Any] = field(default_factory=dict)
    """Config fields / factory arguments of `model` (``--model-option``)."""
    paired: bool = False
    """Variants take turns step by step (slices of one step) instead of slices of `SLICE_STEPS`: a
    monitored step and a bare one run next to each other, so even a short slow spell of the machine
    hits both members of each pair (the per-step A/B of the cost guide)."""

    def __post_init__(self) -> None:
        if self.model is not None:
            parse_model_spec(self.model, self.model_options)  # a bad spec fails here, in one line
        if self.size not in bench_sizes():
            raise ValueError(f"bench: unknown size {self.size!r}; choose one of {list(bench_sizes())}")
        if self.steps < 1 or self.repeats < 1 or self.warmup < 0:
            raise ValueError("bench: --steps and --repeats must be >= 1 (warmup >= 0)")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"bench: --seq-len must be an integer >= 1, got {self.seq_len!r}")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise ValueError(f"bench: --batch-size must be an integer >= 1, got {self.batch_size!r}")
        if self.d_model is not None:
            head_dim = preset_head_dim(self.size)
            if not isinstance(self.d_model, int) or self.d_model < 1 or self.d_model % head_dim:
                raise ValueError(
                    f"bench: --d-model must be a positive multiple of the {self.size} preset's head "
                    f"dimension {head_dim}, got {self.d_model!r}"
                )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"bench: --device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("bench: --device cuda asked for, but torch.cuda.is_available() is False")
        allowed = [*VARIANTS, *SPARSE_VARIANTS, *INTERVENTION_VARIANTS]
        unknown = set(self.variants) - set(allowed)
        if unknown:
            raise ValueError(f"bench: unknown variant(s) {sorted(unknown)}; allowed: {allowed}")
        if self.compile and set(self.variants) & set(INTERVENTION_VARIANTS):
            raise ValueError(f"bench: {sorted(INTERVENTION_VARIANTS)} are measured without --compile")
        if "bare" not in self.variants:
            self.variants = ("bare", *self.variants)
        if self.compile and "anomaly" in self.variants:
            if self.variants == VARIANTS:  # the default list: the compiled variants
                self.variants = COMPILED_VARIANTS
            else:
                raise ValueError(
                    "bench: --compile runs bare, default and full (anomaly is an eager-mode peer)"
                )


@dataclass
class VariantResult:
    """Per-variant timing (seconds per step) and memory."""

    name: str
    step_times: list[float] = field(default_factory=list)
    """Mean wall-clock step time of each round."""
    cpu_times: list[float] = field(default_factory=list)
    """Mean process CPU time per step of each round (robust to other processes on a shared machine)."""
    peak_bytes: int | None = None
    """CUDA max allocated during the variant's rounds."""
    graphs: int | None = None
    """Compiled: Dynamo graphs compiled during the warm-up (a sampled and an unsampled step)."""
    breaks: int | None = None
    """Compiled: graph breaks Dynamo met during the warm-up."""
    recompiles: int | None = None
    """Compiled: graphs compiled during the timed rounds, after warm-up (0 expected)."""
    compile_s: float | None = None
    """Compiled: CPU seconds of compiling every graph, cold (`stabkit.bench.compiled`)."""
    step_cpu: list[list[float]] = field(default_factory=list)
    """Per round, the seconds of each timed step in order — process CPU time on a CPU, wall time to a
    synchronize on CUDA (`stabkit.bench.fixed_cost` pairs them with bare's steps of the same round)."""
    monitored: bool = False
    """A monitor is attached to this variant's model (the "+ms" columns are its cost)."""
    step_sampled: list[list[bool]] = field(default_factory=list)
    """Per round, whether each timed step was a sampled one for the variant's monitor
    (``MonitorConfig.every``; False throughout without a monitor)."""
    cycle: int = 1
    """Steps after which the variant's monitor repeats its work (`stabkit.bench.noise.cycle`; 1
    without a monitor): the noise band's blocks are whole cycles."""

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu_times)


@dataclass
class BenchResult:
    """Everything `stabkit bench` prints and writes as JSON."""

    config: dict[str, Any]
    variants: dict[str, VariantResult]
    model_bytes: int
    """Parameters + gradients + optimizer state, in bytes."""
    memory: dict[str, int | None] = field(default_factory=dict)
    """Memory overhead per variant in bytes (CUDA max allocated delta, or CPU peak RSS delta)."""
    memory_method: str = ""
    memory_rss: dict[str, int | None] = field(default_factory=dict)
    """CPU only: peak RSS delta per variant (counts Python objects too), shown beside `memory`."""
    compile_noise: float | None = None
    """Compiled: |bare − bare again| of the compile CPU seconds (None when not measured twice)."""
    compile_method: str = ""

    def compile_ratio(self, name: str) -> float | None:
        """Compile time against bare's (None when not measured)."""
        mine, bare = self.variants[name].compile_s, self.variants["bare"].compile_s
        return None if mine is None or not bare else mine / bare

    def ratio(self, name: str) -> float:
        """Wall-clock ratio of medians against bare."""
        return self.variants[name].median / self.variants["bare"].median

    def cpu_ratio(self, name: str) -> float:
        """Process-CPU-time ratio against bare: the median of the per-round paired ratios (each round
        times every variant in interleaved slices, so a slow spell of the machine hits both sides of
        a pair), or the ratio of medians when a round lacks a bare time."""
        mine, bare = self.variants[name].cpu_times, self.variants["bare"].cpu_times
        if len(mine) == len(bare) and all(b > 0 for b in bare):
            return statistics.median(m / b for m, b in zip(mine, bare, strict=True))
        return self.variants[name].cpu_median / self.variants["bare"].cpu_median

    def round_ratios(self, name: str) -> list[float]:
        """The budget ratio of each round (CPU time on a CPU, wall on CUDA): variant over bare in
        the same round, so slow spells of the machine cancel."""
        cpu = self.config["device"] == "cpu"
        mine = self.variants[name].cpu_times if cpu else self.variants[name].step_times
        bare = self.variants["bare"].cpu_times if cpu else self.variants["bare"].step_times
        return [m / b for m, b in zip(mine, bare) if b > 0]

    def noise(self, name: str) -> float | None:
        """The noise band of the ratio (`noise_band`'s value; None with a single short round)."""
        found = self.noise_band(name)
        return None if found is None else found.value

    def noise_band(self, name: str) -> Band | None:
        """The ratio's noise band (`stabkit.bench.noise.band`): the standard error over blocks of
        whole monitor cycles when the rounds hold enough of them, else the rounds' half spread."""
        v, bare = self.variants[name], self.variants["bare"]
        return band(self.round_ratios(name), v.step_cpu, bare.step_cpu, v.cycle)

    def budget_ratio(self, name: str) -> float:
        """The ratio the budget is judged on: CPU time on a CPU (one thread: immune to neighbours' load), wall on CUDA."""
        return self.cpu_ratio(name) if self.config["device"] == "cpu" else self.ratio(name)

    def to_dict(self) -> dict[str, Any]:
        rows = {}
        for name, v in self.variants.items():
            noise = self.noise_band(name)
            rows[name] = {
                "median_step_s": v.median,
                "min_step_s": min(v.step_times),
                "max_step_s": max(v.step_times),
                "ratio_to_bare": self.ratio(name),
                "median_cpu_step_s": v.cpu_median,
                "cpu_ratio_to_bare": self.cpu_ratio(name),
                "ratio_noise": None if noise is None else noise.value,
                "ratio_noise_basis": None if noise is None else noise.basis(),
                "memory_overhead_bytes": self.memory.get(name),
                "rss_overhead_bytes": self.memory_rss.get(name),
                "memory_overhead_fraction": (
                    None if self.memory.get(name) is None else self.memory[name] / self.model_bytes  # type: ignore[operator]
                ),
            }
            for kind, added in added_ms(self, name).items():
                rows[name][f"added_ms_{kind}"] = None if added is None else added.ms
                rows[name][f"added_ms_{kind}_noise"] = None if added is None else added.noise
            if self.config.get("compile"):
                rows[name].update(
                    graphs=v.graphs,
                    graph_breaks=v.breaks,
                    recompiles=v.recompiles,
                    compile_cpu_s=v.compile_s,
                    compile_ratio_to_bare=self.compile_ratio(name),
                )
        return {
            "config": self.config,
            "model_bytes": self.model_bytes,
            "memory_method": self.memory_method,
            "compile_method": self.compile_method,
            "compile_noise_s": self.compile_noise,
            "variants": rows,
        }


class _Trainer:
    """One model + optimizer + fixed batches; `run(n)` trains n steps with an optional monitor."""

    def __init__(self, cfg: BenchConfig, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        torch.manual_seed(cfg.seed)
        mcfg = model_config(cfg)
        self.device = torch.device(cfg.device)
        spec = parse_model_spec(cfg.model, cfg.model_options) if cfg.model else None
        self.model = build(spec, mcfg).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
        self.batches = [(x.to(self.device), y.to(self.device)) for x, y in batches]
        self.bf16 = cfg.bf16
        self.cursor = 0
        self.monitor: Monitor | None = None
        self.forward: Any = torch.compile(self.model) if cfg.compile else self.model
        """What the loop calls: the model, or ``torch.compile(model)`` (monitors attach to the model)."""

    def run(self, steps: int, anomaly: bool = False, record: VariantResult | None = None) -> None:
        """Train `steps` steps; with `record`, each step's CPU time and sampling join its last round."""
        ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        every = None if self.monitor is None else self.monitor.config.every
        cuda = self.device.type == "cuda"
        clock = time.perf_counter if cuda else time.process_time  # CUDA: wall, each step synchronized
        if anomaly:
            with warnings.catch_warnings():  # "Anomaly Detection has been enabled": on purpose here
                warnings.simplefilter("ignore", UserWarning)
                ctx = torch.autograd.detect_anomaly(check_nan=True)
        with ctx:
            for _ in range(steps):
                start = clock() if record is not None else 0.0
                sampled = every is not None and self.monitor.global_step % every == 0  # type: ignore[union-attr]
                x, y = self.batches[self.cursor % len(self.batches)]
                self.cursor += 1
                with _autocast(self.device, self.bf16):
                    logits = self.forward(x)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.opt.step()
                if self.monitor is not None:
                    self.monitor.step(loss)
                self.opt.zero_grad(set_to_none=True)
                if record is not None:
                    if cuda:
                        torch.cuda.synchronize()  # sync point: a timed step's end (bench only)
                    record.step_cpu[-1].append(clock() - start)
                    record.step_sampled[-1].append(sampled)

    def model_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        state = sum(
            t.numel() * t.element_size()
            for s in self.opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        return 2 * params + state  # parameters + gradients + optimizer state


@contextlib.contextmanager
def _autocast(device: torch.device, bf16: bool) -> Iterator[None]:
    if bf16:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


def _separate_compiled_models(cfg: BenchConfig) -> contextlib.AbstractContextManager[Any]:
    """Compiled variants in one process: make Dynamo guard on module hooks. By default it does not
    (``skip_nnmodule_hook_guards``), and the variants' models share one class, so a monitored model
    would run the graph compiled for the bare one — without its hooks. Costs every variant alike."""
    if not cfg.compile:
        return contextlib.nullcontext()
    import torch._dynamo

    return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks met) so far in this process, from Dynamo's counters."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["graph_break"].values()))


def model_config(cfg: BenchConfig) -> GPTConfig:
    """The benchmarked model: the preset, with `seq_len` as its context and `d_model` as its width
    (heads of the preset's head dimension) when given."""
    overrides: dict[str, Any] = {} if cfg.seq_len is None else {"context": cfg.seq_len}
    if cfg.d_model is not None:
        overrides.update(d_model=cfg.d_model, n_heads=cfg.d_model // preset_head_dim(cfg.size))
    return size_config(cfg.size, **overrides)


def preset_head_dim(size: str) -> int:
    """The head dimension of preset `size` (d_model / n_heads)."""
    preset = size_config(size)
    return preset.d_model // preset.n_heads


def batch_size(cfg: BenchConfig) -> int:
    """Sequences per step: `batch_size`, else the preset's tokens per step in `seq_len`-long
    sequences (at least one), else the preset's batch."""
    if cfg.batch_size:
        return cfg.batch_size
    if cfg.seq_len is None:
        return size_batch(cfg.size)
    return max(1, size_batch(cfg.size) * size_config(cfg.size).context // cfg.seq_len)


def make_batches(cfg: BenchConfig, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` fixed batches from the embedded text (the same for every variant)."""
    corpus = load_corpus()
    gen = torch.Generator().manual_seed(cfg.seed)
    context = model_config(cfg).context
    return [corpus.batch("train", batch_size(cfg), context, gen) for _ in range(n)]


def monitor_config(variant: str) -> MonitorConfig | None:
    """The MonitorConfig a variant attaches with (None: no monitor)."""
    if variant == "default":
        return MonitorConfig(console=False)
    if variant == "full":
        return MonitorConfig.full(console=False)
    if variant == "every100":
        return MonitorConfig(console=False, every=100, log_every=100)
    return None


def total_steps(cfg: BenchConfig) -> int:
    """Training steps `run_bench` runs (warm-up and timed), the units it reports progress in."""
    return len(cfg.variants) * (cfg.warmup + cfg.repeats * cfg.steps)


SLICE_STEPS = 10
"""A round times each variant in slices of this many steps, variants taking turns slice by slice, so
that a slow spell of the machine (seconds long on shared CPUs) hits every variant of the round. It is
`MonitorConfig.every`'s default: a slice holds whole sampling cycles."""


def slices(steps: int, size: int = SLICE_STEPS) -> list[int]:
    """A round's `steps` as consecutive slices of `size` steps (the last one shorter)."""
    return [min(size, steps - done) for done in range(0, steps, size)]


def _timed_block(cfg: BenchConfig, tr: _Trainer, result: VariantResult, steps: int) -> tuple[float, float]:
    """Train `steps` steps of one variant; (wall, CPU) seconds, the CUDA peak and Dynamo's recompiles
    kept in `result`."""
    if cfg.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = dynamo_counts() if cfg.compile else None
    start, cpu_start = time.perf_counter(), time.process_time()
    tr.run(steps, anomaly=result.name == "anomaly", record=result)
    if cfg.device == "cuda":
        torch.cuda.synchronize()  # sync point: end of a timed block
        result.peak_bytes = max(result.peak_bytes or 0, torch.cuda.max_memory_allocated())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if before is not None:
        result.recompiles = (result.recompiles or 0) + dynamo_counts()[0] - before[0]
    return wall, cpu


def run_bench(cfg: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Interleaved rounds of every variant; returns medians, ratios and memory (see module doc).

    `progress.begin(what)` is called before each warm-up and timed block, `progress.update(steps)`
    after it (between timed blocks, never inside one)."""
    batches = make_batches(cfg)
    results = {name: VariantResult(name) for name in cfg.variants}
    trainers = {name: _Trainer(cfg, batches) for name in cfg.variants}
    with tempfile.TemporaryDirectory(prefix="stabkit-bench-") as tmp, _separate_compiled_models(cfg):
        for name, tr in trainers.items():  # every monitor before anything compiles (attach resets Dynamo)
            mcfg = monitor_config(name)
            if mcfg is not None:
                tr.monitor = attach(tr.model, tr.opt, logdir=f"{tmp}/{name}", config=mcfg)
                results[name].monitored = True
                results[name].cycle = cycle(mcfg)
        handles = [apply_variant(tr.model, tr.opt, name) for name, tr in trainers.items()]
        for name, tr in trainers.items():
            if progress is not None:
                progress.begin(f"warm-up {name}")
            before = dynamo_counts() if cfg.compile else None
            tr.run(cfg.warmup, anomaly=name == "anomaly")
            if before is not None:
                graphs, breaks = dynamo_counts()
                results[name].graphs, results[name].breaks = graphs - before[0], breaks - before[1]
                results[name].recompiles = 0
            if progress is not None:
                progress.update(cfg.warmup)
        order = list(cfg.variants)
        try:
            for r in range(cfg.repeats):
                rotation = order[r % len(order) :] + order[: r % len(order)]
                spent = {name: [0.0, 0.0] for name in rotation}  # wall, CPU seconds this round
                for name in rotation:
                    results[name].step_cpu.append([])
                    results[name].step_sampled.append([])
                for part in slices(cfg.steps, 1 if cfg.paired else SLICE_STEPS):
                    for name in rotation:
                        if progress is not None:
                            progress.begin(f"round {r + 1}/{cfg.repeats} {name}")
                        wall, cpu = _timed_block(cfg, trainers[name], results[name], part)
                        spent[name][0] += wall
                        spent[name][1] += cpu
                        if progress is not None:
                            progress.update(part)
                for name, (wall, cpu) in spent.items():
                    results[name].step_times.append(wall / cfg.steps)
                    results[name].cpu_times.append(cpu / cfg.steps)
        finally:
            for tr in trainers.values():
                if tr.monitor is not None:
                    tr.monitor.detach()
            for handle in handles:
                if handle is not None:
                    handle.remove()
    model_bytes = trainers["bare"].model_bytes()
    out = BenchResult(config=vars(cfg).copy(), variants=results, model_bytes=model_bytes)
    out.config["variants"] = list(cfg.variants)
    out.config["batch"] = batch_size(cfg)  # sequences per step actually used
    out.config["machine"] = describe(cfg.device)
    if cfg.device == "cuda":
        base = results["bare"].peak_bytes or 0
        out.memory = {n: (v.peak_bytes or 0) - base for n, v in results.items()}
        out.memory_method = "CUDA max_memory_allocated delta against bare"
    return out
