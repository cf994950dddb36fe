#!/usr/bin/env bash
# A time-boxed session on a borrowed GPU machine that reaches no package registry, in two steps.
#
#   scripts/gpu_session.sh pack
#       Here, where pip reaches a registry: fills .gpu/ (git-ignored) with what that machine lacks, the wheels of
#       Hydra, jsonargparse and the sweepers at the versions this environment holds (for $AESGD_GPU_PYTHON_VERSION,
#       3.12 by default, on x86-64), and Fashion-MNIST's four files where they are installed here. Carry `.gpu`.
#   scripts/gpu_session.sh run STAGE...
#       There: installs the wheels into /tmp/site (the image's torch and Lightning stay), then runs the stages in
#       the order given, each under `timeout` ($AESGD_GPU_STAGE_SECONDS, 480 by default), its output in
#       $OUT/STAGE.log (./gpu_session_out without $OUT). Exits non-zero if any stage failed or ran out of time.
#       A stage written `a+b` runs a and b at the same time (checks whose timings mean nothing, e.g.
#       `cuda-tests+check`); `STAGE@SECONDS` gives a stage (or such a group) its own time box.
# Stages, most telling first for the checks that need a GPU:
#   cuda-tests  the tests marked `cuda`, each named in the log as it ends (a few minutes; AESGD_GPU_TEST_WORKERS=N
#               runs them in N pytest workers)
#   check       steps 1-4 of scripts/gpu_check.sh (scripts/gpu_check.py; step 5 is the cuda-tests stage): every
#               algorithm config, the experiments, replicas sharing the GPU, GPU + CPU
#               (AESGD_GPU_CHECK_JOBS runs several at once; 4 by default here)
#   bench       scripts/gpu_bench.sh: one GPU against DDP and a single-device Trainer, 4 replicas sharing it
#               (AESGD_GPU_BENCH_ONLY picks races); each race's table is appended to the log, and its
#               records (results.json, each run's record.json and metrics.csv) come back in bench_results.tgz
#   probe       scripts/gpu_sharing_probe.py: what a host synchronisation costs on a shared GPU
#   placement   the placement benchmark on XMC EURLex-shaped data (GPU alone, GPU + CPU replicas, CPU alone)
#   seeds       the GPU claims of the seed papers: Crossbow's learners on one GPU, Adaptive Hogbatch (CPU replicas
#               beside it): seeds --claims crossbow_learners_gpu,adaptive_hogbatch
#   suite       the whole test suite, each test named as it ends (AESGD_GPU_SUITE_WORKERS workers, 12 by default,
#               one thread each)
# Arguments after `--` go to every stage's command. Example, in one call of the device tool:
#   carry [".gpu"], command "scripts/gpu_session.sh run cuda-tests+check@240 bench@300"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# What the GPU image lacks, by the names pip knows them (the image holds torch, Lightning, pytest and the rest).
CARRIED=(hydra-core omegaconf antlr4-python3-runtime PyYAML jsonargparse docstring-parser typeshed-client
         hydra-optuna-sweeper optuna alembic SQLAlchemy Mako colorlog cmaes greenlet hydra-submitit-launcher
         submitit pytest-xdist execnet)
FASHION_MNIST=/usr/share/datasets/fashion-mnist
STAGES=(cuda-tests check bench probe placement seeds suite)

