# Configuration files of ./dev up, one per process. Sourced by scripts/up.sh, which sets
# NATS_URL, REDIS_URL, GATEWAY_PORT, POLICY and STATE_DIR. Every key is documented in the
# README's configuration reference.
# shellcheck shell=bash

render_dispatcher_config() { # dispatcher id, metrics port
  cat <<TOML
nats_url = "$NATS_URL"
redis_url = "$REDIS_URL"
dispatcher_id = "$1"
policy = "$POLICY"
metrics_addr = "127.0.0.1:$2"
TOML
  # Extra dispatcher settings (TOML appended after the keys above, e.g. a [scheduler]
  # table), so benchmarks can run a tuned scheduler without editing defaults.
  if [ -n "${METRONOME_DISPATCHER_EXTRA_TOML:-}" ]; then
    printf '%s\n' "$METRONOME_DISPATCHER_EXTRA_TOML"
  fi
}

render_worker_config() { # worker id, model, model server port, gpu index, metrics port
  cat <<TOML
worker_id = "$1"
metrics_port = $5
model = "$2"
node = "$(hostname -s 2>/dev/null || echo local)"
gpu_index = $4
model_server_url = "http://127.0.0.1:$3"
model_server_kind = "simulator"
max_concurrency = ${WORKER_MAX_CONCURRENCY:-256}
nats_url = "$NATS_URL"
redis_url = "$REDIS_URL"
TOML
}

render_gateway_config() {
  cat <<TOML
listen = "127.0.0.1:$GATEWAY_PORT"
nats_url = "$NATS_URL"
# Loopback demo: requests without an API key are served as tenant "anonymous".
allow_anonymous = true
TOML
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
