#!/usr/bin/env bash
# The main job: analyse seed 000's GAT and print its memory formulas (installs what it needs).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export FXMEM_EXTRAS="${FXMEM_EXTRAS-}"  # the demo needs fxmem and its dependencies, not the test packages
source "$here/scripts/setup.sh"
cd "$here"
echo "demo: analysing seed 000's GAT (examples/seed_gat.py) and printing its formulas" >&2
exec "$FXMEM_PY" examples/seed_gat.py
