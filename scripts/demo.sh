#!/usr/bin/env bash
# The main job: analyse seed 000's GAT and print its memory formulas (installs what it needs).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$here/scripts/setup.sh"
cd "$here"
exec "$FXMEM_PY" examples/seed_gat.py
