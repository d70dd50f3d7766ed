#!/usr/bin/env bash
# Make the loopback brokers srl's tests and benches use answer: Redis 6379,
# RabbitMQ 5672, Mosquitto 1883 and the Google Pub/Sub emulator 127.0.0.1:8085.
#
#   scripts/services.sh start    # start what does not answer (default)
#   scripts/services.sh status   # only report
#
# A server that already answers is left alone (whoever started it owns it).
# What this script starts binds 127.0.0.1 only, keeps its log and pid under
# .srl-services/ in the repository, and is stopped by its pid, never by name:
#   kill "$(cat .srl-services/<name>.pid)"
# A missing binary is installed with apt-get (Debian packages), nothing else.
# One line per service; the exit status is non-zero if one does not answer.
# Env: SRL_SERVICES_DIR (state dir), SRL_SERVICES_WAIT (seconds to wait for
# a start, default 60), PUBSUB_EMULATOR_HOST (checked instead of 127.0.0.1:8085
# when set).
set -u

action="${1:-start}"
case "$action" in
start | status) ;;
*)
    echo "usage: $0 start|status" >&2
    exit 2
    ;;
esac

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
state="${SRL_SERVICES_DIR:-$repo/.srl-services}"
wait_s="${SRL_SERVICES_WAIT:-60}"
pubsub_hostport="${PUBSUB_EMULATOR_HOST:-127.0.0.1:8085}"
pubsub_host="${pubsub_hostport%:*}"
pubsub_port="${pubsub_hostport##*:}"
failed=0
apt_updated=0

port_open() { # host port
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

wait_port() { # host port seconds -> 0 once it answers
    local deadline=$((SECONDS + $3))
    while ((SECONDS < deadline)); do
        port_open "$1" "$2" && return 0
        sleep 0.2
    done
    port_open "$1" "$2"
}

apt_install() { # packages...
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "  (no apt-get here: install $* by hand)" >&2
        return 1
    fi
    local sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    if [ "$apt_updated" = 0 ]; then
        $sudo apt-get update -qq >"$state/apt.log" 2>&1 || true
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >>"$state/apt.log" 2>&1
}

have_binary() { # name-or-path
    [ -n "$1" ] && { command -v "$1" >/dev/null 2>&1 || [ -x "$1" ]; }
}

report() { # name host port how
    printf '%-10s %-22s %s\n' "$1" "$2:$3" "$4"
}

# ensure NAME HOST PORT BINARY PACKAGE START_FUNCTION
ensure() {
    local name=$1 host=$2 port=$3 binary=$4 package=$5 starter=$6
    if port_open "$host" "$port"; then
        report "$name" "$host" "$port" "up"
        return 0
    fi
    if [ "$action" = status ]; then
        report "$name" "$host" "$port" "DOWN"
        failed=1
        return 1
    fi
    if ! have_binary "$binary"; then
        if [ -z "$package" ] || ! apt_install "$package"; then
            report "$name" "$host" "$port" "DOWN: ${binary:-binary} missing and apt-get install ${package:-?} failed (see $state/apt.log)"
            failed=1
            return 1
        fi
    fi
    local t0=$SECONDS
    if ! "$starter" >>"$state/$name.start.log" 2>&1; then
        report "$name" "$host" "$port" "DOWN: start command failed, see $state/$name.start.log and $state/$name.log"
        failed=1
        return 1
    fi
    if wait_port "$host" "$port" "$wait_s"; then
        report "$name" "$host" "$port" "started in $((SECONDS - t0))s (pid $(cat "$state/$name.pid" 2>/dev/null || echo ?), log $state/$name.log)"
    else
        report "$name" "$host" "$port" "DOWN: started but not answering after ${wait_s}s, see $state/$name.log"
        failed=1
        return 1
    fi
}

start_redis() {
    local bin
    bin="$(command -v redis-server)"
    "$bin" --daemonize yes --bind 127.0.0.1 --port 6379 --save '' --appendonly no \
        --dir "$state" --logfile "$state/redis.log" --pidfile "$state/redis.pid"
}

start_rabbitmq() {
    local node=""
    # rabbit@<hostname> needs a resolvable hostname
    if ! getent hosts "$(hostname)" >/dev/null 2>&1; then node="rabbit@localhost"; fi
    (
        export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 ERL_EPMD_ADDRESS=127.0.0.1
        export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
        export RABBITMQ_LOG_BASE="$state/rabbitmq-logs"
        export RABBITMQ_PID_FILE="$state/rabbitmq-logs/rabbitmq.pid"
        if [ -n "$node" ]; then export RABBITMQ_NODENAME="$node"; fi
        mkdir -p "$RABBITMQ_LOG_BASE"
        chmod 777 "$RABBITMQ_LOG_BASE" 2>/dev/null || true
        rabbitmq-server -detached
    )
    ln -sfn "$state/rabbitmq-logs" "$state/rabbitmq.log"
    ln -sfn "$state/rabbitmq-logs/rabbitmq.pid" "$state/rabbitmq.pid"
}

start_mosquitto() {
    # max_queued_messages 0: never drop QoS 1 batches queued for an offline or
    # slow trainer (mosquitto's default drops beyond 1000); srl's actors apply
    # backpressure themselves. set_tcp_nodelay: no 40 ms Nagle stalls on
    # PUBACKs. max_inflight_messages: the Receive Maximum it announces (20 by
    # default) caps a producer's window. As root mosquitto drops to the
    # mosquitto user, so its files live in a directory that user can write.
    local dir="$state/mosquitto"
    mkdir -p "$dir"
    chmod 777 "$dir"
    cat >"$dir/mosquitto.conf" <<EOF
listener 1883 127.0.0.1
allow_anonymous true
max_queued_messages 0
max_inflight_messages 128
set_tcp_nodelay true
persistence true
persistence_location $dir/
pid_file $dir/mosquitto.pid
log_dest file $dir/mosquitto.log
EOF
    mosquitto -d -c "$dir/mosquitto.conf"
    sleep 0.1
    ln -sfn "$dir/mosquitto.pid" "$state/mosquitto.pid"
    ln -sfn "$dir/mosquitto.log" "$state/mosquitto.log"
}

pubsub_emulator_bin() {
    local emu
    emu="$(dpkg -L google-cloud-cli-pubsub-emulator 2>/dev/null | grep '/bin/cloud-pubsub-emulator$' | head -1)"
    if [ -z "$emu" ]; then
        emu="/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"
    fi
    echo "$emu"
}

start_pubsub() {
    local emu
    emu="$(pubsub_emulator_bin)"
    JAVA_OPTS="${JAVA_OPTS:--Xmx2g}" nohup "$emu" --host="$pubsub_host" --port="$pubsub_port" \
        >"$state/pubsub.log" 2>&1 </dev/null &
    echo $! >"$state/pubsub.pid"
}

mkdir -p "$state"

ensure redis 127.0.0.1 6379 redis-server redis-server start_redis
ensure rabbitmq 127.0.0.1 5672 rabbitmq-server rabbitmq-server start_rabbitmq
ensure mosquitto 127.0.0.1 1883 mosquitto mosquitto start_mosquitto
ensure pubsub "$pubsub_host" "$pubsub_port" "$(pubsub_emulator_bin)" google-cloud-cli-pubsub-emulator start_pubsub

if [ -z "${PUBSUB_EMULATOR_HOST:-}" ]; then
    echo "export PUBSUB_EMULATOR_HOST=$pubsub_hostport   # for your own shell; srl's tests and bench default to it"
fi
exit "$failed"
