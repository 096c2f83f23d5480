#!/usr/bin/env bash
# The postgres-pair profile's standby: a base backup of postgres-1 the first time, then
# streaming from it as `node2` (the name synchronous_standby_names waits for). Promote it with
# `docker compose exec -u postgres postgres-2 pg_ctl promote`; docs/postgres.md has the rest.
set -euo pipefail
mkdir -p "$PGDATA"
chown postgres:postgres "$PGDATA"
chmod 700 "$PGDATA"
if [[ ! -s "$PGDATA/PG_VERSION" ]]; then
    until gosu postgres pg_isready -h postgres-1 -U "$POSTGRES_USER" -q; do sleep 1; done
    PGPASSWORD="$POSTGRES_PASSWORD" gosu postgres pg_basebackup -h postgres-1 -U "$POSTGRES_USER" \
        -D "$PGDATA" -X stream -c fast -S node2
    cat >>"$PGDATA/postgresql.auto.conf" <<CONF
primary_conninfo = 'host=postgres-1 user=$POSTGRES_USER password=$POSTGRES_PASSWORD application_name=node2'
primary_slot_name = 'node2'
CONF
    gosu postgres touch "$PGDATA/standby.signal"
fi
exec gosu postgres postgres -c max_connections=300 -c shared_buffers=256MB
