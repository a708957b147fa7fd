#!/usr/bin/env bash
# One call on a lent GPU machine, everything at once (its time is counted, its start is not cheap):
#   * the test suite on CUDA (CREDITAUDIT_TEST_DEVICE=cuda): the `device`-marked tests first, then the rest;
#   * benchmarks/gpu_throughput.py on the ResMLP, first and alone;
#   * the paper reproductions at their papers' budgets (docs/reproductions/parallel.py, which cuts a
#     rule to a stated reduced budget when it cannot finish before the deadline).
# What it needs beside the checkout: MNIST's IDX files in data/mnist, and the wheels in .whl of the
# packages the machine lacks (mnist1d). Results land in $OUT (logs, and repro.tgz with each audit).
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh 400        # the reproductions' deadline, seconds
#
# Knobs (environment): RULES (the rules to reproduce, "" for none), BENCH=0 (skip the benchmark,
# when it was measured already), WORKERS (pytest-xdist workers, default 4), QUICK=1 (also the quick
# audit on the GPU, --jobs 3, its audit.json and audit.md into $OUT/quick.tgz).
set -u
OUT=${OUT:-/tmp/gpu_session}
DEADLINE=${1:-400}
RULES=${RULES-"kolen-pollack dfa fa ep local-loss"}
WORKERS=${WORKERS:-4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
t0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, os; print('torch', torch.__version__, torch.cuda.get_device_name(), os.cpu_count(), 'cpus')"
} | tee "$OUT/machine.txt"
echo "set-up took $(( $(date +%s) - t0 )) s"

# the benchmark first, alone on the machine, so its timings are not shared with the rest
[ "${BENCH:-1}" = 0 ] || { timeout 100 python3 benchmarks/gpu_throughput.py --archs resmlp --methods bp fa dfa kolen-pollack ep local-loss \
    pepita --steps 20 >"$OUT/bench.log" 2>&1; echo "bench exit $?" >>"$OUT/bench.log"; }
# the tests that take the device fixture first (-m device, ~100), then the rest, which reach the GPU
# through `--device auto`; each with its own log and summary (-rfE)
( export CREDITAUDIT_TEST_DEVICE=cuda; end=$(( $(date +%s) + DEADLINE - 20 ))
  timeout $(( DEADLINE - 20 )) python3 -m pytest -q -rfE -n "$WORKERS" -p no:cacheprovider -m device \
      >"$OUT/tests-device.log" 2>&1; echo "pytest exit $?" >>"$OUT/tests-device.log"
  timeout $(( end - $(date +%s) )) python3 -m pytest -q -rfE -n "$WORKERS" -p no:cacheprovider -m "not device" \
      >"$OUT/tests.log" 2>&1; echo "pytest exit $?" >>"$OUT/tests.log" ) &
if [ "${QUICK:-0}" = 1 ]; then
  ( s=$(date +%s); timeout $(( DEADLINE - 10 )) python3 -m creditaudit audit --preset quick --device cuda --jobs 3 \
        --out audits/quick-cuda >"$OUT/quick.log" 2>&1
    echo "quick audit exit $? after $(( $(date +%s) - s )) s" >>"$OUT/quick.log"
    tar czf "$OUT/quick.tgz" audits/quick-cuda/audit.json audits/quick-cuda/audit.md 2>/dev/null ) &
fi
[ -z "$RULES" ] || python3 docs/reproductions/parallel.py --data-dir data --deadline "$DEADLINE" --probe 75 \
    --jobs 3 $RULES 2>&1 | tee "$OUT/repro.log"
wait
tar czf "$OUT/repro.tgz" audits/reproduce/*/audit.json audits/reproduce/*/audit.md audits/reproduce/logs 2>/dev/null
[ -f "$OUT/bench.log" ] && { echo "--- bench"; tail -n 30 "$OUT/bench.log"; }
echo "--- tests"; grep -hE "^FAILED|^ERROR|passed|failed|pytest exit" "$OUT/tests-device.log" "$OUT/tests.log" | tail -n 40
[ "${QUICK:-0}" = 1 ] && { echo "--- quick audit"; tail -n 25 "$OUT/quick.log"; }
echo "all took $(( $(date +%s) - t0 )) s"
