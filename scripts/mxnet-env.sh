# Creates (once) and refreshes the MXNet test environment: keras-mxnet 2.2.4.3 (Keras 2) installs its own
# `keras` module, so it lives in a virtual environment of its own, .venv-mxnet, beside the Keras 3 one.
# Run it (`bash scripts/mxnet-env.sh`) to set it up; source it to also use it in this shell. Idempotent:
# a stamp file holding the hash of the requirements skips pip when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
PYTHON_MXNET="${PYTHON_MXNET:-python3}"
VENV_MXNET="$ROOT/.venv-mxnet"
# numpy 1.24 removed the aliases (np.bool, ...) MXNet 1.9.1 uses. psutil, matplotlib and scikit-learn are
# for the benchmark (python -m benchmarks run --backends mxnet), in versions that take numpy 1.23.
REQS_MXNET=("mxnet==1.9.1" "keras-mxnet==2.2.4.3" "numpy<1.24" "pytest>=7" "psutil==7.2.2" "matplotlib==3.10.9"
            "scikit-learn==1.6.1" -e "$ROOT")
make_venv "$VENV_MXNET" "$PYTHON_MXNET" "${REQS_MXNET[@]}"
# keras-mxnet writes keras.json with "backend": "mxnet" into KERAS_HOME when it finds none: it gets a
# KERAS_HOME of its own, so that file never reaches the Keras 3 environment or ~/.keras.
mkdir -p "$VENV_MXNET/keras-home"
if [ "${BASH_SOURCE[0]}" != "$0" ]; then  # sourced: use it in this shell
  export KERAS_HOME="$VENV_MXNET/keras-home" KERAS_BACKEND=mxnet
  export PATH="$VENV_MXNET/bin:$PATH"
fi
