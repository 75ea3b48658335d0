#!/usr/bin/env bash
# Stop the training processes, then delete the TPU (and its queued resource).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<HELP
Usage: $ERPO_SCRIPT [settings] [--queued] [--stop-only | --no-stop] [--grace SECONDS] [--yes]

First sends SIGTERM to 'erpo train' on every worker (the trainer writes a
checkpoint and exits) and waits SECONDS for it; then deletes the TPU VM, or with
--queued the queued resource and the TPU it holds (create.sh --spot, --queued,
--reserved). Fetch the results first (fetch.sh): the workers' disks go with
the TPU.

  --queued         delete the queued resource named --name (with --force)
  --stop-only      stop the training processes, keep the TPU
  --no-stop        skip stopping (the TPU is already preempted or idle)
  --grace SECONDS  how long to wait after SIGTERM (default 60)
  --yes            do not ask for confirmation

Needs: project, zone, name.

$COMMON_HELP
HELP
}

QUEUED=0
STOP=1
DELETE=1
GRACE=60
YES=0
while (($#)); do
    if parse_setting "$@"; then shift "$SHIFT" && continue; fi
    case $1 in
        -h | --help) usage && exit 0 ;;
        --queued) QUEUED=1 && shift ;;
        --stop-only) DELETE=0 && shift ;;
        --no-stop) STOP=0 && shift ;;
        --grace) need_value "$@" && GRACE=$2 && shift 2 ;;
        --yes | -y) YES=1 && shift ;;
        *) die "unknown option '$1' (see --help)." ;;
    esac
done
require_settings project zone name
[[ $GRACE =~ ^[0-9]+$ ]] || die "--grace must be a number of seconds, got '$GRACE'."
((STOP || DELETE)) || die "--stop-only and --no-stop leave nothing to do."

if ((DELETE && !YES && !DRY_RUN)); then
    [[ -t 0 ]] || die "refusing to delete $TPU_NAME without --yes when not run from a terminal."
    read -r -p "Delete TPU $TPU_NAME in $ZONE ($PROJECT)? [y/N] " answer
    [[ $answer == [yY]* ]] || die "not deleted."
fi
if ((STOP)); then
    tpu_ssh all "pkill -TERM -f '[e]rpo train' && echo \"\$(hostname): stopping\" || echo \"\$(hostname): no training process\"" ||
        echo "$ERPO_SCRIPT: could not reach every worker (already preempted?); going on." >&2
    ((GRACE == 0)) || run sleep "$GRACE"
fi
((DELETE)) || exit 0
if ((QUEUED)); then
    run gcloud compute tpus queued-resources delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" --force --quiet
else
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" --quiet
fi
