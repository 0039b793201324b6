#!/bin/sh
# Entry point of the dapo images: read the secrets from files (Docker/Compose secrets) where they are named
# (DAPO_TOKEN_FILE -> DAPO_TOKEN, DAPO_TOKEN_SHA256_FILE -> DAPO_TOKEN_SHA256, DAPO_WEIGHTS_TOKEN_FILE ->
# DAPO_WEIGHTS_TOKEN, DAPO_REDIS_PASSWORD_FILE -> DAPO_REDIS__PASSWORD, DAPO_KEYS_PRIVATE_KEY_FILE ->
# DAPO_KEYS__PRIVATE_KEY), so they need not sit in
# the container's environment as `docker inspect` shows it; then run the command.
set -eu

read_secret() {  # $1: the variable to set, $2: the variable naming its file
    eval "file=\${$2:-}"
    if [ -n "$file" ]; then
        if [ ! -s "$file" ]; then
            echo "dapo-entrypoint: $2=$file is missing or empty (set the host variable behind it: docs/deploy.md)" >&2
            exit 64
        fi
        eval "$1=\$(cat \"\$file\")"
        export "${1?}"
    fi
}
read_secret DAPO_TOKEN DAPO_TOKEN_FILE
read_secret DAPO_TOKEN_SHA256 DAPO_TOKEN_SHA256_FILE
read_secret DAPO_WEIGHTS_TOKEN DAPO_WEIGHTS_TOKEN_FILE
read_secret DAPO_REDIS__PASSWORD DAPO_REDIS_PASSWORD_FILE
read_secret DAPO_KEYS__PRIVATE_KEY DAPO_KEYS_PRIVATE_KEY_FILE

# vLLM on CPU runs markedly faster with tcmalloc; preload it where the image has it (x86_64 and arm64 paths).
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4; do
    if [ -z "${LD_PRELOAD:-}" ] && [ -f "$lib" ] && [ "${DAPO_TCMALLOC:-1}" != "0" ]; then
        export LD_PRELOAD="$lib"
    fi
done

exec "$@"
