#!/usr/bin/env bash
# Set everything up in .venv and build the book.
#
#   ./tools/setup_and_build.sh             # the site from the outputs stored in the chapters
#   ./tools/setup_and_build.sh --execute   # the same, re-executing every chapter (LOWPREC_SCALE, default quick)
#
# Then open _build/html/index.html. Environment: PYTHON (default python3), VENV (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# pip without its progress bars, and without the one warning per package that a pip configured
# with partial local indexes prints ("... is neither a file nor a directory"); errors still show.
pip_install() {
    pip install --quiet --progress-bar off "$@" 2> >(grep -v "is neither a file nor a directory" >&2)
}

# torch first, and its CPU build: left to resolve torch from requirements.txt, pip would take the
# default PyPI build, which bundles CUDA (several GB). First a CPU wheel that pip can already see
# (a local wheel, or an index configured on this machine), then PyTorch's CPU index: one attempt,
# with a short timeout.
if ! python -c "import torch" 2>/dev/null; then
    echo "== installing torch $TORCH_VERSION (CPU build) [$(elapsed)]"
    if pip_install --only-binary=:all: "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
        echo "   from a CPU wheel pip already sees"
    elif pip_install --timeout 20 --retries 0 --index-url "$CPU_INDEX" "torch==$TORCH_VERSION"; then
        echo "   from $CPU_INDEX"
    else
        echo "could not install torch $TORCH_VERSION (CPU build): pip found no CPU wheel locally, and" >&2
        echo "$CPU_INDEX could not be reached (the error above). Install torch into $VENV" >&2
        echo "yourself ($VENV/bin/pip install torch), then run this script again." >&2
        exit 1
    fi
fi

echo "== installing requirements.txt and the package [$(elapsed)]"
pip_install -r requirements.txt
pip_install -e .

echo "== building the book [$(elapsed)]"
./tools/build_book.sh "$@"
echo "== done in $(elapsed): open _build/html/index.html"
