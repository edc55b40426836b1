#!/usr/bin/env bash
# ./dev test: install what is missing, build once, run every test suite: the Rust tests
# alone, the Ansible suite with the drills beside it (see below), then the other suites.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/lib.sh"

# Wall-clock seconds of each phase, printed at the end (the suite's budget is 15 minutes
# on a fresh 2-core machine; this shows where it goes).
PHASES=()
phase_started=$SECONDS
phase_done() {
  PHASES+=("$(printf '%-28s %4ds' "$1" $((SECONDS - phase_started)))")
  phase_started=$SECONDS
}

ensure_cargo
ensure_servers

log "workspace checks (unused dependencies, undeclared test files, module cycles)"
python3 "$ROOT/scripts/check-workspace.py"

# The suites' tools (Debian packages, the Python environment) install while cargo compiles:
# the one is mostly download and unpacking, the other CPU.
tools_log="$(mktemp)"
( ensure_suite_tools ) >"$tools_log" 2>&1 &
tools_pid=$!

# One invocation for the binaries and the tests: the tests' dev-dependencies turn on
# features of shared crates (rand's through criterion, for one), and a `cargo build --bins`
# of its own resolves features without them and compiles most of the workspace a second
# time. Built together, the binaries the suites run are the ones the tests start, and the
# test runner below finds everything built.
log "building the workspace (binaries and tests, once)"
cargo build --workspace --bins --tests --quiet
phase_done "build"

log "waiting for the suites' tools"
if ! wait "$tools_pid"; then
  cat "$tools_log" >&2
  die "installing the suites' tools failed (see above)"
fi
phase_done "tools (after the build)"

status=0
log "Rust tests"
if command -v cargo-nextest >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast || status=1
else
  cargo test --workspace --no-fail-fast || status=1
fi
phase_done "Rust tests"

# The drills spend their time waiting on a live system (seconds of load per fault, then
# the settling; about 45 s of CPU in their 3 minutes), not computing: they run beside the
# Ansible suite, which is CPU-bound (the servers it starts to check rendered configs are
# waited on by condition, with deadlines of 20 s and more). It runs under SCHED_IDLE
# (nice 19 where chrt is missing), so the drills' processes, whose heartbeats and leases
# have deadlines, get the CPU the moment they ask for it and the Ansible suite takes the
# rest. The suites that start live systems of their own (console, python) run after the
# drills have ended, at normal priority. The drills' output is printed when they end.
beside_drills=(nice -n 19)
chrt --idle 0 true 2>/dev/null && beside_drills=(chrt --idle 0)
drills_log="$(mktemp)"
drills_started=$SECONDS
log "suite drills.sh (beside the Ansible suite; its output follows when it ends)"
bash "$ROOT/tests/suites/drills.sh" >"$drills_log" 2>&1 &
drills_pid=$!
log "suite ansible.sh (beside the drills)"
"${beside_drills[@]}" bash "$ROOT/tests/suites/ansible.sh" || status=1
phase_done "suite ansible"
drills_status=0
wait "$drills_pid" || drills_status=$?
log "suite drills.sh (its output):"
cat "$drills_log"
rm -f "$drills_log"
[ "$drills_status" -eq 0 ] || status=1
PHASES+=("$(printf '%-28s %4ds' "suite drills (beside it)" $((SECONDS - drills_started)))")
phase_done "waiting for the drills"

for suite in "$ROOT"/tests/suites/*.sh; do
  [ -e "$suite" ] || continue
  case "$(basename "$suite")" in ansible.sh | drills.sh) continue ;; esac
  log "suite $(basename "$suite")"
  bash "$suite" || status=1
  phase_done "suite $(basename "$suite" .sh)"
done

log "time per phase (wall clock):"
printf '  %s\n' "${PHASES[@]}" >&2

[ $status -eq 0 ] && log "all test suites passed" || log "some test suites failed"
exit $status
