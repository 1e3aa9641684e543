#!/usr/bin/env bash
# Create (or reuse) a virtual environment with torch and fxmem installed; source this file.
# Says on stderr what it creates and installs, as it does.
#   FXMEM_VENV   where the venv lives            (default: .venv)
#   FXMEM_TORCH  the torch requirement to install (default: torch==2.13.0, the CPU build on this
#                project's machines; elsewhere pip picks the build for your platform)
#   FXMEM_LATEST 1: the newest versions of every other package PyPI serves; otherwise the versions the
#                tests were proved with (scripts/pinned.txt, pip constraints)
#   FXMEM_EXTRAS the package's extras to install (default: test, what the test suite needs; the demo
#                sets none: it needs fxmem and its dependencies only)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FXMEM_VENV:-$here/.venv}"
torch_req="${FXMEM_TORCH:-torch==2.13.0}"
say() { echo "setup: $*" >&2; }
if [ ! -x "$venv/bin/python" ]; then
  say "creating a virtual environment in $venv (python3 -m venv)"
  python3 -m venv "$venv"
else
  say "using the virtual environment in $venv"
fi
py="$venv/bin/python"
log="$(mktemp)"
quiet() { "$@" >"$log" 2>&1 || { cat "$log" >&2; return 1; }; }
if [ "${FXMEM_LATEST:-0}" = 1 ]; then
  pins=(--upgrade --upgrade-strategy eager)
  which="the newest versions PyPI serves (FXMEM_LATEST=1)"
else
  pins=(-c "$here/scripts/pinned.txt")
  which="the versions the tests were proved with (scripts/pinned.txt)"
fi
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  say "installing $torch_req (pip; the largest download, a few minutes) ..."
  quiet "$py" -m pip install "$torch_req" "${pins[@]}"
else
  say "torch $("$py" -c 'import torch; print(torch.__version__)') is installed already"
fi
extras="${FXMEM_EXTRAS-test}"
if [ -n "$extras" ]; then
  say "installing fxmem from $here with its dependencies (sympy, networkx, graphviz) and the extras [$extras] (test: pytest, transformers, torch-geometric, peft, ...), $which ..."
  quiet "$py" -m pip install -e "$here[$extras]" "$torch_req" "${pins[@]}"
else
  say "installing fxmem from $here with its dependencies (sympy, networkx, graphviz), $which ..."
  quiet "$py" -m pip install -e "$here" "$torch_req" "${pins[@]}"
fi
rm -f "$log"
say "ready: $py"
export FXMEM_PY="$py"
