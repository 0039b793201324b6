#!/usr/bin/env bash
# Build every image docker-compose.yml needs on a machine that cannot reach Docker Hub (and whose containers
# cannot reach PyPI): the base from Debian's packages, the Python packages from a wheelhouse the host builds.
#
#   deploy/local-images.sh            # from the repository root; prints the variables to export for compose
#
# Steps, each skipped when its result is already there (or when the official image can be pulled):
#   1. local/debian:12         debootstrap --variant=minbase bookworm, then docker import (needs root, ~3 min)
#   2. local/python:3.11       Debian's python3 + python3-venv over it (only if python:3.11.11-slim-bookworm
#                              cannot be pulled)
#   3. the wheelhouse          deploy/lock_requirements.py pins the dependencies as installed in $DAPO_PYTHON's
#                              environment (the one scripts/setup.sh made), markers evaluated for the image's
#                              Python; `pip wheel --no-deps` fetches them (~880 MB)
#   4. dapo:0.1.0-cpu          deploy/Dockerfile.cpu, pip pointed at the wheelhouse (served on the docker
#                              bridge for the length of the build): the build itself needs no network
#   5. local/redis:7, local/prometheus:2   Debian's redis-server and prometheus (only if redis:7.4.2 and
#                              prom/prometheus:v3.1.0 cannot be pulled). Grafana has no Debian package: run the
#                              stack without it (name the services to `docker compose up`).
#
# With Docker Hub and PyPI reachable none of this is needed: `docker compose up --build` builds from
# python:3.11.11-slim-bookworm and PyPI, and pulls the official Redis, Prometheus and Grafana images.
#
# Settings (environment): DAPO_DOCKER_CACHE (rootfs, wheelhouse; default ~/.cache/dapo-docker), DAPO_PYTHON
# (default .venv/bin/python), DOCKER (a client whose `build` honours DOCKER_BUILDKIT=1: BuildKit reads
# deploy/Dockerfile.cpu.dockerignore; the Docker 20.10 client does without buildx), DAPO_IMAGE (dapo:0.1.0-cpu),
# DAPO_FORCE_LOCAL=1 (build the local images even when the official ones can be pulled), DAPO_PIP_OPTIONS
# (the host pip's extra options for the wheelhouse; default: PyTorch's CPU index when it answers within 5 s, else
# none, leaving pip's own configuration to find torch; pip itself gives up on an index after 15 s and one retry).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${DAPO_DOCKER_CACHE:-$HOME/.cache/dapo-docker}"
python="${DAPO_PYTHON:-.venv/bin/python}"
docker="${DOCKER:-docker}"
image="${DAPO_IMAGE:-dapo:0.1.0-cpu}"
force="${DAPO_FORCE_LOCAL:-0}"
# Where the host's pip finds torch 2.13.0+cpu (not on PyPI): PyTorch's CPU index, when it can be reached. An
# unreachable index is dropped at once rather than retried by pip for minutes.
torch_index=https://download.pytorch.org/whl/cpu/
base=local/debian:12
mkdir -p "$cache"
export DOCKER_BUILDKIT=1

