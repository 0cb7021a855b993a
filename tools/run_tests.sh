#!/usr/bin/env bash
# Run the tests and verify the chapters.
#
#   ./tools/run_tests.sh                              # everything
#   ./tools/run_tests.sh book/02_freeze_rule.ipynb    # verify that chapter alone
#   ./tools/run_tests.sh tests/test_rounding.py       # that test file (-k, -x ... go to pytest)
#   ./tools/run_tests.sh $(python tools/stored_outputs.py changed --paths) tests/test_rounding.py
#
# Everything is: the stored outputs well formed (tools/stored_outputs.py check), the test suite
# under tests/ in a random order (its seed printed; LOWPREC_TEST_SEED=N repeats one), then every
# chapter executed by nbval in its full mode, which compares every output a reader sees with the
# stored one (book/conftest.py: text, tables and glued values, numbers at a relative tolerance of
# 1e-6, timings masked, each figure drawn). A chapter that reads Tiny Shakespeare is compared only
# where the real text is at hand (LOWPREC_DATA_DIR, the cache or a download); on the offline fallback
# its cells still run and its checks still hold, and the summary says it was not compared.
#
# Uses .venv when it exists and no virtual environment is active. Chapters run at LOWPREC_SCALE
# (default quick) on OMP_NUM_THREADS threads (default 1, as their outputs were stored). With
# pytest-xdist (requirements.txt) the tests and the chapters run on LOWPREC_TEST_WORKERS processes
# (default: the CPU count, at most 4), a chapter's cells in one process, in order, the longest
# chapters first. It goes on after a failure, so that one run lists every failure, and prints the
# slowest tests and every chapter's duration.
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

# What to run: notebooks are verified, other paths and options go to the test suite.
notebooks=()
tests=()
test_options=()
for arg in "$@"; do
    case "$arg" in
        *.ipynb)
            [ -f "$arg" ] || { echo "run_tests.sh: no notebook $arg (the chapters are book/*.ipynb)" >&2; exit 2; }
            notebooks+=("$arg") ;;
        -*) test_options+=("$arg") ;;
        *)
            if [ ${#test_options[@]} -gt 0 ] && [[ "${test_options[-1]}" =~ ^-(k|m|p|n|-deselect|-randomly-seed)$ ]]; then
                test_options+=("$arg")   # the value of the option before it
            elif [ -e "${arg%%::*}" ]; then
                tests+=("$arg")
            else
                echo "run_tests.sh: no file or folder $arg (give tests/... or book/....ipynb)" >&2
                exit 2
            fi ;;
    esac
done
run_chapters=1
run_suite=1
if [ ${#notebooks[@]} -gt 0 ] || [ ${#tests[@]} -gt 0 ]; then
    [ ${#notebooks[@]} -gt 0 ] || run_chapters=0
    [ ${#tests[@]} -gt 0 ] || run_suite=0
fi
[ ${#tests[@]} -gt 0 ] || tests=(tests)

workers=()
if python -c "import xdist" 2>/dev/null; then
    n=${LOWPREC_TEST_WORKERS:-$(python -c "import os; print(min(4, os.cpu_count() or 1))")}
    if [ "$n" -gt 1 ]; then
        workers=(-n "$n" --dist loadfile)
    fi
fi

order=()
if python -c "import pytest_randomly" 2>/dev/null; then
    seed=${LOWPREC_TEST_SEED:-$(( $(date +%s) % 1000000 ))}
    order=(-p randomly "--randomly-seed=$seed")
elif [ -n "${LOWPREC_TEST_SEED:-}" ]; then
    echo "LOWPREC_TEST_SEED is set but pytest-randomly is not installed (pip install -r requirements.txt)" >&2
    exit 1
fi

status=0
if [ $run_suite = 1 ]; then
    echo "== test suite (${tests[*]}) [$(elapsed)]${workers:+ on ${workers[1]} processes}, ${seed:+random order of seed $seed (LOWPREC_TEST_SEED=$seed repeats it)}, OMP_NUM_THREADS=$OMP_NUM_THREADS"
    python -m pytest "${workers[@]}" "${order[@]}" --durations=15 "${tests[@]}" "${test_options[@]}" || status=1
fi

if [ $run_chapters = 1 ]; then
    ordered=()   # every chapter when none is named; the longest first
    while IFS= read -r nb; do ordered+=("$nb"); done < <(python tools/stored_outputs.py list "${notebooks[@]}")
    notebooks=("${ordered[@]}")
    echo "== stored chapter outputs (tools/stored_outputs.py check) [$(elapsed)]"
    python tools/stored_outputs.py check "${notebooks[@]}" || status=1
    echo "== ${#notebooks[@]} chapter(s) verified with nbval, longest first (LOWPREC_SCALE=$LOWPREC_SCALE) [$(elapsed)]"
    chapter_workers=("${workers[@]}")
    [ ${#notebooks[@]} -gt 1 ] || chapter_workers=()
    python -m pytest "${chapter_workers[@]}" -p no:randomly --nbval --nbval-current-env --nbval-cell-timeout=1200 \
        -p no:cacheprovider "${notebooks[@]}" || status=1
fi
if [ $status -ne 0 ]; then
    echo "== FAILED after $(elapsed) (see above)"
else
    echo "== all passed in $(elapsed)"
fi
exit $status
