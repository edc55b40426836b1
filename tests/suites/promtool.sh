#!/usr/bin/env bash
# Observability suite, with Prometheus' own tools:
#   - `promtool check rules` / `promtool test rules` on ops/prometheus/alerts.yml and its
#     unit tests (ops/prometheus/alerts_test.yml);
#   - `promtool check config` on ops/prometheus/prometheus.yml (compose.yaml's scrape config);
#   - the Grafana dashboard (ops/grafana/metronome.json) parses, and every panel's query
#     passes promtool's PromQL parser (each becomes a recording rule of a scratch file);
#   - `./dev up --observe` for real (debug binaries, one simulated GPU): its rendered
#     Prometheus config passes `promtool check config`, Prometheus scrapes every target
#     with `up == 1`, and every metric name the alert rules and the dashboard use is one the
#     binaries actually expose (after one job, so per-job series exist).
#
# promtool and prometheus come from Debian's `prometheus` package; missing ones are
# installed like the other suites' tools (scripts/lib.sh), and fail with an install hint
# when they cannot be, never skip.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/lib.sh
source "$ROOT/scripts/lib.sh"

ensure_prometheus
command -v promtool >/dev/null 2>&1 \
  || die "promtool is missing: apt-get install prometheus (Debian), or put promtool from https://prometheus.io/download/ on PATH"

WORK="$(mktemp -d -t metronome-promtool-XXXXXX)"
UP_PID=""
cleanup() {
  if [ -n "$UP_PID" ]; then kill -TERM "$UP_PID" 2>/dev/null || true; wait "$UP_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

cd "$ROOT/ops/prometheus"
log "promtool check rules alerts.yml"
promtool check rules alerts.yml
log "promtool test rules alerts_test.yml"
promtool test rules alerts_test.yml
log "promtool check config prometheus.yml"
promtool check config prometheus.yml

log "dashboard ops/grafana/metronome.json: every panel query parses"
python3 - "$ROOT/ops/grafana/metronome.json" "$WORK/dashboard_rules.yml" "$WORK/dashboard_metrics.txt" <<'PY'
import json, re, sys
dash = json.load(open(sys.argv[1]))
exprs = []
for p in dash["panels"]:
    for t in p.get("targets", []):
        exprs.append((p["title"], t["expr"]))
assert exprs, "the dashboard has no queries"
with open(sys.argv[2], "w") as f:
    f.write("groups:\n  - name: dashboard\n    rules:\n")
    for i, (_, e) in enumerate(exprs):
        f.write(f"      - record: dashboard:panel_{i}\n        expr: {json.dumps(e)}\n")
names = set()
for _, e in exprs:
    e = re.sub(r'\{[^}]*\}', '', e)           # label matchers
    e = re.sub(r'"[^"]*"', '', e)             # strings
    e = re.sub(r'\[[^\]]*\]', '', e)          # ranges
    for tok in re.findall(r'[a-zA-Z_:][a-zA-Z0-9_:]*', e):
        if tok.startswith(("metronome_", "vllm:")):
            names.add(tok)
open(sys.argv[3], "w").write("\n".join(sorted(names)) + "\n")
print(f"{len(exprs)} queries, {len(names)} metric names")
PY
promtool check rules "$WORK/dashboard_rules.yml"

log "./dev up --observe: Prometheus scrapes every process"
BIN="$ROOT/target/debug"
for b in metronome-dispatcher metronome-gateway metronome-worker-agent metronome-gpu-sim; do
  [ -x "$BIN/$b" ] || die "$BIN/$b is missing: build first (cargo build --bins)"
done
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$ROOT/scripts/up.sh" --profile debug --no-build --observe --gpus 1 --models llama-3.1-8b \
  --gateway-port "$PORT" --state-dir "$WORK/state" >"$WORK/up.log" 2>&1 &
UP_PID=$!
deadline=$((SECONDS + 120))
until [ -f "$WORK/state/env" ]; do
  kill -0 "$UP_PID" 2>/dev/null || { cat "$WORK/up.log" >&2; die "./dev up --observe exited early"; }
  [ $SECONDS -lt $deadline ] || { cat "$WORK/up.log" >&2; die "./dev up --observe did not come up in 120 s"; }
  sleep 0.5
done
PROM=$(sed -n 's/^PROMETHEUS_URL=//p' "$WORK/state/env")
[ -n "$PROM" ] || die "./dev up --observe wrote no PROMETHEUS_URL"
grep -q "$PORT/metrics" "$WORK/up.log" || die "./dev up did not print where the gateway's metrics are"
promtool check config "$WORK/state/config/prometheus.yml"
curl -fsS -o /dev/null "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}' \
  || die "the job through the gateway failed"

python3 - "$PROM" "$ROOT/ops/prometheus/alerts.yml" "$WORK/dashboard_metrics.txt" <<'PY'
import json, re, sys, time, urllib.request
prom, alerts, dash_names = sys.argv[1:]
def get(path):
    return json.load(urllib.request.urlopen(prom + path, timeout=10))["data"]
jobs = {"metronome-gateway", "metronome-dispatcher", "metronome-worker-agent", "metronome-gpu-sim"}
wanted = set(open(dash_names).read().split())
text = open(alerts).read()
wanted |= set(re.findall(r'\b(metronome_[a-z_]+)', "\n".join(l for l in text.splitlines() if "expr" in l or l.startswith("          ")) ))
deadline = time.time() + 60
while True:
    targets = get("/api/v1/targets")["activeTargets"]
    down = [f'{t["labels"]["job"]} {t["scrapeUrl"]}: {t["health"]} {t.get("lastError","")}' for t in targets if t["health"] != "up"]
    seen_jobs = {t["labels"]["job"] for t in targets}
    exposed = set(get("/api/v1/label/__name__/values"))
    # Histograms are referenced by their series names (_bucket/_sum/_count).
    missing = sorted(n for n in wanted if n not in exposed)
    if not down and jobs <= seen_jobs and not missing:
        break
    if time.time() > deadline:
        sys.exit(f"targets down: {down}\njobs scraped: {sorted(seen_jobs)}\nmetric names used but not exposed: {missing}")
    time.sleep(1)
print(f"{len(targets)} targets up in jobs {sorted(seen_jobs)}; all {len(wanted)} metric names used by the rules and the dashboard are exposed")
PY
log "observability checks passed"
