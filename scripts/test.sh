#!/usr/bin/env bash
# Sets up the environments (once), lints, builds the docs and runs every test suite, each backend in its own process.
set -euo pipefail
bash "$(dirname "${BASH_SOURCE[0]}")/mxnet-env.sh"
bash "$(dirname "${BASH_SOURCE[0]}")/cntk-env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# The linter must be clean (pyproject.toml's [tool.ruff] says which rules and why).
python -m ruff check --quiet "$ROOT"
# The docs site must build without a warning (broken links, docstrings, options rendered from the adapters).
SITE="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 python -m mkdocs build --strict --quiet --config-file "$ROOT/mkdocs.yml" --site-dir "$SITE"
rm -rf "$SITE"
exec python "$ROOT/scripts/run_tests.py" "$@"
