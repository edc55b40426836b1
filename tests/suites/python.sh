#!/usr/bin/env bash
# Cross-language client tests: the official Python NATS and OpenAI clients against the whole
# system started by `./dev up` (see tests/python/conftest.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT/tests/python"
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
