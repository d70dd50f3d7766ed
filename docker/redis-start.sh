#!/bin/sh
# Entrypoint of the redis service in docker-compose.yaml: redis-server with
# docker/redis.conf plus `requirepass` from $SRL_REDIS_PASSWORD.
#
# The password reaches redis-server on its standard input (the trailing "-":
# config file, then stdin), never on its command line, where `ps` on the
# Docker host would show it to every user. Needs Redis >= 7.0.
set -eu

: "${SRL_REDIS_PASSWORD:?set SRL_REDIS_PASSWORD (see .env.example)}"
case "$SRL_REDIS_PASSWORD" in
*[!\ -~]* | *'"'* | *'\'*)
    echo "redis: SRL_REDIS_PASSWORD must be printable ASCII without quote or backslash;" \
        "generate one with: openssl rand -hex 32" >&2
    exit 2
    ;;
esac

exec redis-server /usr/local/etc/redis/redis.conf - <<CONF
requirepass "$SRL_REDIS_PASSWORD"
CONF
