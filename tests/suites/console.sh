#!/usr/bin/env bash
# Console suite: the operator console in headless Chromium against a real system.
#
# Starts the system the way an operator does (scripts/up.sh with the debug binaries that
# ./dev test built, two simulated GPUs, its own state folder and ports), sends one job
# through the gateway while following the console's event stream (the job's decision must
# be pushed), then loads /console?job=<id> in `chromium --headless --dump-dom`
# and checks the rendered page: every running worker has its row, and the explain view of
# that job names the worker that ran it as the winner with all seven score terms. The
# checks read what the page's script wrote into the DOM, so a broken page (script error,
# failing endpoint, wrong shape) fails the suite. A screenshot is kept for people.
#
# Chromium comes from Debian's `chromium` package (scripts/lib.sh installs it when
# missing); a missing browser fails with an install hint, never skips.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/lib.sh
source "$ROOT/scripts/lib.sh"
ensure_servers
ensure_chromium

BIN="$ROOT/target/debug"
for b in metronome-dispatcher metronome-gateway metronome-worker-agent metronome-gpu-sim; do
  [ -x "$BIN/$b" ] || die "$BIN/$b is missing: build first (cargo build --bins)"
done

WORK="$(mktemp -d -t metronome-console-XXXXXX)"
UP_PID=""
cleanup() {
  if [ -n "$UP_PID" ]; then
    kill -TERM "$UP_PID" 2>/dev/null || true
    wait "$UP_PID" 2>/dev/null || true
  fi
  if [ "${KEEP:-0}" = 1 ]; then log "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail() {
  printf '\033[31m[console] FAIL:\033[0m %s\n' "$*" >&2
  for f in "$WORK"/state/logs/*.log; do echo "==== $f" >&2; tail -n 15 "$f" >&2; done
  [ -f "$WORK/page.html" ] && { echo "==== rendered page" >&2; head -c 4000 "$WORK/page.html" >&2; echo >&2; }
  exit 1
}

PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
"$ROOT/scripts/up.sh" --profile debug --no-build --gpus 2 --models llama-3.1-8b \
  --gateway-port "$PORT" --state-dir "$WORK/state" >"$WORK/up.log" 2>&1 &
UP_PID=$!
deadline=$((SECONDS + 120))
until [ -f "$WORK/state/env" ]; do
  kill -0 "$UP_PID" 2>/dev/null || { cat "$WORK/up.log" >&2; fail "./dev up exited early"; }
  [ $SECONDS -lt $deadline ] || fail "the system did not come up within 120 s"
  sleep 0.5
done
WORKERS=(local-gpu0 local-gpu1)
# Both workers heartbeat before the job, so the decision has both as candidates.
deadline=$((SECONDS + 60))
until curl -fsS "$URL/console/api/workers" 2>/dev/null | grep -q '"local-gpu1"' \
  && curl -fsS "$URL/console/api/workers" | grep -q '"local-gpu0"'; do
  [ $SECONDS -lt $deadline ] || fail "the workers never appeared in /console/api/workers"
  sleep 0.5
done

# Follow the event stream while the job runs: the job's decision must be pushed.
curl -sN --max-time 30 "$URL/console/api/events" > "$WORK/events.txt" 2>/dev/null &
EVENTS_PID=$!
deadline=$((SECONDS + 20))
until grep -q '^event: workers' "$WORK/events.txt" 2>/dev/null; do
  [ $SECONDS -lt $deadline ] || fail "the console's event stream sent no workers snapshot"
  sleep 0.2
done
curl -fsS -D "$WORK/headers" -o "$WORK/response.json" "$URL/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d '{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "console-secret-prompt"}], "max_tokens": 8}' \
  || fail "the job failed"
JOB=$(tr -d '\r' < "$WORK/headers" | awk -F': ' 'tolower($1)=="x-metronome-job-id" {print $2}')
WINNER=$(tr -d '\r' < "$WORK/headers" | awk -F': ' 'tolower($1)=="x-metronome-worker" {print $2}')
[ -n "$JOB" ] && [ -n "$WINNER" ] || fail "no job id / worker header in the response"
log "job $JOB ran on $WINNER"
deadline=$((SECONDS + 20))
until grep -q "^data: {\"job_id\":\"$JOB\"" "$WORK/events.txt" 2>/dev/null; do
  [ $SECONDS -lt $deadline ] || fail "the event stream did not push the decision of $JOB"
  sleep 0.2
done
kill "$EVENTS_PID" 2>/dev/null || true
grep -q '^event: queues' "$WORK/events.txt" || fail "the console's event stream sent no queue snapshot"
# The leader publishes its queue of every model its workers serve (empty now, and fresh).
curl -fsS "$URL/console/api/queues" | python3 -c '
import json, sys
rows = {r["model"]: r for r in json.load(sys.stdin)["queues"]}
r = rows.get("llama-3.1-8b")
sys.exit(0 if r and r["stale"] is False and r["waiting"] == 0 else 1)' \
  || fail "/console/api/queues has no fresh, empty queue for llama-3.1-8b"
# Under auth the gateway reads the EWMAs with its own Redis user: the winner's are shown.
deadline=$((SECONDS + 20))
until curl -fsS "$URL/console/api/workers" | python3 -c '
import json, sys
w = [x for x in json.load(sys.stdin)["workers"] if x["status"]["worker_id"] == sys.argv[1]]
sys.exit(0 if w and (w[0].get("ewma") or {}).get("ttft_ms") is not None else 1)' "$WINNER"; do
  [ $SECONDS -lt $deadline ] || fail "the console shows no EWMA for $WINNER (the gateway's Redis user)"
  sleep 0.5
done

# `live=0`: the page loads its snapshots and opens no event stream (tested above), so the
# network goes quiet and the virtual time budget lets every fetch and script finish.
render() { # extra chromium flags...
  timeout 90 chromium --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
    --no-first-run --user-data-dir="$WORK/profile" --virtual-time-budget=10000 \
    "$@" "$URL/console?job=$JOB&live=0" 2>>"$WORK/chromium.log"
}
render --dump-dom > "$WORK/page.html" || fail "chromium could not render the console (see $WORK/chromium.log)"
render --screenshot="$WORK/console.png" --window-size=1400,1600 >/dev/null 2>&1 || true

page="$WORK/page.html"
grep -q 'data-loaded="yes"' "$page" || fail "the page did not finish loading its data"
for w in "${WORKERS[@]}"; do
  grep -q "<tr data-worker=\"$w\">" "$page" || fail "worker $w has no row in the workers table"
done
explain=$(sed -n '/<div id="explain"/,/<\/details>/p' "$page")
grep -q "data-job=\"$JOB\"" <<<"$explain" || fail "the explain view does not show job $JOB"
grep -q "data-winner=\"$WINNER\"" <<<"$explain" || fail "the explain view does not name $WINNER as the winner"
for term in active_requests queue_depth latency_ewma job_cost throughput_ewma kv_pressure gpu_utilisation; do
  n=$(grep -o "data-term=\"$term\"" <<<"$explain" | wc -l)
  [ "$n" -ge 2 ] || fail "term $term shows for $n candidates in the explain view, expected both"
done
grep -q 'data-actual-outcome="done"' <<<"$explain" || fail "the explain view does not show the job's outcome"
grep -q '<tr data-model="llama-3.1-8b" data-queue-state="fresh">' "$page" \
  || fail "the models table shows no fresh queue snapshot for llama-3.1-8b"
if grep -q 'console-secret-prompt' "$page"; then fail "the console shows a prompt"; fi
OUTPUT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"][:40])' "$WORK/response.json")
if [ -n "$OUTPUT" ] && grep -qF "$OUTPUT" "$page"; then fail "the console shows a model output"; fi
log "console: workers ${WORKERS[*]} shown with EWMAs; the queue snapshot shown; job $JOB explained with winner $WINNER and seven terms"
