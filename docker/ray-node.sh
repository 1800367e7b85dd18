#!/usr/bin/env bash
# Start a Ray node in the foreground (--block), so the container lives as long as the node.
# In the GPU image it is /usr/local/bin/ray-node.sh; run it with --entrypoint:
#   head:   docker run ... --entrypoint ray-node.sh rlpad:gpu head
#   worker: docker run ... --entrypoint ray-node.sh rlpad:gpu worker HEAD_IP
# Arguments after those are passed on to `ray start` (e.g. --num-gpus=8).
set -euo pipefail

usage() {
    echo "usage: ray-node.sh head [ray start args...]" >&2
    echo "       ray-node.sh worker HEAD_IP[:PORT] [ray start args...]" >&2
    exit 2
}

role=${1:-}
case "$role" in
    head)
        shift
        # 0.0.0.0: the dashboard (and `ray job submit`, port 8265) must be reachable from
        # other hosts, not only from inside the container.
        exec ray start --head --port=6379 --dashboard-host=0.0.0.0 --block "$@"
        ;;
    worker)
        [ $# -ge 2 ] || usage
        head=$2
        shift 2
        # The head's GCS port is 6379 unless the address names another.
        [[ "$head" == *:* ]] || head="$head:6379"
        exec ray start --address="$head" --block "$@"
        ;;
    *)
        usage
        ;;
esac
