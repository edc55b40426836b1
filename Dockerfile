# Metronome's binaries in one small image: the dispatcher, the gateway, the worker-agent,
# the GPU simulator and the operator CLI (`metronome`). Used by compose.yaml; any of them
# is the container's command.
#
#   docker build -t metronome:local --build-arg METRONOME_GIT_COMMIT=$(git rev-parse HEAD) .
#   docker run --rm metronome:local metronome-gateway --help
#   docker run --rm metronome:local metronome --help

# --- toolchain with cargo-chef ---------------------------------------------------------
# The workspace's rust-version is 1.85; the builder tracks stable 1.x on Debian bookworm,
# the same distribution as the runtime image, so the binaries link against its glibc.
FROM rust:1-slim-bookworm AS chef
RUN cargo install cargo-chef --locked --version 0.1.71
WORKDIR /src

# --- recipe: the manifests and the lock file, nothing else -----------------------------
# Its output (recipe.json) changes only when a Cargo.toml or Cargo.lock does, so the
# dependency layer below is rebuilt only then, not on every source edit.
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# --- build -----------------------------------------------------------------------------
FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
# Dependencies only: the cached layer.
RUN cargo chef cook --release --locked --recipe-path recipe.json
COPY . .
# The commit every binary reports in metronome_build_info (`unknown` when not given).
ARG METRONOME_GIT_COMMIT=""
RUN METRONOME_GIT_COMMIT="$METRONOME_GIT_COMMIT" cargo build --release --locked \
        -p metronome-dispatcher -p metronome-gateway \
        -p metronome-worker-agent -p metronome-gpu-sim -p metronome-cli \
 && mkdir -p /out/bin /out/share/man/man1 /out/share/bash-completion/completions \
 && cp target/release/metronome-dispatcher target/release/metronome-gateway \
       target/release/metronome-worker-agent target/release/metronome-gpu-sim \
       target/release/metronome /out/bin/ \
 && /out/bin/metronome man > /out/share/man/man1/metronome.1 \
 && /out/bin/metronome completions bash > /out/share/bash-completion/completions/metronome

# --- runtime ---------------------------------------------------------------------------
FROM debian:bookworm-slim
# curl: the health check below (and compose's) asks each service's own HTTP endpoint.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 metronome \
 && useradd --system --uid 10001 --gid metronome --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin metronome
COPY --from=builder /out/bin/ /usr/local/bin/
COPY --from=builder /out/share/ /usr/local/share/
USER metronome:metronome
ENV RUST_LOG=info
# The endpoint the health check asks: the gateway's /healthz by default. A container
# running another binary sets its own (compose.yaml does, per service): the dispatcher's
# /healthz on its metrics address, the worker-agent's /metrics, the simulator's /health.
ENV METRONOME_HEALTHCHECK_URL=http://127.0.0.1:8080/healthz
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD curl -fsS -o /dev/null "$METRONOME_HEALTHCHECK_URL" || exit 1
# No default service: compose.yaml (or `docker run`) names the binary to run.
CMD ["metronome-gateway", "--help"]