log() { printf '[local-images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
if [ -n "${DAPO_PIP_OPTIONS+set}" ]; then
    pip_options="$DAPO_PIP_OPTIONS"
elif "$python" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$torch_index" 2>/dev/null; then
    pip_options="--extra-index-url $torch_index"
else
    log "PyTorch's CPU index ($torch_index) does not answer: pip's own configuration must find torch 2.13.0+cpu"
    pip_options=""
fi
have_image() { "$docker" image inspect "$1" >/dev/null 2>&1; }
# The official image if it can be pulled (and DAPO_FORCE_LOCAL is not set), else nothing.
pullable() { [ "$force" != 1 ] && "$docker" pull -q "$1" >/dev/null 2>&1; }

need_base() {
    have_image "$base" && return
    command -v debootstrap >/dev/null || { log "debootstrap missing: apt-get install debootstrap"; exit 1; }
    log "debootstrap --variant=minbase bookworm (a few minutes)"
    local root="$cache/rootfs"
    rm -rf "$root"
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$cache/debootstrap.log"
    # As Docker's own Debian images: no service starts at package installation, no package lists or caches.
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d" && chmod +x "$root/usr/sbin/policy-rc.d"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" -c . | "$docker" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' - "$base" >/dev/null
    rm -rf "$root"
}

python_image=python:3.11.11-slim-bookworm
if pullable "$python_image"; then
    log "using $python_image"
else
    need_base
    python_image=local/python:3.11
    if ! have_image "$python_image"; then
        log "building $python_image from Debian's python3"
        "$docker" build -q -f deploy/local/Dockerfile.python --build-arg BASE_IMAGE="$base" -t "$python_image" \
            deploy/local >/dev/null
    fi
fi

wheels="$cache/wheelhouse"
mkdir -p "$wheels"
log "pinning the dependencies of $python's environment and filling $wheels"
# Markers are evaluated for the image's Python (Debian's 3.11.2 needs async-timeout for redis; 3.11.7 does not).
image_python="$("$docker" run --rm --entrypoint python3 "$python_image" -c 'import platform; print(platform.python_version())')"
"$python" deploy/lock_requirements.py --python "$image_python" >"$wheels/requirements.lock"
# setuptools and wheel: the project's own wheel is built in an isolated build environment from the wheelhouse.
printf 'setuptools==78.1.1\nwheel\n' >"$wheels/build-requirements.txt"
stamp="$(cat "$wheels/requirements.lock" "$wheels/build-requirements.txt" | sha256sum | cut -c1-16)"
if [ "$(cat "$wheels/.stamp" 2>/dev/null)" != "$stamp" ]; then
    # shellcheck disable=SC2086
    "$python" -m pip wheel -q --no-deps -r "$wheels/requirements.lock" -r "$wheels/build-requirements.txt" \
        --wheel-dir "$wheels" --timeout 15 --retries 1 $pip_options
    echo "$stamp" >"$wheels/.stamp"
fi
# Named by its hash: the build caches the dependency layer by the RUN line, which holds this name.
cp "$wheels/requirements.lock" "$wheels/requirements-$stamp.lock"

# Serve the wheelhouse on the docker bridge for the build (pip in a build step reaches the host there).
bridge="$(ip -4 -o addr show docker0 | awk '{split($4, a, "/"); print a[1]}')"
port="${DAPO_WHEELHOUSE_PORT:-8765}"
"$python" -m http.server --bind "$bridge" --directory "$wheels" "$port" >"$cache/http.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
sleep 1
url="http://$bridge:$port"
log "building $image (deploy/Dockerfile.cpu, packages from $url)"
"$docker" build -f deploy/Dockerfile.cpu -t "$image" \
    --build-arg PYTHON_IMAGE="$python_image" \
    --build-arg PIP_OPTIONS="--no-index --find-links $url/ --trusted-host $bridge" \
    --build-arg DAPO_REQUIREMENTS="$url/requirements-$stamp.lock" \
    .
kill "$server" 2>/dev/null || true

redis_image=redis:7.4.2
if pullable "$redis_image"; then
    log "using $redis_image"
else
    need_base
    redis_image=local/redis:7
    log "building $redis_image from Debian's redis-server"
    "$docker" build -q -f deploy/local/Dockerfile.redis --build-arg BASE_IMAGE="$base" -t "$redis_image" \
        deploy/local >/dev/null
fi

prometheus_image=prom/prometheus:v3.1.0
if pullable "$prometheus_image"; then
    log "using $prometheus_image"
else
    need_base
    prometheus_image=local/prometheus:2
    log "building $prometheus_image from Debian's prometheus"
    "$docker" build -q -f deploy/local/Dockerfile.prometheus --build-arg BASE_IMAGE="$base" \
        -t "$prometheus_image" deploy/local >/dev/null
fi

"$docker" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^($image|$redis_image|$prometheus_image|$python_image) " >&2 || true
cat <<EOF
# for docker compose (docker-compose.yml reads these):
export DAPO_IMAGE=$image REDIS_IMAGE=$redis_image PROMETHEUS_IMAGE=$prometheus_image
EOF
