#!/usr/bin/env bash
# Install the project and its TPU extra into a virtual environment on every worker.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<HELP
Usage: $ERPO_SCRIPT [settings] [--python PYTHON] [--no-check]

On every worker (--worker=all), in the code directory that sync.sh copied:
installs PYTHON (default python3.11; the project needs 3.11+, and the stock TPU
VM images ship 3.10) with apt if it is missing, creates .venv, runs
pip install -e '.[tpu]' (jax with libtpu), then checks that each worker sees
its TPU chips. Run sync.sh first.

  --python PYTHON   interpreter to build the venv with (ERPO_TPU_PYTHON)
  --no-check        skip the final device check

Needs: project, zone, name.

$COMMON_HELP
HELP
}

PYTHON=${ERPO_TPU_PYTHON:-python3.11}
CHECK=1
while (($#)); do
    if parse_setting "$@"; then shift "$SHIFT" && continue; fi
    case $1 in
        -h | --help) usage && exit 0 ;;
        --python) need_value "$@" && PYTHON=$2 && shift 2 ;;
        --no-check) CHECK=0 && shift ;;
        *) die "unknown option '$1' (see --help)." ;;
    esac
done
require_settings project zone name
[[ $PYTHON =~ ^python3(\.[0-9]+)?$ ]] || die "--python must look like python3.11, got '$PYTHON'."

dir=$(q "$REMOTE_DIR")
steps=(
    "set -euo pipefail"
    "test -f $dir/pyproject.toml || { echo \"\$(hostname): no code in $dir; run sync.sh first\" >&2; exit 3; }"
    "command -v $PYTHON >/dev/null || { sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $PYTHON $PYTHON-venv; }"
    "cd $dir"
    "$PYTHON -m venv .venv"
    ".venv/bin/pip install -q --upgrade pip"
    ".venv/bin/pip install -q -e \".[tpu]\""
)
if ((CHECK)); then
    steps+=(".venv/bin/python -c \"import jax, socket; print(socket.gethostname(), jax.local_devices())\"")
fi
script=$(printf '%s; ' "${steps[@]}")
tpu_ssh all "${script%; }"
