#!/usr/bin/env bash
# Runs the compatibility and equivalence suites (tests/backends/test_compat.py, test_distribute.py) on the
# TensorFlow, JAX and PyTorch backends against keras-nightly, to see early what the next Keras breaks in the
# private APIs distkeras reaches into. Usage: bash scripts/nightly.sh [pytest args, e.g. -x or -k NAME]
#
# The nightly lives in .venv-nightly, made once beside .venv and sharing its packages: a .pth file in its
# site-packages adds .venv's site-packages (and runs that directory's .pth files, so the editable distkeras
# install is seen too) after its own, and only keras-nightly is pip-installed there, without dependencies,
# so `import keras` finds the nightly ahead of .venv's Keras 3.15 while TensorFlow, JAX and torch are .venv's.
# KERAS_NIGHTLY picks another build (`pip index versions --pre keras-nightly` lists them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KERAS_NIGHTLY="${KERAS_NIGHTLY:-3.16.0.dev2026102704}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  source "$ROOT/scripts/env.sh"
fi
source "$ROOT/scripts/venv.sh"
VENV_NIGHTLY="$ROOT/.venv-nightly"
# keras-nightly asks for the same pure-Python packages as Keras 3.15 (absl-py, numpy, rich, namex, h5py,
# optree, ml-dtypes, packaging), all in .venv: nothing else to install. --no-deps keeps pip from
# touching what .venv provides.
make_venv "$VENV_NIGHTLY" "$ROOT/.venv/bin/python" --no-deps "keras-nightly==$KERAS_NIGHTLY"
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
echo "import site; site.addsitedir('$(site_of "$ROOT/.venv/bin/python")')" \
  > "$(site_of "$VENV_NIGHTLY/bin/python")/distkeras-main-venv.pth"

export KERAS_HOME="$VENV_NIGHTLY/keras-home"
mkdir -p "$KERAS_HOME"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export PATH="$VENV_NIGHTLY/bin:$PATH"
PY="$VENV_NIGHTLY/bin/python"
echo "keras-nightly: $("$PY" -c 'import keras; print(keras.__version__, "from", keras.__file__)')"
# The full matrices (tests/full.py): every pattern at N=2 and N=3, every save reloaded in every backend.
DISTKERAS_FULL_TESTS="${DISTKERAS_FULL_TESTS:-1}" \
DISTKERAS_SUITES=tensorflow,jax,torch \
DISTKERAS_TESTS=tests/backends/test_compat.py,tests/backends/test_distribute.py \
  exec "$PY" "$ROOT/scripts/run_tests.py" "$@"
