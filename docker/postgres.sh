#!/usr/bin/env bash
# PostgreSQL 15 from the installed Debian packages, on 127.0.0.1, run as the postgres user:
# one server, or with JOBFOLD_PG_NODES=2 a primary and a streaming-replication standby that
# every commit waits for (synchronous_standby_names), promoted by these commands.
#
#   docker/postgres.sh start|stop|status|restart-immediate
#   docker/postgres.sh url                   the database URL (both hosts for a pair)
# A pair only:
#   docker/postgres.sh primary               the node (1 or 2) that is primary now
#   docker/postgres.sh failover [--rejoin]   SIGKILL the primary's processes, promote the standby
#                                            (--rejoin: then rejoin the old primary as its standby)
#   docker/postgres.sh switchover            stop the primary cleanly, promote the standby,
#                                            the old primary following it as its standby
#   docker/postgres.sh kill|start-node|rejoin NODE
#                                            SIGKILL node NODE; start it again in its role;
#                                            make it (an old primary) the standby of the
#                                            primary (pg_rewind, else a new pg_basebackup)
#
# start is idempotent: a running instance (by the pid in postmaster.pid) is reused.
# The database `jobfold` belongs to role `jobfold` (password `jobfold`, CREATEDB so that
# tests can make a fresh database each).
#
# A pair's node n listens on JOBFOLD_PG_PORT + 10n (5442 and 5452 by default, as
# docker/compose.yaml's postgres-pair profile), so it runs beside the single server, and keeps
# its data under $JOBFOLD_STATE_DIR/postgres-pair/node-n. The standby streams from the
# primary through a physical replication slot named after it (node1, node2) and is named by
# its application_name; each node's synchronous_standby_names is 'FIRST 1 (node1, node2)'
# (a server never waits for itself), so a commit is acknowledged only once the standby has
# flushed it, whichever node is primary. Promotion is `pg_ctl promote`, driven by these
# commands: the manual procedure docs/postgres.md describes. A node that was primary and was
# failed over carries a `needs-rejoin` file: start-node will not start it as a second primary.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PG_BIN="${JOBFOLD_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}"
[[ -x "$PG_BIN/pg_ctl" ]] || die "no PostgreSQL server binaries under /usr/lib/postgresql (apt-get install postgresql-15)"
NODES="${JOBFOLD_PG_NODES:-1}"
[[ "$NODES" == 1 || "$NODES" == 2 ]] || die "postgres: JOBFOLD_PG_NODES must be 1 or 2, not $NODES"

pg() { as_postgres "$PG_BIN/$1" "${@:2}"; }

# Node n's directory, data directory, port, log and pid file; the single server is node 1.
node_dir() {
    if [[ "$NODES" == 1 ]]; then echo "$JOBFOLD_STATE_DIR/postgres"; else echo "$JOBFOLD_STATE_DIR/postgres-pair/node-$1"; fi
}
data() { echo "$(node_dir "$1")/data"; }
port() { if [[ "$NODES" == 1 ]]; then echo "$JOBFOLD_PG_PORT"; else echo $((JOBFOLD_PG_PORT + 10 * $1)); fi; }
logfile() { echo "$(node_dir "$1")/postgres.log"; }
pidfile() { echo "$(data "$1")/postmaster.pid"; }
name() { if [[ "$NODES" == 1 ]]; then echo postgres; else echo "postgres node $1"; fi; }
other() { echo $((3 - $1)); }

url() {
    local hosts="" n
    for ((n = 1; n <= NODES; n++)); do hosts+="${hosts:+,}127.0.0.1:$(port "$n")"; done
    if [[ "$NODES" == 1 ]]; then
        echo "postgres://jobfold:jobfold@$hosts/jobfold"
    else
        echo "postgres://jobfold:jobfold@$hosts/jobfold?target_session_attrs=read-write"
    fi
}

ready() { pg pg_isready -q -h 127.0.0.1 -p "$(port "$1")"; }

