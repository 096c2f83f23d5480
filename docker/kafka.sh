#!/usr/bin/env bash
# The real Apache Kafka broker (KRaft, one combined broker + controller) on 127.0.0.1,
# from Maven Central jars on Java 17.
#
#   docker/kafka.sh start|stop|status|kill
#
# start resolves docker/kafka/pom.xml into $JOBFOLD_CACHE_DIR with Maven (once), formats
# KRaft storage (once), starts kafka.Kafka and waits until it answers a metadata request.
# It is idempotent: a running broker (by pid) is reused. kill is SIGKILL, for fault tests.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$JOBFOLD_ROOT/docker/kafka/pom.xml")"
LIBS="$JOBFOLD_CACHE_DIR/kafka-$KAFKA_VERSION/libs"
DIR="$JOBFOLD_STATE_DIR/kafka"
DATA="$DIR/data"
LOG="$DIR/kafka.log"
PIDFILE="$DIR/kafka.pid"
CONFIG="$DIR/server.properties"
BOOTSTRAP="127.0.0.1:$JOBFOLD_KAFKA_PORT"

find_java() {
    local candidate
    for candidate in "${JAVA_HOME:-}" /usr/lib/jvm/java-17-openjdk-amd64 /usr/lib/jvm/java-17-openjdk-*; do
        [[ -n "$candidate" && -x "$candidate/bin/java" ]] && { echo "$candidate/bin/java"; return; }
    done
    command -v java || die "kafka: no Java found (apt-get install openjdk-17-jre-headless)"
}
JAVA="$(find_java)"

resolve_jars() {
    [[ -f "$LIBS/.complete" ]] && return 0
    command -v mvn >/dev/null || die "kafka: Maven is needed to fetch the broker (apt-get install maven)"
    say "kafka: resolving org.apache.kafka:kafka_2.13:$KAFKA_VERSION from Maven Central into $LIBS"
    rm -rf "$LIBS"
    mkdir -p "$LIBS"
    mvn -q -B -f "$JOBFOLD_ROOT/docker/kafka/pom.xml" dependency:copy-dependencies \
        -DoutputDirectory="$LIBS" -DincludeScope=runtime >"$DIR/maven.log" 2>&1 \
        || { log_tail maven "$DIR/maven.log"; die "kafka: Maven could not resolve the broker"; }
    touch "$LIBS/.complete"
}

kafka_java() { "$JAVA" -cp "$LIBS/*" -Dlog4j2.configurationFile="$JOBFOLD_ROOT/docker/kafka/log4j2.yaml" "$@"; }

broker_version() {
    local v
    v="$(sed -n 's/.*Kafka version: \([^ ]*\).*/\1/p' "$LOG" 2>/dev/null | tail -n 1)"
    echo "Apache Kafka ${v:-$KAFKA_VERSION}"
}

answers_metadata() {
    port_open "$JOBFOLD_KAFKA_PORT" \
        && kafka_java org.apache.kafka.tools.TopicCommand --bootstrap-server "$BOOTSTRAP" --list
}

start() {
    if pid_alive "$PIDFILE"; then
        say "kafka: $(broker_version) already running (pid $(cat "$PIDFILE")) on $BOOTSTRAP, log $LOG"
        return 0
    fi
    port_open "$JOBFOLD_KAFKA_PORT" && die "kafka: $BOOTSTRAP is taken by another process (set JOBFOLD_KAFKA_PORT)"
    local t0=$SECONDS
    mkdir -p "$DIR"
    resolve_jars
    sed -e "s|@PORT@|$JOBFOLD_KAFKA_PORT|g" -e "s|@CONTROLLER_PORT@|$JOBFOLD_KAFKA_CONTROLLER_PORT|g" \
        -e "s|@SASL_PORT@|$JOBFOLD_KAFKA_SASL_PORT|g" -e "s|@SASL_USER@|$JOBFOLD_KAFKA_SASL_USER|g" \
        -e "s|@SASL_PASSWORD@|$JOBFOLD_KAFKA_SASL_PASSWORD|g" \
        -e "s|@DATA@|$DATA|g" "$JOBFOLD_ROOT/docker/kafka/server.properties" >"$CONFIG"
    chmod 600 "$CONFIG"
    if [[ ! -f "$DATA/meta.properties" ]]; then
        local cluster_id
        cluster_id="$(kafka_java kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)"
        kafka_java kafka.tools.StorageTool format -t "$cluster_id" -c "$CONFIG" >"$DIR/format.log" 2>&1 \
            || { log_tail "kafka storage format" "$DIR/format.log"; die "kafka: formatting KRaft storage failed"; }
    fi
    KAFKA_HEAP_OPTS="${KAFKA_HEAP_OPTS:--Xms256m -Xmx1g}"
    # shellcheck disable=SC2086 # the heap options are words on purpose
    setsid "$JAVA" $KAFKA_HEAP_OPTS -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$JOBFOLD_ROOT/docker/kafka/log4j2.yaml" \
        -cp "$LIBS/*" kafka.Kafka "$CONFIG" >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    wait_until 120 kafka "$LOG" "$PIDFILE" answers_metadata
    say "kafka: $(broker_version) (KRaft, broker+controller) started in $((SECONDS - t0))s (pid $(cat "$PIDFILE")) on $BOOTSTRAP, log $LOG"
    say "kafka: JOBFOLD_KAFKA_BROKERS=$BOOTSTRAP (SASL/PLAIN on 127.0.0.1:$JOBFOLD_KAFKA_SASL_PORT)"
}

status() {
    if pid_alive "$PIDFILE"; then
        say "kafka: $(broker_version) running (pid $(cat "$PIDFILE")) on $BOOTSTRAP, log $LOG"
    else
        say "kafka: not running"; return 1
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop_pid kafka "$PIDFILE" 60 ;;
    kill)
        pid_alive "$PIDFILE" || die "kafka: not running"
        kill -KILL "$(cat "$PIDFILE")"; rm -f "$PIDFILE"; say "kafka: killed" ;;
    status) status ;;
    *) die "usage: $0 start|stop|status|kill" ;;
esac
