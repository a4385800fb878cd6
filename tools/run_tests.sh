#!/usr/bin/env bash
# The test suite: set up the environment (first time only) and run pytest.
#   bash tools/run_tests.sh [pytest args ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$(bash tools/bootstrap.sh | tail -n 1)"
export PYTHONUNBUFFERED=1
[ $# -gt 0 ] || set -- tests
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
