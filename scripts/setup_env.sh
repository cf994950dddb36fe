#!/usr/bin/env bash
# Prepare a Python environment for lightning_aesgd and print the interpreter to use.
#
# Uses, in order: $AESGD_PYTHON; the active virtual environment ($VIRTUAL_ENV); otherwise a project-local
# .venv that can see system packages, so that a GPU build of torch already installed is reused, not replaced.
# torch is installed only where none is importable: a CUDA build where an NVIDIA GPU is present, otherwise the
# CPU build $AESGD_CPU_TORCH (torch==2.13.0 by default; set PIP_INDEX_URL/PIP_EXTRA_INDEX_URL to a CPU wheel
# index where the default index serves CUDA builds). Everything else comes from pyproject.toml. With
# --with-data, Debian's dataset-fashion-mnist package is installed too when apt-get is available.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
log() { echo "[setup] $*" >&2; }

if [[ -n "${AESGD_PYTHON:-}" ]]; then
    python="$AESGD_PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
    python="$VIRTUAL_ENV/bin/python"
else
    if [[ ! -x .venv/bin/python ]]; then
        log "creating .venv"
        python3 -m venv --system-site-packages .venv
    fi
    python="$PWD/.venv/bin/python"
fi

if ! "$python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        spec="${AESGD_GPU_TORCH:-torch>=2.3}"
    else
        spec="${AESGD_CPU_TORCH:-torch==2.13.0}"
    fi
    log "installing $spec"
    "$python" -m pip install --quiet "$spec" >&2
fi

# Reinstall the project only when its metadata changed since the last install.
stamp="$("$python" -c 'import sys; print(sys.prefix)')/.lightning_aesgd-installed"
digest="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]] || ! "$python" -c "import lightning_aesgd" >/dev/null 2>&1; then
    log "installing lightning_aesgd with its development extras"
    "$python" -m pip install --quiet -e ".[dev]" >&2
    echo "$digest" > "$stamp"
fi

if [[ "${1:-}" == "--with-data" && ! -d /usr/share/datasets/fashion-mnist && -z "${AESGD_FASHION_MNIST_DIR:-}" ]]; then
    if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
        log "installing Debian's dataset-fashion-mnist"
        (apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; }) \
            || log "dataset-fashion-mnist could not be installed; Fashion-MNIST tests will be skipped"
    else
        log "Fashion-MNIST not found: install Debian's dataset-fashion-mnist or set AESGD_FASHION_MNIST_DIR"
    fi
fi

echo "$python"
