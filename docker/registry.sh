#!/usr/bin/env bash
# The schema registry (Confluent API) on 127.0.0.1.
#
#   docker/registry.sh start|stop|status
#
# Users run a real registry: docker/compose.yaml starts Apicurio Registry with its Confluent
# API. No real registry installs on the development and CI machines from their package
# registries (see README, "Schema registry"), so this script starts jobfold's STAND-IN, the
# `jobfold-registry-standin` binary from the tests crate: the Confluent endpoints jobfold
# calls, Avro only, persisted to a state file. JOBFOLD_SCHEMA_REGISTRY_URL pointed at a real
# registry makes every test use that one instead; then do not start this.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DIR="$JOBFOLD_STATE_DIR/registry"
LOG="$DIR/registry.log"
PIDFILE="$DIR/registry.pid"
URL="http://127.0.0.1:$JOBFOLD_REGISTRY_PORT/apis/ccompat/v7"

answers() { curl -fsS "$URL/subjects" >/dev/null; }

start() {
    if pid_alive "$PIDFILE"; then
        say "registry: already running (pid $(cat "$PIDFILE")) on $URL, log $LOG"
        return 0
    fi
    port_open "$JOBFOLD_REGISTRY_PORT" && die "registry: 127.0.0.1:$JOBFOLD_REGISTRY_PORT is taken by another process (set JOBFOLD_REGISTRY_PORT)"
    local t0=$SECONDS
    mkdir -p "$DIR"
    # JOBFOLD_REGISTRY_PROFILE=release|debug picks the build (`jobfold demo` passes its own).
    # Unset: the profile already built — the stand-in of either profile, else the profile
    # whose dependencies a `cargo build [--release]` compiled — so nothing is built twice.
    local target profile="${JOBFOLD_REGISTRY_PROFILE:-}" flag=()
    target="$(cd "$JOBFOLD_ROOT" && cargo metadata --format-version 1 --no-deps \
        | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
    if [[ -z "$profile" ]]; then
        if [[ -x "$target/release/jobfold-registry-standin" ]]; then profile=release
        elif [[ -x "$target/debug/jobfold-registry-standin" ]]; then profile=debug
        elif [[ -d "$target/release/deps" && ! -d "$target/debug/deps" ]]; then profile=release
        else profile=debug
        fi
    fi
    # Release: the whole workspace's binaries, as `cargo build --release` builds them — the
    # same features, so nothing that build compiled is compiled again (building the one
    # package alone would resolve its dependencies' features anew and rebuild them).
    # Debug: the same, as the tests' harness and docker/test.sh build the binaries.
    local what=(--workspace --bins)
    [[ "$profile" == release ]] && flag=(--release)
    say "registry: building jobfold-registry-standin ($profile)"
    (cd "$JOBFOLD_ROOT" && cargo build --quiet "${flag[@]}" "${what[@]}") \
        || die "registry: building the stand-in failed"
    local bin="$target/$profile/jobfold-registry-standin"
    setsid "$bin" --listen "127.0.0.1:$JOBFOLD_REGISTRY_PORT" --state-file "$DIR/registry.json" \
        >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    wait_until 30 registry "$LOG" "$PIDFILE" answers
    say "registry: STAND-IN Confluent-compatible schema registry (not a real registry; see README) started in $((SECONDS - t0))s (pid $(cat "$PIDFILE")) on $URL, log $LOG"
    say "registry: JOBFOLD_SCHEMA_REGISTRY_URL=$URL"
}

status() {
    if pid_alive "$PIDFILE"; then
        say "registry: running (pid $(cat "$PIDFILE")) on $URL, log $LOG"
    else
        say "registry: not running"; return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop_pid registry "$PIDFILE" 10 ;;
    status) status ;;
    *) die "usage: $0 start|stop|status" ;;
esac
