# Sourced by dist_train.sh and dist_test.sh: sets ROOT (the repository) and PYTHON, the
# interpreter: $PYTHON if set; else the active virtual / conda environment's python; else the
# project's .venv (made by tools/bootstrap.sh), whose python the other commands call.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && [ -x "$ROOT/.venv/bin/python" ]; then
        PYTHON="$ROOT/.venv/bin/python"
    else
        PYTHON=python
    fi
fi
