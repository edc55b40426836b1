#!/usr/bin/env bash
# Container image suite: the Dockerfile builds and its image runs every binary.
#   - the build context: .dockerignore keeps build outputs, VCS data and the benchmark
#     results out, and what it lets in (computed here with the same patterns) is under
#     10 MiB;
#   - with a container engine (docker with a running daemon, or podman) and the
#     Dockerfile's base images present or pullable: `build` of the Dockerfile, then the
#     image runs `metronome --help`, `metronome man`, each service binary's `--help`, and
#     carries a health check.
# Without an engine or without the base images (an offline machine cannot pull them) the
# build is skipped with a line saying exactly what is missing; the context checks always
# run.
#
# Usage: bash tests/suites/image.sh
# Prints one line per check and ends with "N passed, M failed" (", K skipped" when the
# build is skipped); exits non-zero on any failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1

PASSED=0
FAILED=0
SKIPPED=0
pass() { PASSED=$((PASSED + 1)); printf '  ok    %s\n' "$1"; }
fail() {
  FAILED=$((FAILED + 1))
  printf '  FAIL  %s\n' "$1"
  if [ -n "${2:-}" ]; then printf '%s\n' "$2" | tail -n 30 | sed 's/^/        /'; fi
}
skip() { SKIPPED=$((SKIPPED + 1)); printf '  SKIP  %s\n' "$1"; }
finish() {
  if [ "$SKIPPED" -gt 0 ]; then
    printf '%d passed, %d failed, %d skipped\n' "$PASSED" "$FAILED" "$SKIPPED"
  else
    printf '%d passed, %d failed\n' "$PASSED" "$FAILED"
  fi
  [ "$FAILED" -eq 0 ]
  exit $?
}

# --- the build context ------------------------------------------------------------------
missing=""
for entry in .git target bench-results; do
  grep -qxF "$entry" .dockerignore || missing="$missing $entry"
done
if [ -z "$missing" ]; then
  pass ".dockerignore keeps .git, target and bench-results out of the build context"
else
  fail ".dockerignore lets in:$missing"
fi

# The context as an engine sends it: every file under the root that no .dockerignore
# pattern matches (Go's filepath.Match per path, a pattern also excluding what lies
# below a matched folder; `**/` matches any depth, as docker's own matcher does).
context=$(python3 - <<'PY'
import fnmatch, os, re
patterns = []
for line in open(".dockerignore"):
    line = line.strip()
    if line and not line.startswith("#"):
        patterns.append(line.lstrip("/"))
def regex(p):
    out = ""
    i = 0
    while i < len(p):
        if p.startswith("**/", i):
            out += "(.*/)?"; i += 3
        elif p.startswith("**", i):
            out += ".*"; i += 2
        else:
            c = p[i]
            out += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
            i += 1
    return re.compile(out + "(/.*)?$")
rules = [(regex(p.lstrip("!")), p.startswith("!")) for p in patterns]
def excluded(rel):
    out = False
    for rx, negated in rules:
        if rx.match(rel):
            out = not negated
    return out
total = 0
for dirpath, dirs, files in os.walk("."):
    rel_dir = os.path.relpath(dirpath, ".")
    rel_dir = "" if rel_dir == "." else rel_dir + "/"
    dirs[:] = [d for d in dirs if not excluded(rel_dir + d)]
    for f in files:
        path = rel_dir + f
        if not excluded(path) and not os.path.islink(path):
            total += os.path.getsize(path)
print(total)
PY
)
limit=$((10 * 1024 * 1024))
if [ -n "$context" ] && [ "$context" -lt "$limit" ]; then
  pass "the build context is $((context / 1024)) KiB (under 10 MiB)"
else
  fail "the build context is ${context:-?} bytes, over 10 MiB: add what is large to .dockerignore"
fi

# --- the engine -------------------------------------------------------------------------
ENGINE=""
why_no_engine=""
if command -v docker >/dev/null 2>&1; then
  if info=$(docker info 2>&1); then
    ENGINE=docker
  else
    why_no_engine="docker is installed but its daemon does not answer (\`docker info\`: $(printf '%s\n' "$info" | grep -v '^ *$' | tail -n 1))"
  fi
fi
if [ -z "$ENGINE" ] && command -v podman >/dev/null 2>&1; then
  if info=$(podman info 2>&1); then
    ENGINE=podman
  else
    why_no_engine="podman is installed but does not run (\`podman info\`: $(printf '%s\n' "$info" | grep -v '^ *$' | tail -n 1))"
  fi
fi
if [ -z "$ENGINE" ]; then
  skip "image build: ${why_no_engine:-no container engine: neither docker nor podman is on PATH (Debian: apt-get install podman)}"
  finish
fi

# The base images: present, or pulled now.
BASES=$(awk 'toupper($1) == "FROM" { print $2 }' Dockerfile | sort -u)
STAGES=$(awk 'toupper($1) == "FROM" && toupper($3) == "AS" { print $4 }' Dockerfile)
for base in $BASES; do
  if printf '%s\n' "$STAGES" | grep -qxF "$base"; then continue; fi
  if ! "$ENGINE" image inspect "$base" >/dev/null 2>&1 \
     && ! "$ENGINE" pull "$base" >/dev/null 2>&1; then
    skip "image build: the base image $base is not present in $ENGINE and cannot be pulled (no registry reachable from here)"
    finish
  fi
done

TAG="metronome:image-suite-$$"
cleanup() { "$ENGINE" image rm -f "$TAG" >/dev/null 2>&1 || true; }
trap cleanup EXIT
if out=$("$ENGINE" build -t "$TAG" --build-arg "METRONOME_GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null)" . 2>&1); then
  pass "$ENGINE build of the Dockerfile"
else
  fail "$ENGINE build of the Dockerfile" "$out"
  finish
fi
for cmd in "metronome --help" "metronome man" "metronome-gateway --help" \
           "metronome-dispatcher --help" "metronome-worker-agent --help" \
           "metronome-gpu-sim --help"; do
  # shellcheck disable=SC2086
  if out=$("$ENGINE" run --rm "$TAG" $cmd 2>&1); then
    pass "the image runs \`$cmd\`"
  else
    fail "the image runs \`$cmd\`" "$out"
  fi
done
health=$("$ENGINE" image inspect --format '{{json .Config.Healthcheck}}' "$TAG" 2>&1)
if printf '%s' "$health" | grep -q 'METRONOME_HEALTHCHECK_URL'; then
  pass "the image carries its health check"
else
  fail "the image carries its health check" "$health"
fi
finish
