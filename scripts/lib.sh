# Shared helpers of ./dev: installing what is missing, the Python environment.
# shellcheck shell=bash

log() { printf '\033[1m[dev]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[31m[dev] error:\033[0m %s\n' "$*" >&2; exit 1; }

APT_UPDATED=0
apt_install() {
  # Installs Debian packages that are missing. Needs root (as CI and the dev machines are).
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  log "installing from Debian: ${missing[*]}"
  if [ "$APT_UPDATED" -eq 0 ]; then
    $sudo apt-get update -qq >/dev/null || die "apt-get update failed"
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
}

ensure_servers() {
  command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || apt_install nats-server
  command -v redis-server >/dev/null 2>&1 || apt_install redis-server
  export PATH="$PATH:/usr/sbin"
  command -v nats-server >/dev/null || die "nats-server still missing (apt-get install nats-server)"
  command -v redis-server >/dev/null || die "redis-server still missing (apt-get install redis-server)"
}

ensure_prometheus() {
  # promtool (config and rule checks) and prometheus (./dev up --observe).
  command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || apt_install prometheus
  command -v prometheus >/dev/null 2>&1 || die "prometheus is missing (apt-get install prometheus)"
}

PHOENIX_VENV="$ROOT/.venv-phoenix"
ensure_phoenix() {
  # The trace viewer of ./dev up --traces, from PyPI into its own virtual environment
  # (several hundred MB: installed on first use only). Reinstalled when its pin changes.
  local req="$ROOT/ops/phoenix/requirements.txt"
  if [ ! -x "$PHOENIX_VENV/bin/python" ]; then
    python3 -m venv "$PHOENIX_VENV" 2>/dev/null || { apt_install python3-venv; python3 -m venv "$PHOENIX_VENV"; }
  fi
  local stamp="$PHOENIX_VENV/.requirements.sha"
  local want
  want="$(sha256sum "$req" | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing the trace viewer (Arize Phoenix) into .venv-phoenix (first time: a few minutes)"
    "$PHOENIX_VENV/bin/pip" install -q --disable-pip-version-check -r "$req" \
      || die "pip install of the trace viewer failed"
    echo "$want" > "$stamp"
  fi
}

ensure_chromium() {
  # The console suite renders the operator console in headless Chromium.
  command -v chromium >/dev/null 2>&1 || apt_install chromium
  command -v chromium >/dev/null 2>&1 || die "chromium is missing (apt-get install chromium)"
}

ensure_suite_tools() {
  # Everything the shell suites install on first use, in one apt-get call and one pip run,
  # so `./dev test` can do it while the workspace builds instead of between suites.
  local pkgs=()
  command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || pkgs+=(prometheus)
  command -v chromium >/dev/null 2>&1 || pkgs+=(chromium)
  command -v docker-compose >/dev/null 2>&1 || pkgs+=(docker-compose)
  command -v systemd-analyze >/dev/null 2>&1 || pkgs+=(systemd)
  [ ${#pkgs[@]} -eq 0 ] || apt_install "${pkgs[@]}"
  ensure_venv
}

ensure_cargo() {
  command -v cargo >/dev/null 2>&1 || die "cargo is missing: install Rust from https://rustup.rs (or apt-get install cargo)"
}

VENV="$ROOT/.venv"
ensure_venv() {
  # One virtual environment for the Python-side tests and tools (nats-py, openai, pytest,
  # ansible). Reinstalled only when requirements change.
  local req="$ROOT/tests/python/requirements.txt"
  # Debian's own python3 where there is one: it runs Ansible (the provisioning suite is
  # Python-bound) about 15% faster than a python3 built without its optimisations, as a
  # locally compiled one often is; otherwise the first python3 on PATH.
  local python=python3
  [ -x /usr/bin/python3 ] && python=/usr/bin/python3
  if [ ! -x "$VENV/bin/python" ]; then
    "$python" -m venv "$VENV" 2>/dev/null || { apt_install python3-venv; "$python" -m venv "$VENV"; }
  fi
  local stamp="$VENV/.requirements.sha"
  local want
  want="$(cat "$ROOT"/tests/python/requirements*.txt "$ROOT"/ansible/requirements*.txt 2>/dev/null | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing Python test tools into .venv"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$req" \
      $( [ -f "$ROOT/ansible/requirements.txt" ] && echo "-r $ROOT/ansible/requirements.txt" ) \
      || die "pip install failed"
    echo "$want" > "$stamp"
  fi
}
