#!/usr/bin/env bash
# Run every test: the test suite under tests/, then every chapter notebook with nbval.
#
#   ./tools/run_tests.sh [extra pytest arguments for the test suite]
#
# Uses .venv when it exists and no virtual environment is active. Chapters run at LOWPREC_SCALE
# (default quick). nbval runs in lax mode: a cell fails only if it raises, or if it is marked
# `# NBVAL_CHECK_OUTPUT` and its output changed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
export LOWPREC_SCALE=${LOWPREC_SCALE:-quick}

echo "== test suite (tests/)"
python -m pytest tests "$@"

notebooks=()
while IFS= read -r -d '' nb; do
    notebooks+=("$nb")
done < <(find book -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' -not -path 'book/results/*' -print0 | sort -z)

if [ ${#notebooks[@]} -eq 0 ]; then
    echo "== nbval: no chapter notebook under book/ yet, nothing to execute"
else
    echo "== chapters with nbval (${#notebooks[@]} notebooks, LOWPREC_SCALE=$LOWPREC_SCALE)"
    python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider "${notebooks[@]}"
fi
