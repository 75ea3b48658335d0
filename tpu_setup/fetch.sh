#!/usr/bin/env bash
# Copy a run's results (and its logs) back from worker 0.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<HELP
Usage: $ERPO_SCRIPT [settings] [--from PATH] [--to DIR] [--no-logs]

Copies PATH (the trainer's train.out_dir, relative to the code directory on
the workers; default runs) from worker 0, which writes the run's single files
(config, metrics, reports), into DIR (default tpu_results/<name>). A gs:// PATH
is copied with gsutil from here instead. Worker 0's logs/ come along unless
--no-logs.

  --from PATH   remote results directory or gs:// path (default runs)
  --to DIR      local destination (default tpu_results/<TPU name>)
  --no-logs     do not copy logs/

Needs: project, zone, name.

$COMMON_HELP
HELP
}

FROM=runs
TO=
LOGS=1
while (($#)); do
    if parse_setting "$@"; then shift "$SHIFT" && continue; fi
    case $1 in
        -h | --help) usage && exit 0 ;;
        --from) need_value "$@" && FROM=$2 && shift 2 ;;
        --to) need_value "$@" && TO=$2 && shift 2 ;;
        --no-logs) LOGS=0 && shift ;;
        *) die "unknown option '$1' (see --help)." ;;
    esac
done
require_settings project zone name
TO=${TO:-tpu_results/$TPU_NAME}
[[ $FROM == gs://* || ($FROM != /* && $FROM != *..*) ]] ||
    die "--from must be a path inside the code directory or a gs:// path, got '$FROM'."

run mkdir -p "$TO"
if [[ $FROM == gs://* ]]; then
    run gsutil -m cp -r "${FROM%/}" "$TO/"
else
    tpu_scp 0 --recurse "$TPU_NAME:$REMOTE_DIR/${FROM%/}" "$TO/"
fi
if ((LOGS)); then
    tpu_scp 0 --recurse "$TPU_NAME:$REMOTE_DIR/logs" "$TO/"
fi
echo "results in $TO" >&2
