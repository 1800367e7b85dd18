#!/usr/bin/env bash
# make test-images: build both images and run them (opt-in, not in `make test`: it downloads
# gigabytes and takes long). Prints the sizes and times at the end.
#   scripts/test_images.sh [cpu|gpu|all]   (ray-cpu / ray-gpu: the Ray cluster part alone)
# CPU image (rlpad:cpu, the runtime image): built with the one command; as uid 1000, `rlpad check`
#   and the default job (the image's ENTRYPOINT + CMD, 2 steps) with its outputs on a host folder
#   mounted on /app/outputs, which must hold the job's metrics after the container is gone; a
#   rebuild after a source edit must reuse every dependency layer.
# GPU image (rlpad:gpu): `import torch, vllm, ray, rlpad`, torch's CUDA build, `rlpad check` (CPU).
# Both: docker/ray-node.sh starts a head and a worker node in two containers (host network,
#   loopback addresses), and `ray job submit` runs the tiny recipe, 2 steps, on the CPU.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/image_lib.sh
source "$ROOT/scripts/image_lib.sh"
pick_engine
export ENGINE
WHICH=${1:-all}
WORK=$(mktemp -d /var/tmp/rlpad-test-images.XXXXXX)
declare -a REPORT=() CONTAINERS=()
note() { echo "[test_images] $*"; REPORT+=("$*"); }
fail() { echo "[test_images] FAIL: $*" >&2; exit 1; }
cleanup() { for c in "${CONTAINERS[@]}"; do ctr_rm "$c"; done; }
trap cleanup EXIT
STEPS=2
JOB=(trainer.total_training_steps=$STEPS)

T0=0
tick() { T0=$(date +%s); }
tock() { echo $(( $(date +%s) - T0 )); }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
new_ctr() { CONTAINERS+=("$1"); ctr_create "$@"; }
drop_ctr() { ctr_rm "$1"; CONTAINERS=("${CONTAINERS[@]/$1}"); }

