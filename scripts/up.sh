#!/usr/bin/env bash
# ./dev up: start the whole Metronome system on this machine, in the foreground.
#
#   ./dev up [--gpus N] [--models a,b] [--gateway-port P] [--speeds 1,1,1,0.5]
#            [--policy metronome|least_connections|round_robin|random|power_of_two]
#            [--state-dir DIR] [--profile release|debug] [--no-build] [--observe] [--traces]
#            [--keep-going] [--nats-cluster 3]
#
# Starts its own nats-server (JetStream) and redis-server on free ports with their state under
# the state folder (default .metronome/), never touching servers already running on the
# machine (--nats-cluster 3: three nats-servers clustered on loopback, nats-1..3, each with
# its own store, every stream and bucket kept on all three, R3; docs/DELIVERY.md); a
# dispatcher leader and a standby; the gateway; N simulated GPUs (one simulator
# process) with one worker-agent each, models assigned round-robin. Every process serves
# Prometheus /metrics (the addresses are printed); --observe also starts a local Prometheus
# (Debian's `prometheus`) scraping all of them with ops/prometheus/alerts.yml loaded;
# --traces starts a trace viewer (Arize Phoenix, from PyPI, installed on first use: a few
# minutes and about 860 MB) that the gateway, the dispatchers and the agents export their
# spans to: one trace per request.
# NATS and Redis require authentication: one identity per process
# with its role's permissions (scripts/render-auth.py), passwords generated into
# <state>/auth/ (mode 0600, kept across runs; delete the folder to rotate them). TLS is
# off: everything listens on 127.0.0.1. Ctrl-C or SIGTERM stops everything it started. --keep-going (fault drills) reports a process
# that exits instead of stopping everything: the drill restarts it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/lib.sh"

GPUS=4
MODELS="llama-3.1-8b,qwen2.5-7b"
GATEWAY_PORT=8080
SPEEDS=""
POLICY="metronome"
STATE_DIR="$ROOT/.metronome"
PROFILE="release"
BUILD=1
OBSERVE=0
TRACES=0
KEEP_GOING=0
NATS_CLUSTER=1
SIM_ARGS=()

while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) GPUS="$2"; shift 2 ;;
    --models) MODELS="$2"; shift 2 ;;
    --gateway-port) GATEWAY_PORT="$2"; shift 2 ;;
    --speeds) SPEEDS="$2"; shift 2 ;;
    --policy) POLICY="$2"; shift 2 ;;
    --state-dir) STATE_DIR="$2"; shift 2 ;;
    --profile) PROFILE="$2"; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --observe) OBSERVE=1; shift ;;
    --traces) TRACES=1; shift ;;
    --keep-going) KEEP_GOING=1; shift ;;
    --nats-cluster) NATS_CLUSTER="$2"; shift 2 ;;
    --sim-arg) SIM_ARGS+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see ./dev up --help)" ;;
  esac
done

[[ "$GPUS" =~ ^[0-9]+$ ]] && [ "$GPUS" -ge 1 ] && [ "$GPUS" -le 64 ] || die "--gpus must be 1..64"
[[ "$GATEWAY_PORT" =~ ^[0-9]+$ ]] && [ "$GATEWAY_PORT" -ge 1 ] && [ "$GATEWAY_PORT" -le 65535 ] || die "--gateway-port must be 1..65535"
# A cluster of 3 (or 5) keeps 3 copies of every stream: one node can be lost (two of
# five) with no message lost and the service going on. Two or four nodes survive no more
# losses than one or three.
case "$NATS_CLUSTER" in
  1) NATS_REPLICAS=1 ;;
  3|5) NATS_REPLICAS=3; CLUSTER_HEARTBEAT_TIMEOUT_MS=12000 ;;
  *) die "--nats-cluster must be 1 (one server), 3 or 5" ;;
