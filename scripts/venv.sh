# Sourced by env.sh and mxnet-env.sh. make_venv DIR PYTHON REQUIREMENT...: create the virtual environment
# DIR with PYTHON (once), and pip-install the requirements whenever they or pyproject.toml changed since
# the last install (a stamp file in DIR holds their hash), so running it again costs nothing.
make_venv() {
  local venv="$1" python="$2" stamp want
  shift 2
  stamp="$venv/.distkeras-reqs"
  want="$(printf '%s\n' "$@" | cat - "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$@"
    echo "$want" > "$stamp"
  fi
}
