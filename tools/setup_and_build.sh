#!/usr/bin/env bash
# Set everything up in .venv and build the book, chapters executed at the quick scale.
#
#   ./tools/setup_and_build.sh            # then open _build/html/index.html
#
# Environment: PYTHON (default python3), VENV (default .venv), LOWPREC_SCALE (default quick).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
export LOWPREC_SCALE=${LOWPREC_SCALE:-quick}

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# torch first, and the CPU build: left to resolve it from requirements.txt, pip would take the
# default PyPI build, which bundles CUDA (several GB). A wheel already on this machine (pip's
# find-links) is used when there is one; otherwise PyTorch's CPU index.
if ! python -c "import torch" 2>/dev/null; then
    echo "== installing torch 2.13.0 (CPU)"
    pip install --no-index "torch==2.13.0" 2>/dev/null \
        || pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
fi

echo "== installing requirements.txt and the package"
pip install -r requirements.txt
pip install -e .

echo "== building the book (LOWPREC_SCALE=$LOWPREC_SCALE)"
jupyter-book build .
echo "== done: open _build/html/index.html"
