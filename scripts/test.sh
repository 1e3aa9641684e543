#!/usr/bin/env bash
# The test suite (installs what it needs):
#   1. the whole suite on torch 2.13.0 (CPU build),
#   2. on torch 2.14.1 (CUDA build, no GPU needed): the tests that simulate CUDA with fake tensors,
#      the CUDA build's own refusals and a smoke set (tests/conftest.py: CUDA_PHASE_FILES); the
#      first phase already proves the rest (FXMEM_CUDA_SIM=0 skips this phase).
# graphviz's `dot` is installed with apt when missing, so diagram tests really render.
# Packages are installed at the versions the tests were proved with (scripts/pinned.txt);
#   bash scripts/test.sh --latest   runs the same tests against the newest versions PyPI serves, in
#   venvs of their own (.venv-latest, .venv-cuda-latest). Other arguments go to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
suffix=""
if [ "${1:-}" = --latest ]; then
  shift
  export FXMEM_LATEST=1
  suffix="-latest"
  echo "test: the newest versions of fxmem's dependencies (--latest), in .venv-latest and .venv-cuda-latest"
fi

if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing graphviz (apt-get; its dot program renders the diagrams the tests check) ..." >&2
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq graphviz >/dev/null) \
      || echo "warning: could not install graphviz (dot); diagram tests will fail" >&2
  else
    echo "warning: no apt-get; install graphviz (dot) yourself" >&2
  fi
fi

# a headless browser, so the memory-viewer page is opened offline as a user's browser would open it
# (tests/views/test_memory_viz.py; without one that test says so and skips, the page's content is still checked)
if ! command -v chromium-headless-shell >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing chromium-headless-shell (apt-get; the memory-viewer test opens its page offline) ..." >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  ($SUDO apt-get install -y -qq chromium-headless-shell >/dev/null 2>&1 \
     || ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium-headless-shell >/dev/null 2>&1)) \
    || echo "warning: could not install chromium-headless-shell; the browser test will skip" >&2
fi

# tests kill processes on purpose (kernels that die in a probe's child, gloo ranks): none of them may
# leave a core file (a copy of a test process, hundreds of MB each) on a CI machine's disk. Soft limit
# only: tests/kernels/test_probes.py raises it again to check that fxmem itself forbids them.
ulimit -S -c 0 2>/dev/null || true
disk() { echo "disk: $(df -Pk . | awk 'NR==2 {printf "%.1f GiB free", $4/1048576}') ($1)"; }

run_pytest() {  # pytest exit 5 = "no tests collected": not a failure of the code under test
  local rc=0
  "$@" || rc=$?
  if [ "$rc" = 5 ]; then echo "(no tests collected in this phase)"; rc=0; fi
  return "$rc"
}

# CI (CI=true) runs the quick set: tests marked slow (more spellings of one rewrite, more random
# seeds, the seeds' full configurations) each have a quicker sibling there; FXMEM_ALL_TESTS=1 runs them too
selection=()
if [ "${CI:-}" = true ] && [ "${FXMEM_ALL_TESTS:-0}" != 1 ]; then
  selection=(-m "not slow")
  echo "CI: leaving out the tests marked slow (FXMEM_ALL_TESTS=1 runs them too)"
fi

disk "before phase 1's install"
FXMEM_VENV="$here/.venv$suffix" FXMEM_TORCH="${FXMEM_TORCH:-torch==2.13.0}" source "$here/scripts/setup.sh"
echo "== phase 1: $("$FXMEM_PY" -c 'import torch; print("torch", torch.__version__)'), ${FXMEM_TEST_WORKERS:-2} test processes"
# one pytest process per core (pytest-xdist): the tests are independent processes' worth of work
run_pytest "$FXMEM_PY" -m pytest -q -p no:cacheprovider -n "${FXMEM_TEST_WORKERS:-2}" "${selection[@]}" tests "$@"

if [ "${FXMEM_CUDA_SIM:-1}" != 0 ]; then
  disk "before phase 2's install: the CUDA build of torch and its CUDA libraries take about 6 GiB"
  FXMEM_VENV="$here/.venv-cuda$suffix" FXMEM_TORCH="torch==2.14.1" source "$here/scripts/setup.sh"
  echo "== phase 2: $("$FXMEM_PY" -c 'import torch; print("torch", torch.__version__, "cuda build:", torch.backends.cuda.is_built())')"
  FXMEM_TEST_PHASE=cuda-build run_pytest "$FXMEM_PY" -m pytest -q -p no:cacheprovider "${selection[@]}" tests "$@"
fi
