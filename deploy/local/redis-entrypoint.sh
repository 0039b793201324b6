#!/bin/sh
# As the official image's entry point: started as root, give /data to redis and run redis-server as redis.
set -e
if [ "${1#-}" != "$1" ]; then set -- redis-server "$@"; fi
if [ "$1" = "redis-server" ] && [ "$(id -u)" = "0" ]; then
    find /data \! -user redis -exec chown redis:redis '{}' +
    exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
