# Helpers shared by the native service scripts. Sourced, not run.
#
# Every service keeps its data, pid file and log under $JOBFOLD_STATE_DIR/<service>,
# so a second `start` finds the running instance by pid and reuses it, and `stop`
# ends only the process it started.

set -euo pipefail

JOBFOLD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBFOLD_STATE_DIR="${JOBFOLD_STATE_DIR:-/tmp/jobfold-services}"
# Maven artefacts (the Kafka broker jars) are cached here between runs.
JOBFOLD_CACHE_DIR="${JOBFOLD_CACHE_DIR:-${HOME}/.cache/jobfold}"

JOBFOLD_PG_PORT="${JOBFOLD_PG_PORT:-5432}"
JOBFOLD_KAFKA_PORT="${JOBFOLD_KAFKA_PORT:-9092}"
JOBFOLD_KAFKA_CONTROLLER_PORT="${JOBFOLD_KAFKA_CONTROLLER_PORT:-9093}"
# The broker's SASL/PLAIN listener and its one user (a local credential, not a secret of
# any deployment).
JOBFOLD_KAFKA_SASL_PORT="${JOBFOLD_KAFKA_SASL_PORT:-9094}"
JOBFOLD_KAFKA_SASL_USER="${JOBFOLD_KAFKA_SASL_USER:-jobfold}"
JOBFOLD_KAFKA_SASL_PASSWORD="${JOBFOLD_KAFKA_SASL_PASSWORD:-local-sasl-password-7f3e}"
JOBFOLD_REGISTRY_PORT="${JOBFOLD_REGISTRY_PORT:-8081}"

mkdir -p "$JOBFOLD_STATE_DIR"
chmod 755 "$JOBFOLD_STATE_DIR"

say() { printf '%s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# pid_alive PIDFILE: the pid in PIDFILE names a live process.
pid_alive() {
    local pidfile="$1" pid
    [[ -s "$pidfile" ]] || return 1
    pid="$(cat "$pidfile")"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    kill -0 "$pid" 2>/dev/null
}

# port_open PORT: something accepts TCP connections on 127.0.0.1:PORT.
port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# log_tail NAME LOGFILE: print the end of a service's log to stderr.
log_tail() {
    local name="$1" log="$2"
    {
        printf -- '--- last 40 lines of %s (%s) ---\n' "$name" "$log"
        tail -n 40 "$log" 2>/dev/null || true
        printf -- '--- end of %s log ---\n' "$name"
    } >&2
}

# wait_until SECONDS NAME LOGFILE PIDFILE CMD...: poll CMD every 0.5 s until it succeeds.
# Fails with the log tail when time runs out or the process died.
wait_until() {
    local seconds="$1" name="$2" log="$3" pidfile="$4"
    shift 4
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        if [[ -n "$pidfile" ]] && ! pid_alive "$pidfile"; then
            log_tail "$name" "$log"
            die "$name exited during start-up"
        fi
        if ((SECONDS >= deadline)); then
            log_tail "$name" "$log"
            die "$name did not become ready within ${seconds}s"
        fi
        sleep 0.5
    done
}

# gone PID SECONDS: waits until PID has exited (a process in uninterruptible I/O dies only
# once it returns); fails if it still runs after SECONDS.
gone() {
    local deadline=$((SECONDS + $2))
    while kill -0 "$1" 2>/dev/null; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

# stop_pid NAME PIDFILE [SECONDS]: SIGTERM the process, SIGKILL it if it outlives SECONDS.
stop_pid() {
    local name="$1" pidfile="$2" seconds="${3:-30}" pid
    if ! pid_alive "$pidfile"; then
        rm -f "$pidfile"
        say "$name: not running"
        return 0
    fi
    pid="$(cat "$pidfile")"
    kill -TERM "$pid"
    local deadline=$((SECONDS + seconds))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            say "$name: still running after ${seconds}s, sending SIGKILL to $pid"
            kill -KILL "$pid" 2>/dev/null || true
            gone "$pid" 30 || true
            break
        fi
        sleep 0.2
    done
    rm -f "$pidfile"
    say "$name: stopped (pid $pid)"
}

# as_postgres CMD...: run CMD as the postgres user when we are root (PostgreSQL refuses root).
as_postgres() {
    if [[ "$(id -u)" == 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}
