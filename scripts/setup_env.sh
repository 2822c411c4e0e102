#!/usr/bin/env bash
# Create ./.venv on first use and install the pinned requirements (and the test extras with --test).
# Re-running is cheap: pip only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($python --version 2>&1)"
  "$python" -m venv .venv
fi
reqs=requirements.txt
[ "${1:-}" = "--test" ] && reqs=requirements-test.txt
stamp=".venv/.installed-$(basename "$reqs")"
if [ ! -f "$stamp" ] || [ "$reqs" -nt "$stamp" ] || [ requirements.txt -nt "$stamp" ]; then
  echo "setup: installing $reqs into .venv (first time: a few minutes, torch is large)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$reqs"
  touch "$stamp"
fi
