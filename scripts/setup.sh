#!/usr/bin/env bash
# Create (or reuse) a virtual environment with torch and fxmem installed; source this file.
#   FXMEM_VENV   where the venv lives            (default: .venv)
#   FXMEM_TORCH  the torch requirement to install (default: torch==2.13.0, the CPU build on this
#                project's machines; elsewhere pip picks the build for your platform)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FXMEM_VENV:-$here/.venv}"
torch_req="${FXMEM_TORCH:-torch==2.13.0}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
log="$(mktemp)"
quiet() { "$@" >"$log" 2>&1 || { cat "$log" >&2; return 1; }; }
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "installing $torch_req into $venv ..." >&2
  quiet "$py" -m pip install "$torch_req"
fi
quiet "$py" -m pip install -e "$here[test]"
rm -f "$log"
export FXMEM_PY="$py"
