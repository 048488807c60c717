#!/usr/bin/env bash
# Sets up the environments (once) and runs every test suite, each backend in its own process.
set -euo pipefail
bash "$(dirname "${BASH_SOURCE[0]}")/mxnet-env.sh"
bash "$(dirname "${BASH_SOURCE[0]}")/cntk-env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python "$ROOT/scripts/run_tests.py" "$@"
