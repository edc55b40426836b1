#!/usr/bin/env bash
# ./dev env [--state-dir DIR]: print the running system's URLs, sourceable by a shell:
#   eval "$(./dev env)"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE_DIR="$ROOT/.metronome"
[ "${1:-}" = "--state-dir" ] && STATE_DIR="$2"
if [ ! -f "$STATE_DIR/env" ]; then
  echo "# no running system found under $STATE_DIR (start one with ./dev up)" >&2
  exit 1
fi
sed 's/^/export /' "$STATE_DIR/env"
