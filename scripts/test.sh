#!/usr/bin/env bash
# Run the whole test suite with lint and type checks; installs what it needs first. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="$(scripts/setup_env.sh --with-data)"
"$python" -m ruff check .
"$python" -m ruff format --check .
"$python" -m mypy
# Test workers: most tests wait on processes they start (imports, rendezvous, timeouts), so two workers share
# even two cores well; more than four crowd a big machine with each one's replica processes. AESGD_TEST_WORKERS=0
# runs the tests in one process (for --pdb, or -p no:xdist); a `-n` of your own comes last and wins.
workers="${AESGD_TEST_WORKERS:-$("$python" -c 'import os; print(min(4, max(2, len(os.sched_getaffinity(0)))))')}"
if [[ "$workers" != 0 ]]; then
    set -- -n "$workers" "$@"
fi
exec "$python" -m pytest "$@"
