#!/bin/sh
# Entry point of the dapo images: read the shared token from a file (Docker/Compose secret) if one is named,
# so the token need not sit in the container's environment as `docker inspect` shows it; then run the command.
set -eu

if [ -n "${DAPO_TOKEN_FILE:-}" ]; then
    if [ ! -s "$DAPO_TOKEN_FILE" ]; then
        echo "dapo-entrypoint: DAPO_TOKEN_FILE=$DAPO_TOKEN_FILE is missing or empty (set DAPO_TOKEN on the host)" >&2
        exit 64
    fi
    DAPO_TOKEN="$(cat "$DAPO_TOKEN_FILE")"
    export DAPO_TOKEN
fi

# vLLM on CPU runs markedly faster with tcmalloc; preload it where the image has it (x86_64 and arm64 paths).
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4; do
    if [ -z "${LD_PRELOAD:-}" ] && [ -f "$lib" ] && [ "${DAPO_TCMALLOC:-1}" != "0" ]; then
        export LD_PRELOAD="$lib"
    fi
done

exec "$@"
