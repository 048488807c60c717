# Sourced by scripts/demo.sh and scripts/test.sh: create (once) and refresh the virtual environment
# with the three live Keras 3 backends, then export what every run needs. Idempotent: a stamp file
# holding the hash of the requirements skips pip when nothing changed. DISTKERAS_ENV_BACKEND (a shell variable
# demo.sh sets: tensorflow, jax or torch) installs only what the demo needs on that backend, unless the
# environment already holds everything.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/venv.sh"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
# torch is pinned to the CPU build here (a loose requirement pulls several GB of CUDA wheels); the
# package itself only asks for torch>=2.1 in its extra.
REQS=("torch==2.13.0" "keras==3.15.*" "tensorflow-cpu==2.21.*" "tf-keras==2.21.*" "jax[cpu]>=0.4.30" "ray[train]==2.60.0" "keras-hub==0.32.*" -e "$ROOT[dev]")
if [ -z "${DISTKERAS_ENV_BACKEND:-}" ] || venv_has "$VENV" .distkeras-reqs "${REQS[@]}"; then
  make_venv "$VENV" "$PYTHON" "${REQS[@]}"
else
  # The demo on one backend: Keras, that backend, scikit-learn (the digits data) and distkeras, nothing else.
  case "$DISTKERAS_ENV_BACKEND" in
    tensorflow) BACKEND_REQS=("tensorflow-cpu==2.21.*") ;;
    jax) BACKEND_REQS=("jax[cpu]>=0.4.30") ;;
    torch) BACKEND_REQS=("torch==2.13.0") ;;
    *) echo "KERAS_BACKEND=$DISTKERAS_ENV_BACKEND: the demo runs on tensorflow, jax or torch (MXNet and CNTK:" \
         "docs/backends/legacy-setup.md)" >&2
       return 2 ;;
  esac
  VENV_STAMP=".distkeras-reqs-$DISTKERAS_ENV_BACKEND" make_venv "$VENV" "$PYTHON" "keras==3.15.*" \
    "${BACKEND_REQS[@]}" "scikit-learn>=1.3" -e "$ROOT"
fi
# Keras reads its default backend from $KERAS_HOME/keras.json; keep ours apart from the user's (and
# from keras-mxnet's, which rewrites it to "mxnet").
export KERAS_HOME="$VENV/keras-home"
mkdir -p "$KERAS_HOME"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export PATH="$VENV/bin:$PATH"