esac
IFS=',' read -r -a MODEL_LIST <<< "$MODELS"
[ ${#MODEL_LIST[@]} -ge 1 ] || die "--models needs at least one name"
IFS=',' read -r -a SPEED_LIST <<< "$SPEEDS"

ensure_servers
if [ "$OBSERVE" -eq 1 ]; then ensure_prometheus; fi
if [ "$TRACES" -eq 1 ]; then ensure_phoenix; fi
BIN="$ROOT/target/$PROFILE"
if [ "$BUILD" -eq 1 ]; then
  ensure_cargo
  log "building release binaries (first time: a few minutes)"
  if [ "$PROFILE" = release ]; then cargo build --release --bins --quiet; else cargo build --bins --quiet; fi
fi
for b in metronome-dispatcher metronome-gateway metronome-worker-agent metronome-gpu-sim; do
  [ -x "$BIN/$b" ] || die "$BIN/$b is missing (run without --no-build)"
done

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port_busy() { (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null; }

port_busy "$GATEWAY_PORT" && die "port $GATEWAY_PORT is in use: pass --gateway-port"

# Configs hold their process's credentials (the Redis URL carries a password): every file
# this run writes is private to its user.
umask 077
mkdir -p "$STATE_DIR"
STATE_DIR="$(cd "$STATE_DIR" && pwd)"
rm -rf "$STATE_DIR/run"
mkdir -p "$STATE_DIR/run" "$STATE_DIR/logs" "$STATE_DIR/nats" "$STATE_DIR/redis" "$STATE_DIR/config"

REDIS_PORT=$(free_port)
# One client port per NATS node; the components get all of them (nats_url lists every
# node), so they connect and reconnect to whichever nodes are up.
NATS_PORTS=()
for ((n=1; n<=NATS_CLUSTER; n++)); do NATS_PORTS+=("$(free_port)"); done
NATS_URL=$(printf 'nats://127.0.0.1:%s,' "${NATS_PORTS[@]}"); NATS_URL="${NATS_URL%,}"
GATEWAY_URL="http://127.0.0.1:$GATEWAY_PORT"
export NATS_URL
# Each process gets its own identity from its config file; credentials left in this shell
# (e.g. by `eval "$(./dev env)"`) would override them.
unset REDIS_URL METRONOME_NATS_USER METRONOME_NATS_PASSWORD METRONOME_NATS_PASSWORD_FILE \
  METRONOME_NATS_CA METRONOME_NATS_CERT METRONOME_NATS_KEY
export RUST_LOG="${RUST_LOG:-info}"

PIDS=()
stop_all() {
  trap - INT TERM EXIT
  log "stopping everything ./dev up started"
  # Reverse start order: gateway and agents drain first, NATS and Redis go last.
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill -TERM "${PIDS[$i]}" 2>/dev/null || true; done
  local deadline=$((SECONDS + 20))
  for pid in "${PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -f "$STATE_DIR/env"
  exit 0
}
trap stop_all INT TERM EXIT

start() { # name, command...
  local name="$1"; shift
  "$@" >"$STATE_DIR/logs/$name.log" 2>&1 &
  PIDS+=($!)
  echo "$!" > "$STATE_DIR/run/$name.pid"
}

wait_tcp() { # port, what
  local deadline=$((SECONDS + 30))
  until port_busy "$1"; do
    [ $SECONDS -lt $deadline ] || die "$2 did not open port $1 (see $STATE_DIR/logs)"
    sleep 0.1
  done
}

# One identity per process, each with its role's permissions (docs/SECURITY.md).
AUTH_DIR="$STATE_DIR/auth"
# Direct-NATS clients: one per tenant (its own subjects only), here the demo tenant's and
# the one of jobs without a tenant (`_anon`).
IDENTITIES=(admin:admin dispatcher-a:dispatcher dispatcher-b:dispatcher gateway:gateway
  client-demo:client:demo client-_anon:client:_anon auditor:auditor)
for ((g=0; g<GPUS; g++)); do
  # Its model and concurrency ceiling go into the provisioning record the dispatchers
  # read (workers.json): the ceiling is the max_concurrency its config is given.
  IDENTITIES+=("worker-local-gpu$g:worker-agent:local-gpu$g:${MODEL_LIST[$((g % ${#MODEL_LIST[@]}))]}:${WORKER_MAX_CONCURRENCY:-256}")
done
# A cluster's nodes authenticate to each other with their own credential (route user).
ROUTE_USER=nats-route
python3 "$ROOT/scripts/render-auth.py" --dir "$AUTH_DIR" --route-user "$ROUTE_USER" "${IDENTITIES[@]}"
password() { cat "$AUTH_DIR/$1.password"; }

# Jobs carry whole prompts: allow messages up to the gateway's 4 MiB body limit and more.
( umask 077
  printf 'max_payload: 8MB\n' > "$STATE_DIR/config/nats.conf"
  cat "$AUTH_DIR/nats-authorization.conf" >> "$STATE_DIR/config/nats.conf"
  cp "$AUTH_DIR/redis-acl.conf" "$STATE_DIR/config/redis.conf" )
NATS_MONITORS=()
if [ "$NATS_CLUSTER" -eq 1 ]; then
  start nats nats-server -c "$STATE_DIR/config/nats.conf" -a 127.0.0.1 -p "${NATS_PORTS[0]}" -js -sd "$STATE_DIR/nats"
else
  # Each node: its own name (JetStream's peers are named), store and ports; the shared
  # users and limits of nats.conf; routes to the others, authenticated with the route user.
  ROUTE_PORTS=()
  for ((n=1; n<=NATS_CLUSTER; n++)); do ROUTE_PORTS+=("$(free_port)"); NATS_MONITORS+=("$(free_port)"); done
  route_pw=$(password "$ROUTE_USER")
  mkdir -p "$STATE_DIR/nats-cluster"
  for ((n=1; n<=NATS_CLUSTER; n++)); do
    routes=""
    for ((m=1; m<=NATS_CLUSTER; m++)); do
      [ "$m" -eq "$n" ] || routes+="    \"nats-route://$ROUTE_USER:$route_pw@127.0.0.1:${ROUTE_PORTS[$((m-1))]}\"\n"
    done
    ( umask 077
      cat > "$STATE_DIR/config/nats-$n.conf" <<CONF
include "nats.conf"
server_name: "nats-$n"
listen: "127.0.0.1:${NATS_PORTS[$((n-1))]}"
http: "127.0.0.1:${NATS_MONITORS[$((n-1))]}"
jetstream { store_dir: "$STATE_DIR/nats-cluster/nats-$n" }
cluster {
  name: "metronome-dev"
  listen: "127.0.0.1:${ROUTE_PORTS[$((n-1))]}"
  authorization { user: "$ROUTE_USER", password: "$route_pw", timeout: 2 }
  routes: [
$(printf "$routes")
  ]
}
CONF
    )
    start "nats-$n" nats-server -c "$STATE_DIR/config/nats-$n.conf"
  done
fi
# noeviction: Metronome's keys are state, never a cache (docs/PROVISIONING.md).
start redis redis-server "$STATE_DIR/config/redis.conf" --bind 127.0.0.1 --protected-mode yes --port "$REDIS_PORT" --dir "$STATE_DIR/redis" --appendonly yes --save "" \
  --maxmemory 256mb --maxmemory-policy noeviction
for port in "${NATS_PORTS[@]}"; do wait_tcp "$port" nats-server; done
if [ "$NATS_CLUSTER" -gt 1 ]; then
  # Streams can be created once the JetStream cluster has elected its meta leader.
  deadline=$((SECONDS + 60))
  until curl -fsS "http://127.0.0.1:${NATS_MONITORS[0]}/jsz" 2>/dev/null | grep -q '"leader": *"nats-'; do
    [ $SECONDS -lt $deadline ] || die "the NATS cluster elected no JetStream leader in 60 s (see $STATE_DIR/logs/nats-*.log)"
    sleep 0.2
  done
fi
wait_tcp "$REDIS_PORT" redis-server

source "$ROOT/scripts/render-config.sh"

# The trace viewer starts before the processes that export to it (it takes a while to
# open its port; the simulators start meanwhile). Spans go to its OTLP/HTTP endpoint, in
# its project "metronome".
TRACES_URL=""
if [ "$TRACES" -eq 1 ]; then
  PHOENIX_PORT=$(free_port)
  TRACES_URL="http://127.0.0.1:$PHOENIX_PORT"
  mkdir -p "$STATE_DIR/phoenix"
  start phoenix env PHOENIX_WORKING_DIR="$STATE_DIR/phoenix" PHOENIX_HOST=127.0.0.1 \
    PHOENIX_PORT="$PHOENIX_PORT" PHOENIX_GRPC_PORT="$(free_port)" PHOENIX_TELEMETRY_ENABLED=false \
    "$PHOENIX_VENV/bin/phoenix" serve
  PHOENIX_PID=${PIDS[-1]}
fi

# Simulated GPUs: one simulator process per GPU (sim-gpu<g>), as a host runs one model
# server per GPU, so one model server can fail or restart without the others (the drill
# stop-model-server). The GPUs are independent, so this serves exactly what one process
# serving every GPU would.
# Each publishes its prefix cache's KV events as vLLM does (a ZMQ PUB socket and its replay
# socket), which its worker-agent follows and reports to the leader.
declare -a GPU_PORTS GPU_MODELS KV_PORTS KV_REPLAY_PORTS
for ((g=0; g<GPUS; g++)); do
  GPU_PORTS[$g]=$(free_port)
  KV_PORTS[$g]=$(free_port)
  KV_REPLAY_PORTS[$g]=$(free_port)
  GPU_MODELS[$g]="${MODEL_LIST[$((g % ${#MODEL_LIST[@]}))]}"
  speed="${SPEED_LIST[$g]:-1.0}"
  start "sim-gpu$g" "$BIN/metronome-gpu-sim" --gpu "model=${GPU_MODELS[$g]},port=${GPU_PORTS[$g]},speed=$speed,kv_events_endpoint=tcp://127.0.0.1:${KV_PORTS[$g]},kv_events_replay_endpoint=tcp://127.0.0.1:${KV_REPLAY_PORTS[$g]}" \
    ${SIM_ARGS[@]+"${SIM_ARGS[@]}"}
done
for ((g=0; g<GPUS; g++)); do wait_tcp "${GPU_PORTS[$g]}" "simulated GPU $g"; done
if [ -n "$TRACES_URL" ]; then
  deadline=$((SECONDS + 180))
  until curl -fsS -o /dev/null "$TRACES_URL/" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || die "the trace viewer did not start in 180 s (see $STATE_DIR/logs/phoenix.log)"
    kill -0 "$PHOENIX_PID" 2>/dev/null || die "the trace viewer exited (see $STATE_DIR/logs/phoenix.log)"
    sleep 0.5
  done
  export OTEL_EXPORTER_OTLP_ENDPOINT="$TRACES_URL"
  export OTEL_RESOURCE_ATTRIBUTES="openinference.project.name=metronome"
  export OTEL_BSP_SCHEDULE_DELAY=1000
fi

# Each dispatcher serves Prometheus /metrics (queue depth, decisions) on its own free port;
# its config file under $STATE_DIR/config/ names it (metrics_addr).
DISPATCHER_METRICS=()
for id in a b; do
  port=$(free_port); DISPATCHER_METRICS+=("127.0.0.1:$port")
  render_dispatcher_config "dispatcher-$id" "$port" > "$STATE_DIR/config/dispatcher-$id.toml"
  start "dispatcher-$id" "$BIN/metronome-dispatcher" --config "$STATE_DIR/config/dispatcher-$id.toml"
done

WORKER_METRICS=()
for ((g=0; g<GPUS; g++)); do
  port=$(free_port); WORKER_METRICS+=("127.0.0.1:$port")
  render_worker_config "local-gpu$g" "${GPU_MODELS[$g]}" "${GPU_PORTS[$g]}" "$g" "$port" \
    "${KV_PORTS[$g]}" "${KV_REPLAY_PORTS[$g]}" > "$STATE_DIR/config/worker-gpu$g.toml"
  start "worker-gpu$g" "$BIN/metronome-worker-agent" --config "$STATE_DIR/config/worker-gpu$g.toml"
done

render_gateway_config > "$STATE_DIR/config/gateway.toml"
start gateway "$BIN/metronome-gateway" --config "$STATE_DIR/config/gateway.toml"

deadline=$((SECONDS + 60))
until curl -fsS "$GATEWAY_URL/readyz" >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || die "gateway not ready after 60 s: see $STATE_DIR/logs/"
  for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || die "a process exited early: see $STATE_DIR/logs/"; done
  sleep 0.2
done

SIM_METRICS=()
for ((g=0; g<GPUS; g++)); do SIM_METRICS+=("127.0.0.1:${GPU_PORTS[$g]}"); done
join() { local IFS=,; echo "$*"; }
PROMETHEUS_URL=""
if [ "$OBSERVE" -eq 1 ]; then
  PROMETHEUS_PORT=$(free_port)
  PROMETHEUS_URL="http://127.0.0.1:$PROMETHEUS_PORT"
  render_prometheus_config \
    "metronome-gateway=127.0.0.1:$GATEWAY_PORT" \
    "metronome-dispatcher=$(join "${DISPATCHER_METRICS[@]}")" \
    "metronome-worker-agent=$(join "${WORKER_METRICS[@]}")" \
    "metronome-gpu-sim=$(join "${SIM_METRICS[@]}")" > "$STATE_DIR/config/prometheus.yml"
  mkdir -p "$STATE_DIR/prometheus"
  start prometheus prometheus --config.file="$STATE_DIR/config/prometheus.yml" \
    --storage.tsdb.path="$STATE_DIR/prometheus" --web.listen-address="127.0.0.1:$PROMETHEUS_PORT"
  wait_tcp "$PROMETHEUS_PORT" prometheus
fi

# The operator's identity for the CLI and tools (admin), and the direct-NATS client's.
# Written whole, then moved into place: whoever waits for the file reads all of it.
( umask 077
  cat > "$STATE_DIR/env.tmp" <<ENV
METRONOME_GATEWAY_URL=$GATEWAY_URL
NATS_URL=$NATS_URL
REDIS_URL=redis://admin:$(password admin)@127.0.0.1:$REDIS_PORT/
METRONOME_NATS_USER=admin
METRONOME_NATS_PASSWORD=$(password admin)
METRONOME_CLIENT_NATS_USER=client-demo
METRONOME_CLIENT_NATS_PASSWORD=$(password client-demo)
METRONOME_CLIENT_TENANT=demo
ENV
  if [ -n "$PROMETHEUS_URL" ]; then echo "PROMETHEUS_URL=$PROMETHEUS_URL" >> "$STATE_DIR/env.tmp"; fi
  if [ -n "$TRACES_URL" ]; then echo "METRONOME_TRACES_URL=$TRACES_URL" >> "$STATE_DIR/env.tmp"; fi
  mv "$STATE_DIR/env.tmp" "$STATE_DIR/env"
)

NATS_CLUSTER_LINE=""
if [ "$NATS_CLUSTER" -gt 1 ]; then
  NATS_CLUSTER_LINE=$(printf '                 a cluster of %s nodes (nats-1..%s), streams and buckets R%s; monitoring %s' \
    "$NATS_CLUSTER" "$NATS_CLUSTER" "$NATS_REPLICAS" "$(printf 'http://127.0.0.1:%s ' "${NATS_MONITORS[@]}")")$'\n'
fi
# Composed here, not inside the message: quotes inside a ${VAR:+word} of a here-document
# are taken as quoting, which garbled this line and the curl example after it.
TRACES_LINE="off (start with --traces)"
if [ -n "$TRACES_URL" ]; then
  TRACES_LINE="$TRACES_URL/projects   (project \"metronome\"; a response's x-metronome-trace-id names its trace)"
fi
cat <<MSG

  Metronome is up: $GPUS simulated GPUs serving ${MODELS}, policy $POLICY.

    gateway      $GATEWAY_URL   (OpenAI API; /metrics, /readyz)
                 anonymous access ON (loopback demo): no API key needed
    NATS         $NATS_URL   (users and permissions per role; credentials in $AUTH_DIR)
${NATS_CLUSTER_LINE}    Redis        redis://127.0.0.1:$REDIS_PORT/   (ACL users per role)
    console      $GATEWAY_URL/console   (workers, queues, live decisions, explain)
    logs         $STATE_DIR/logs/

  Prometheus /metrics:
    gateway        $GATEWAY_URL/metrics
    dispatchers    $(printf 'http://%s/metrics ' "${DISPATCHER_METRICS[@]}")
    worker-agents  $(printf 'http://%s/metrics ' "${WORKER_METRICS[@]}")
    simulated GPUs $(printf 'http://%s/metrics ' "${SIM_METRICS[@]}")
    Prometheus     ${PROMETHEUS_URL:-off (start with --observe)}
    traces         $TRACES_LINE

  Send a request:

    curl -s $GATEWAY_URL/v1/chat/completions -H 'content-type: application/json' \\
      -d '{"model": "${MODEL_LIST[0]}", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'

  Stream one:   add "stream": true to the body (and curl -N)
  Environment:  eval "\$(./dev env)"        Stop: Ctrl-C

MSG

# Stay in the foreground; if any process dies, say which and stop everything (with
# --keep-going: say it once and carry on).
declare -A REPORTED=()
while true; do
  for pid in "${PIDS[@]}"; do
    if [ -z "${REPORTED[$pid]:-}" ] && ! kill -0 "$pid" 2>/dev/null; then
      REPORTED[$pid]=1
      name=$(grep -l "^$pid\$" "$STATE_DIR"/run/*.pid 2>/dev/null | xargs -r basename | sed 's/\.pid$//' || true)
      log "process ${name:-$pid} exited: see $STATE_DIR/logs/${name:-}.log"
      [ "$KEEP_GOING" -eq 1 ] || stop_all
    fi
  done
  sleep 1
done
