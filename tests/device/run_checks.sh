#!/usr/bin/env bash
# The standing GPU check, in one run on a lent CUDA device (each part under a time limit, 9 minutes
# at most together: one device call of 600 s holds it):
#   0. the device itself (CUDA must be there: without it every CUDA test would skip and pass) and the
#      libraries named in EXPECT (a comma list, e.g. EXPECT=flash_attn,transformer_engine): one that
#      does not import fails the run — it is exported as STABKIT_EXPECT, so the tests that use it fail
#      instead of skipping;
#   1. the device tests (tests/device/test_cuda.py: real SDPA backends and FlexAttention measured
#      exactly, observation only, Inductor full monitoring; tests/device/test_cuda_interventions.py: a
#      backward through attn_softcap and qk_norm on CUDA SDPA and FlexAttention against a reference)
#      and the CUDA sync-debug test; pytest lists its skips (-rs);
#   2. stabkit bench --device cuda --size gpt2 --bf16 (shortened rounds);
#   3. the fixed cost: stabkit bench --device cuda --size small-step --paired (a launch-bound loop,
#      where each millisecond of Python per step is a millisecond of step time), then the
#      milliseconds each monitored variant adds per sampled and per unsampled step, from both benches;
#   4. stabkit run attention-logit-growth --size gpt2 --device cuda, shortened.
# Usage, from the repository root on the device machine:  bash tests/device/run_checks.sh [OUT]
# Needs a python3 with CUDA torch, click, scipy, numpy, tensorboard and pytest (the lent machine's
# image has them); stabkit runs from this checkout (PYTHONPATH): nothing is installed. Each part's
# output goes to OUT/<part>.txt (OUT: the argument, else $OUT, else runs/device-check), at most
# nine files; the exit status is 1 when any part failed.
set -uo pipefail
out="${1:-${OUT:-runs/device-check}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
failed=0

part() {  # part NAME LIMIT_S COMMAND...: run it into OUT/NAME.txt, print its tail
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    tail -n 30 "$out/$name.txt"
    [ "$rc" -eq 0 ] || failed=1
}

export STABKIT_EXPECT="${EXPECT:-}"
part device 60 "$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
if [ -n "${EXPECT:-}" ]; then
    part libraries 60 "$py" - "$EXPECT" <<'PY'
import importlib, sys
missing = []
for name in filter(None, sys.argv[1].split(",")):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:  # expected here: its absence fails the run
        missing.append(name)
        print(name, "MISSING:", type(exc).__name__, exc)
sys.exit(1 if missing else 0)
PY
fi
part tests 210 "$py" -m pytest -q -rs -p no:cacheprovider tests/device \
    tests/bench/test_bench.py::test_no_host_sync_between_log_intervals_on_cuda
part bench 150 "$py" -m stabkit bench --device cuda --size gpt2 --bf16 --steps 10 --repeats 3 --json "$out/bench.json"
part fixed 60 "$py" -m stabkit bench --device cuda --size small-step --paired --variants bare,default,every100 \
    --steps 30 --repeats 3 --no-memory --json "$out/bench-fixed.json"
"$py" - "$out" <<'PY' | tee "$out/added-ms.txt"
import json, pathlib, sys
for name in ("bench.json", "bench-fixed.json"):  # ms added per step on CUDA (wall, each step synchronized)
    path = pathlib.Path(sys.argv[1]) / name
    if not path.exists():
        print(f"{name}: missing")
        continue
    data = json.loads(path.read_text())
    size = data["config"]["size"]
    for variant, row in data["variants"].items():
        if row.get("added_ms_unsampled") is None and row.get("added_ms_sampled") is None:
            continue
        cells = []
        for kind in ("sampled", "unsampled"):
            ms, noise = row.get(f"added_ms_{kind}"), row.get(f"added_ms_{kind}_noise")
            cells.append(f"{kind} " + ("-" if ms is None else f"{ms:+.2f} ms" + (f" ±{noise:.2f}" if noise else "")))
        print(f"ms added per step, {size} {variant} (x{row['ratio_to_bare']:.3f}): " + ", ".join(cells))
PY
recipe_out="$(mktemp -d)"
part recipe 120 "$py" -m stabkit run attention-logit-growth --size gpt2 --device cuda --steps 100 --out "$recipe_out"
cp "$recipe_out/summary.json" "$out/recipe-summary.json" 2>/dev/null
exit "$failed"
