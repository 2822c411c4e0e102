#!/usr/bin/env bash
# Set up .venv (first use) and run the whole test suite on the CPU, on two pytest workers (most tests wait on a
# subprocess of one thread: two workers keep both cores busy). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --test
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=10 "$@"
