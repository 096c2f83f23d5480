#!/usr/bin/env bash
# Checks `jobfold capacity` against what the workers did: an M/M/c workload
# (examples/capacity/mmc.py) run by the shipped jobfold-processor at each concurrency in
# CONCURRENCIES, and for each window the tool's recommendation for two objectives (p99 wait
# at most 1 s, and at most 0.5 s) next to the p99 wait the window measured. The least
# concurrency whose own window met an objective is the answer a recommendation should give
# (or one more, never fewer) from any of the windows.
#
#   docker/services.sh start && cargo build --release --bins
#   examples/capacity/sweep.sh         # MEAN_MS=200 RATE=15 SECONDS=180 CONCURRENCIES="4 5 6 7 32"
#
# Topics and groups of its own on the services in services.env; logs and figures in
# target/capacity-sweep/.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release}
OUT=${OUT:-$ROOT/target/capacity-sweep}
MEAN_MS=${MEAN_MS:-200}
RATE=${RATE:-15}
SECONDS_EACH=${SECONDS:-180}
CONCURRENCIES=${CONCURRENCIES:-4 5 6 7 32}
HTTP_PORT=${HTTP_PORT:-18081}
HANDLER_PORT=${HANDLER_PORT:-18091}
# shellcheck disable=SC1091
source "${JOBFOLD_STATE_DIR:-/tmp/jobfold-services}/services.env"
mkdir -p "$OUT"

figure() { python3 -c "import json,sys; k=json.load(open(sys.argv[1]))['kinds'][0]; print(eval(sys.argv[2]))" "$@"; }

printf '| %s | %s | %s | %s | %s | %s | %s |\n' "service, arrivals" "window at" "busy" \
    "p99 wait measured" "p99 replayed" "for p99 ≤ 1 s" "for p99 ≤ 0.5 s"
printf '| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n'
for c in $CONCURRENCIES; do
    run=capacity-sweep-$MEAN_MS-$RATE-$c-$(date +%s)
    dir=$OUT/$MEAN_MS-$RATE-$c
    mkdir -p "$dir"
    export JOBFOLD_TOPICS__EVENTS=$run.events JOBFOLD_TOPICS__REQUESTS=$run.requests
    export JOBFOLD_PROCESSOR__GROUP=$run.processors JOBFOLD_INTAKE__GROUP=$run.intake
    export JOBFOLD_HTTP_ADDR=127.0.0.1:$HTTP_PORT
    printf '[kinds.work]\nurl = "http://127.0.0.1:%s/work"\nconcurrency = %s\n' \
        "$HANDLER_PORT" "$c" >"$dir/config.toml"
    export JOBFOLD_CONFIG=$dir/config.toml
    JOBFOLD_METRICS_ADDR=127.0.0.1:0 "$BIN/jobfold-relay" >"$dir/relay.log" 2>&1 &
    relay=$!
    JOBFOLD_METRICS_ADDR=127.0.0.1:0 "$BIN/jobfold-processor" >"$dir/processor.log" 2>&1 &
    processor=$!
    trap 'kill "$relay" "$processor" 2>/dev/null; wait 2>/dev/null' EXIT
    for _ in $(seq 120); do
        curl -fs "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null && break
        sleep 1
    done
    window=$(python3 "$ROOT/examples/capacity/mmc.py" --api "http://127.0.0.1:$HTTP_PORT" \
        --handler-port "$HANDLER_PORT" --rate "$RATE" --mean-ms "$MEAN_MS" \
        --seconds "$SECONDS_EACH" 2>"$dir/mmc.log" | tail -n 1)
    kill "$relay" "$processor" 2>/dev/null; wait "$relay" "$processor" 2>/dev/null || true
    for wait in 1s 500ms; do
        # shellcheck disable=SC2086 # the window is two options and their values
        "$BIN/jobfold" capacity $window --wait "$wait" --json "$dir/$wait.json" \
            --plot "$dir/$wait.svg" >"$dir/$wait.txt"
    done
    printf '| %s ms at %s/s | %s | %s%% | %s s | %s s | %s | %s |\n' "$MEAN_MS" "$RATE" "$c" \
        "$(figure "$dir/1s.json" "round(k['window_utilization']*100)")" \
        "$(figure "$dir/1s.json" "'%.3f' % k['wait_seconds']['p99']")" \
        "$(figure "$dir/1s.json" "'%.3f' % k['simulated_window_wait_seconds']")" \
        "$(figure "$dir/1s.json" "k['recommended_concurrency']")" \
        "$(figure "$dir/500ms.json" "k['recommended_concurrency']")"
done
