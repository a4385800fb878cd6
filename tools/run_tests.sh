#!/usr/bin/env bash
# The test suite: set up the environment (first time only) and run pytest.
#   bash tools/run_tests.sh [pytest args ...]
#
# The tests run in parallel worker processes (pytest-xdist): one per core, at most 4, each with
# an equal share of the cores as its torch / OpenMP threads (the tools the tests start inherit
# it). LINATTN_TEST_WORKERS sets the number of workers; 0 runs the tests in this one process
# with torch's default threads. With pytest's own -n or -p no:xdist among the arguments, those
# decide and nothing is added.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$(bash tools/bootstrap.sh | tail -n 1)"
export PYTHONUNBUFFERED=1
[ $# -gt 0 ] || set -- tests
CORES="$(nproc)"
WORKERS="${LINATTN_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}"
for arg in "$@"; do
    case "$arg" in -n|-n*|--numprocesses*|no:xdist) WORKERS=0 ;; esac
done
if [ "$WORKERS" -gt 1 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES / WORKERS > 0 ? CORES / WORKERS : 1 ))}"
    set -- -n "$WORKERS" --dist worksteal "$@"
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