# The postmaster's pid file names it in its first line; lib.sh's pid_alive reads the whole file.
running() {
    local file; file="$(pidfile "$1")"
    [[ -s "$file" ]] || return 1
    local pid; pid="$(head -n 1 "$file")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}
postmaster() { head -n 1 "$(pidfile "$1")"; }

sql() { pg psql -X -qAt -h 127.0.0.1 -p "$(port "$1")" -U postgres -d postgres -v ON_ERROR_STOP=1 -c "$2"; }

in_recovery() { [[ "$(sql "$1" 'SELECT pg_is_in_recovery()')" == t ]]; }

# initdb for node 1 (or the single server), with the settings the tests and the pair need.
init_primary() {
    local dir; dir="$(node_dir 1)"
    mkdir -p "$dir"
    chown postgres:postgres "$dir" 2>/dev/null || true
    pg initdb -D "$(data 1)" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
        -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 || { log_tail initdb "$dir/initdb.log"; die "postgres: initdb failed"; }
    # The postgres superuser may connect over TCP without a password from this machine only,
    # to a database and, for a pair, for replication.
    sed -i '0,/^host/s//host    all             postgres        127.0.0.1\/32            trust\nhost    replication     postgres        127.0.0.1\/32            trust\nhost/' "$(data 1)/pg_hba.conf"
    cat >>"$(data 1)/postgresql.conf" <<CONF

# jobfold development and test settings
listen_addresses = '127.0.0.1'
max_connections = 300
shared_buffers = 256MB
unix_socket_directories = '$dir'
log_min_messages = warning
log_min_duration_statement = -1
CONF
    if [[ "$NODES" == 2 ]]; then
        cat >>"$(data 1)/postgresql.conf" <<'CONF'
# The pair: every commit waits until the standby has flushed it. pg_rewind needs the hints.
synchronous_standby_names = 'FIRST 1 (node1, node2)'
synchronous_commit = on
wal_log_hints = on
max_slot_wal_keep_size = 2GB
wal_sender_timeout = 5s
wal_receiver_timeout = 5s
wal_retrieve_retry_interval = 500ms
CONF
    fi
}

# Node n's own lines: its socket directory, its name towards the primary when a standby.
own_settings() {
    local n="$1" peer; peer="$(other "$1")"
    cat >"$(data "$n")/postgresql.auto.conf" <<CONF
# Written by docker/postgres.sh for node $n.
unix_socket_directories = '$(node_dir "$n")'
primary_conninfo = 'host=127.0.0.1 port=$(port "$peer") user=postgres application_name=node$n'
primary_slot_name = 'node$n'
CONF
    chown postgres:postgres "$(data "$n")/postgresql.auto.conf" 2>/dev/null || true
}

launch() {
    local n="$1"
    port_open "$(port "$n")" && die "$(name "$n"): 127.0.0.1:$(port "$n") is taken by another process (set JOBFOLD_PG_PORT)"
    rm -f "$(pidfile "$n")"
    pg pg_ctl -D "$(data "$n")" -l "$(logfile "$n")" -o "-p $(port "$n")" -w -t 60 start >/dev/null \
        || { log_tail "$(name "$n")" "$(logfile "$n")"; die "$(name "$n"): pg_ctl start failed"; }
    wait_until 60 "$(name "$n")" "$(logfile "$n")" "" ready "$n"
}

# The slot node n streams through, on the primary p.
slot_for() {
    PGOPTIONS='-c synchronous_commit=local' sql "$1" "SELECT pg_create_physical_replication_slot('node$2') WHERE NOT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = 'node$2')" >/dev/null
}

# Node n, empty, made a standby of primary p by a base backup.
clone() {
    local n="$1" p="$2" dir; dir="$(node_dir "$1")"
    rm -rf "$(data "$n")"
    mkdir -p "$dir"
    chown postgres:postgres "$dir" 2>/dev/null || true
    slot_for "$p" "$n"
    pg pg_basebackup -h 127.0.0.1 -p "$(port "$p")" -U postgres -D "$(data "$n")" -X stream -c fast \
        >"$dir/basebackup.log" 2>&1 || { log_tail pg_basebackup "$dir/basebackup.log"; die "$(name "$n"): pg_basebackup failed"; }
    follow "$n"
}

follow() {
    local n="$1"
    own_settings "$n"
    as_postgres touch "$(data "$n")/standby.signal"
    rm -f "$(node_dir "$n")/needs-rejoin"
}

# Whether primary p reports node n streaming as its synchronous standby, flushed up to lsn.
synchronous() {
    local p="$1" n="$2" lsn="$3"
    [[ "$(sql "$p" "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'node$n' AND state = 'streaming' AND sync_state = 'sync' AND flush_lsn >= '$lsn'")" == 1 ]]
}
# Waits until node n has flushed all that primary p had written when it was asked: a standby
# that connects, then finds it cannot follow the primary's timeline, never gets there.
wait_synchronous() {
    local lsn; lsn="$(sql "$1" 'SELECT pg_current_wal_lsn()')"
    wait_until 60 "$(name "$2") as synchronous standby" "$(logfile "$2")" "" synchronous "$1" "$2" "$lsn"
}

# The running node that accepts writes, if any.
primary() {
    local n
    for ((n = 1; n <= NODES; n++)); do
        if running "$n" && ready "$n" && ! in_recovery "$n"; then echo "$n"; return 0; fi
    done
    return 1
}

# Its own statements commit locally: the role and database are made before a standby exists
# (a commit would wait for one for ever), and the base backup copies them.
create_database() {
    PGOPTIONS='-c synchronous_commit=local' pg psql -q -h 127.0.0.1 -p "$(port "$1")" -U postgres -d postgres -v ON_ERROR_STOP=1 <<'SQL' >/dev/null
SELECT 'CREATE ROLE jobfold LOGIN CREATEDB PASSWORD ''jobfold'''
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'jobfold') \gexec
SELECT 'CREATE DATABASE jobfold OWNER jobfold'
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'jobfold') \gexec
SQL
}

