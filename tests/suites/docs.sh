#!/usr/bin/env bash
# Documents suite: the documents say what is true now.
#   - no document names a development step ("stop 12", "session 3", "step 4"), a machine
#     path (/tmp/, /work/, /home/, /root/) or a branch ("branch `x`", "the `x` branch",
#     a worktree named wt-x): history lives in git and CHANGELOG.md;
#   - BENCHMARKS.md is at most 400 lines and RELIABILITY.md at most 200;
#   - README.md shows how to start the system and run the tests (`./dev up`, `./dev test`);
#   - BENCHMARKS.md is exactly what `metronome-bench --render bench-results/report.json`
#     writes from the committed results (rendered into a scratch copy; nothing in the
#     tree is touched), so every figure in it comes from bench-results/.
#
# Usage: bash tests/suites/docs.sh [TREE]   (TREE: the checkout to check, default this one;
# the renderer is always this checkout's target/debug/metronome-bench).
# Run by `./dev test` after the workspace binaries are built into target/debug.
# Prints one line per check and ends with "N passed, M failed"; exits non-zero on any
# failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TREE="$(cd "${1:-$ROOT}" && pwd)"
BENCH="$ROOT/target/debug/metronome-bench"

PASSED=0
FAILED=0
pass() { PASSED=$((PASSED + 1)); printf '  ok    %s\n' "$1"; }
fail() {
  FAILED=$((FAILED + 1))
  printf '  FAIL  %s\n' "$1"
  if [ -n "${2:-}" ]; then printf '%s\n' "$2" | head -n 20 | sed 's/^/        /'; fi
}

cd "$TREE" || exit 1
DOCS=()
for f in README.md BENCHMARKS.md RELIABILITY.md CHANGELOG.md docs/*.md */README.md bench-results/*/README.md; do
  [ -f "$f" ] && DOCS+=("$f")
done

# What a document must not name, as extended regular expressions (case-insensitive).
# A number after "step" with a decimal part is a quantity ("decode step 16.7 ms"), not a step.
STEP='(^|[^[:alnum:]_])(stops?|sessions?|steps?)[ -][0-9]+($|[^0-9.]|\.($|[^0-9]))'
MACHINE_PATH='(^|[^[:alnum:]_.~-])/(tmp|work|home|root)/'
BRANCH='[Bb]ranch(es)? `|`[^`]+` branch|\(branch |(^|[^[:alnum:]_])wt-[a-z]+'

check_pattern() { # name, regex
  local hits
  hits="$(grep -nHiE -- "$2" "${DOCS[@]}" 2>/dev/null)"
  if [ -z "$hits" ]; then
    pass "no document names $1 (${#DOCS[@]} documents)"
  else
    fail "documents name $1 ($(printf '%s\n' "$hits" | wc -l) lines)" "$hits"
  fi
}
check_pattern "a development step" "$STEP"
check_pattern "a machine path" "$MACHINE_PATH"
check_pattern "a branch" "$BRANCH"

check_length() { # file, most lines
  local n
  if [ ! -f "$1" ]; then
    fail "$1 is missing"
    return
  fi
  n="$(wc -l <"$1")"
  if [ "$n" -le "$2" ]; then
    pass "$1 has $n lines (at most $2)"
  else
    fail "$1 has $n lines, more than $2"
  fi
}
check_length BENCHMARKS.md 400
check_length RELIABILITY.md 200

for cmd in './dev up' './dev test'; do
  if grep -qF -- "$cmd" README.md 2>/dev/null; then
    pass "README.md shows \`$cmd\`"
  else
    fail "README.md does not show \`$cmd\`"
  fi
done

# BENCHMARKS.md against a fresh render of the committed results.
if [ ! -x "$BENCH" ]; then
  fail "BENCHMARKS.md renders from bench-results/" \
    "$BENCH is missing: cargo build -p metronome-bench"
elif [ ! -f bench-results/report.json ]; then
  fail "BENCHMARKS.md renders from bench-results/" "bench-results/report.json is missing"
else
  SCRATCH="$(mktemp -d -t metronome-docs-XXXXXX)"
  trap 'rm -rf "$SCRATCH"' EXIT
  cp -a bench-results "$SCRATCH/bench-results"
  if out="$("$BENCH" --repo "$ROOT" --out "$SCRATCH/bench-results" --report "$SCRATCH/BENCHMARKS.md" \
    --render "$SCRATCH/bench-results/report.json" 2>&1)"; then
    if d="$(diff -u BENCHMARKS.md "$SCRATCH/BENCHMARKS.md")"; then
      pass "BENCHMARKS.md is what --render writes from bench-results/report.json"
    else
      fail "BENCHMARKS.md differs from what --render writes from bench-results/report.json" "$d"
    fi
  else
    fail "metronome-bench --render bench-results/report.json failed" "$out"
  fi
fi

echo "$PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
