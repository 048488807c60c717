#!/usr/bin/env bash
# Sets up the environment (once) and runs the demo: an MLP on scikit-learn's digits, data-parallel
# over virtual CPU devices. KERAS_BACKEND picks the backend (tensorflow by default).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export KERAS_BACKEND="${KERAS_BACKEND:-tensorflow}"
exec distkeras demo "$@"
