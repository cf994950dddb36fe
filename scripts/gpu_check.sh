#!/usr/bin/env bash
# The checks that need a GPU, on whatever GPUs are present; exits non-zero on any failure.
#   1. every algorithm config trains XMC mini on the GPUs and tests it (P@1 within 0.01 of Lightning's DDP), but
#      crossbow, whose batched learners need dense layers: it trains Fashion-MNIST at 64 rows per learner;
#   2. the digits and Fashion-MNIST experiments;
#   3. 2 replicas sharing one GPU under both sync modes (experiment=gpu_shared);
#   4. GPU and CPU replicas side by side (devices=gpu_cpu) under hogbatch, adaptive_elastic and ddp;
#   5. the tests marked `cuda`.
# Uses $AESGD_PYTHON (default python3) as it is: no install step, so it runs where no registry can be reached.
# Extra arguments are Hydra overrides for every run of steps 1-4 (e.g. trainer.max_epochs=1 for a quick look);
# AESGD_GPU_CHECK_JOBS=N runs N of them at a time (default 1); AESGD_GPU_CHECK_ONLY=REGEX keeps the runs it names.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${AESGD_PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device is visible')"
"$python" scripts/gpu_check.py "$@"
# Only the CUDA tests, without the suite's options (pytest-timeout, hypothesis and the dev tools may be absent).
"$python" -m pytest -o addopts="" -p no:cacheprovider -q tests/test_cuda.py tests/engine/test_device_timeline.py \
    tests/emulation/test_clock.py -m cuda