start_single() {
    if running 1 && ready 1; then
        say "postgres: already running (pid $(postmaster 1)) on 127.0.0.1:$(port 1), log $(logfile 1)"
        return 0
    fi
    local t0=$SECONDS
    [[ -s "$(data 1)/PG_VERSION" ]] || init_primary
    launch 1
    create_database 1
    say "postgres: $("$PG_BIN/postgres" --version) started in $((SECONDS - t0))s (pid $(postmaster 1)) on 127.0.0.1:$(port 1), log $(logfile 1)"
    say "postgres: JOBFOLD_DATABASE_URL=$(url)"
}

# Node n in the role its data gives it: a standby if it has standby.signal.
start_node() {
    local n="$1"
    if running "$n" && ready "$n"; then return 0; fi
    [[ -e "$(node_dir "$n")/needs-rejoin" ]] && { rejoin "$n"; return 0; }
    launch "$n"
}

start_pair() {
    local t0=$SECONDS p s
    if [[ ! -s "$(data 1)/PG_VERSION" ]]; then
        init_primary
        own_settings 1
        launch 1
        create_database 1
    fi
    # The primary first (the node without standby.signal), then the standby.
    p=1
    [[ -e "$(data 1)/standby.signal" ]] && p=2
    s="$(other "$p")"
    start_node "$p"
    if [[ ! -s "$(data "$s")/PG_VERSION" ]]; then clone "$s" "$p"; fi
    start_node "$s"
    wait_synchronous "$p" "$s"
    say "postgres: a pair started in $((SECONDS - t0))s: primary node $p on 127.0.0.1:$(port "$p"), synchronous standby node $s on 127.0.0.1:$(port "$s"); logs $(logfile 1), $(logfile 2)"
    say "postgres: JOBFOLD_DATABASE_URL=$(url)"
}

# Every process of node n: the postmaster and all it started, found by their working
# directory (the data directory), which they keep after their parent dies. Each child runs
# in a session of its own, so no process group holds them all.
processes() {
    local dir p
    dir="$(readlink -f "$(data "$1")")"
    for p in /proc/[0-9]*; do
        [[ "$(readlink "$p/cwd" 2>/dev/null)" == "$dir" ]] && echo "${p#/proc/}"
    done
    return 0
}

# SIGKILL of node n's postmaster and every process it started, as if its machine died: the
# postmaster is stopped first so that it forks nothing more, then all are killed at once. A
# backend left alive would go on serving its clients what the dead primary held for as long
# as it takes to notice its postmaster gone.
kill_node() {
    local n="$1" pid left
    running "$n" || { say "$(name "$n"): not running"; return 0; }
    pid="$(postmaster "$n")"
    kill -STOP "$pid" 2>/dev/null || true
    # shellcheck disable=SC2046
    kill -KILL $(processes "$n") 2>/dev/null || true
    gone "$pid" 30 || die "$(name "$n"): pid $pid outlived SIGKILL"
    local deadline=$((SECONDS + 30))
    while left="$(processes "$n")" && [[ -n "$left" ]]; do
        ((SECONDS < deadline)) || die "$(name "$n"): processes $left outlived SIGKILL"
        # shellcheck disable=SC2086
        kill -KILL $left 2>/dev/null || true
        sleep 0.05
    done
    say "$(name "$n"): killed (pid $pid and every process it started)"
}

promote() {
    local n="$1"
    # -w: until the server has left recovery and accepts writes.
    pg pg_ctl -D "$(data "$n")" -w -t 60 promote >/dev/null || die "$(name "$n"): promotion failed"
    say "$(name "$n"): promoted to primary"
}

