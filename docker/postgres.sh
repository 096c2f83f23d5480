#!/usr/bin/env bash
# PostgreSQL 15 from the installed Debian packages, on 127.0.0.1, run as the postgres user.
#
#   docker/postgres.sh start|stop|status|restart-immediate
#
# start is idempotent: a running instance (by the pid in postmaster.pid) is reused.
# The database `jobfold` belongs to role `jobfold` (password `jobfold`, CREATEDB so that
# tests can make a fresh database each).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PG_BIN="${JOBFOLD_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}"
[[ -x "$PG_BIN/pg_ctl" ]] || die "no PostgreSQL server binaries under /usr/lib/postgresql (apt-get install postgresql-15)"

DIR="$JOBFOLD_STATE_DIR/postgres"
DATA="$DIR/data"
LOG="$DIR/postgres.log"
PIDFILE="$DATA/postmaster.pid"
URL="postgres://jobfold:jobfold@127.0.0.1:$JOBFOLD_PG_PORT/jobfold"

pg() { as_postgres "$PG_BIN/$1" "${@:2}"; }

ready() { pg pg_isready -q -h 127.0.0.1 -p "$JOBFOLD_PG_PORT"; }

start() {
    if pid_alive "$PIDFILE" && ready; then
        say "postgres: already running (pid $(head -n 1 "$PIDFILE")) on 127.0.0.1:$JOBFOLD_PG_PORT, log $LOG"
        return 0
    fi
    port_open "$JOBFOLD_PG_PORT" && die "postgres: 127.0.0.1:$JOBFOLD_PG_PORT is taken by another process (set JOBFOLD_PG_PORT)"
    local t0=$SECONDS
    mkdir -p "$DIR"
    chown postgres:postgres "$DIR" 2>/dev/null || true
    if [[ ! -s "$DATA/PG_VERSION" ]]; then
        pg initdb -D "$DATA" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
            -E UTF8 --locale=C.UTF-8 >"$DIR/initdb.log" 2>&1 || { log_tail initdb "$DIR/initdb.log"; die "postgres: initdb failed"; }
        # The postgres superuser may connect over TCP without a password from this machine only.
        sed -i '0,/^host/s//host    all             postgres        127.0.0.1\/32            trust\nhost/' "$DATA/pg_hba.conf"
        cat >>"$DATA/postgresql.conf" <<CONF

# jobfold development and test settings
listen_addresses = '127.0.0.1'
max_connections = 300
shared_buffers = 256MB
unix_socket_directories = '$DIR'
log_min_messages = warning
log_min_duration_statement = -1
CONF
    fi
    rm -f "$PIDFILE"
    pg pg_ctl -D "$DATA" -l "$LOG" -o "-p $JOBFOLD_PG_PORT" -w -t 60 start >/dev/null \
        || { log_tail postgres "$LOG"; die "postgres: pg_ctl start failed"; }
    wait_until 60 postgres "$LOG" "$PIDFILE" ready
    # Role and database, created once.
    pg psql -q -h 127.0.0.1 -p "$JOBFOLD_PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 <<'SQL' >/dev/null
SELECT 'CREATE ROLE jobfold LOGIN CREATEDB PASSWORD ''jobfold'''
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'jobfold') \gexec
SELECT 'CREATE DATABASE jobfold OWNER jobfold'
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'jobfold') \gexec
SQL
    say "postgres: $("$PG_BIN/postgres" --version) started in $((SECONDS - t0))s (pid $(head -n 1 "$PIDFILE")) on 127.0.0.1:$JOBFOLD_PG_PORT, log $LOG"
    say "postgres: JOBFOLD_DATABASE_URL=$URL"
}

stop() {
    if pid_alive "$PIDFILE"; then
        local pid; pid="$(head -n 1 "$PIDFILE")"
        pg pg_ctl -D "$DATA" -m fast -w -t 60 stop >/dev/null
        say "postgres: stopped (pid $pid)"
    else
        say "postgres: not running"
    fi
}

# Crash-restart for fault tests: no shutdown checkpoint, recovery from WAL at start.
restart_immediate() {
    pid_alive "$PIDFILE" || die "postgres: not running"
    pg pg_ctl -D "$DATA" -m immediate -w stop >/dev/null
    pg pg_ctl -D "$DATA" -l "$LOG" -o "-p $JOBFOLD_PG_PORT" -w -t 60 start >/dev/null \
        || { log_tail postgres "$LOG"; die "postgres: restart failed"; }
    say "postgres: restarted after immediate stop (pid $(head -n 1 "$PIDFILE"))"
}

status() {
    if pid_alive "$PIDFILE" && ready; then
        say "postgres: running (pid $(head -n 1 "$PIDFILE")) on 127.0.0.1:$JOBFOLD_PG_PORT, log $LOG"
    else
        say "postgres: not running"; return 1
    fi
}

# The pid file's first line is the postmaster's pid; lib.sh's pid_alive reads the whole
# file, so compare on the first line only.
pid_alive() {
    [[ -s "$1" ]] || return 1
    local pid; pid="$(head -n 1 "$1")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    restart-immediate) restart_immediate ;;
    *) die "usage: $0 start|stop|status|restart-immediate" ;;
esac
