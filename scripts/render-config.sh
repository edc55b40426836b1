# Configuration files of ./dev up, one per process. Sourced by scripts/up.sh, which sets
# NATS_URL (every node of a cluster, comma-separated), NATS_REPLICAS, REDIS_PORT,
# GATEWAY_PORT, POLICY, STATE_DIR and AUTH_DIR (one password file per identity). Every key is documented in the README's configuration reference.

# The identity's NATS credentials, as an inline table so keys appended after it stay
# top-level.
nats_auth_line() { # user
  printf 'nats_auth = { user = "%s", password_file = "%s" }\n' "$1" "$AUTH_DIR/$1.password"
}

redis_url_for() { # user
  printf 'redis://%s:%s@127.0.0.1:%s/' "$1" "$(cat "$AUTH_DIR/$1.password")" "$REDIS_PORT"
}
# shellcheck shell=bash

render_dispatcher_config() { # dispatcher id, metrics port
  cat <<TOML
nats_url = "$NATS_URL"
stream_replicas = ${NATS_REPLICAS:-1}
$(nats_auth_line "$1")
redis_url = "$(redis_url_for "$1")"
dispatcher_id = "$1"
policy = "$POLICY"
metrics_addr = "127.0.0.1:$2"
# Each worker id's model and concurrency ceiling (scripts/render-auth.py): a worker whose
# heartbeat claims more takes no work.
provisioning_file = "$AUTH_DIR/workers.json"
TOML
  # Extra dispatcher settings (TOML appended after the keys above, e.g. a [scheduler]
  # table), so benchmarks can run a tuned scheduler without editing defaults.
  if [ -n "${METRONOME_DISPATCHER_EXTRA_TOML:-}" ]; then
    printf '%s\n' "$METRONOME_DISPATCHER_EXTRA_TOML"
  fi
  # On a NATS cluster, losing the node that leads the workers bucket leaves the bucket
  # without a leader until the other copies elect one (about 5 s measured, up to JetStream's
  # election timeout): no heartbeat can be stored meanwhile. A heartbeat timeout shorter
  # than that declares every worker dead at each such failover (docs/DELIVERY.md). Last, in
  # a table of its own, unless the extra TOML sets [scheduler] itself.
  if [ "${NATS_CLUSTER:-1}" -gt 1 ] && ! grep -q '^\[scheduler\]' <<< "${METRONOME_DISPATCHER_EXTRA_TOML:-}"; then
    printf '[scheduler]\nheartbeat_timeout_ms = %s\n' "$CLUSTER_HEARTBEAT_TIMEOUT_MS"
  fi
}

render_worker_config() { # worker id, model, model server port, gpu index, metrics port[, KV events port, replay port]
  cat <<TOML
worker_id = "$1"
metrics_port = $5
model = "$2"
node = "$(hostname -s 2>/dev/null || echo local)"
gpu_index = $4
model_server_url = "http://127.0.0.1:$3"
model_server_kind = "simulator"
$([ -n "${6:-}" ] && echo "kv_events_endpoint = \"tcp://127.0.0.1:$6\"")
$([ -n "${7:-}" ] && echo "kv_events_replay_endpoint = \"tcp://127.0.0.1:$7\"")
max_concurrency = ${WORKER_MAX_CONCURRENCY:-256}
nats_url = "$NATS_URL"
stream_replicas = ${NATS_REPLICAS:-1}
$(nats_auth_line "worker-$1")
redis_url = "$(redis_url_for "worker-$1")"
TOML
}

render_gateway_config() {
  cat <<TOML
listen = "127.0.0.1:$GATEWAY_PORT"
nats_url = "$NATS_URL"
stream_replicas = ${NATS_REPLICAS:-1}
$(nats_auth_line gateway)
# The console's EWMA columns (a read-only Redis user).
redis_url = "$(redis_url_for gateway)"
# Loopback demo: requests without an API key are served as tenant "anonymous".
allow_anonymous = true
TOML
  # Extra gateway settings (TOML appended after the keys above, e.g. [[tenants]] and
  # [[keys]]), so a benchmark can send with real API keys.
  if [ -n "${METRONOME_GATEWAY_EXTRA_TOML:-}" ]; then
    printf '%s\n' "$METRONOME_GATEWAY_EXTRA_TOML"
  fi
}

# Prometheus scraping every process of ./dev up (--observe), with the project's alert rules.
# Arguments: "job=host:port,host:port" groups, one per scrape job.
render_prometheus_config() {
  cat <<YAML
global:
  scrape_interval: 2s
  evaluation_interval: 5s
rule_files:
  - "$ROOT/ops/prometheus/alerts.yml"
scrape_configs:
YAML
  local group job targets t
  for group in "$@"; do
    job="${group%%=*}"; targets="${group#*=}"
    printf '  - job_name: %s\n    static_configs:\n      - targets:\n' "$job"
    IFS=',' read -r -a t <<< "$targets"
    printf '          - "%s"\n' "${t[@]}"
  done
}
