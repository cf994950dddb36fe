#!/usr/bin/env bash
# Run the whole test suite with lint and type checks; installs what it needs first. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="$(scripts/setup_env.sh --with-data)"
"$python" -m ruff check .
"$python" -m ruff format --check .
"$python" -m mypy
exec "$python" -m pytest "$@"
