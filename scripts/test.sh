#!/usr/bin/env bash
# Sets up the environment (once) and runs every test suite, each backend in its own process.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python "$ROOT/scripts/run_tests.py" "$@"
