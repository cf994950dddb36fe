#!/usr/bin/env bash
# The GPU figures of docs/results/gpu/: the race benchmark on whatever GPU is present, on the training clock.
#   1. one GPU: Lightning's single-device Trainer, Lightning's DDP (1 process; the race's `ddp` skips DDP's
#      per-forward buffer broadcast, as the strategy does) and the strategy's defaults, on
#      XMC mini with dense gradients and on the Fashion-MNIST CNN: per-step overhead and throughput;
#   2. 4 replicas sharing the GPU under the strong profile: the defaults against DDP sharing it the same way (no
#      solo run, so no efficiency: a device-time budget of minutes is better spent on pairs).
# Uses $AESGD_PYTHON (default python3) as it is. Each race interleaves its entrants in every repeat (their spread
# is in results.json). Sized from the first GPU run (one H100): a run there spends most of its wall time starting,
# validating and testing, so validation is thinned; XMC mini's steps take about 4 ms on one GPU, so it trains 40
# epochs (1,120 steps); 4 replicas sharing the GPU train 60 epochs (420 gradient sums: 28 did not let the plan
# settle, and over 140 the first step's warm-up of 1.3-2.1 s, the same in every entrant, was a third of the
# defaults' training clock). Extra arguments go to every race and win (e.g. --repeats 5; not --out: the races would share it);
# AESGD_GPU_BENCH_REPEATS=N sets the repeats (3 by default) where extra arguments cannot reach, as in gpu_session.sh.
# AESGD_GPU_BENCH_ONLY=NAMES (a regular expression matching whole names, e.g. "xmc_mini_one_gpu|fashion_mnist_one_gpu")
# keeps those races: xmc_mini_one_gpu, fashion_mnist_one_gpu, xmc_mini_shared_strong.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${AESGD_PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${AESGD_GPU_BENCH_OUT:-bench_results/gpu}"
only="${AESGD_GPU_BENCH_ONLY:-.*}"
raced=0
failed=0
race() {  # race NAME ARGS...: one race into $out/NAME, unless AESGD_GPU_BENCH_ONLY leaves it out
    local name=$1
    shift
    if [[ $name =~ ^($only)$ ]]; then
        echo "== $name"
        raced=$((raced + 1))
        # A race with a failed run exits non-zero; the other races still run, and the script fails at the end.
        "$python" -m lightning_aesgd.bench --repeats "${AESGD_GPU_BENCH_REPEATS:-3}" --out "$out/$name" "$@" ||
            failed=$((failed + 1))
    fi
}
once_per_epoch=(--override ++trainer.val_check_interval=1.0)
one_gpu=(--profiles real --algorithms single_device,ddp,adaptive_elastic --no-solo --override experiment=gpu
         --override devices.num_replicas=1 "${once_per_epoch[@]}")
race xmc_mini_one_gpu --workload xmc_mini "${one_gpu[@]}" --override model.sparse_gradients=false --epochs 40 \
     --override ++trainer.check_val_every_n_epoch=10 "$@"
race fashion_mnist_one_gpu --workload fashion_mnist "${one_gpu[@]}" --epochs 1 "$@"
race xmc_mini_shared_strong --workload xmc_mini --profiles strong --algorithms adaptive_elastic,ddp --no-solo \
     --override experiment=gpu_shared --epochs 60 "${once_per_epoch[@]}" --override ++trainer.check_val_every_n_epoch=10 \
     "$@"
if ((raced == 0)); then
    echo "gpu_bench: AESGD_GPU_BENCH_ONLY=$only names no race" >&2
    exit 2
fi
if ((failed > 0)); then
    echo "gpu_bench: $failed of $raced races had failed runs (named beneath their tables)" >&2
    exit 1
fi
