#!/usr/bin/env bash
# Every service jobfold's tests and demo need, started natively (no Docker engine needed):
# PostgreSQL, Apache Kafka, the schema registry.
#
#   docker/services.sh start|stop|status
#
# JOBFOLD_KAFKA_NODES=3 runs Kafka as a cluster of three (docker/kafka.sh), and services.env
# then asks for topics with three replicas, written to two before an event counts.
# JOBFOLD_PG_NODES=2 runs Postgres as a primary and a synchronous standby (docker/postgres.sh),
# and services.env then names both hosts and asks every binary to refuse a primary without one.
#
# start reuses what already runs and writes the addresses to $JOBFOLD_STATE_DIR/services.env
# (source it to point the binaries at these services).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
HERE="$JOBFOLD_ROOT/docker"

case "${1:-}" in
    start)
        # Kafka's and the registry's JVMs warm up side by side while Postgres starts.
        "$HERE/kafka.sh" start &
        kafka=$!
        "$HERE/registry.sh" start &
        registry=$!
        "$HERE/postgres.sh" start
        wait "$kafka" || die "kafka did not start"
        wait "$registry" || die "the registry did not start"
        cat >"$JOBFOLD_STATE_DIR/services.env" <<ENV
export JOBFOLD_DATABASE_URL='$("$HERE/postgres.sh" url)'
export JOBFOLD_KAFKA_BROKERS=$("$HERE/kafka.sh" brokers)
export JOBFOLD_SCHEMA_REGISTRY_URL=http://127.0.0.1:$JOBFOLD_REGISTRY_PORT/apis/ccompat/v7
# The broker's SASL/PLAIN listener, for running with credentials.
export JOBFOLD_SASL_BROKERS=127.0.0.1:$JOBFOLD_KAFKA_SASL_PORT
export JOBFOLD_SASL_USERNAME=$JOBFOLD_KAFKA_SASL_USER
export JOBFOLD_SASL_PASSWORD=$JOBFOLD_KAFKA_SASL_PASSWORD
ENV
        if [[ "${JOBFOLD_KAFKA_NODES:-1}" == 3 ]]; then
            cat >>"$JOBFOLD_STATE_DIR/services.env" <<ENV
export JOBFOLD_TOPICS__REPLICATION_FACTOR=3
export JOBFOLD_TOPICS__MIN_INSYNC_REPLICAS=2
ENV
        fi
        if [[ "${JOBFOLD_PG_NODES:-1}" == 2 ]]; then
            cat >>"$JOBFOLD_STATE_DIR/services.env" <<ENV
export JOBFOLD_DATABASE__REQUIRE_SYNC_STANDBY=true
ENV
        fi
        say "services: ready; addresses in $JOBFOLD_STATE_DIR/services.env"
        ;;
    stop)
        "$HERE/registry.sh" stop
        "$HERE/kafka.sh" stop
        "$HERE/postgres.sh" stop
        ;;
    status)
        rc=0
        for s in postgres kafka registry; do "$HERE/$s.sh" status || rc=1; done
        exit $rc
        ;;
    *) die "usage: $0 start|stop|status" ;;
esac
