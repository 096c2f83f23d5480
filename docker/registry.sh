#!/usr/bin/env bash
# The schema registry on 127.0.0.1: Apicurio Registry, serving the Confluent API.
#
#   docker/registry.sh start|stop|status
#
# start fetches Apicurio Registry from Maven Central with Maven (once: the ready-to-run
# archive, io.apicurio:apicurio-registry-app:$APICURIO_VERSION:tar.gz:all, unpacked into
# $JOBFOLD_CACHE_DIR) and runs it on the Java found on the PATH (17 or later), with
# - its HTTP port on 127.0.0.1:$JOBFOLD_REGISTRY_PORT and its management port switched off
#   (it would listen on 0.0.0.0:9000);
# - BACKWARD compatibility, enforced for every subject and what `GET /config` answers;
# - storage in an H2 file under $JOBFOLD_STATE_DIR/registry, so schema ids survive a restart.
# docker/compose.yaml runs the same version for users.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

APICURIO_VERSION=3.0.9
HOME_DIR="$JOBFOLD_CACHE_DIR/apicurio-registry-$APICURIO_VERSION"
JAR="$HOME_DIR/apicurio-registry-app-$APICURIO_VERSION-runner.jar"
DIR="$JOBFOLD_STATE_DIR/registry"
LOG="$DIR/registry.log"
PIDFILE="$DIR/registry.pid"
URL="http://127.0.0.1:$JOBFOLD_REGISTRY_PORT/apis/ccompat/v7"

answers() { curl -fsS "$URL/subjects" >/dev/null; }

fetch() {
    [[ -f "$JAR" ]] && return 0
    # One fetch at a time (a campaign's registry starts beside the tests' one). The lock's
    # descriptor is closed before Java starts, so the registry never inherits the lock.
    mkdir -p "$JOBFOLD_CACHE_DIR"
    exec 9>"$JOBFOLD_CACHE_DIR/apicurio.lock"
    flock 9
    [[ -f "$JAR" ]] || fetch_locked
    exec 9>&-
}

fetch_locked() {
    command -v mvn >/dev/null || die "registry: Maven is needed to fetch Apicurio Registry (apt-get install maven)"
    say "registry: fetching Apicurio Registry $APICURIO_VERSION from Maven Central (once)"
    local artifact="io.apicurio:apicurio-registry-app:$APICURIO_VERSION:tar.gz:all"
    local fetched="$DIR/fetched"
    rm -rf "$fetched"
    mvn -q -B dependency:copy -Dartifact="$artifact" -DoutputDirectory="$fetched" \
        >"$DIR/maven.log" 2>&1 \
        || { log_tail maven "$DIR/maven.log"; die "registry: Maven could not resolve $artifact"; }
    local archive="$fetched/apicurio-registry-app-$APICURIO_VERSION-all.tar.gz"
    [[ -f "$archive" ]] || die "registry: $archive is missing after Maven fetched it"
    local unpack="$HOME_DIR.partial"
    rm -rf "$unpack" && mkdir -p "$unpack"
    tar -xzf "$archive" -C "$unpack" || die "registry: cannot unpack $archive"
    [[ -f "$unpack/$(basename "$JAR")" ]] || die "registry: $archive holds no $(basename "$JAR")"
    rm -rf "$HOME_DIR" "$fetched" && mv "$unpack" "$HOME_DIR"
}

start() {
    if pid_alive "$PIDFILE"; then
        say "registry: already running (pid $(cat "$PIDFILE")) on $URL, log $LOG"
        return 0
    fi
    port_open "$JOBFOLD_REGISTRY_PORT" && die "registry: 127.0.0.1:$JOBFOLD_REGISTRY_PORT is taken by another process (set JOBFOLD_REGISTRY_PORT)"
    command -v java >/dev/null || die "registry: Java 17 or later is needed (apt-get install openjdk-17-jre-headless)"
    local t0=$SECONDS
    mkdir -p "$DIR"
    fetch
    # -XX:TieredStopAtLevel=1: the C1 compiler alone starts it sooner and is ample for a
    # registry read once per schema id.
    setsid java -Xms64m -Xmx384m -XX:TieredStopAtLevel=1 \
        -Dquarkus.http.host=127.0.0.1 \
        -Dquarkus.http.port="$JOBFOLD_REGISTRY_PORT" \
        -Dquarkus.management.enabled=false \
        -Dapicurio.rules.global.compatibility=BACKWARD \
        -Dapicurio.storage.kind=sql \
        -Dapicurio.storage.sql.kind=h2 \
        -Dapicurio.datasource.url="jdbc:h2:file:$DIR/data/registry" \
        -Dquarkus.log.console.format='%d{HH:mm:ss} %-5p [%c{2.}] %s%e%n' \
        -jar "$JAR" >>"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    wait_until 180 registry "$LOG" "$PIDFILE" answers
    # The global rule is enforced from start-up, but `GET /config` reports it only once set
    # through the Confluent API; set there too, both agree.
    curl -fsS -X PUT -H 'Content-Type: application/json' -d '{"compatibility":"BACKWARD"}' \
        "$URL/config" >/dev/null || die "registry: cannot set BACKWARD compatibility"
    say "registry: Apicurio Registry $APICURIO_VERSION started in $((SECONDS - t0))s (pid $(cat "$PIDFILE")) on $URL, log $LOG"
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
    stop) stop_pid registry "$PIDFILE" 20 ;;
    status) status ;;
    *) die "usage: $0 start|stop|status" ;;
esac