pack() {
    local python version wheels=.gpu/whl
    python="$(scripts/setup_env.sh)"
    version="${AESGD_GPU_PYTHON_VERSION:-3.12}"
    rm -rf "$wheels" && mkdir -p "$wheels"
    local specs=()
    for name in "${CARRIED[@]}"; do
        if held="$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null)"; then
            specs+=("$name==$held")
        fi
    done
    echo "[gpu_session] wheels for Python $version: ${specs[*]}" >&2
    local platforms=()
    for n in 17 24 27 28 31 34 35; do
        platforms+=(--platform "manylinux_2_${n}_x86_64")
    done
    for spec in "${specs[@]}"; do
        # A package published as source alone (antlr4-python3-runtime 4.9.3) is pure Python: its wheel is built here.
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
            "${platforms[@]}" --platform manylinux2014_x86_64 -d "$wheels" "$spec" 2>/dev/null ||
            "$python" -m pip wheel -q --no-deps -w "$wheels" "$spec"
    done
    if [[ -d $FASHION_MNIST ]]; then
        mkdir -p .gpu/fashion-mnist
        cp "$FASHION_MNIST"/*-ubyte* .gpu/fashion-mnist/
    else
        echo "[gpu_session] no Fashion-MNIST at $FASHION_MNIST: its stages will fail there" >&2
    fi
    du -sh .gpu >&2
    echo "[gpu_session] carry .gpu; there: scripts/gpu_session.sh run ${STAGES[*]}" >&2
}

test_workers() {  # -n N for pytest where AESGD_GPU_TEST_WORKERS=N asks for it and pytest-xdist is installed
    if [[ -n ${AESGD_GPU_TEST_WORKERS:-} ]] && python3 -c "import xdist" 2>/dev/null; then
        echo "-n $AESGD_GPU_TEST_WORKERS"
    fi
}

stage_command() {  # the command of one stage, extra arguments last
    local stage=$1
    shift
    local cuda_files
    cuda_files="$(grep -rl --include='test_*.py' pytest.mark.cuda tests | sort | tr '\n' ' ')"
    case $stage in
        cuda-tests) echo python3 -m pytest -o addopts= -p no:cacheprovider -v -m cuda "$(test_workers)" \
                        "$cuda_files" "$@" ;;
        check) echo python3 scripts/gpu_check.py "$@" ;;
        bench) echo scripts/gpu_bench.sh "$@" ;;
        probe) echo python3 scripts/gpu_sharing_probe.py "$@" ;;
        placement) echo python3 -m lightning_aesgd.bench placement --workloads xmc_eurlex --repeats 3 "$@" ;;
        seeds) echo python3 -m lightning_aesgd.bench seeds --claims crossbow_learners_gpu,adaptive_hogbatch "$@" ;;
        suite) # The files of cuda tests first, the others after: the slowest tests there then start first (a
               # directory named beside its own files would be collected in its own order). The slowest tests'
               # durations close the log, also when the time box stops it: on a GPU machine tests ran several
               # times slower than here, and which ones is what the next time box needs to know. Work stealing
               # (pytest-xdist >= 3.2, carried): xdist hands each worker a block of tests in collection order, and
               # in the fourth session most of the 11 cuda tests that did not end had likely never started, queued
               # behind one worker's block while others had finished theirs.
               echo python3 -m pytest -p no:cacheprovider -v --durations=60 --dist worksteal \
                   -n "${AESGD_GPU_SUITE_WORKERS:-12}" \
                   "$cuda_files" \
                   "$(find tests -name 'test_*.py' | sort | grep -vxF "${cuda_files// /$'\n'}" | tr '\n' ' ')" \
                   lightning_aesgd "$@" ;;
        *) return 1 ;;
    esac
}

run_stage() {  # run_stage STAGE SECONDS OUT EXTRA...: one stage under its time box; its exit status
    local stage=$1 seconds=$2 out=$3 command status started=$SECONDS
    shift 3
    command="$(stage_command "$stage" "$@")"
    echo "== $stage: $command (at most $seconds s)"
    set +e
    if [[ $stage == suite ]]; then
        OMP_NUM_THREADS=1 timeout --signal=INT --kill-after=20 "$seconds" $command >"$out/$stage.log" 2>&1
    else
        timeout --signal=INT --kill-after=20 "$seconds" $command >"$out/$stage.log" 2>&1
    fi
    status=$?
    set -e
    if [[ $stage == bench ]]; then
        for table in bench_results/gpu/*/results.md; do
            [[ -f $table ]] && { echo "== $table"; cat "$table"; } >>"$out/$stage.log"
        done
        [[ -d bench_results/gpu ]] && tar -czf "$out/bench_results.tgz" \
            --exclude='*.ckpt' --exclude='*.pt' --exclude='*.png' bench_results/gpu
    fi
    echo "== $stage: exit $status after $((SECONDS - started)) s (124: out of time); last lines:"
    tail -n 5 "$out/$stage.log"
    return "$status"
}

