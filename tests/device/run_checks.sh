#!/usr/bin/env bash
# The standing GPU check, in one run on a lent CUDA device (each part under a time limit, 8.5 minutes
# at most together: one device call of 600 s holds it):
#   1. the device tests (tests/device/test_cuda.py: real SDPA backends and FlexAttention measured
#      exactly, observation only, Inductor full monitoring) and the CUDA sync-debug test;
#   2. stabkit bench --device cuda --size gpt2 --bf16 (shortened rounds);
#   3. stabkit run attention-logit-growth --size gpt2 --device cuda, shortened.
# Usage, from the repository root on the device machine:  bash tests/device/run_checks.sh [OUT]
# Needs a python3 with CUDA torch, click, scipy, numpy, tensorboard and pytest (the lent machine's
# image has them); stabkit runs from this checkout (PYTHONPATH): nothing is installed. Each part's
# output goes to OUT/<part>.txt (OUT: the argument, else $OUT, else runs/device-check), at most
# six files; the exit status is 1 when any part failed.
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

"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee "$out/device.txt"
part tests 210 "$py" -m pytest -q -p no:cacheprovider tests/device \
    tests/bench/test_bench.py::test_no_host_sync_between_log_intervals_on_cuda
part bench 150 "$py" -m stabkit bench --device cuda --size gpt2 --bf16 --steps 10 --repeats 3 --json "$out/bench.json"
recipe_out="$(mktemp -d)"
part recipe 150 "$py" -m stabkit run attention-logit-growth --size gpt2 --device cuda --steps 100 --out "$recipe_out"
cp "$recipe_out/summary.json" "$out/recipe-summary.json" 2>/dev/null
exit "$failed"
