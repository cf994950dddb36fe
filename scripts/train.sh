#!/usr/bin/env bash
# Run the main job (the default experiment of configs/train.yaml); installs what it needs first.
# Extra arguments are Hydra overrides, e.g. `scripts/train.sh algorithm=sma devices=mild`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="$(scripts/setup_env.sh)"
exec "$python" -m lightning_aesgd.train "$@"
