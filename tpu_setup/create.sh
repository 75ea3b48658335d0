#!/usr/bin/env bash
# Create a Cloud TPU VM (or pod slice): on demand, or as a queued resource
# (spot, reserved or plain queued).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<HELP
Usage: $ERPO_SCRIPT [settings] [--spot | --reserved | --queued] [--valid-until DURATION] [--wait]

Creates the TPU named by --name. Without a provisioning flag it runs
'gcloud compute tpus tpu-vm create' (on demand, fails at once when the zone has
no capacity). --spot, --reserved and --queued ask through
'gcloud compute tpus queued-resources create' instead, which waits in a queue
for capacity; the queued resource gets the same id as the TPU. Spot TPUs can be
preempted at any time: the trainer checkpoints on SIGTERM and
'launch.sh --resume' continues the run on a new TPU.

  --spot                  queued spot capacity (cheapest, preemptible)
  --reserved              queued, from the project's reservation
  --queued                queued on-demand capacity
  --valid-until DURATION  give up on a queued request after DURATION (e.g. 6h)
  --wait                  poll a queued request until it is ACTIVE (or fails)

Needs: project, zone, accelerator type, name, runtime version.

$COMMON_HELP
HELP
}

MODE=plain
VALID_UNTIL=
WAIT=0
while (($#)); do
    if parse_setting "$@"; then shift "$SHIFT" && continue; fi
    case $1 in
        -h | --help) usage && exit 0 ;;
        --spot) MODE=spot && shift ;;
        --reserved) MODE=reserved && shift ;;
        --queued) MODE=queued && shift ;;
        --valid-until) need_value "$@" && VALID_UNTIL=$2 && shift 2 ;;
        --wait) WAIT=1 && shift ;;
        *) die "unknown option '$1' (see --help)." ;;
    esac
done
require_settings project zone type name runtime
[[ -z $VALID_UNTIL || $MODE != plain ]] || die "--valid-until only applies to --spot, --reserved or --queued."

if [[ $MODE == plain ]]; then
    run gcloud compute tpus tpu-vm create "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
        --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION"
    exit 0
fi

args=(gcloud compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME"
    --project="$PROJECT" --zone="$ZONE" --accelerator-type="$ACCELERATOR_TYPE"
    --runtime-version="$RUNTIME_VERSION")
case $MODE in
    spot) args+=(--spot) ;;
    reserved) args+=(--reserved) ;;
esac
[[ -z $VALID_UNTIL ]] || args+=(--valid-until-duration="$VALID_UNTIL")
run "${args[@]}"

describe=(gcloud compute tpus queued-resources describe "$TPU_NAME" --project="$PROJECT"
    --zone="$ZONE" --format='value(state.state)')
if ((!WAIT)); then
    echo "queued; check with: $(quote_all "${describe[@]}")" >&2
    exit 0
fi
while true; do
    state=$(run "${describe[@]}")
    ((DRY_RUN)) && echo "$state" && break
    echo "$(date +%H:%M:%S) $TPU_NAME: $state" >&2
    case $state in
        ACTIVE) break ;;
        FAILED | SUSPENDED | SUSPENDING) die "queued resource $TPU_NAME is $state; 'gcloud compute tpus queued-resources describe $TPU_NAME' says why." ;;
    esac
    sleep 30
done
