#!/usr/bin/env bash
# Start (or resume) one training run: the same `erpo train` command on every worker.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<HELP
Usage: $ERPO_SCRIPT [settings] --config FILE [--run NAME] [--resume]
                 [--explicit [--coordinator HOST] [--port PORT]] [OVERRIDE...] [-- OVERRIDE...]

Runs '.venv/bin/erpo train --config FILE OVERRIDE...' in the code directory of
every worker, in the background (nohup), each writing its own log
logs/NAME.worker-<N>.log on that worker (watch with logs.sh). OVERRIDEs are the
trainer's dotted settings, e.g. train.out_dir=gs://bucket/runs/x.

Every worker gets ERPO_MULTIHOST=1, so erpo_jax.runtime.distributed.maybe_initialize()
calls jax.distributed.initialize(), which on Cloud TPU finds the other workers
by itself. --explicit instead starts each worker separately with
JAX_COORDINATOR_ADDRESS (worker 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID set,
the mode used off TPU and when auto-detection fails.

  --config FILE       experiment config, relative to the code directory
  --run NAME          names the logs (default: the config's file name)
  --resume            continue run NAME after a preemption or a crash: the same
                      command (the trainer resumes from the latest checkpoint in
                      its train.out_dir), appending to the existing logs.
                      Without it, existing logs for NAME stop the launch.
  --explicit          pass the coordinator, process count and id explicitly
  --coordinator HOST  with --explicit: worker 0's address (default: asked of gcloud)
  --port PORT         with --explicit: coordinator port (default 8476)

Needs: project, zone, name; with --explicit also the accelerator type.
Spot TPUs lose their disks when preempted: put train.out_dir on gs:// so that
--resume on a recreated TPU finds the checkpoints.

$COMMON_HELP
HELP
}

CONFIG=
RUN_NAME=
RESUME=0
EXPLICIT=0
COORDINATOR=
PORT=8476
OVERRIDES=()
while (($#)); do
    if parse_setting "$@"; then shift "$SHIFT" && continue; fi
    case $1 in
        -h | --help) usage && exit 0 ;;
        --config) need_value "$@" && CONFIG=$2 && shift 2 ;;
        --run) need_value "$@" && RUN_NAME=$2 && shift 2 ;;
        --resume) RESUME=1 && shift ;;
        --explicit) EXPLICIT=1 && shift ;;
        --coordinator) need_value "$@" && COORDINATOR=$2 && shift 2 ;;
        --port) need_value "$@" && PORT=$2 && shift 2 ;;
        --) shift && OVERRIDES+=("$@") && break ;;
        -*) die "unknown option '$1' (see --help)." ;;
        *=*) OVERRIDES+=("$1") && shift ;;
        *) die "'$1' is neither an option nor a dotted override like train.steps=10." ;;
    esac
done
if ((EXPLICIT)); then
    require_settings project zone name type
else
    require_settings project zone name
fi
[[ -n $CONFIG ]] || die "nothing was run because --config is not set (e.g. --config experiments/real_scale.py)."
RUN_NAME=${RUN_NAME:-$(basename "$CONFIG" .py)}
[[ $RUN_NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "--run '$RUN_NAME' may only use letters, digits, '.', '_' and '-'."
[[ $PORT =~ ^[0-9]+$ ]] || die "--port must be a number, got '$PORT'."
((EXPLICIT)) || [[ -z $COORDINATOR ]] || die "--coordinator only applies with --explicit."

train=(.venv/bin/erpo train --config "$CONFIG" "${OVERRIDES[@]}")
dir=$(q "$REMOTE_DIR")

# remote_command WORKER_LABEL EXPORTS: the shell command one worker runs.
remote_command() {
    local label=$1 exports=$2 log="logs/$RUN_NAME.worker-\$W.log"
    local guard=":"
    ((RESUME)) || guard="[ ! -e $log ] || { echo \"\$(hostname): $log exists; pass --resume to continue run $RUN_NAME, or choose another --run\" >&2; exit 3; }"
    printf '%s; ' \
        "set -e" \
        "cd $dir" \
        "mkdir -p logs" \
        "if pgrep -f '[e]rpo train' >/dev/null; then echo \"\$(hostname): a training run is already running\" >&2; exit 3; fi" \
        "W=$label" \
        "$guard" \
        "echo \"=== \$(date -u +%FT%TZ) $( ((RESUME)) && echo resume || echo start) $RUN_NAME on \$(hostname)\" >> $log" \
        "export $exports"
    printf '%s' "nohup $(quote_all "${train[@]}") >> $log 2>&1 < /dev/null & echo \"\$(hostname): started, log $REMOTE_DIR/$log\""
}

if ((!EXPLICIT)); then
    # Expanded on the worker: its index from the TPU VM's metadata.
    # shellcheck disable=SC2016
    worker_id='$(curl -sf -H "Metadata-Flavor: Google" http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'
    tpu_ssh all "$(remote_command "$worker_id" "ERPO_MULTIHOST=1")"
    exit 0
fi

hosts=$(tpu_hosts "$ACCELERATOR_TYPE")
if [[ -z $COORDINATOR ]]; then
    describe=(gcloud compute tpus tpu-vm describe "$TPU_NAME" --project="$PROJECT" --zone="$ZONE"
        --format='value(networkEndpoints[0].ipAddress)')
    if ((DRY_RUN)); then
        run "${describe[@]}"
        COORDINATOR=WORKER0_IP
    else
        COORDINATOR=$(run "${describe[@]}")
        [[ -n $COORDINATOR ]] || die "gcloud did not report worker 0's address; pass --coordinator."
    fi
fi
for ((i = 0; i < hosts; i++)); do
    exports="ERPO_MULTIHOST=1 JAX_COORDINATOR_ADDRESS=$COORDINATOR:$PORT JAX_NUM_PROCESSES=$hosts JAX_PROCESS_ID=$i"
    tpu_ssh "$i" "$(remote_command "$i" "$exports")"
done
