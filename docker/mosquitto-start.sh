#!/bin/sh
# Entrypoint of the mosquitto service in docker-compose.yaml (runs as the
# image's mosquitto user): writes the password file named in
# docker/mosquitto.conf from $SRL_MQTT_USER / $SRL_MQTT_PASSWORD, then starts
# the broker.
#
# The password never goes on a command line (`ps` on the Docker host shows
# those to every user): a shell builtin writes "user:password" to a file only
# this user can read, and `mosquitto_passwd -U` hashes it in place. The same
# credentials go to a mosquitto_sub config file for the healthcheck
# (XDG_CONFIG_HOME=/tmp/srl).
set -eu

user="${SRL_MQTT_USER:-srl}"
password="${SRL_MQTT_PASSWORD:?set SRL_MQTT_PASSWORD (see .env.example)}"
case "$user" in
'' | *[!!-~]* | *:*)
    echo "mosquitto: SRL_MQTT_USER must be printable ASCII without space or colon" >&2
    exit 2
    ;;
esac
case "$password" in
*[!\ -~]* | *:*)
    # mosquitto_passwd -U cuts a password at its first colon
    echo "mosquitto: SRL_MQTT_PASSWORD must be printable ASCII without colon;" \
        "generate one with: openssl rand -hex 32" >&2
    exit 2
    ;;
esac

dir=/tmp/srl
umask 077
mkdir -p "$dir"
printf '%s:%s\n' "$user" "$password" >"$dir/passwd"
mosquitto_passwd -U "$dir/passwd"
printf '%s\n' "-u $user" "-P $password" >"$dir/mosquitto_sub"

exec mosquitto -c /mosquitto/config/mosquitto.conf
