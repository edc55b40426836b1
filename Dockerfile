# Metronome's binaries in one small image: the dispatcher, the gateway, the worker-agent
# and the GPU simulator. Used by compose.yaml; any of them is the container's command.
#
#   docker build -t metronome:local .
#   docker run --rm metronome:local metronome-gateway --help

# --- build -----------------------------------------------------------------------------
# The workspace's rust-version is 1.85; the builder tracks stable 1.x on Debian bookworm,
# the same distribution as the runtime image, so the binaries link against its glibc.
FROM rust:1-slim-bookworm AS builder
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
        -p metronome-dispatcher -p metronome-gateway \
        -p metronome-worker-agent -p metronome-gpu-sim \
 && mkdir -p /out \
 && cp target/release/metronome-dispatcher target/release/metronome-gateway \
       target/release/metronome-worker-agent target/release/metronome-gpu-sim /out/

# --- runtime ---------------------------------------------------------------------------
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 metronome \
 && useradd --system --uid 10001 --gid metronome --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin metronome
COPY --from=builder /out/ /usr/local/bin/
USER metronome:metronome
ENV RUST_LOG=info
# No default service: compose.yaml (or `docker run`) names the binary to run.
CMD ["metronome-gateway", "--help"]
