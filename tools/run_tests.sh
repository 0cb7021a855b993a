#!/usr/bin/env bash
# Run every test: the stored chapter outputs are current, the test suite under tests/, then every
# chapter notebook with nbval.
#
#   ./tools/run_tests.sh [extra pytest arguments for the test suite]
#
# Uses .venv when it exists and no virtual environment is active. Chapters run at LOWPREC_SCALE
# (default quick), on OMP_NUM_THREADS threads (default 1: the chapters' tensors are small, and on a
# 2-core machine two threads that wait on each other make them several times slower). nbval runs
# in lax mode: a cell fails if it raises, or if it is marked `# NBVAL_CHECK_OUTPUT` and its output
# differs from the one stored in the notebook. With pytest-xdist installed (requirements.txt), the
# test suite and the chapters run on LOWPREC_TEST_WORKERS processes (default: the CPU count, at
# most 4), a chapter's cells always in one process, in order.
#
# The test suite runs in file order; with LOWPREC_TEST_SEED set it runs in the random order of
# that seed instead (pytest-randomly, in requirements.txt: `LOWPREC_TEST_SEED=123 ./tools/run_tests.sh`
# reproduces the order a run printed as "Using --randomly-seed=123"). The chapters always run in
# order.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start )) s"; }

if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
export LOWPREC_SCALE=${LOWPREC_SCALE:-quick}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

workers=()
if python -c "import xdist" 2>/dev/null; then
    n=${LOWPREC_TEST_WORKERS:-$(python -c "import os; print(min(4, os.cpu_count() or 1))")}
    if [ "$n" -gt 1 ]; then
        workers=(-n "$n" --dist loadfile)
    fi
fi

order=()
chapters_in_order=()
if python -c "import pytest_randomly" 2>/dev/null; then
    chapters_in_order=(-p no:randomly)
    if [ -n "${LOWPREC_TEST_SEED:-}" ]; then
        order=(-p randomly "--randomly-seed=$LOWPREC_TEST_SEED")
    else
        order=(-p no:randomly)
    fi
elif [ -n "${LOWPREC_TEST_SEED:-}" ]; then
    echo "LOWPREC_TEST_SEED is set but pytest-randomly is not installed (pip install -r requirements.txt)" >&2
    exit 1
fi

status=0
echo "== stored chapter outputs (tools/stored_outputs.py check)"
python tools/stored_outputs.py check || status=1

echo "== test suite (tests/) [$(elapsed)]${workers:+ on ${workers[1]} processes}, ${LOWPREC_TEST_SEED:+random order of seed }${LOWPREC_TEST_SEED:-file order}, OMP_NUM_THREADS=$OMP_NUM_THREADS"
python -m pytest "${workers[@]}" "${order[@]}" tests "$@" || status=1

notebooks=()
while IFS= read -r -d '' nb; do
    notebooks+=("$nb")
done < <(find book -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' -not -path 'book/results/*' -print0 | sort -z)

if [ ${#notebooks[@]} -eq 0 ]; then
    echo "== nbval: no chapter notebook under book/ yet, nothing to execute"
else
    echo "== chapters with nbval (${#notebooks[@]} notebooks, LOWPREC_SCALE=$LOWPREC_SCALE) [$(elapsed)]"
    python -m pytest "${workers[@]}" "${chapters_in_order[@]}" --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -p no:cacheprovider \
        "${notebooks[@]}" || status=1
fi
if [ $status -ne 0 ]; then
    echo "== FAILED after $(elapsed) (see above)"
else
    echo "== all passed in $(elapsed)"
fi
exit $status
