#!/usr/bin/env bash
# Show or stream the training logs of worker 0 (or any or all workers).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<HELP
Usage: $ERPO_SCRIPT [settings] [--run NAME] [--worker 0|N|all] [--lines N] [--follow]

Prints the last lines of run NAME's log (default: the newest log) on worker 0,
or on worker N, or on every worker (--worker all). --follow keeps streaming
until Ctrl-C; the run goes on without it.

  --run NAME     the run (launch.sh --run; default: the newest log)
  --worker W     0 (default), a worker number, or all
  --lines N      how many lines to show first (default 50)
  --follow, -f   keep streaming new lines (tail -F)

Needs: project, zone, name.

$COMMON_HELP
HELP
}

RUN_NAME=
WORKER=0
LINES=50
FOLLOW=0
while (($#)); do
    if parse_setting "$@"; then shift "$SHIFT" && continue; fi
    case $1 in
        -h | --help) usage && exit 0 ;;
        --run) need_value "$@" && RUN_NAME=$2 && shift 2 ;;
        --worker) need_value "$@" && WORKER=$2 && shift 2 ;;
        --worker=*) WORKER=${1#*=} && shift ;;
        --lines | -n) need_value "$@" && LINES=$2 && shift 2 ;;
        --follow | -f) FOLLOW=1 && shift ;;
        *) die "unknown option '$1' (see --help)." ;;
    esac
done
require_settings project zone name
check_worker "$WORKER"
[[ $LINES =~ ^[0-9]+$ ]] || die "--lines must be a number, got '$LINES'."
[[ -z $RUN_NAME || $RUN_NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "--run '$RUN_NAME' is not a run name."

if [[ -n $RUN_NAME ]]; then
    pick="ls logs/$RUN_NAME.worker-*.log 2>/dev/null"
else
    pick="ls -t logs/*.log 2>/dev/null | head -n 1"
fi
tail_flags="-n $LINES"
((FOLLOW)) && tail_flags+=" -F"
tpu_ssh "$WORKER" "cd $(q "$REMOTE_DIR") && f=\$($pick) && [ -n \"\$f\" ] || { echo \"\$(hostname): no log found in $REMOTE_DIR/logs\" >&2; exit 3; }; tail $tail_flags \$f"
