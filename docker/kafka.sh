#!/usr/bin/env bash
# The real Apache Kafka (KRaft) on 127.0.0.1, from Maven Central jars on Java 17: one combined
# broker + controller, or with JOBFOLD_KAFKA_NODES=3 a cluster of three such nodes (a
# three-voter controller quorum; every topic three replicas, min.insync.replicas=2).
#
#   docker/kafka.sh start|stop|kill [NODE]   every node, or node NODE (1-3)
#   docker/kafka.sh pause|resume NODE        SIGSTOP / SIGCONT, for fault tests
#   docker/kafka.sh status|brokers|controller
#
# start resolves docker/kafka/pom.xml into $JOBFOLD_CACHE_DIR with Maven (once), formats
# each node's KRaft storage (once), starts kafka.Kafka and waits until the node is serving. It is idempotent: a running node (by pid) is reused. kill is SIGKILL.
# brokers prints the bootstrap list; controller the active controller's node id.
#
# A cluster's node n listens on JOBFOLD_KAFKA_PORT + 10n (controller and SASL/PLAIN listeners
# likewise from theirs): 9102, 9112, 9122 by default, as docker/compose.yaml's cluster profile.
# It keeps its data apart from the single node's, under $JOBFOLD_STATE_DIR/kafka-cluster/node-n.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KAFKA_VERSION="$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$JOBFOLD_ROOT/docker/kafka/pom.xml")"
LIBS="$JOBFOLD_CACHE_DIR/kafka-$KAFKA_VERSION/libs"
NODES="${JOBFOLD_KAFKA_NODES:-1}"
[[ "$NODES" == 1 || "$NODES" == 3 ]] || die "kafka: JOBFOLD_KAFKA_NODES must be 1 or 3, not $NODES"

find_java() {
    local candidate
    for candidate in "${JAVA_HOME:-}" /usr/lib/jvm/java-17-openjdk-amd64 /usr/lib/jvm/java-17-openjdk-*; do
        [[ -n "$candidate" && -x "$candidate/bin/java" ]] && { echo "$candidate/bin/java"; return; }
    done
    command -v java || die "kafka: no Java found (apt-get install openjdk-17-jre-headless)"
}
JAVA="$(find_java)"

# Where node n keeps its data, log, pid and configuration, and its ports.
node_dir() {
    if [[ "$NODES" == 1 ]]; then echo "$JOBFOLD_STATE_DIR/kafka"; else echo "$JOBFOLD_STATE_DIR/kafka-cluster/node-$1"; fi
}
# A cluster's node n is 10n ports above the single node, so either can run beside the other.
shift_for() { if [[ "$NODES" == 1 ]]; then echo 0; else echo $((10 * $1)); fi; }
port() { echo $((JOBFOLD_KAFKA_PORT + $(shift_for "$1"))); }
controller_port() { echo $((JOBFOLD_KAFKA_CONTROLLER_PORT + $(shift_for "$1"))); }
sasl_port() { echo $((JOBFOLD_KAFKA_SASL_PORT + $(shift_for "$1"))); }
pidfile() { echo "$(node_dir "$1")/kafka.pid"; }
logfile() { echo "$(node_dir "$1")/kafka.log"; }
name() { if [[ "$NODES" == 1 ]]; then echo kafka; else echo "kafka node $1"; fi; }
# who N: how a line names node N: "kafka:" alone, or "kafka node N:".
who() { echo "$(name "$1"):"; }

bootstrap() {
    local n list=""
    for ((n = 1; n <= NODES; n++)); do list+="${list:+,}127.0.0.1:$(port "$n")"; done
    echo "$list"
}

resolve_jars() {
    [[ -f "$LIBS/.complete" ]] && return 0
    command -v mvn >/dev/null || die "kafka: Maven is needed to fetch the broker (apt-get install maven)"
    say "kafka: resolving org.apache.kafka:kafka_2.13:$KAFKA_VERSION from Maven Central into $LIBS"
    rm -rf "$LIBS"
    mkdir -p "$LIBS" "$JOBFOLD_STATE_DIR/kafka"
    mvn -q -B -f "$JOBFOLD_ROOT/docker/kafka/pom.xml" dependency:copy-dependencies \
        -DoutputDirectory="$LIBS" -DincludeScope=runtime >"$JOBFOLD_STATE_DIR/kafka/maven.log" 2>&1 \
        || { log_tail maven "$JOBFOLD_STATE_DIR/kafka/maven.log"; die "kafka: Maven could not resolve the broker"; }
    touch "$LIBS/.complete"
}

kafka_java() { "$JAVA" -cp "$LIBS/*" -Dlog4j2.configurationFile="$JOBFOLD_ROOT/docker/kafka/log4j2.yaml" "$@"; }

