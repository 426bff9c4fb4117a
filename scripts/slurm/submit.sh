#!/usr/bin/env bash
# Submit one job as N shards (a Slurm array) plus a final step that runs once every shard succeeded.
#
#   scripts/slurm/submit.sh 8 [sbatch options ...] -- conf=job.yaml [key=value ...]
#
# The array runs scripts/slurm/pipeline.sbatch with --array=0-(N-1). The final step is the same command
# as a plain (non-array) job, i.e. one shard covering the whole output, held until every array task ends
# with status 0 (--dependency=afterok): it finds every unit committed, writes `_SUCCESS` if the last shard
# has not already, and exits at once without loading the model. If a task fails for good, the final step
# is cancelled with it (--kill-on-invalid-dep) and nothing claims the output complete.
# sbatch options, in --name=value form (e.g. --partition=gpu --time=4:00:00 --cpus-per-task=8 --gres=gpu:1),
# apply to the array tasks; the final step shares only --partition, --account, --qos and --chdir, takes
# 1 CPU, and logs to slurm-<id>-final.out beside the tasks' --output (default: the submission directory).
# Prints the two job ids: "<array id> <final id>".
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { echo "usage: $0 NUM_SHARDS [sbatch options ...] -- [python -m pipeline arguments ...]" >&2; exit 2; }

[ $# -ge 1 ] || usage
shards="$1"; shift
[[ "$shards" =~ ^[1-9][0-9]*$ ]] || { echo "$0: NUM_SHARDS must be a positive integer, got '$shards'" >&2; exit 2; }
sbatch_args=()
shared_args=()  # options the final step needs too: where it may run and under which account
log_dir=.
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        --array=*) echo "$0: the array is 0-(NUM_SHARDS-1); give NUM_SHARDS instead of $1" >&2; exit 2 ;;
        --partition=*|--account=*|--qos=*|--chdir=*) shared_args+=("$1") ;;
        --output=*/*) log_dir="${1#--output=}"; log_dir="${log_dir%/*}" ;;
        --*) ;;
        *) echo "$0: give sbatch options as --name=value, got '$1'" >&2; exit 2 ;;
    esac
    sbatch_args+=("$1"); shift
done
[ $# -gt 0 ] || usage  # the "--" separator is required so that sbatch options and job keys cannot mix
shift

array_id="$(sbatch --parsable --array=0-$((shards - 1)) "${sbatch_args[@]}" "$HERE/pipeline.sbatch" "$@")"
array_id="${array_id%%;*}"
final_id="$(sbatch --parsable --job-name=pipeline-final --cpus-per-task=1 --output="$log_dir/slurm-%j-final.out" \
    "${shared_args[@]}" --dependency="afterok:$array_id" --kill-on-invalid-dep=yes \
    "$HERE/pipeline.sbatch" "$@")"
echo "$array_id ${final_id%%;*}"
