#!/usr/bin/env bash
# Alert rules suite: `promtool check rules` on ops/prometheus/alerts.yml and
# `promtool test rules` on its unit tests (ops/prometheus/alerts_test.yml).
#
# promtool comes from Debian's `prometheus` package; a missing promtool is installed like
# the other suites' tools (scripts/lib.sh), and fails with an install hint when it cannot
# be, never skips.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/lib.sh
source "$ROOT/scripts/lib.sh"

command -v promtool >/dev/null 2>&1 || apt_install prometheus
command -v promtool >/dev/null 2>&1 \
  || die "promtool is missing: apt-get install prometheus (Debian), or put promtool from https://prometheus.io/download/ on PATH"

cd "$ROOT/ops/prometheus"
log "promtool check rules alerts.yml"
promtool check rules alerts.yml
log "promtool test rules alerts_test.yml"
promtool test rules alerts_test.yml
