# Sourced by env.sh and mxnet-env.sh. make_venv DIR PYTHON REQUIREMENT...: create the virtual environment
# DIR with PYTHON (once), and pip-install the requirements whenever they or pyproject.toml changed since
# the last install (a stamp file in DIR holds their hash), so running it again costs nothing.
# VENV_STAMP names the stamp file (default .distkeras-reqs): a smaller set of requirements installed into the same
# environment (the demo's one backend) keeps a stamp of its own, and pip only ever adds, so every stamp stays true.
reqs_hash() {
  printf '%s\n' "$@" | cat - "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1
}

# venv_has DIR STAMP REQUIREMENT...: whether DIR's stamp file STAMP says these requirements are installed.
venv_has() {
  local venv="$1" stamp="$2"
  shift 2
  [ -x "$venv/bin/python" ] && [ "$(cat "$venv/$stamp" 2>/dev/null)" = "$(reqs_hash "$@")" ]
}

make_venv() {
  local venv="$1" python="$2" stamp="${VENV_STAMP:-.distkeras-reqs}"
  shift 2
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  if ! venv_has "$venv" "$stamp" "$@"; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$@"
    reqs_hash "$@" > "$venv/$stamp"
  fi
}
