#!/usr/bin/env bash
# The GPU figures of docs/results/gpu/: the race benchmark on whatever GPU is present, on the training clock.
#   1. one GPU: Lightning's single-device Trainer, Lightning's DDP (1 process) and the strategy's defaults, on
#      XMC mini with dense gradients and on the Fashion-MNIST CNN: per-step overhead and throughput;
#   2. 4 replicas sharing the GPU under the strong profile: the defaults against DDP sharing it the same way.
# Uses $AESGD_PYTHON (default python3) as it is. Each race runs 3 repeats (their spread is in results.json);
# XMC mini on one GPU runs 20 epochs (560 steps of a few milliseconds: the default 4 epochs last well under a
# second on a GPU, too short to tell a few percent). Extra arguments go to every race and win (e.g. --repeats 5).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${AESGD_PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${AESGD_GPU_BENCH_OUT:-bench_results/gpu}"
race() { "$python" -m lightning_aesgd.bench --repeats 3 "$@"; }
one_gpu=(--profiles real --algorithms single_device,ddp,adaptive_elastic --override experiment=gpu
         --override devices.num_replicas=1)
race --workload xmc_mini "${one_gpu[@]}" --override model.sparse_gradients=false --epochs 20 \
     --out "$out/xmc_mini_one_gpu" "$@"
race --workload fashion_mnist "${one_gpu[@]}" --out "$out/fashion_mnist_one_gpu" "$@"
race --workload xmc_mini --profiles strong --algorithms adaptive_elastic,ddp --override experiment=gpu_shared \
     --out "$out/xmc_mini_shared_strong" "$@"
