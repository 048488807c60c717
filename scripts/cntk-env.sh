# Creates (once) and refreshes the CNTK test environment, .venv-cntk: CPython 3.6 with CNTK 2.7 and
# Keras 2.3.1 (CNTK 2.7's wheels exist for CPython 3.5/3.6 only), and the Open MPI its libraries load.
# Run it (`bash scripts/cntk-env.sh`) to set it up; source it to also use it in this shell. Idempotent:
# a stamp file holding the hash of the requirements skips pip when nothing changed.
#
# Python 3.6 comes from $DISTKERAS_PYTHON36, else `python3.6` on PATH, else pyenv's newest 3.6.x. Where
# none exists this prints why and exits 0 without an environment: the CNTK suite's real-runtime tests
# then skip, saying so. Open MPI (`mpiexec`, libmpi.so.40) is installed with apt-get when missing and
# this runs as root; otherwise install it yourself (Debian/Ubuntu: openmpi-bin libopenmpi3).
#
# CNTK 2.7's libraries were linked against Open MPI 1.10 (libmpi.so.12, libmpi_cxx.so.1) and find
# their neighbours through the run path $ORIGIN, so two links in cntk/libs point those names at the
# system's Open MPI 4 (libmpi.so.40, libmpi_cxx.so.40), whose MPI-2 C and C++ interfaces CNTK uses.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_CNTK="$ROOT/.venv-cntk"
# The newest wheels that still support 3.6; pip 21.3.1 is the last pip for 3.6 (its bundled one can't
# read today's wheel metadata). --only-binary: nothing of this is built from source.
REQS_CNTK=("cntk==2.7.post2" "keras==2.3.1" "numpy==1.19.5" "h5py==2.10.0" "scipy==1.5.4" "pytest==7.0.1")

cntk_env_skip() {  # why: print it and stop without failing whoever ran or sourced this
  echo "scripts/cntk-env.sh: $1; the CNTK suite's real-runtime tests will skip." >&2
  if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; else exit 0; fi
}

find_python36() {
  local candidate
  if [ -n "${DISTKERAS_PYTHON36:-}" ]; then
    echo "$DISTKERAS_PYTHON36"
    return
  fi
  if command -v python3.6 >/dev/null 2>&1 && python3.6 -c "" >/dev/null 2>&1; then
    command -v python3.6
    return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    candidate="$(ls -d "$(pyenv root)"/versions/3.6.* 2>/dev/null | sort -V | tail -n 1)"
    if [ -n "$candidate" ] && [ -x "$candidate/bin/python3.6" ]; then
      echo "$candidate/bin/python3.6"
      return
    fi
  fi
}

cntk_env_main() {
  local python36 stamp want libs lib
  python36="$(find_python36)"
  if [ -z "$python36" ] || ! "$python36" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 6))' 2>/dev/null; then
    cntk_env_skip "no CPython 3.6 found (tried \$DISTKERAS_PYTHON36, python3.6 on PATH, pyenv's versions/3.6.*)${python36:+; $python36 is not one}"
    return 0
  fi
  if ! command -v mpiexec >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep 'libmpi_cxx\.so\.40' >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "scripts/cntk-env.sh: installing Open MPI (openmpi-bin libopenmpi3) for CNTK" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi3 >/dev/null \
        || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi3 >/dev/null; } \
        || { cntk_env_skip "apt-get could not install Open MPI"; return 0; }
    else
      cntk_env_skip "Open MPI 4 (mpiexec, libmpi_cxx.so.40) is missing; install openmpi-bin and libopenmpi3"
      return 0
    fi
  fi
  if [ ! -x "$VENV_CNTK/bin/python" ]; then
    "$python36" -m venv "$VENV_CNTK"
  fi
  stamp="$VENV_CNTK/.distkeras-reqs"
  want="$(printf '%s\n' "${REQS_CNTK[@]}" | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV_CNTK/bin/python" -m pip install --quiet --disable-pip-version-check "pip==21.3.1"
    "$VENV_CNTK/bin/python" -m pip install --quiet --disable-pip-version-check --only-binary=:all: "${REQS_CNTK[@]}"
    echo "$want" > "$stamp"
  fi
  libs="$("$VENV_CNTK/bin/python" -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("cntk").origin), "libs"))')"
  for pair in "libmpi.so.12 libmpi.so.40" "libmpi_cxx.so.1 libmpi_cxx.so.40"; do
    set -- $pair
    # awk reads to the end: a reader that stops early (exit, grep -q) kills ldconfig with SIGPIPE, and under
    # pipefail that 141 ends this script.
    lib="$(ldconfig -p | awk -v name="$2" '$1 == name && /x86-64/ && lib == "" {lib = $NF} END {print lib}')"
    [ -n "$lib" ] || { cntk_env_skip "ldconfig finds no $2 (Open MPI 4)"; return 0; }
    ln -sfn "$lib" "$libs/$1"
  done
  mkdir -p "$VENV_CNTK/keras-home"
}

cntk_env_main
if [ "${BASH_SOURCE[0]}" != "$0" ] && [ -x "$VENV_CNTK/bin/python" ]; then  # sourced: use it in this shell
  export KERAS_HOME="$VENV_CNTK/keras-home" KERAS_BACKEND=cntk
  export PATH="$VENV_CNTK/bin:$PATH"
fi
