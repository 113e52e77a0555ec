"""`stabkit bench` runs end to end; on CUDA, monitored steps between log intervals never sync."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from stabkit.bench import BenchConfig
from stabkit.bench.report import memory_verdict
from stabkit.cli import main


@pytest.mark.multiprocess
def test_bench_tiny_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main,
        ["bench", "--size", "tiny", "--steps", "5", "--repeats", "1", "--json", str(out)],
        standalone_mode=False,
    )
    assert result.exit_code == 0, result.output
    for name in ("bare", "default", "full", "anomaly"):
        assert name in result.output
    data = json.loads(out.read_text())
    rows = data["variants"]
    assert rows["bare"]["ratio_to_bare"] == 1.0
    for name in ("default", "full", "anomaly"):
        assert rows[name]["median_step_s"] > 0
        assert rows[name]["ratio_to_bare"] == pytest.approx(
            rows[name]["median_step_s"] / rows["bare"]["median_step_s"]
        )
        assert rows[name]["memory_overhead_bytes"] is not None  # peak tensor memory delta
        assert rows[name]["rss_overhead_bytes"] is not None
    assert data["model_bytes"] > 0


def test_bench_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        BenchConfig(variants=("bare", "fast"))
    with pytest.raises(ValueError, match="must be >= 1"):
        BenchConfig(steps=0)


def test_bench_measures_qk_clip_against_bare(monkeypatch: pytest.MonkeyPatch) -> None:
    import stabkit.bench.runner as runner
    from stabkit.bench import format_table, run_bench

    handles: dict[str, Any] = {}
    real = runner.apply_variant

    def spy(model: Any, optimizer: Any, variant: str) -> Any:
        handles[variant] = real(model, optimizer, variant)
        return handles[variant]

    monkeypatch.setattr(runner, "apply_variant", spy)
    result = run_bench(BenchConfig(size="tiny", steps=2, repeats=1, warmup=1, variants=("qk_clip",)))
    assert list(result.variants) == ["bare", "qk_clip"] and result.ratio("qk_clip") > 0
    assert handles["bare"] is None and handles["qk_clip"].options.tau == 100.0
    assert handles["qk_clip"].clips == 3  # it watched the optimizer: a clip pass after every step
    assert "qk_clip: the bare loop with QK-Clip at tau 100" in format_table(result)
    with pytest.raises(ValueError, match="without --compile"):
        BenchConfig(variants=("qk_clip",), compile=True)


def test_memory_verdict() -> None:
    assert memory_verdict(5, 1000, None) == "ok"
    assert memory_verdict(15, 1000, 10) == "within noise"
    assert memory_verdict(15, 1000, 2) == "OVER"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_between_log_intervals_on_cuda() -> None:
    import stabkit
    from stabkit.harness.models import GPT, preset_config

    model = GPT(preset_config("tiny")).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log_every = 5
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(every=2, log_every=log_every, console=False)
    )
    x = torch.randint(0, 256, (4, 64), device="cuda")
    for step in range(3 * log_every):
        flushing = (step + 1) % log_every == 0
        torch.cuda.set_sync_debug_mode("warn" if flushing else "error")
        try:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
            loss.backward()
            opt.step()
            if not flushing:
                mon.step(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if flushing:
            mon.step(loss)  # the one host copy of the interval happens here
        opt.zero_grad(set_to_none=True)
    mon.detach()


def test_bench_widens_the_preset_keeping_its_head_dimension() -> None:
    from stabkit.bench.runner import batch_size, model_config
    from stabkit.harness.models import preset_config

    small = preset_config("small")
    wide = model_config(BenchConfig(d_model=256, batch_size=8))
    assert (wide.d_model, wide.n_heads) == (256, 8)  # small: 128 / 4 heads -> head dim 32 kept
    assert (wide.n_layers, wide.context, wide.vocab_size) == (small.n_layers, small.context, small.vocab_size)
    assert batch_size(BenchConfig(d_model=256, batch_size=8)) == 8
    assert model_config(BenchConfig()) == small
    with pytest.raises(ValueError, match="multiple of the small preset's head dimension 32"):
        BenchConfig(d_model=100)
    with pytest.raises(ValueError, match="batch-size"):
        BenchConfig(batch_size=0)


def test_bench_cli_runs_a_wider_model_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--size", "tiny", "--d-model", "128", "--batch-size", "2", "--steps", "1"]
    result = CliRunner().invoke(
        main,
        [*args, "--repeats", "1", "--variants", "bare,full", "--no-memory", "--json", str(out)],
        standalone_mode=False,
    )
    assert result.exit_code == 0, result.output
    assert "size=tiny d_model=128 seq_len=preset batch=2" in result.output
    data = json.loads(out.read_text())
    assert data["config"]["d_model"] == 128 and data["config"]["batch"] == 2
    bad = CliRunner().invoke(main, ["bench", "--size", "tiny", "--d-model", "100"])
    assert bad.exit_code == 2 and "--d-model must be a positive multiple" in bad.output
