#!/usr/bin/env bash
# Observability suite, with Prometheus' own tools:
#   - `promtool check rules` / `promtool test rules` on ops/prometheus/alerts.yml and its
#     unit tests (ops/prometheus/alerts_test.yml);
#   - `promtool check config` on ops/prometheus/prometheus.yml (compose.yaml's scrape config);
#   - every alert has a `runbook_url` (docs/RUNBOOK.md#<anchor>) whose section exists;
#   - the dashboard has its template variables (data source, model, worker, tenant), every
#     panel on the $datasource variable, each filter used, and a Tenants row;
#   - the Grafana dashboard (ops/grafana/metronome.json) parses, and every panel's query
#     passes promtool's PromQL parser (each becomes a recording rule of a scratch file);
#   - `./dev up --observe` for real (debug binaries, one simulated GPU): its rendered
#     Prometheus config passes `promtool check config`, Prometheus scrapes every target
#     with `up == 1`, and every metric name the alert rules and the dashboard use is one the
#     binaries actually expose (after one job, so per-job series exist), and every
#     binary's metronome_build_info (version, commit) is scraped.
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

log "every alert has a runbook_url whose section exists in docs/RUNBOOK.md"
python3 - "$ROOT/ops/prometheus/alerts.yml" "$ROOT/docs/RUNBOOK.md" <<'PY'
import re, sys, yaml
rules = [r for g in yaml.safe_load(open(sys.argv[1]))["groups"] for r in g["rules"] if "alert" in r]
# GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped,
# spaces to '-'.
anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
           for h in re.findall(r"(?m)^#{1,6} (.+)$", open(sys.argv[2]).read())}
errors = []
for r in rules:
    url = r.get("annotations", {}).get("runbook_url")
    if not url:
        errors.append(f"{r['alert']}: no runbook_url annotation")
    elif not re.fullmatch(r"docs/RUNBOOK\.md#[a-z0-9_-]+", url):
        errors.append(f"{r['alert']}: runbook_url {url!r} is not docs/RUNBOOK.md#<anchor>")
    elif url.split("#", 1)[1] not in anchors:
        errors.append(f"{r['alert']}: docs/RUNBOOK.md has no section #{url.split('#', 1)[1]}")
if errors:
    sys.exit("\n".join(errors))
print(f"{len(rules)} alerts, each with a runbook section")
PY

log "dashboard ops/grafana/metronome.json: variables (data source, model, worker, tenant) and tenant panels"
python3 - "$ROOT/ops/grafana/metronome.json" <<'PY'
import json, sys
dash = json.load(open(sys.argv[1]))
errors = []
variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
for name, kind in [("datasource", "datasource"), ("model", "query"), ("worker", "query"), ("tenant", "query")]:
    if name not in variables:
        errors.append(f"no template variable ${name}")
    elif variables[name]["type"] != kind:
        errors.append(f"${name} is a {variables[name]['type']} variable, want {kind}")
panels = [p for p in dash["panels"] if p.get("targets")]
for p in panels:
    uids = {ds.get("uid") for ds in [p.get("datasource")] + [t.get("datasource") for t in p["targets"]] if ds is not None}
    if uids - {"${datasource}"}:
        errors.append(f"panel {p['title']!r} queries data source(s) {sorted(uids - {'${datasource}'})}, not $datasource")
# Each filter variable is used by at least one panel, and the tenant ones sit under a
# Tenants row.
exprs = [t["expr"] for p in panels for t in p["targets"]]
for var, label in [("model", "model"), ("worker", "worker_id"), ("tenant", "tenant")]:
    if not any(f'=~"${var}"' in e for e in exprs):
        errors.append(f"no panel filters by ${var} ({label}=~\"${var}\")")
rows = [p for p in dash["panels"] if p["type"] == "row"]
tenant_row = next((r for r in rows if r["title"] == "Tenants"), None)
if tenant_row is None:
    errors.append("no Tenants row")
else:
    below = [p for p in panels if p["gridPos"]["y"] > tenant_row["gridPos"]["y"]]
    tenant_panels = [p for p in below if any('tenant=~"$tenant"' in t["expr"] for t in p["targets"])]
    if len(tenant_panels) < 3:
        errors.append(f"the Tenants row has {len(tenant_panels)} panels filtered by $tenant, want at least 3")
if errors:
    sys.exit("\n".join(errors))
print(f"variables {sorted(variables)}; {len(panels)} panels on $datasource")
PY

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
# Every Metronome binary reports its build: metronome_build_info with a version and a
# commit label, value 1, in each of the four jobs.
deadline = time.time() + 30
while True:
    rows = get("/api/v1/query?query=metronome_build_info")["result"]
    bad = [r["metric"] for r in rows if r["value"][1] != "1" or not r["metric"].get("version") or not r["metric"].get("commit")]
    build_jobs = {r["metric"].get("job") for r in rows}
    if jobs <= build_jobs and not bad:
        break
    if time.time() > deadline:
        sys.exit(f"metronome_build_info: jobs reporting it {sorted(build_jobs)}, want {sorted(jobs)}; malformed: {bad}")
    time.sleep(1)
print("metronome_build_info in every job: " + ", ".join(sorted({f"{r['metric']['job']} {r['metric']['version']} {r['metric']['commit']}" for r in rows})))
PY
log "observability checks passed"
