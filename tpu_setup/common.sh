# shellcheck shell=bash
# shellcheck disable=SC2034  # the settings are read by the scripts that source this
# Shared by every tpu_setup script (sourced, not run): the settings, their
# up-front check, and the one place commands are run or, with --dry-run,
# printed.
#
# Settings come from flags or environment variables (flags win):
#   --project NAME           ERPO_TPU_PROJECT   Google Cloud project
#   --zone ZONE              ERPO_TPU_ZONE      e.g. us-central2-b
#   --accelerator-type TYPE  ERPO_TPU_TYPE      v4-8, v5litepod-16, v5p-8, v6e-8, ...
#   --name NAME              ERPO_TPU_NAME      the TPU VM (and queued resource) name
#   --runtime-version V      ERPO_TPU_RUNTIME   e.g. tpu-ubuntu2204-base, v2-alpha-tpuv6e
#   --remote-dir DIR         ERPO_TPU_DIR       code directory on the workers, relative
#                                               to the home directory (default erpo-jax)
#   --dry-run                ERPO_TPU_DRY_RUN=1 print every command instead of running it

ERPO_SCRIPT=$(basename "$0")
PROJECT=${ERPO_TPU_PROJECT:-}
ZONE=${ERPO_TPU_ZONE:-}
ACCELERATOR_TYPE=${ERPO_TPU_TYPE:-}
TPU_NAME=${ERPO_TPU_NAME:-}
RUNTIME_VERSION=${ERPO_TPU_RUNTIME:-}
REMOTE_DIR=${ERPO_TPU_DIR:-erpo-jax}
DRY_RUN=${ERPO_TPU_DRY_RUN:-0}
SHIFT=0

COMMON_HELP="Settings (flag or environment variable; every script checks the ones it needs
before running anything):
  --project NAME            ERPO_TPU_PROJECT  Google Cloud project
  --zone ZONE               ERPO_TPU_ZONE     zone, e.g. us-central2-b
  --accelerator-type TYPE   ERPO_TPU_TYPE     v4-8, v5litepod-16, v5p-8, v6e-8, ...
  --name NAME               ERPO_TPU_NAME     TPU VM name (also the queued-resource id)
  --runtime-version V       ERPO_TPU_RUNTIME  TPU software version, e.g. tpu-ubuntu2204-base
  --remote-dir DIR          ERPO_TPU_DIR      code directory on the workers (default erpo-jax)
  --dry-run                 print every gcloud/ssh/scp command instead of running it
  -h, --help                this help"

die() {
    echo "$ERPO_SCRIPT: $*" >&2
    exit 2
}

# parse_setting "$@": if $1 is a shared flag, store it, set SHIFT to the number
# of arguments it used and return 0; otherwise return 1.
parse_setting() {
    local flag=$1 value=
    case $flag in
        --project | --zone | --accelerator-type | --type | --name | --runtime-version | --version | --remote-dir)
            [[ $# -ge 2 ]] || die "$flag needs a value."
            value=$2
            SHIFT=2
            ;;
        --project=* | --zone=* | --accelerator-type=* | --type=* | --name=* | --runtime-version=* | --version=* | --remote-dir=*)
            value=${flag#*=}
            flag=${flag%%=*}
            SHIFT=1
            ;;
        --dry-run)
            DRY_RUN=1
            SHIFT=1
            return 0
            ;;
        *) return 1 ;;
    esac
    case $flag in
        --project) PROJECT=$value ;;
        --zone) ZONE=$value ;;
        --accelerator-type | --type) ACCELERATOR_TYPE=$value ;;
        --name) TPU_NAME=$value ;;
        --runtime-version | --version) RUNTIME_VERSION=$value ;;
        --remote-dir) REMOTE_DIR=$value ;;
    esac
    return 0
}

