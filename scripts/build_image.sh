#!/usr/bin/env bash
# Build rlpad's image with one command, with whatever this machine has:
#   scripts/build_image.sh cpu|gpu [extra build args...]     (make image-cpu / make image-gpu)
# - `docker build` where a Docker daemon answers, else buildah (daemonless; as root, chroot
#   isolation and the host network, for machines whose cgroups the OCI runtime refuses).
# - The base is the Dockerfile's `ARG BASE` default, pulled from the registry. Where no image
#   registry is reachable it is made here instead with debootstrap (Debian bookworm with Python
#   3.11 for the CPU image, Ubuntu 24.04 for the GPU image) and passed as --build-arg BASE.
# - Where PyTorch's CPU index is unreachable, the CPU image takes the torch CPU wheel from the
#   machine's local wheel folder (pip's find-links), mounted into the build (buildah only).
# It says which engine, which base and which wheel source it used, the build time and the size.
# Environment: TAG (default rlpad:cpu / rlpad:gpu), ENGINE (docker|buildah), BASE (a base image
# to use as is), CONTEXT (build context, default the repository root), WHEELS (wheel folder).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIND=${1:-}
case "$KIND" in
    cpu) DOCKERFILE=$ROOT/docker/Dockerfile.cpu ;;
    gpu) DOCKERFILE=$ROOT/docker/Dockerfile ;;
    *) echo "usage: scripts/build_image.sh cpu|gpu [extra build args...]" >&2; exit 2 ;;
esac
shift
TAG=${TAG:-rlpad:$KIND}
CONTEXT=${CONTEXT:-$ROOT}
STATE=${RLPAD_IMAGE_STATE:-/var/tmp/rlpad-image}   # debootstrap folders, pip.conf for the build
say() { echo "[build_image] $*"; }
die() { echo "[build_image] error: $*" >&2; exit 1; }
reachable() { # URL: any HTTP answer (a registry says 401 to an anonymous /v2/)
    local code
    code=$(curl -s -o /dev/null -m 10 -w '%{http_code}' "$1" 2>/dev/null) || code=000
    [ "$code" != 000 ]
}

# ---- engine ----
# shellcheck source=scripts/image_lib.sh
source "$ROOT/scripts/image_lib.sh"
pick_engine

# ---- base ----
DEFAULT_BASE=$(sed -n 's/^ARG BASE=//p' "$DOCKERFILE" | head -n1)
[ -n "$DEFAULT_BASE" ] || die "$DOCKERFILE has no ARG BASE=..."
make_base() { # NAME SUITE MIRROR PACKAGES: a minimal root filesystem committed as an image
    local name=$1 suite=$2 mirror=$3 pkgs=$4 rootfs="$STATE/rootfs-$2" script="" keyring=""
    command -v debootstrap >/dev/null || die "no registry reachable and no debootstrap (apt-get install debootstrap)"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    if [ "$suite" = noble ]; then
        # Debian's debootstrap has no script for noble; Ubuntu's releases share gutsy's. The
        # archive key comes from Ubuntu's keyring package (Debian 12 does not ship it), checked
        # against its SHA-256 in noble's package index (the one release it is fetched for).
        script=/usr/share/debootstrap/scripts/gutsy
        keyring=$STATE/ubuntu-archive-keyring.gpg
        if [ ! -s "$keyring" ]; then
            local deb=$STATE/ubuntu-keyring.deb x=$STATE/ubuntu-keyring
            curl -fsSL -m 120 -o "$deb" "$mirror/pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb"
            echo "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8  $deb" | sha256sum -c --quiet \
                || die "ubuntu-keyring: unexpected SHA-256"
            rm -rf "$x" && dpkg-deb -x "$deb" "$x"
            cp "$x/usr/share/keyrings/ubuntu-archive-keyring.gpg" "$keyring"
        fi
    fi
    say "making the base $name: debootstrap --variant=minbase $suite ($mirror) + $pkgs"
    rm -rf "$rootfs" && mkdir -p "$rootfs"
    debootstrap --variant=minbase --include="$pkgs" ${keyring:+--keyring="$keyring"} \
        "$suite" "$rootfs" "$mirror" $script >"$STATE/debootstrap-$suite.log" 2>&1 \
        || { tail -n 20 "$STATE/debootstrap-$suite.log" >&2; die "debootstrap $suite failed"; }
    # The pockets and components a registry image of the same release has enabled (updates and
    # security fixes; Ubuntu's universe holds python3.12-venv).
    if [ "$suite" = noble ]; then
        printf 'deb %s %s main restricted universe multiverse\n' "$mirror noble" "$mirror noble-updates" \
            "$mirror noble-security" >"$rootfs/etc/apt/sources.list"
    else
        printf 'deb %s main\n' "$mirror $suite" "$mirror $suite-updates" \
            "${mirror%/debian}/debian-security $suite-security" >"$rootfs/etc/apt/sources.list"
    fi
    # The host's local CAs (an egress proxy's, say), added the Debian way so that a later
    # update-ca-certificates in the image keeps them: pip and apt in the build go through them.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >/dev/null
    fi
    # As Debian's and Ubuntu's registry images do: apt keeps no downloaded packages nor caches,
    # so a Dockerfile's `apt-get install` leaves none in its layer.
    cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    local ctr mnt
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$rootfs" -cf - . | tar -C "$mnt" -xpf -
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd /bin/bash "$ctr"
    buildah commit -q --rm "$ctr" "$name" >/dev/null
    rm -rf "$rootfs"
}
BASE_NOTE="the Dockerfile's default"
if [ -n "${BASE:-}" ]; then
    BASE_NOTE="given by BASE"