broker_version() {
    local v
    v="$(sed -n 's/.*Kafka version: \([^ ]*\).*/\1/p' "$(logfile "$1")" 2>/dev/null | tail -n 1)"
    echo "Apache Kafka ${v:-$KAFKA_VERSION}"
}

# started N LINES: node N logged, past the first LINES lines of its log, that it is unfenced and
# serving (after it caught up with the cluster's metadata), and its port answers. A log line
# rather than a client's metadata request: a JVM per poll would compete with the starting node
# for the cores.
started() {
    tail -n "+$(($2 + 1))" "$(logfile "$1")" 2>/dev/null | grep -q 'Kafka Server started' \
        && port_open "$(port "$1")"
}

# configure N: node N's server.properties, and its storage formatted once with the cluster's id.
configure() {
    local n="$1" dir voters="" m replicas=1 min_isr=1
    dir="$(node_dir "$n")"
    mkdir -p "$dir"
    for ((m = 1; m <= NODES; m++)); do voters+="${voters:+,}$m@127.0.0.1:$(controller_port "$m")"; done
    if [[ "$NODES" == 3 ]]; then replicas=3 min_isr=2; fi
    sed -e "s|@NODE_ID@|$n|g" -e "s|@VOTERS@|$voters|g" \
        -e "s|@REPLICAS@|$replicas|g" -e "s|@MIN_ISR@|$min_isr|g" \
        -e "s|@PORT@|$(port "$n")|g" -e "s|@CONTROLLER_PORT@|$(controller_port "$n")|g" \
        -e "s|@SASL_PORT@|$(sasl_port "$n")|g" -e "s|@SASL_USER@|$JOBFOLD_KAFKA_SASL_USER|g" \
        -e "s|@SASL_PASSWORD@|$JOBFOLD_KAFKA_SASL_PASSWORD|g" \
        -e "s|@DATA@|$dir/data|g" "$JOBFOLD_ROOT/docker/kafka/server.properties" >"$dir/server.properties"
    chmod 600 "$dir/server.properties"
    [[ -f "$dir/data/meta.properties" ]] && return 0
    # Every node of a cluster is formatted with the same id, made once.
    local id_file="$(dirname "$dir")/cluster.id" cluster_id
    [[ "$NODES" == 1 ]] && id_file="$dir/cluster.id"
    if [[ ! -s "$id_file" ]]; then
        kafka_java kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1 >"$id_file"
    fi
    cluster_id="$(cat "$id_file")"
    kafka_java kafka.tools.StorageTool format -t "$cluster_id" -c "$dir/server.properties" >"$dir/format.log" 2>&1 \
        || { log_tail "kafka storage format" "$dir/format.log"; die "kafka: formatting node $n's KRaft storage failed"; }
}