# need_value "$@": fail unless the flag in $1 is followed by a value.
need_value() {
    [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value."
}

# require_settings KEY...: check every named setting (project zone type name
# runtime) and fail with one sentence naming all that are missing.
require_settings() {
    local key missing=() value label
    for key in "$@"; do
        case $key in
            project) value=$PROJECT label="the project (--project or ERPO_TPU_PROJECT)" ;;
            zone) value=$ZONE label="the zone (--zone or ERPO_TPU_ZONE)" ;;
            type) value=$ACCELERATOR_TYPE label="the accelerator type (--accelerator-type or ERPO_TPU_TYPE)" ;;
            name) value=$TPU_NAME label="the TPU name (--name or ERPO_TPU_NAME)" ;;
            runtime) value=$RUNTIME_VERSION label="the runtime version (--runtime-version or ERPO_TPU_RUNTIME)" ;;
            *) die "internal error: unknown setting $key." ;;
        esac
        [[ -n $value ]] || missing+=("$label")
    done
    if ((${#missing[@]})); then
        local sentence=${missing[0]} i
        for ((i = 1; i < ${#missing[@]}; i++)); do
            if ((i == ${#missing[@]} - 1)); then
                sentence+=" and ${missing[i]}"
            else
                sentence+=", ${missing[i]}"
            fi
        done
        die "nothing was run because $sentence $( ((${#missing[@]} > 1)) && echo are || echo is) not set."
    fi
    if [[ " $* " == *" type "* ]] && ! tpu_hosts "$ACCELERATOR_TYPE" >/dev/null; then
        die "nothing was run because accelerator type '$ACCELERATOR_TYPE' is not a Cloud TPU type such as v4-8, v5litepod-16, v5p-8 or v6e-8."
    fi
    [[ $REMOTE_DIR != /* && $REMOTE_DIR != *..* && -n $REMOTE_DIR ]] ||
        die "nothing was run because --remote-dir '$REMOTE_DIR' must be a path inside the home directory."
    if ((!DRY_RUN)) && ! command -v gcloud >/dev/null; then
        die "nothing was run because gcloud is not installed (https://cloud.google.com/sdk/docs/install)."
    fi
}

# tpu_hosts TYPE: the number of hosts (workers) of a slice. Mirrors
# erpo_jax.runtime.distributed.abstract_mesh_shape (the tests check they agree): for
# v2-v5p the number counts TensorCores (2 per chip, 4 chips per host); for
# v5e/v6e it counts chips (up to 8 on one host, else 4 per host).
tpu_hosts() {
    local t=${1,,} gen count chips
    [[ $t =~ ^(v[0-9]+[a-z]*)-([0-9]+)$ ]] || return 1
    gen=${BASH_REMATCH[1]}
    count=$((10#${BASH_REMATCH[2]}))
    case $gen in
        v2 | v3 | v4 | v5p)
            ((count >= 8 && count % 8 == 0)) || return 1
            chips=$((count / 2))
            if ((chips <= 4)); then echo 1; else echo $((chips / 4)); fi
            ;;
        v5litepod | v5e | v5lite | v6e)
            ((count >= 1)) || return 1
            if ((count <= 8)); then
                echo 1
            elif ((count % 4 == 0)); then
                echo $((count / 4))
            else
                return 1
            fi
            ;;
        *) return 1 ;;
    esac
}

# q ARG: ARG quoted for a POSIX shell, left bare when that is unambiguous.
q() {
    if [[ $1 =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

# quote_all ARG...: the arguments as one shell-quoted line.
quote_all() {
    local a out=()
    for a in "$@"; do out+=("$(q "$a")"); done
    printf '%s' "${out[*]}"
}

# run CMD...: run it, or print it (one line, shell-quoted) under --dry-run.
run() {
    if ((DRY_RUN)); then
        quote_all "$@"
        echo
    else
        echo "+ $(quote_all "$@")" >&2
        "$@"
    fi
}

# check_worker W: 'all' or a worker index.
check_worker() {
    [[ $1 == all || $1 =~ ^[0-9]+$ ]] || die "--worker must be 'all' or a worker number, got '$1'."
}

# tpu_ssh WORKER COMMAND: run COMMAND in a login shell on one worker or all.
tpu_ssh() {
    run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
        --worker="$1" --command="$2"
}

# tpu_scp WORKER ARG...: gcloud's scp (remote paths are NAME:PATH) on one worker or all.
tpu_scp() {
    local worker=$1
    shift
    run gcloud compute tpus tpu-vm scp "$@" --project="$PROJECT" --zone="$ZONE" --worker="$worker"
}
