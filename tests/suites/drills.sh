#!/usr/bin/env bash
# Fault drills suite: the short drills of `metronome-drill --short` (leader SIGKILL, alone and
# together with a second agent's SIGKILL while a first one is SIGSTOPped, agent
# SIGKILL + restart, agent SIGSTOP, Redis down, nats-server restart, both dispatchers
# SIGKILLed, a model server SIGKILLed, a rolling deploy of every process, `hostile`: 5,000
# seeded hostile messages on every subject and bucket the admin identity can write, about
# 20 s, and `gateway-flood`: 2,000 chat requests through the gateway at once, each answered
# 200 or 429 and the gateway's peak RSS under 256 MiB, about 15 s) on a real system of debug
# binaries under load; `compromised-worker` (every attack of the threat model with one
# worker's credentials, each refused or dropped and counted) on a fresh system of its own,
# which it SIGKILLs the leader of and stops an agent in; then `kill-nats-leader` on a second
# system with a 3-node NATS cluster (every stream and bucket R3; SIGKILL the node leading
# JOBS, every other stream but the lease moved to it first; about 45 s), about 4 minutes
# in all. Fails when any drill lost or duplicated a job, or when a check failed (hostile: a
# process exited, the leader changed, a class of message went unanswered; kill-nats-leader:
# a job failed, JOBS kept fewer than 3 copies, the node did not catch up), or when a binary
# or server is missing (with the command that provides it), never skips.
#
# Run by `./dev test` after the workspace binaries are built into target/debug; alone:
#   cargo build --bins && bash tests/suites/drills.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/lib.sh
source "$ROOT/scripts/lib.sh"

ensure_servers
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug"
for b in metronome-drill metronome-dispatcher metronome-gateway metronome-worker-agent metronome-gpu-sim; do
  [ -x "$BIN/$b" ] || die "$BIN/$b is missing: cargo build --bins"
done
if [ -n "${CARGO_TARGET_DIR:-}" ] && [ "$CARGO_TARGET_DIR" != "$ROOT/target" ]; then
  # ./dev up runs target/<profile> of the repository.
  die "CARGO_TARGET_DIR=$CARGO_TARGET_DIR: the drills run $ROOT/target/debug; build there"
fi

report="$(mktemp -d)/RELIABILITY-short.md"
log "metronome-drill --short (report: $report)"
# A failed drill lists the lost or duplicated jobs in the report (finals, runs); rerun it
# with METRONOME_SYSTEM_LOG=info to keep the components' info logs under its state folder.
"$BIN/metronome-drill" --short --skip compromised-worker --repo "$ROOT" --profile debug --report "$report"
log "metronome-drill --short --only compromised-worker (a system of its own)"
"$BIN/metronome-drill" --short --only compromised-worker --repo "$ROOT" --profile debug --report "${report%.md}-compromised.md"