# launch N: starts node N's JVM unless it runs; prints nothing.
launch() {
    local n="$1" dir
    dir="$(node_dir "$n")"
    pid_alive "$(pidfile "$n")" && return 0
    # A node just killed may hold its port for a moment longer.
    local deadline=$((SECONDS + 10))
    while port_open "$(port "$n")"; do
        ((SECONDS < deadline)) || die "kafka: 127.0.0.1:$(port "$n") is taken by another process (set JOBFOLD_KAFKA_PORT)"
        sleep 0.2
    done
    configure "$n"
    local heap="-Xms256m -Xmx1g"
    [[ "$NODES" == 3 ]] && heap="-Xms128m -Xmx512m"
    # shellcheck disable=SC2086 # the heap options are words on purpose
    setsid "$JAVA" ${KAFKA_HEAP_OPTS:-$heap} -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$JOBFOLD_ROOT/docker/kafka/log4j2.yaml" \
        -cp "$LIBS/*" kafka.Kafka "$dir/server.properties" >>"$dir/kafka.log" 2>&1 </dev/null &
    echo $! >"$(pidfile "$n")"
}

# nodes [N]: N, or every node.
nodes() {
    if [[ -n "${1:-}" ]]; then
        [[ "$1" =~ ^[1-9]$ && "$1" -le "$NODES" ]] || die "kafka: no node $1 (JOBFOLD_KAFKA_NODES=$NODES)"
        echo "$1"
    else
        seq 1 "$NODES"
    fi
}

start() {
    local t0=$SECONDS n fresh=()
    resolve_jars
    for n in $(nodes "${1:-}"); do
        if pid_alive "$(pidfile "$n")"; then
            say "$(who "$n") $(broker_version "$n") already running (pid $(cat "$(pidfile "$n")")) on 127.0.0.1:$(port "$n"), log $(logfile "$n")"
        else
            mkdir -p "$(node_dir "$n")"
            fresh+=("$n:$( { wc -l <"$(logfile "$n")"; } 2>/dev/null || echo 0)")
            launch "$n"
        fi
    done
    # The nodes of a cluster start together: none answers before a quorum of them runs.
    local entry lines
    for entry in "${fresh[@]}"; do
        n="${entry%%:*}" lines="${entry#*:}"
        wait_until 120 "$(name "$n")" "$(logfile "$n")" "$(pidfile "$n")" started "$n" "$lines"
        say "$(who "$n") $(broker_version "$n") (KRaft, broker+controller) started in $((SECONDS - t0))s (pid $(cat "$(pidfile "$n")")) on 127.0.0.1:$(port "$n"), log $(logfile "$n")"
    done
    if [[ -z "${1:-}" ]]; then
        say "kafka: JOBFOLD_KAFKA_BROKERS=$(bootstrap) (SASL/PLAIN on 127.0.0.1:$(sasl_port 1))"
    fi
}

stop() {
    local n pidfiles=() pidfile pid
    if [[ -n "${1:-}" ]]; then
        stop_pid "$(name "$1")" "$(pidfile "$1")" 60
        return
    fi
    # Whatever runs, of either layout: the single node and a cluster's nodes. A cluster's
    # nodes are stopped together: the last one left alone would wait for a controller quorum
    # to shut down cleanly.
    for pidfile in "$JOBFOLD_STATE_DIR/kafka/kafka.pid" "$JOBFOLD_STATE_DIR"/kafka-cluster/node-*/kafka.pid; do
        if pid_alive "$pidfile"; then pidfiles+=("$pidfile"); kill -TERM "$(cat "$pidfile")"; else rm -f "$pidfile"; fi
    done
    ((${#pidfiles[@]})) || { say "kafka: not running"; return 0; }
    for pidfile in "${pidfiles[@]}"; do
        pid="$(cat "$pidfile")" n="$(basename "$(dirname "$pidfile")")"
        [[ "$n" == kafka ]] && n="" || n=" ${n/-/ }"
        if ! gone "$pid" 60; then
            say "kafka$n: still running after 60s, sending SIGKILL to $pid"
            kill -KILL "$pid" 2>/dev/null || true
            gone "$pid" 30 || true
        fi
        rm -f "$pidfile"
        say "kafka$n: stopped (pid $pid)"
    done
}

signal() {
    local sig="$1" n="$2"
    pid_alive "$(pidfile "$n")" || die "kafka: $(name "$n") is not running"
    kill "-$sig" "$(cat "$(pidfile "$n")")"
}

status() {
    local n rc=0
    for n in $(nodes); do
        if pid_alive "$(pidfile "$n")"; then
            say "$(who "$n") $(broker_version "$n") running (pid $(cat "$(pidfile "$n")")) on 127.0.0.1:$(port "$n"), log $(logfile "$n")"
        else
            say "$(who "$n") not running"; rc=1
        fi
    done
    return $rc
}

# The active controller: the leader of the KRaft quorum, asked of any running controller.
controller() {
    local n out
    for n in $(nodes); do
        pid_alive "$(pidfile "$n")" || continue
        out="$(kafka_java org.apache.kafka.tools.MetadataQuorumCommand \
            --bootstrap-controller "127.0.0.1:$(controller_port "$n")" describe --status 2>/dev/null)" || continue
        out="$(sed -n 's/^LeaderId:[[:space:]]*\([0-9]*\).*/\1/p' <<<"$out")"
        [[ -n "$out" ]] && { echo "$out"; return 0; }
    done
    die "kafka: no controller answers"
}

case "${1:-}" in
    start) start "${2:-}" ;;
    stop) stop "${2:-}" ;;
    kill)
        for n in $(nodes "${2:-}"); do
            if pid_alive "$(pidfile "$n")"; then
                pid="$(cat "$(pidfile "$n")")"
                signal KILL "$n"; rm -f "$(pidfile "$n")"
                # Gone, its ports closed, before this returns (a restart must find them free).
                gone "$pid" 30 || die "kafka: $(name "$n") (pid $pid) outlived SIGKILL by 30s"
                say "$(who "$n") killed"
            elif [[ -n "${2:-}" ]]; then
                die "kafka: $(name "$n") is not running"
            fi
        done ;;
    pause) [[ -n "${2:-}" ]] || die "usage: $0 pause NODE"; signal STOP "$2"; say "$(who "$2") paused" ;;
    resume) [[ -n "${2:-}" ]] || die "usage: $0 resume NODE"; signal CONT "$2"; say "$(who "$2") resumed" ;;
    status) status ;;
    brokers) bootstrap ;;
    controller) controller ;;
    *) die "usage: $0 start|stop|kill [NODE] | pause|resume NODE | status|brokers|controller" ;;
esac
