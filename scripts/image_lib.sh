# Sourced by scripts/build_image.sh and scripts/test_images.sh: which engine builds and runs the
# images, and how a container is run with it.
#   docker:  a Docker daemon answers (`docker info`).
#   buildah: no daemon; buildah, as root, with chroot isolation (the default OCI runtime refuses
#            some machines' cgroups) and the host network. A "container" is a working container
#            (`buildah from`) with processes started in it by `buildah run`.
# shellcheck shell=bash

pick_engine() { # sets ENGINE unless the caller did
    if [ -n "${ENGINE:-}" ]; then return; fi
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
    elif command -v buildah >/dev/null; then ENGINE=buildah
    else echo "neither a Docker daemon nor buildah here (Debian/Ubuntu: apt-get install buildah)" >&2; return 1; fi
}

have_image() { # IMAGE
    if [ "$ENGINE" = docker ]; then docker image inspect "$1" >/dev/null 2>&1
    else buildah inspect --type image "$1" >/dev/null 2>&1; fi
}

image_size() { # IMAGE -> size in MB (the uncompressed layers)
    if [ "$ENGINE" = docker ]; then echo $(( $(docker image inspect -f '{{.Size}}' "$1") / 1000000 ))
    else python3 - "$1" <<'EOF'
import json, subprocess, sys
# buildah prints a decimal size with 3 significant digits ("2.91 GB")
out = subprocess.run(["buildah", "images", "--json", sys.argv[1]], capture_output=True, text=True, check=True)
num, unit = json.loads(out.stdout)[0]["size"].split()
print(round(float(num) * {"B": 1e-6, "kB": 1e-3, "KB": 1e-3, "MB": 1, "GB": 1e3, "TB": 1e6}[unit]))
EOF
    fi
}

image_layers() { # IMAGE -> its layer digests, one a line
    if [ "$ENGINE" = docker ]; then docker image inspect -f '{{range .RootFS.Layers}}{{println .}}{{end}}' "$1"
    else buildah inspect --type image -f '{{range .OCIv1.RootFS.DiffIDs}}{{println .}}{{end}}' "$1"; fi | sed '/^$/d'
}

image_rm() { # IMAGE
    if [ "$ENGINE" = docker ]; then docker rmi "$1" >/dev/null; else buildah rmi "$1" >/dev/null; fi
}

image_config() { # IMAGE FIELD (Entrypoint|Cmd) -> the JSON list
    if [ "$ENGINE" = docker ]; then docker image inspect -f "{{json .Config.$2}}" "$1"
    else buildah inspect --type image "$1" | python3 -c "import json, sys; print(json.dumps(json.load(sys.stdin)['OCIv1']['config'].get('$2') or []))"; fi
}

# ctr_create NAME IMAGE [-v HOST:CTR]...: a container to start processes in (not started yet).
ctr_create() {
    local name=$1 image=$2; shift 2
    if [ "$ENGINE" = docker ]; then
        docker create --name "$name" --network host --shm-size=8g --entrypoint sleep "$@" "$image" infinity >/dev/null
        docker start "$name" >/dev/null
    else
        CTR_VOLUMES[$name]="$*"
        buildah from --pull=never --name "$name" "$image" >/dev/null
    fi
}

# ctr_exec NAME USER CMD...: run CMD in the container as USER (uid:gid), in the foreground.
ctr_exec() {
    local name=$1 user=$2; shift 2
    if [ "$ENGINE" = docker ]; then docker exec --user "$user" "$name" "$@"
    else
        # shellcheck disable=SC2086  # the volumes are "-v A:B -v C:D"
        buildah run --isolation chroot --network host --user "$user" ${CTR_VOLUMES[$name]:-} \
            "$name" -- "$@"
    fi
}

# ctr_pids NAME: the processes running in a buildah container. `buildah run` gives each its own
# mount namespace whose root is the container's overlay: its upper layer names the container.
ctr_pids() {
    local mnt upper pid
    mnt=$(buildah mount "$1" 2>/dev/null) || return 0
    upper="upperdir=${mnt%/merged}/diff,"
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        head -n1 "/proc/$pid/mountinfo" 2>/dev/null | grep -qF "$upper" && echo "$pid"
    done
    return 0
}

# ctr_rm NAME: stop every process of the container (by pid, never by name: other people's
# processes may share the names) and remove it.
ctr_rm() {
    local name=$1 pids sig
    [ -n "$name" ] || return 0
    if [ "$ENGINE" = docker ]; then docker rm -f "$name" >/dev/null 2>&1 || true; return; fi
    for sig in TERM KILL; do
        pids=$(ctr_pids "$name")
        [ -z "$pids" ] && break
        # shellcheck disable=SC2086
        kill -s "$sig" $pids 2>/dev/null || true
        sleep 5
    done
    buildah umount "$name" >/dev/null 2>&1 || true
    buildah rm "$name" >/dev/null 2>&1 || true
}

declare -A CTR_VOLUMES=()
