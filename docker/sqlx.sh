#!/usr/bin/env bash
# The compile-time checked queries' offline data (.sqlx/ at the workspace root).
#
#   docker/sqlx.sh prepare   rebuild .sqlx/ from a database migrated from scratch
#   docker/sqlx.sh check     fail if .sqlx/ differs from what the migrations give now
#   docker/sqlx.sh lint      cargo clippy -D warnings over the workspace with every query
#                            checked against that database, then `check`'s comparison: one
#                            compile for both (the test command's)
#
# Every SQL statement in the product crates is a `sqlx::query!`/`query_as!`/`query_scalar!`:
# the compiler checks it (columns, parameter and result types, nullability) against the
# schema. Builds read that schema from the committed .sqlx/ (`SQLX_OFFLINE=true`, set in
# .cargo/config.toml), so building needs no database. After changing a query or a migration,
# run `docker/sqlx.sh prepare` (it starts PostgreSQL if it is not running) and commit .sqlx/.
#
# Both commands migrate a scratch database `jobfold_sqlx` from nothing (the core migrations,
# then the example jobs' tables, then the tables `jobfold bench` makes in its own database) and compile every crate that holds a query against it, with
# the macros writing what they learned into a directory; prepare makes that .sqlx/, check
# compares it with .sqlx/.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$JOBFOLD_ROOT"

PG_BIN="${JOBFOLD_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}"
ADMIN_URL="postgres://jobfold:jobfold@127.0.0.1:$JOBFOLD_PG_PORT/jobfold"
URL="postgres://jobfold:jobfold@127.0.0.1:$JOBFOLD_PG_PORT/jobfold_sqlx"
# The crates whose sources hold queries (the tests' own queries run against scratch tables
# and are checked by running them).
CRATES=(common relay processor cli examples)

psql_on() { PGOPTIONS="-c client_min_messages=warning" "$PG_BIN/psql" -q -X -v ON_ERROR_STOP=1 "$@" >/dev/null; }

# A database migrated from scratch, as `jobfold migrate` and the examples processor leave it.
schema() {
    docker/postgres.sh start >/dev/null
    psql_on "$ADMIN_URL" -c 'DROP DATABASE IF EXISTS jobfold_sqlx WITH (FORCE)' -c 'CREATE DATABASE jobfold_sqlx'
    local file
    # In version order, as sqlx applies them (the examples' versions start at 100001).
    for file in $(for file in migrations/*.sql examples/migrations/*.sql; do
        printf '%s %s\n' "${file##*/}" "$file"
    done | sort -V | cut -d' ' -f2) cli/sql/bench.sql; do
        psql_on "$URL" -1 -f "$file" || die "sqlx: $file failed"
    done
}

# compile DIR: every crate with queries, checked against the live schema; the macros write
# their data into DIR.
compile() {
    local dir="$1" crate packages=()
    for crate in "${CRATES[@]}"; do
        packages+=(-p "jobfold-$crate")
        # The macros read DATABASE_URL when they run, which cargo does not track: make sure
        # they run again.
        touch "$crate/src/lib.rs"
    done
    SQLX_OFFLINE=false DATABASE_URL="$URL" SQLX_OFFLINE_DIR="$dir" \
        cargo check --locked -q --all-targets "${packages[@]}"
}

drop_schema() { psql_on "$ADMIN_URL" -c 'DROP DATABASE IF EXISTS jobfold_sqlx WITH (FORCE)'; }

# compare DIR: fail unless .sqlx/ holds what the macros wrote into DIR.
compare() {
    if ! diff -r -q .sqlx "$1" >/dev/null; then
        { diff -r -q .sqlx "$1" || true; } | sed 's/^/sqlx: /' >&2
        die "sqlx: .sqlx/ is out of date with the queries or the migrations: run docker/sqlx.sh prepare and commit it"
    fi
    say "sqlx: .sqlx/ matches every query against the migrated schema ($(ls .sqlx | wc -l) queries)"
}

case "${1:-}" in
    prepare)
        schema
        rm -rf .sqlx && mkdir .sqlx
        compile "$JOBFOLD_ROOT/.sqlx"
        drop_schema
        say "sqlx: .sqlx/ holds $(ls .sqlx | wc -l) queries; commit it"
        ;;
    check)
        schema
        fresh="$(mktemp -d)"
        trap 'rm -rf "$fresh"' EXIT
        compile "$fresh"
        drop_schema
        compare "$fresh"
        ;;
    lint)
        schema
        fresh="$(mktemp -d)"
        trap 'rm -rf "$fresh"' EXIT
        for crate in "${CRATES[@]}"; do touch "$crate/src/lib.rs"; done
        SQLX_OFFLINE=false DATABASE_URL="$URL" SQLX_OFFLINE_DIR="$fresh" \
            cargo clippy --workspace --all-targets --locked -- -D warnings
        drop_schema
        compare "$fresh"
        ;;
    *) die "usage: docker/sqlx.sh prepare|check|lint" ;;
esac
