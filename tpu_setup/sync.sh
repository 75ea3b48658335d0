#!/usr/bin/env bash
# Put the code and a checkpoint on every worker.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    cat <<HELP
Usage: $ERPO_SCRIPT [settings] [--code | --git URL [--ref REF]] [--checkpoint DIR | --gcs gs://...]
                 [--data DIR]

Copies to every worker (--worker=all), into the code directory (--remote-dir):
  --code              this checkout's tracked and untracked-but-not-ignored files,
                      as one tarball (the default when nothing else is asked for);
                      files deleted here are not deleted there
  --git URL           clone URL on each worker, or fetch it if already cloned
  --ref REF           with --git: the branch, tag or commit to check out (default HEAD)
  --checkpoint DIR    a local Hugging Face checkpoint directory, copied to
                      checkpoints/<basename of DIR> on each worker
  --gcs gs://PATH     a checkpoint in Cloud Storage, copied on the workers with
                      gsutil -m cp -r to checkpoints/<basename of PATH> (fast for pods)
  --data DIR          a local data directory (training JSONL, benchmarks), copied
                      to data/<basename of DIR> on each worker
The checkpoint's path for the trainer is then model.path=checkpoints/<basename>.

Needs: project, zone, name.

$COMMON_HELP
HELP
}

CODE=0
GIT_URL=
GIT_REF=HEAD
CHECKPOINT=
GCS=
DATA=
while (($#)); do
    if parse_setting "$@"; then shift "$SHIFT" && continue; fi
    case $1 in
        -h | --help) usage && exit 0 ;;
        --code) CODE=1 && shift ;;
        --git) need_value "$@" && GIT_URL=$2 && shift 2 ;;
        --ref) need_value "$@" && GIT_REF=$2 && shift 2 ;;
        --checkpoint) need_value "$@" && CHECKPOINT=$2 && shift 2 ;;
        --gcs) need_value "$@" && GCS=$2 && shift 2 ;;
        --data) need_value "$@" && DATA=$2 && shift 2 ;;
        *) die "unknown option '$1' (see --help)." ;;
    esac
done
require_settings project zone name
[[ -z $GIT_URL || $CODE == 0 ]] || die "use --code or --git, not both."
[[ -z $CHECKPOINT || -z $GCS ]] || die "use --checkpoint or --gcs, not both."
[[ -z $CHECKPOINT || -d $CHECKPOINT ]] || die "--checkpoint '$CHECKPOINT' is not a local directory."
[[ -z $DATA || -d $DATA ]] || die "--data '$DATA' is not a local directory."
[[ -z $GCS || $GCS == gs://?* ]] || die "--gcs must be a gs:// path, got '$GCS'."
[[ -n $GIT_URL || -n $CHECKPOINT || -n $GCS || -n $DATA ]] || CODE=1

dir=$(q "$REMOTE_DIR")
if ((CODE)); then
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    tarball=${TMPDIR:-/tmp}/erpo-code-$TPU_NAME.tgz
    run bash -c "cd $(q "$repo") && git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -czf $(q "$tarball")"
    tpu_scp all "$tarball" "$TPU_NAME:erpo-code.tgz"
    tpu_ssh all "set -e; mkdir -p $dir; tar -xzf erpo-code.tgz -C $dir; rm erpo-code.tgz"
    run rm -f "$tarball"
fi
if [[ -n $GIT_URL ]]; then
    url=$(q "$GIT_URL") ref=$(q "$GIT_REF")
    tpu_ssh all "set -e; if [ -d $dir/.git ]; then git -C $dir fetch -q $url $ref; else git clone -q $url $dir && git -C $dir fetch -q $url $ref; fi; git -C $dir checkout -q FETCH_HEAD; git -C $dir log -1 --oneline"
fi
if [[ -n $CHECKPOINT ]]; then
    src=${CHECKPOINT%/}
    tpu_ssh all "mkdir -p $dir/checkpoints"
    tpu_scp all --recurse "$src" "$TPU_NAME:$REMOTE_DIR/checkpoints/"
    echo "checkpoint on the workers: model.path=checkpoints/$(basename "$src")" >&2
fi
if [[ -n $GCS ]]; then
    src=${GCS%/}
    tpu_ssh all "set -e; mkdir -p $dir/checkpoints; gsutil -m -q cp -r $(q "$src") $dir/checkpoints/"
    echo "checkpoint on the workers: model.path=checkpoints/$(basename "$src")" >&2
fi
if [[ -n $DATA ]]; then
    src=${DATA%/}
    tpu_ssh all "mkdir -p $dir/data"
    tpu_scp all --recurse "$src" "$TPU_NAME:$REMOTE_DIR/data/"
    echo "data on the workers: $REMOTE_DIR/data/$(basename "$src")" >&2
fi
