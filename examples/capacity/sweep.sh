#!/usr/bin/env bash
# Checks `jobfold capacity` against what the workers did: an M/M/c workload
# (examples/capacity/mmc.py) run by the shipped jobfold-processor at each concurrency in
# CONCURRENCIES, and for each window the tool's recommendation for each p99 wait objective
# in OBJECTIVES next to the p99 wait the window measured. The least concurrency whose own
# window met an objective is the answer a recommendation should give (or one more, never
# fewer) from any of the windows.
#
#   docker/services.sh start && cargo build --release --bins
#   examples/capacity/sweep.sh
#   # MEAN_MS=200 RATE=15 SECONDS=180 CONCURRENCIES="4 5 6 7 32" OBJECTIVES="1s 500ms 250ms 100ms"
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
OBJECTIVES=${OBJECTIVES:-1s 500ms 250ms 100ms}
HTTP_PORT=${HTTP_PORT:-18081}
HANDLER_PORT=${HANDLER_PORT:-18091}
# shellcheck disable=SC1091
source "${JOBFOLD_STATE_DIR:-/tmp/jobfold-services}/services.env"
mkdir -p "$OUT"

figure() { python3 -c "import json,sys; k=json.load(open(sys.argv[1]))['kinds'][0]; print(eval(sys.argv[2]))" "$@"; }

header="| service, arrivals | window at | busy | p99 wait measured | p99 replayed |"
rule="| --- | ---: | ---: | ---: | ---: |"
for wait in $OBJECTIVES; do header="$header for p99 ≤ $wait |"; rule="$rule ---: |"; done
printf '%s\n%s\n' "$header" "$rule"
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
    for wait in $OBJECTIVES; do
        # shellcheck disable=SC2086 # the window is two options and their values
        "$BIN/jobfold" capacity $window --wait "$wait" --json "$dir/$wait.json" \
            --plot "$dir/$wait.svg" >"$dir/$wait.txt"
    done
    first=$dir/${OBJECTIVES%% *}.json
    row="| $MEAN_MS ms at $RATE/s | $c | $(figure "$first" "round(k['window_utilization']*100)")% |"
    row="$row $(figure "$first" "'%.3f' % k['wait_seconds']['p99']") s |"
    row="$row $(figure "$first" "'%.3f' % k['simulated_window_wait_seconds']") s |"
    for wait in $OBJECTIVES; do
        row="$row $(figure "$dir/$wait.json" "k['recommended_concurrency']") |"
    done
    echo "$row"
done
