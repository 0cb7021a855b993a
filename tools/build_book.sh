#!/usr/bin/env bash
# Build the book into _build/html.
#
#   ./tools/build_book.sh              # from the outputs stored in the chapters (about a minute)
#   ./tools/build_book.sh --execute    # re-execute the chapters first, at LOWPREC_SCALE (default quick)
#   ./tools/build_book.sh --warningiserror --keep-going    # other options go to jupyter-book build
#
# The stored outputs are made by `python tools/stored_outputs.py execute`; `tools/run_tests.sh`
# executes every chapter with nbval and compares every output with them. With --execute,
# Jupyter Book runs the chapters itself (execute_notebooks: cache, for this build: a later --execute
# build re-runs only the chapters whose code changed), and the page shows what this machine computed.
# A plain `jupyter-book build .` builds from the stored outputs too (_config.yml: execute_notebooks: off).
set -euo pipefail
cd "$(dirname "$0")/.."

execute=off
args=()
for arg in "$@"; do
    case "$arg" in
        --execute) execute=cache ;;
        *) args+=("$arg") ;;
    esac
done

# _config.yml says execute_notebooks: off (the stored outputs); --execute builds with a copy that
# says cache, for this build only.
if [ "$execute" = off ]; then
    echo "== jupyter-book build . (from the outputs stored in the chapters)"
    exec jupyter-book build . "${args[@]}"
fi
export LOWPREC_SCALE=${LOWPREC_SCALE:-quick}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
config=_build_book_config.yml
trap 'rm -f "$config"' EXIT
python - "$config" <<'PY'
import sys
import yaml
with open("_config.yml") as f:
    config = yaml.safe_load(f)
config["execute"]["execute_notebooks"] = "cache"
with open(sys.argv[1], "w") as f:
    yaml.safe_dump(config, f, sort_keys=False)
PY
echo "== jupyter-book build . (chapters executed, LOWPREC_SCALE=$LOWPREC_SCALE)"
jupyter-book build . --config "$config" "${args[@]}"