run() {
    local specs=() extra=() spec stage group=()
    while (($#)); do
        if [[ $1 == -- ]]; then
            shift
            extra=("$@")
            break
        fi
        spec=${1%%@*}
        if [[ $1 == *@* ]] && ! [[ ${1#*@} =~ ^[0-9]+$ ]]; then
            echo "gpu_session: '$1': the time box after @ is a number of seconds" >&2
            exit 2
        fi
        IFS=+ read -ra group <<<"$spec"
        for stage in "${group[@]}"; do
            stage_command "$stage" >/dev/null || { echo "gpu_session: no stage '$stage'; stages: ${STAGES[*]}" >&2; exit 2; }
        done
        specs+=("$1")
        shift
    done
    ((${#specs[@]})) || { echo "gpu_session: name the stages to run: ${STAGES[*]}" >&2; exit 2; }
    if [[ -d .gpu/whl ]] && [[ -z ${AESGD_GPU_SKIP_WHEELS:-} ]]; then
        # Into the interpreter's own site-packages where it lets us (the wheel test's fresh environment reuses
        # those, never PYTHONPATH); else beside it, on PYTHONPATH.
        local install=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
        if "${install[@]}" --break-system-packages .gpu/whl/*.whl 2>/dev/null ||
            "${install[@]}" .gpu/whl/*.whl 2>/dev/null; then
            echo "gpu_session: wheels installed into $(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
        else
            echo "gpu_session: site-packages refused the wheels; installed into /tmp/site, on PYTHONPATH" >&2
            "${install[@]}" --target /tmp/site .gpu/whl/*.whl
            export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        fi
    fi
    if [[ -d .gpu/fashion-mnist ]]; then
        export AESGD_FASHION_MNIST_DIR="$PWD/.gpu/fashion-mnist"
    fi
    # The package from this checkout, and its pytest plugin (the `aesgd_trainer` fixture) for the suite.
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" AESGD_PYTHON=python3 PYTHONUNBUFFERED=1
    export AESGD_GPU_CHECK_JOBS="${AESGD_GPU_CHECK_JOBS:-4}" PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -p lightning_aesgd.testing"
    local out="${OUT:-gpu_session_out}" failed=()
    mkdir -p "$out"
    nvidia-smi -L 2>/dev/null || echo "gpu_session: no NVIDIA GPU visible" >&2
    for spec in "${specs[@]}"; do
        local seconds="${AESGD_GPU_STAGE_SECONDS:-480}" group=() pids=() i
        [[ $spec == *@* ]] && seconds=${spec#*@}
        IFS=+ read -ra group <<<"${spec%%@*}"
        for stage in "${group[@]}"; do
            run_stage "$stage" "$seconds" "$out" "${extra[@]}" &
            pids+=($!)
        done
        for i in "${!group[@]}"; do
            wait "${pids[$i]}" || failed+=("${group[$i]}")
        done
    done
    if ((${#failed[@]})); then
        echo "gpu_session: failed or out of time: ${failed[*]}" >&2
        exit 1
    fi
}

case "${1:-}" in
    pack) pack ;;
    run) shift && run "$@" ;;
    *)
        echo "usage: scripts/gpu_session.sh pack | run STAGE... [-- ARGS]; stages: ${STAGES[*]}" >&2
        exit 2
        ;;
esac
