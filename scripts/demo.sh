#!/usr/bin/env bash
# Sets up the environment (once) and runs the demo: an MLP on scikit-learn's digits, data-parallel
# over virtual CPU devices. KERAS_BACKEND picks the backend (tensorflow by default); a new environment gets only
# that backend's packages (scripts/test.sh adds the rest).
export KERAS_BACKEND="${KERAS_BACKEND:-tensorflow}"
DISTKERAS_ENV_BACKEND="$KERAS_BACKEND"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec distkeras demo "$@"
