#!/usr/bin/env bash
# The postgres-pair profile's primary, once at initdb (docker-entrypoint-initdb.d): the
# standby may stream from it, through a slot of its own; every commit waits for the standby
# once the server restarts (set last: the entrypoint's own commits must not wait for a
# standby that does not exist yet).
set -euo pipefail
echo "host replication $POSTGRES_USER all scram-sha-256" >>"$PGDATA/pg_hba.conf"
psql -v ON_ERROR_STOP=1 -U "$POSTGRES_USER" -d "$POSTGRES_DB" <<'SQL'
SELECT pg_create_physical_replication_slot('node2');
ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (node1, node2)';
ALTER SYSTEM SET wal_log_hints = on;
SQL