# ray_cluster IMAGE RAY_NODE OVERRIDES...: a head and a worker container joined over loopback,
# then `ray job submit` of the tiny recipe (2 steps) from the head.
ray_cluster() {
    local image=$1 node=$2; shift 2
    local port dash client head=rlpad-test-head worker=rlpad-test-worker t
    port=$(free_port); dash=$(free_port); client=$(free_port)
    new_ctr "$head" "$image"; new_ctr "$worker" "$image"
    # ray-node.sh's own flags come first; the later ones win. Loopback only, one address per node:
    # Ray swaps 127.0.0.1 itself for the machine's external address in a multi-node cluster,
    # and rlpad pins ranks to nodes by IP (two nodes on one IP are refused). Free ports: other
    # Ray clusters may run on this machine and hold Ray's fixed defaults (the agent's 52365).
    ctr_exec "$head" 1000:1000 "$node" head --port="$port" --dashboard-port="$dash" \
        --ray-client-server-port="$client" --dashboard-host=127.0.0.1 --node-ip-address=127.0.0.2 \
        --dashboard-agent-listen-port="$(free_port)" --metrics-export-port="$(free_port)" \
        >"$WORK/ray-head.log" 2>&1 &
    for _ in $(seq 60); do
        ctr_exec "$head" 1000:1000 ray status --address="127.0.0.2:$port" >/dev/null 2>&1 && break; sleep 5
    done
    ctr_exec "$worker" 1000:1000 "$node" worker "127.0.0.2:$port" --node-ip-address=127.0.0.3 \
        --dashboard-agent-listen-port="$(free_port)" --metrics-export-port="$(free_port)" \
        >"$WORK/ray-worker.log" 2>&1 &
    local alive=0
    for _ in $(seq 60); do
        alive=$(ctr_exec "$head" 1000:1000 python -c "import ray; ray.init(address='127.0.0.2:$port', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null | tail -n1) || alive=0
        [ "$alive" = 2 ] && break; sleep 5
    done
    [ "$alive" = 2 ] || { tail -n 30 "$WORK"/ray-*.log; fail "$image: the worker container did not join the head ($alive nodes)"; }
    ctr_exec "$head" 1000:1000 ray status --address="127.0.0.2:$port" | sed -n '/Active:/,/Pending:/p'
    tick
    for try in $(seq 12); do
        ctr_exec "$head" 1000:1000 ray job submit --address="http://127.0.0.1:$dash" -- \
            python -m rlpad.train --config /app/recipes/grpo_tiny.yaml "${JOB[@]}" \
            trainer.default_local_dir=/tmp/rlpad-ray-job "$@" >"$WORK/ray-job.log" 2>&1 || true
        # the job agents register with the head a little after the nodes do
        grep -q "No available agent" "$WORK/ray-job.log" || break
        echo "[test_images] no job agent yet (try $try)"; sleep 10
    done
    t=$(tock)
    tail -n 25 "$WORK/ray-job.log"
    grep -q "succeeded" "$WORK/ray-job.log" || fail "$image: ray job submit did not succeed"
    note "$image: head (127.0.0.2) + worker (127.0.0.3) containers joined; ray job submit of grpo_tiny ($STEPS steps${*:+, $*}) succeeded in ${t}s"
    drop_ctr "$worker"; drop_ctr "$head"
}

build() { # KIND: scripts/build_image.sh KIND, its time and rlpad:KIND's size noted; sets SIZE (MB)
    local t
    tick; "$ROOT/scripts/build_image.sh" "$1" 2>&1 | tee "$WORK/build-$1.log" | tail -n 15
    t=$(tock)
    SIZE=$(image_size "rlpad:$1")
    note "rlpad:$1: scripts/build_image.sh took ${t}s (with the layers cached before), ${SIZE} MB"
}
ray_cpu() { ray_cluster rlpad:cpu /app/docker/ray-node.sh; }
# vLLM's CUDA build has no CPU backend: the job rolls out with transformers (rollout.name=hf)
ray_gpu() { ray_cluster rlpad:gpu ray-node.sh actor_rollout_ref.rollout.name=hf; }

test_cpu() {
    local t out=$WORK/outputs c=rlpad-test-cpu
    build cpu
    [ "$SIZE" -lt 3000 ] || note "rlpad:cpu is over the 3 GB goal"

    # the default job as uid 1000, outputs on a host folder that outlives the container
    mkdir -p "$out" && chown 1000:1000 "$out"
    new_ctr "$c" rlpad:cpu -v "$out:/app/outputs"
    ctr_exec "$c" 1000:1000 rlpad check | tail -n 5
    note "rlpad:cpu: rlpad check passed as uid 1000"
    local cmd
    mapfile -t cmd < <(python3 -c 'import json, sys; print(*json.loads(sys.argv[1]) + json.loads(sys.argv[2]), sep="\n")' \
        "$(image_config rlpad:cpu Entrypoint)" "$(image_config rlpad:cpu Cmd)")
    [ "${#cmd[@]}" -gt 0 ] || fail "rlpad:cpu has no ENTRYPOINT/CMD"
    tick; ctr_exec "$c" 1000:1000 "${cmd[@]}" "${JOB[@]}" 2>&1 | tee "$WORK/job-cpu.log" | tail -n 8
    t=$(tock)
    drop_ctr "$c"
    local steps
    steps=$(grep -c '"step"' "$out/grpo_tiny/metrics.jsonl" 2>/dev/null || true)
    [ "${steps:-0}" -ge "$STEPS" ] || fail "no metrics of $STEPS steps in $out/grpo_tiny/metrics.jsonl after the container is gone"
    note "rlpad:cpu: '${cmd[*]} ${JOB[*]}' ran in ${t}s as uid 1000; $out/grpo_tiny/metrics.jsonl ($steps records) outlives the container"

    # a source edit rebuilds the source layer only
    local ctx=$WORK/context
    mkdir -p "$ctx"
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 tar -cf - 2>/dev/null) | tar -C "$ctx" -xf -
    echo "# an edit (scripts/test_images.sh)" >>"$ctx/rlpad/cli.py"
    tick; env CONTEXT="$ctx" TAG=rlpad:cpu-edit "$ROOT/scripts/build_image.sh" cpu >"$WORK/rebuild-cpu.log" 2>&1
    t=$(tock)
    local base n_base n_same
    base=$(image_layers rlpad:cpu)
    n_base=$(wc -l <<<"$base")
    n_same=$(comm -12 <(sort <<<"$base") <(image_layers rlpad:cpu-edit | sort) | wc -l)
    [ "$n_same" -eq $((n_base - 1)) ] || fail "the rebuild after a source edit shares $n_same of $n_base layers (want all but the source's)"
    note "rlpad:cpu rebuilt after a source edit in ${t}s: $n_same of $n_base layers reused (all but the source's)"
    image_rm rlpad:cpu-edit
    rm -rf "$ctx"

    ray_cpu
}

test_gpu() {
    local c=rlpad-test-gpu
    build gpu
    new_ctr "$c" rlpad:gpu
    ctr_exec "$c" 1000:1000 python -c "import torch, vllm, ray, rlpad; print('torch', torch.__version__, 'CUDA build', torch.version.cuda, 'GPU here', torch.cuda.is_available(), 'vllm', vllm.__version__, 'ray', ray.__version__)" \
        | tee "$WORK/imports-gpu.log"
    grep -q "CUDA build 1[0-9]" "$WORK/imports-gpu.log" || fail "torch in rlpad:gpu is not a CUDA build"
    note "rlpad:gpu: $(tail -n1 "$WORK/imports-gpu.log")"
    ctr_exec "$c" 1000:1000 rlpad check | tail -n 5
    note "rlpad:gpu: rlpad check passed on the CPU as uid 1000"
    drop_ctr "$c"
    ray_gpu
}

case "$WHICH" in
    cpu) test_cpu ;;
    gpu) test_gpu ;;
    all) test_cpu; test_gpu ;;
    ray-cpu) ray_cpu ;;   # the cluster part alone, on built images
    ray-gpu) ray_gpu ;;
    *) echo "usage: scripts/test_images.sh [cpu|gpu|all|ray-cpu|ray-gpu]" >&2; exit 2 ;;
esac
echo "[test_images] summary ($ENGINE, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); logs in $WORK):"
printf '  %s\n' "${REPORT[@]}"