elif have_image "$DEFAULT_BASE"; then
    BASE=$DEFAULT_BASE; BASE_NOTE="the Dockerfile's default, present locally"
elif reachable https://registry-1.docker.io/v2/; then
    BASE=$DEFAULT_BASE; BASE_NOTE="the Dockerfile's default, pulled from the registry"
else
    [ "$ENGINE" = buildah ] || die "no image registry reachable; making a base needs buildah (or pass BASE=)"
    mkdir -p "$STATE"
    if [ "$KIND" = cpu ]; then
        # What python:3.11-slim-bookworm has that minbase lacks: Python 3.11, venv, pip, headers
        # (vLLM's compile step includes Python.h), CA certificates.
        BASE=localhost/rlpad-base:bookworm-python3.11
        have_image "$BASE" || make_base "$BASE" bookworm http://deb.debian.org/debian \
            python3,python3-venv,python3-pip,python3-dev,ca-certificates
    else
        # Ubuntu 24.04, as nvidia/cuda:*-ubuntu24.04; the CUDA libraries then come from PyPI.
        BASE=localhost/rlpad-base:ubuntu24.04
        have_image "$BASE" || make_base "$BASE" noble http://archive.ubuntu.com/ubuntu ca-certificates
    fi
    BASE_NOTE="made with debootstrap: no image registry reachable"
fi
say "engine: $ENGINE; base: $BASE ($BASE_NOTE)"

# ---- build ----
ARGS=(-f "$DOCKERFILE" -t "$TAG" --build-arg "BASE=$BASE")
if [ "$ENGINE" = buildah ]; then
    ARGS=(--isolation chroot --network host --layers --force-rm "${ARGS[@]}")
    have_image "$BASE" && ARGS+=(--pull=never)
    if [ "$KIND" = cpu ] && ! reachable https://download.pytorch.org/whl/cpu/; then
        WHEELS=${WHEELS:-${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}}
        WHEELS=${WHEELS#file://}
        ls "$WHEELS"/torch-*+cpu-*.whl >/dev/null 2>&1 \
            || die "PyTorch's CPU index is unreachable and no torch CPU wheel in a local wheel folder (set WHEELS=)"
        mkdir -p "$STATE"
        printf '[global]\nfind-links = /opt/rlpad-wheels\n' >"$STATE/pip.conf"
        ARGS+=(--build-arg PIP_EXTRA_INDEX_URL= -v "$WHEELS:/opt/rlpad-wheels:ro"
               -v "$STATE/pip.conf:/etc/pip.conf:ro")
        say "wheels: PyTorch's CPU index unreachable; the torch CPU wheel from $WHEELS (mounted)"
    fi
fi
ARGS+=("$@")
start=$(date +%s)
if [ "$ENGINE" = docker ]; then docker build "${ARGS[@]}" "$CONTEXT"
else buildah bud "${ARGS[@]}" "$CONTEXT"; fi
secs=$(( $(date +%s) - start ))
say "built $TAG from ${DOCKERFILE#"$ROOT"/} with $ENGINE in ${secs}s; base $BASE; size $(image_size "$TAG") MB"
