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
# runs in this process alone; a `-n` of your own comes last and wins.
workers="${AESGD_TEST_WORKERS:-$("$python" -c 'from lightning_aesgd.placement import available_cores as c; print(min(4, max(2, c())))')}"
exec "$python" -m pytest -n "$workers" "$@"
