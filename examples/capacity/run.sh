#!/usr/bin/env bash
# docs/capacity.md's worked example: 60 conversations a minute, summarized by a model whose
# answers take about 10 s, through the relay and jobfold-examples; then `jobfold capacity`
# over the window, with a 30 s waiting-time objective.
#
#   docker/services.sh start && cargo build --release --bins
#   examples/capacity/run.sh            # MINUTES=5 PER_MINUTE=60 OBJECTIVE=30s
#
# It uses topics and consumer groups of its own, on the services in services.env, and
# writes its logs, figures (JSON) and plot (SVG) to target/capacity-example/.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release}
OUT=${OUT:-$ROOT/target/capacity-example}
MINUTES=${MINUTES:-5}
PER_MINUTE=${PER_MINUTE:-60}
OBJECTIVE=${OBJECTIVE:-30s}
HTTP_PORT=${HTTP_PORT:-18080}
MODEL_PORT=${MODEL_PORT:-18090}
# shellcheck disable=SC1091
source "${JOBFOLD_STATE_DIR:-/tmp/jobfold-services}/services.env"
mkdir -p "$OUT"

run=capacity-example-$(date +%s)
export JOBFOLD_TOPICS__EVENTS=$run.events JOBFOLD_TOPICS__REQUESTS=$run.requests
export JOBFOLD_PROCESSOR__GROUP=$run.processors JOBFOLD_INTAKE__GROUP=$run.intake
export JOBFOLD_HTTP_ADDR=127.0.0.1:$HTTP_PORT
# The provider's quota, held by every processor of the group together, and a retry after
# the provider's 503 that waits its Retry-After.
cat >"$OUT/config.toml" <<TOML
[kinds.summarize-conversation]
rate_per_second = 2
cost_per_minute = 60000
retry_base = "2s"
TOML
export JOBFOLD_CONFIG=$OUT/config.toml

JOBFOLD_METRICS_ADDR=127.0.0.1:0 "$BIN/jobfold-relay" >"$OUT/relay.log" 2>&1 &
relay=$!
JOBFOLD_METRICS_ADDR=127.0.0.1:0 "$BIN/jobfold-examples" \
    --model-url "http://127.0.0.1:$MODEL_PORT/v1/chat/completions" >"$OUT/processor.log" 2>&1 &
processor=$!
trap 'kill "$relay" "$processor" 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 120); do
    curl -fs "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null && break
    sleep 1
done
curl -fs "http://127.0.0.1:$HTTP_PORT/readyz" >/dev/null || { echo "the processor did not get ready: $OUT/processor.log" >&2; exit 1; }

echo "submitting $PER_MINUTE conversations a minute for $MINUTES minutes ..." >&2
window=$(python3 "$ROOT/examples/capacity/workload.py" --api "http://127.0.0.1:$HTTP_PORT" \
    --model-port "$MODEL_PORT" --per-minute "$PER_MINUTE" --minutes "$MINUTES" | tail -n 1)
# shellcheck disable=SC2086 # the window is two options and their values
"$BIN/jobfold" capacity $window --wait "$OBJECTIVE" \
    --json "$OUT/capacity.json" --plot "$OUT/capacity.svg" | tee "$OUT/capacity.txt"
