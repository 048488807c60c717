#!/usr/bin/env bash
# Sets up the environments (once), lints, builds the docs and runs every test suite, each backend in its own process.
set -euo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
# The three environments are independent (own folders, own stamps): the MXNet and CNTK ones are made while the
# Keras 3 one is, each one's output kept apart and shown after it, and a failure in any ends the run.
LOGS="$(mktemp -d)"
bash "$HERE/mxnet-env.sh" >"$LOGS/mxnet" 2>&1 & MXNET_PID=$!
bash "$HERE/cntk-env.sh" >"$LOGS/cntk" 2>&1 & CNTK_PID=$!
source "$HERE/env.sh"
STATUS=0
for name in mxnet cntk; do
  pid_var="${name^^}_PID"
  if ! wait "${!pid_var}"; then
    echo "scripts/$name-env.sh failed:" >&2
    STATUS=1
  fi
  cat "$LOGS/$name"
done
rm -rf "$LOGS"
[ "$STATUS" = 0 ] || exit 1
# The linter must be clean (pyproject.toml's [tool.ruff] says which rules and why).
python -m ruff check --quiet "$ROOT"
# The docs site must build without a warning (broken links, docstrings, options rendered from the adapters).
SITE="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --config-file "$ROOT/mkdocs.yml" --site-dir "$SITE"
rm -rf "$SITE"
exec python "$ROOT/scripts/run_tests.py" "$@"