# Node n (stopped, an old primary) made the standby of the primary: pg_rewind takes back
# what it wrote that the new primary never had; if it cannot, a new base backup.
rejoin() {
    local n="$1" p
    p="$(primary)" || die "$(name "$n"): no primary to rejoin"
    [[ "$p" != "$n" ]] || die "$(name "$n") is the primary"
    if running "$n"; then pg pg_ctl -D "$(data "$n")" -m fast -w -t 60 stop >/dev/null; fi
    slot_for "$p" "$n"
    # A primary just promoted writes its new timeline to its control file at its next
    # checkpoint; until then pg_rewind would find "no rewind required" and be wrong.
    sql "$p" CHECKPOINT
    if pg pg_rewind --target-pgdata="$(data "$n")" \
        --source-server="host=127.0.0.1 port=$(port "$p") user=postgres dbname=postgres" \
        >"$(node_dir "$n")/rewind.log" 2>&1; then
        follow "$n"
        say "$(name "$n"): rewound to the primary's timeline"
    else
        say "$(name "$n"): pg_rewind failed ($(tail -n 1 "$(node_dir "$n")/rewind.log")); cloning anew"
        clone "$n" "$p"
    fi
    launch "$n"
    wait_synchronous "$p" "$n"
    say "$(name "$n"): the synchronous standby of node $p"
}

failover() {
    local p s t0=$SECONDS
    p="$(primary)" || die "postgres: no primary to fail over from"
    s="$(other "$p")"
    running "$s" || die "$(name "$s"): not running, nothing to promote"
    kill_node "$p"
    touch "$(node_dir "$p")/needs-rejoin"
    promote "$s"
    FAILED_FROM="$p"
    say "postgres: failed over from node $p to node $s in $((SECONDS - t0))s"
}

switchover() {
    local p s t0=$SECONDS
    p="$(primary)" || die "postgres: no primary to switch over from"
    s="$(other "$p")"
    wait_synchronous "$p" "$s"
    # A clean stop sends the shutdown checkpoint to the standby before it ends.
    pg pg_ctl -D "$(data "$p")" -m fast -w -t 60 stop >/dev/null
    touch "$(node_dir "$p")/needs-rejoin"
    promote "$s"
    rejoin "$p"
    say "postgres: switched over from node $p to node $s in $((SECONDS - t0))s"
}

stop() {
    local n
    for ((n = NODES; n >= 1; n--)); do
        if running "$n"; then
            local pid; pid="$(postmaster "$n")"
            pg pg_ctl -D "$(data "$n")" -m fast -w -t 60 stop >/dev/null
            say "$(name "$n"): stopped (pid $pid)"
        else
            say "$(name "$n"): not running"
        fi
    done
}

# Crash-restart for fault tests: no shutdown checkpoint, recovery from WAL at start. On a
# pair, the primary's.
restart_immediate() {
    local n=1
    [[ "$NODES" == 2 ]] && { n="$(primary)" || die "postgres: no primary"; }
    running "$n" || die "$(name "$n"): not running"
    pg pg_ctl -D "$(data "$n")" -m immediate -w stop >/dev/null
    launch "$n"
    say "$(name "$n"): restarted after immediate stop (pid $(postmaster "$n"))"
}

status() {
    local n rc=0 role
    for ((n = 1; n <= NODES; n++)); do
        if running "$n" && ready "$n"; then
            role=""
            if [[ "$NODES" == 2 ]]; then
                if in_recovery "$n"; then role=" (standby)"; else role=" (primary)"; fi
            fi
            say "$(name "$n"): running$role (pid $(postmaster "$n")) on 127.0.0.1:$(port "$n"), log $(logfile "$n")"
        else
            say "$(name "$n"): not running"
            rc=1
        fi
    done
    return $rc
}

pair_only() { [[ "$NODES" == 2 ]] || die "postgres: $1 needs a pair (JOBFOLD_PG_NODES=2)"; }
node_arg() { [[ "${1:-}" == 1 || "${1:-}" == 2 ]] || die "postgres: name the node, 1 or 2"; }

case "${1:-}" in
    start) if [[ "$NODES" == 1 ]]; then start_single; else start_pair; fi ;;
    stop) stop ;;
    status) status ;;
    url) url ;;
    restart-immediate) restart_immediate ;;
    primary) pair_only primary; primary || die "postgres: no primary is running" ;;
    failover)
        pair_only failover
        case "${2:-}" in
            "") failover ;;
            --rejoin) failover; rejoin "$FAILED_FROM" ;;
            *) die "usage: docker/postgres.sh failover [--rejoin]" ;;
        esac ;;
    switchover) pair_only switchover; switchover ;;
    kill) pair_only kill; node_arg "${2:-}"; kill_node "$2" ;;
    start-node) pair_only start-node; node_arg "${2:-}"; start_node "$2"; say "$(name "$2"): running" ;;
    rejoin) pair_only rejoin; node_arg "${2:-}"; rejoin "$2" ;;
    *) die "usage: $0 start|stop|status|url|restart-immediate|primary|failover|switchover|kill N|start-node N|rejoin N" ;;
esac
