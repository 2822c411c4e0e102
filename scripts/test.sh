#!/usr/bin/env bash
# Set up .venv (first use) and run the whole test suite on the CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --test
exec .venv/bin/python -m pytest -q --durations=10 "$@"
