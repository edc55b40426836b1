#!/usr/bin/env bash
# ./dev test: install what is missing, build once, run every test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/lib.sh"

ensure_cargo
ensure_servers
ensure_venv

log "building the workspace (binaries and tests, once)"
cargo build --workspace --bins --quiet
cargo test --workspace --no-run --quiet

status=0
log "Rust tests"
if command -v cargo-nextest >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast || status=1
else
  cargo test --workspace --no-fail-fast || status=1
fi

for suite in "$ROOT"/tests/suites/*.sh; do
  [ -e "$suite" ] || continue
  log "suite $(basename "$suite")"
  bash "$suite" || status=1
done

[ $status -eq 0 ] && log "all test suites passed" || log "some test suites failed"
exit $status
