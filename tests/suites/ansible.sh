#!/usr/bin/env bash
# Provisioning suite: lints ansible/, runs site.yml for real (local connection) on the
# two-host example inventory into a temporary staging root, and checks what it rendered:
# the inventory's GPU -> model -> port mapping, idempotence (second run changed=0), check
# and diff mode, removal of exactly one retired GPU's files, `systemd-analyze verify` on
# every unit, each config accepted by its own binary's --check-config, broken inventories
# refused before anything is written, drain.yml, and `docker-compose config` on
# compose.yaml. Nothing outside the temporary folder is touched; no service is started.
#
# Run by `./dev test` after the workspace binaries are built into target/debug.
# Prints one line per check and ends with "N passed, M failed"; exits non-zero on any
# failure. Runs that do not depend on one another go in background lanes (start_lane), so
# the suite takes about as long as its longest lane, not the sum of its playbook runs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/lib.sh
source "$ROOT/scripts/lib.sh"
VENV="$ROOT/.venv"
ANSIBLE_DIR="$ROOT/ansible"
BINARIES=(metronome-dispatcher metronome-gateway metronome-worker-agent metronome-gpu-sim metronome)
declare -A PACKAGE_OF=(
  [metronome]=metronome-cli
  [metronome-dispatcher]=metronome-dispatcher
  [metronome-gateway]=metronome-gateway
  [metronome-worker-agent]=metronome-worker-agent
  [metronome-gpu-sim]=metronome-gpu-sim
)

PASSED=0
FAILED=0
pass() { PASSED=$((PASSED + 1)); printf '  ok    %s\n' "$1"; }
fail() {
  FAILED=$((FAILED + 1))
  printf '  FAIL  %s\n' "$1"
  if [ -n "${2:-}" ]; then printf '%s\n' "$2" | tail -n 40 | sed 's/^/        /'; fi
}
finish() {
  echo "$PASSED passed, $FAILED failed"
  [ "$FAILED" -eq 0 ]
  exit $?
}

# --- tools -------------------------------------------------------------------------
# ansible-core and ansible-lint come from ansible/requirements.txt via the shared venv;
# docker-compose (v1, no engine needed for `config`), systemd-analyze and promtool from Debian.
ensure_venv # installs or updates ansible/requirements.txt (a no-op when they are current)
command -v docker-compose >/dev/null 2>&1 || apt_install docker-compose
command -v systemd-analyze >/dev/null 2>&1 || apt_install systemd
command -v promtool >/dev/null 2>&1 || apt_install prometheus
export PATH="$VENV/bin:$PATH:/usr/sbin"
for tool in ansible-playbook ansible-lint docker-compose systemd-analyze promtool; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is missing after installation (see ansible/requirements.txt, apt-get install docker-compose systemd prometheus)"
done
PY="$VENV/bin/python"

# Playbook runs use Mitogen's linear strategy (ansible/requirements.txt), all but one:
# it keeps one Python per host and runs each module inside it, where Ansible's own strategy
# starts a Python process per task item. A run of site.yml on the example inventory that
# changes nothing takes ~16 s of CPU with it, ~70 s without. One full run, the fresh
# install of both hosts with every model-server kind (the other-inventories lane), uses
# Ansible's own strategy, so the playbook is also checked as an operator without Mitogen
# runs it.
MITOGEN_STRATEGY_DIR="$("$PY" -c 'import ansible_mitogen, os; print(os.path.join(os.path.dirname(ansible_mitogen.__file__), "plugins", "strategy"))')" \
  || die "Mitogen is missing from $VENV although ansible/requirements.txt names it"
export ANSIBLE_STRATEGY_PLUGINS="$MITOGEN_STRATEGY_DIR" ANSIBLE_STRATEGY=mitogen_linear

export ANSIBLE_CONFIG="$ANSIBLE_DIR/ansible.cfg"
export ANSIBLE_NOCOLOR=1
export ANSIBLE_FORCE_COLOR=0
export ANSIBLE_RETRY_FILES_ENABLED=0
export ANSIBLE_PIPELINING=1

WORK="$(mktemp -d "${TMPDIR:-/tmp}/metronome-ansible.XXXXXX")"
LAST="$WORK/last.log" # the last playbook run's output (each lane has its own)
trap 'rm -rf "$WORK"' EXIT
cd "$ANSIBLE_DIR"

# --- binaries ------------------------------------------------------------------------
# The playbook installs the binaries from a folder and validates every rendered config
# with them. They are copied once, so a rebuild of target/debug while the suite runs
# cannot look like a change between two runs. A missing binary is a failed check (with
# the build command), and a stub that accepts anything stands in for it so the rest of
# the suite still says something.
mkdir -p "$WORK/bin"
MISSING=()
for b in "${BINARIES[@]}"; do
  if [ -x "$ROOT/target/debug/$b" ]; then
    cp "$ROOT/target/debug/$b" "$WORK/bin/$b"
  else
    MISSING+=("$b")
    printf '#!/bin/sh\nexit 0\n' > "$WORK/bin/$b"
    chmod +x "$WORK/bin/$b"
  fi
done
if [ ${#MISSING[@]} -eq 0 ]; then
  pass "workspace binaries present in target/debug"
else
  for b in "${MISSING[@]}"; do
    fail "binary $b is missing from target/debug (build it: cargo build -p ${PACKAGE_OF[$b]}); a stub stands in below"
  done
fi

# --- the modules' Python ----------------------------------------------------------------
# Every task item runs its module in a new Python process, from a zip (AnsiballZ) whose
# Ansible module_utils Python compiles again each time: a fifth of a module's CPU on
# Debian's python3 (0.30 s), two fifths on a locally built one (0.47 s), and the suite
# runs well over a thousand modules (146 in a run that changes nothing). They run under
# the venv's Python with one addition (sitecustomize.py): code compiled from a zip is
# cached in the work folder, keyed by its source, so each source compiles once per suite.
# The code run is the same.
MODULE_PY="$WORK/module-python"
mkdir -p "$MODULE_PY/cache"
cat > "$MODULE_PY/sitecustomize.py" <<'PYEOF'
import hashlib, marshal, os, sys, zipimport

_cache = os.environ.get("METRONOME_ZIP_BYTECODE")
_compile = zipimport._compile_source

def _located(code, filename):  # the cached code, named after this run's zip
    consts = tuple(_located(c, filename) if isinstance(c, type(code)) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)

def _compile_source(pathname, source):
    path = os.path.join(_cache, hashlib.sha256(sys.version.encode() + b"\0" + source).hexdigest())
    try:
        with open(path, "rb") as f:
            return _located(marshal.load(f), pathname)
    except (OSError, EOFError, ValueError, TypeError):
        pass
    code = _compile(pathname, source)
    tmp = f"{path}.{os.getpid()}"
    try:  # written whole, then renamed: a module reading it meanwhile never sees a part
        with open(tmp, "wb") as f:
            marshal.dump(code, f)
        os.replace(tmp, path)
    except OSError:
        pass
    return code

if _cache:
    zipimport._compile_source = _compile_source
PYEOF
cat > "$MODULE_PY/python" <<EOF
#!/bin/sh
PYTHONPATH="$MODULE_PY" METRONOME_ZIP_BYTECODE="$MODULE_PY/cache" exec "$VENV/bin/python" "\$@"
EOF
chmod +x "$MODULE_PY/python"

# Extra vars of every run: local connection, one staging root per inventory host.
vars_file() { # $1 = staging base folder
  cat > "$WORK/vars-$(basename "$1").yml" <<EOF
ansible_connection: local
ansible_python_interpreter: "$MODULE_PY/python"
metronome_root: "$1/{{ inventory_hostname }}"
metronome_binaries_dir: "$WORK/bin"
EOF
  echo "$WORK/vars-$(basename "$1").yml"
}

# Runs a playbook; output in $LAST, exit status returned; prints how long it took (wall
# clock, and CPU seconds of all its processes: the suite is CPU-bound).
play() { # $1 = inventory, $2 = staging base, rest = ansible-playbook arguments
  local inv=$1 stage=$2
  shift 2
  local rc=0 TIMEFORMAT='%R %U %S'
  { time ansible-playbook -i "$inv" -e "@$(vars_file "$stage")" "$@" > "$LAST" 2>&1; } 2> "$LAST.time" || rc=$?
  printf '  ..    %s  ansible-playbook -i %s %s\n' "$(awk '{ printf "%.0fs (%.0fs CPU)", $1, $2 + $3 }' "$LAST.time")" \
    "$(basename "$inv")" "${*//$WORK/\$WORK}"
  return $rc
}

play_failure() { # what an operator needs from a failed run: its errors, then its recap
  grep -E -A6 '^(fatal|failed):|^ERROR|FAILED!' "$LAST" | head -n 60
  grep -E -A4 '^PLAY RECAP' "$LAST" || { echo "(no PLAY RECAP: the run stopped early; its last lines)"; tail -n 15 "$LAST"; }
}

recap_changed() { # prints "host changed=N" for every host of the last run
  grep -E '^[A-Za-z0-9_.-]+ +: ok=' "$LAST" | sed -E 's/^([^ ]+) +:.* changed=([0-9]+).*/\1 changed=\2/'
}

# --- checks that run beside the others ---------------------------------------------------
# The runs below are independent of one another once the first run has made the example
# inventory's credentials: each lane has its own inventory copy, staging roots and log,
# and runs in the background while the main lane (the first run's staging root through
# its edits) runs here. A lane's lines are printed when it ends, its counts added.
LANES=()
start_lane() { # $1 = name, $2 = function
  (
    LAST="$WORK/last-$1.log" PASSED=0 FAILED=0
    trap 'echo "$PASSED $FAILED" > "$WORK/lane-$1.count"' EXIT
    "$2"
  ) > "$WORK/lane-$1.out" 2>&1 &
  LANES+=("$1:$!")
}
finish_lanes() {
  local lane name pid counts
  for lane in "${LANES[@]}"; do
    name=${lane%%:*} pid=${lane#*:}
    wait "$pid" || true
    echo "  -- lane $name"
    cat "$WORK/lane-$name.out"
    if counts=$(cat "$WORK/lane-$name.count" 2>/dev/null); then
      PASSED=$((PASSED + ${counts% *})) FAILED=$((FAILED + ${counts#* }))
    else
      fail "lane $name ended before it could count its checks"
    fi
  done
}

static_checks() {
if out=$(ansible-playbook -i inventories/example --syntax-check site.yml drain.yml 2>&1); then
  pass "ansible-playbook --syntax-check site.yml drain.yml"
else
  fail "ansible-playbook --syntax-check site.yml drain.yml" "$out"
fi

if out=$(ansible-lint --offline 2>&1); then
  pass "ansible-lint (production profile, ansible/.ansible-lint)"
else
  fail "ansible-lint (production profile, ansible/.ansible-lint)" "$out"
fi

if out=$(docker-compose -f "$ROOT/compose.yaml" --project-directory "$ROOT" config -q 2>&1); then
  pass "docker-compose config accepts compose.yaml"
else
  fail "docker-compose config accepts compose.yaml" "$out"
fi

}

# Prometheus scrapes the model servers it can reach: those of its own host on 127.0.0.1,
# labelled with worker id, model and kind; gpu-node-2's listen on its loopback, so they
# are listed as not scraped.
model_scrape_check() { # $1 = prometheus.yml, $2 = expected "target worker_id server" lines
  "$PY" - "$1" "$2" <<'PYEOF'
import sys, yaml
conf = yaml.safe_load(open(sys.argv[1]))
job = next((j for j in conf["scrape_configs"] if j["job_name"] == "metronome-model-server"), None)
if job is None:
    sys.exit("no metronome-model-server job")
got = sorted(f'{t} {c["labels"]["worker_id"]} {c["labels"]["server"]}'
             for c in job["static_configs"] for t in c["targets"])
want = sorted(l for l in sys.argv[2].splitlines() if l)
if got != want:
    sys.exit(f"model-server targets {got}, want {want}")
PYEOF
}

# --- TLS: on by default, every file where it belongs, and off on request -----------------
tls_check() { # $1 = staging base, $2 = on|off
  "$PY" - "$1" "$2" <<'PYEOF'
import pathlib, re, stat, subprocess, sys, tomllib

stage, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
on = mode == "on"
errors = []
def expect(cond, msg):
    if not cond:
        errors.append(msg)

ctl = stage / "gpu-node-1"
nats = (ctl / "etc/metronome/nats/nats-server.conf").read_text()
redis = (ctl / "etc/metronome/redis/redis.conf").read_text()
expect(bool(re.search(r"(?m)^tls \{", nats)) == on, f"nats-server.conf tls block present: {not on}")
expect(bool(re.search(r"(?m)^tls \{[^}]*^  verify: true$", nats)) == on, f"nats-server.conf tls verify: true present: {not on}")
expect(bool(re.search(r"(?m)^port 0$", redis) and re.search(r"(?m)^tls-port 6379$", redis)) == on,
       "redis.conf: TLS only (port 0, tls-port 6379)" if on else "redis.conf: plain port 6379 expected")
configs = [*stage.glob("*/etc/metronome/worker-agent/*.toml"), *stage.glob("*/etc/metronome/dispatcher/*.toml"),
           *stage.glob("*/etc/metronome/gateway.toml")]
expect(len(configs) >= 10, f"only {len(configs)} component configs found")
for path in configs:
    c, where = tomllib.loads(path.read_text()), path.relative_to(stage)
    ca = c.get("nats_auth", {}).get("ca_file")
    expect(bool(ca) == on, f"{where}: nats_auth.ca_file = {ca!r}")
    if "redis_url" in c:
        expect(c["redis_url"].startswith("rediss://") == on, f"{where}: redis_url scheme")
        expect(bool(c.get("redis_tls", {}).get("ca_file")) == on, f"{where}: redis_tls.ca_file")
    # Each component's own NATS client certificate: from the cluster's CA, named after its
    # NATS user, for client authentication, its key readable by the service group only.
    # Redis does not ask for one.
    na = c.get("nats_auth", {})
    cert, key = na.get("cert_file"), na.get("key_file")
    expect(bool(cert) == on and bool(key) == on, f"{where}: nats_auth cert_file/key_file = {cert!r}/{key!r}")
    expect("cert_file" not in c.get("redis_tls", {}), f"{where}: redis_tls has a client certificate")
    if on:
        expect(pathlib.Path(ca).is_file(), f"{where}: {ca} is not installed")
        r = subprocess.run(["openssl", "verify", "-purpose", "sslclient", "-CAfile", ca, cert], capture_output=True, text=True)
        expect(r.returncode == 0, f"{where}: {cert} does not verify as a client certificate of the CA: {r.stdout}{r.stderr}")
        r = subprocess.run(["openssl", "x509", "-noout", "-subject", "-nameopt", "RFC2253", "-in", cert],
                           capture_output=True, text=True)
        expect(r.stdout.strip() == f"subject=CN={na.get('user')}", f"{where}: {cert} subject {r.stdout.strip()!r}, want CN={na.get('user')}")
        pub = subprocess.run(["openssl", "x509", "-noout", "-pubkey", "-in", cert], capture_output=True, text=True).stdout
        kpub = subprocess.run(["openssl", "pkey", "-pubout", "-in", key], capture_output=True, text=True).stdout
        expect(pub and pub == kpub, f"{where}: {key} is not the key of {cert}")
        expect(stat.S_IMODE(pathlib.Path(key).stat().st_mode) == 0o640,
               f"{where}: {key} is mode {stat.S_IMODE(pathlib.Path(key).stat().st_mode):o}")
# Each host holds the CA, its server certificate (control host) and the client
# certificates of the components it runs, and no other identity's.
for host in sorted(p.name for p in stage.iterdir()) if on else []:
    tls_dir = stage / host / "etc/metronome/tls"
    held = {str(p.relative_to(tls_dir)) for p in tls_dir.rglob("*.pem")}
    want = {"ca.pem"} | ({"server.pem"} if (stage / host / "etc/metronome/nats").exists() else set())
    for path in configs:
        if path.is_relative_to(stage / host):
            cert = tomllib.loads(path.read_text())["nats_auth"]["cert_file"]
            want.add(str(pathlib.Path(cert).relative_to(tls_dir)))
    expect(held == want, f"{host}: certificates {sorted(held)}, want {sorted(want)}")
units = [*stage.glob("*/etc/systemd/system/metronome-worker-agent-*.service"),
         *stage.glob("*/etc/systemd/system/metronome-dispatcher@.service"),
         *stage.glob("*/etc/systemd/system/metronome-gateway.service")]
for u in units:
    text = u.read_text()
    for var in ("METRONOME_NATS_CA", "METRONOME_REDIS_CA"):
        expect((f"Environment={var}=/etc/metronome/tls/ca.pem" in text) == on, f"{u.relative_to(stage)}: {var}")
    own = {"metronome-gateway.service": "gateway", "metronome-dispatcher@.service": "dispatcher/%i"}.get(
        u.name, "worker-agent/" + u.name.removeprefix("metronome-worker-agent-").removesuffix(".service"))
    for var, ext in (("METRONOME_NATS_CERT", "pem"), ("METRONOME_NATS_KEY", "key")):
        expect((f"Environment={var}=/etc/metronome/tls/{own}.{ext}\n" in text) == on, f"{u.relative_to(stage)}: {var}")
if on:
    for host in ("gpu-node-1", "gpu-node-2"):
        expect((stage / host / "etc/metronome/tls/ca.pem").is_file(), f"{host}: CA certificate missing")
    expect(not (stage / "gpu-node-2/etc/metronome/tls/server.key").exists(), "the server key reached a GPU-only host")
    key = ctl / "etc/metronome/tls/server.key"
    expect(stat.S_IMODE(key.stat().st_mode) == 0o640, f"server.key is mode {stat.S_IMODE(key.stat().st_mode):o}")
    cert = ctl / "etc/metronome/tls/server.pem"
    ca = ctl / "etc/metronome/tls/ca.pem"
    r = subprocess.run(["openssl", "verify", "-CAfile", str(ca), str(cert)], capture_output=True, text=True)
    expect(r.returncode == 0, f"server.pem does not verify against ca.pem: {r.stdout}{r.stderr}")
    r = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(cert)],
                       capture_output=True, text=True)
    for name in ("IP Address:10.0.0.11", "DNS:gpu-node-1", "IP Address:127.0.0.1"):
        expect(name in r.stdout, f"server.pem lacks {name}: {r.stdout}")
print("\n".join(errors))
sys.exit(1 if errors else 0)
PYEOF
}

# No password of the inventory's .secrets in a run's output (--check --diff shows every
# rendered config that changes).
no_secret_in_log() { # $1 = inventory, $2 = log
  local pw leaked=""
  for pw in "$1"/.secrets/*.password; do
    grep -qF -- "$(cat "$pw")" "$2" && leaked+=" $(basename "$pw" .password)"
  done
  [ -z "$leaked" ] || { echo "the output shows the password of:$leaked"; return 1; }
}

# A copy of an inventory as the first run left it (its credentials made), for a lane.
inventory_copy() { # $1 = name; prints the copy's path
  cp -a "$WORK/inventory-first" "$WORK/inventory-$1"
  echo "$WORK/inventory-$1"
}

variants_lane() {
local INV
INV=$(inventory_copy variants)
INV_PLAIN="$WORK/inventory-plain"
cp -r "$ANSIBLE_DIR/inventories/example" "$INV_PLAIN"
if ! play "$INV_PLAIN" "$WORK/stage-plain" site.yml -e metronome_tls=false; then
  fail "metronome_tls=false renders plain text everywhere (the playbook run failed)" "$(play_failure)"
elif out=$(tls_check "$WORK/stage-plain" off 2>&1); then
  pass "metronome_tls=false renders plain text everywhere (no tls block, redis:// URLs, no CA settings)"
else
  fail "metronome_tls=false renders plain text everywhere (no tls block, redis:// URLs, no CA settings)" "$out"
fi

out=""
if play "$INV" "$WORK/stage-check" site.yml --check --diff && [ ! -e "$WORK/stage-check" ] \
  && grep -q '^+Environment=CUDA_VISIBLE_DEVICES=' "$LAST" && grep -q '^+nats_url = ' "$LAST" \
  && out=$(no_secret_in_log "$INV" "$LAST"); then
  pass "--check --diff on new nodes shows the units and configs as diffs, no password, and writes nothing"
else
  fail "--check --diff on new nodes shows the units and configs as diffs, no password, and writes nothing" "${out:-}$(tail -n 40 "$LAST")"
fi

# --- client verification off on request ---------------------------------------------------
if play "$INV" "$WORK/stage-noverify" site.yml --limit gpu-node-1 -e metronome_nats_verify_clients=false \
  && conf="$WORK/stage-noverify/gpu-node-1/etc/metronome/nats/nats-server.conf" \
  && grep -q '^tls {' "$conf" && ! grep -qE '^[[:space:]]*verify' "$conf" \
  && grep -q '^cert_file = ' "$WORK/stage-noverify/gpu-node-1/etc/metronome/gateway.toml"; then
  pass "metronome_nats_verify_clients=false: nats-server keeps TLS without verify (components keep their certificates)"
else
  fail "metronome_nats_verify_clients=false: nats-server keeps TLS without verify" "$(play_failure)"
fi

# --- the gateway beyond loopback: HTTPS, or refused -----------------------------------------
# A gateway_listen beyond loopback without a certificate is refused before anything is
# written; with gateway_tls_cert/key the gateway serves HTTPS (its config names the
# installed pair, which the binary's --check-config loads), Prometheus scrapes it over HTTPS.
if play "$INV" "$WORK/stage-gw-plain" site.yml --limit gpu-node-1 -e gateway_listen=0.0.0.0:8080; then
  fail "a gateway beyond loopback without TLS is refused" "the play succeeded"
elif ! grep -qF "is beyond loopback and the gateway would serve plain HTTP there" "$LAST" || [ -e "$WORK/stage-gw-plain" ]; then
  fail "a gateway beyond loopback without TLS is refused before anything is written" "$(play_failure)"
else
  pass "a gateway beyond loopback without TLS is refused before anything is written"
fi
gw_tls="$WORK/gateway-https"
mkdir -p "$gw_tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=gateway.example \
  -addext subjectAltName=DNS:gateway.example -keyout "$gw_tls/key.pem" -out "$gw_tls/cert.pem" >/dev/null 2>&1
gw_stage="$WORK/stage-gw-tls/gpu-node-1"
bad=""
if play "$INV" "$WORK/stage-gw-tls" site.yml --limit gpu-node-1 -e gateway_listen=0.0.0.0:8443 \
  -e "gateway_tls_cert=$gw_tls/cert.pem" -e "gateway_tls_key=$gw_tls/key.pem"; then
  grep -qx "tls_cert = \"$gw_stage/etc/metronome/tls/gateway-https.pem\"" "$gw_stage/etc/metronome/gateway.toml" \
    && grep -qx "tls_key = \"$gw_stage/etc/metronome/tls/gateway-https.key\"" "$gw_stage/etc/metronome/gateway.toml" \
    || bad+="gateway.toml does not name the installed pair; "
  cmp -s "$gw_tls/key.pem" "$gw_stage/etc/metronome/tls/gateway-https.key" || bad+="the key is not installed; "
  [ "$(stat -c %a "$gw_stage/etc/metronome/tls/gateway-https.key" 2>/dev/null)" = 640 ] || bad+="the key is not mode 0640; "
  grep -q 'job_name: metronome-gateway-https' "$gw_stage/etc/prometheus/prometheus.yml" || bad+="no HTTPS scrape job; "
  # The gateway itself loads the pair, with the credential its unit hands over.
  cred="$gw_stage/etc/metronome/credentials/gateway.password"
  METRONOME_NATS_PASSWORD_FILE=$cred METRONOME_REDIS_PASSWORD_FILE=$cred \
    "$WORK/bin/metronome-gateway" --check-config --config "$gw_stage/etc/metronome/gateway.toml" >/dev/null 2>&1 \
    || bad+="metronome-gateway --check-config refuses the rendered HTTPS config; "
  if [ -z "$bad" ]; then
    pass "gateway_tls_cert/key: the gateway serves HTTPS beyond loopback (pair installed, key 0640, accepted by --check-config, scraped over HTTPS)"
  else
    fail "gateway_tls_cert/key: the gateway serves HTTPS beyond loopback" "$bad"
  fi
else
  fail "gateway_tls_cert/key: the gateway serves HTTPS beyond loopback" "$(play_failure)"
fi

# --- installing from a release archive ---------------------------------------------------
# The same binaries packed as a release (with ./-prefixed members, as `tar -C dir .` makes
# them), installed on a new gpu-node-2, twice: the second run changes nothing. The
# archive's SHA-256 is required, and a wrong one stops the run before anything is
# unpacked or installed.
tar -C "$WORK/bin" -czf "$WORK/release.tar.gz" .
release_sha=$(sha256sum "$WORK/release.tar.gz" | cut -d' ' -f1)
archive_play() { # $1 = staging base, $2 = the checksum to give
  play "$INV" "$1" site.yml --limit gpu-node-2 \
    -e metronome_binaries_dir= -e "metronome_release_archive=$WORK/release.tar.gz" \
    -e "metronome_release_archive_sha256=$2"
}
archive_run() { archive_play "$WORK/stage-archive" "$release_sha"; }
wrong_sha=$(printf '%s' "$release_sha" | tr '0-9a-f' '1-9a-f0')
if archive_play "$WORK/stage-badsum" "$wrong_sha"; then
  fail "a release archive whose SHA-256 differs is refused" "the play succeeded"
elif ! grep -qF "metronome_release_archive_sha256 says $wrong_sha. Nothing was installed." "$LAST"; then
  fail "a release archive whose SHA-256 differs is refused with a clear message" "$(play_failure)"
elif [ -e "$WORK/stage-badsum/gpu-node-2/usr/local/bin/metronome-worker-agent" ] \
     || [ -n "$(ls -A "$WORK/stage-badsum/gpu-node-2/opt/metronome/release" 2>/dev/null)" ]; then
  fail "a release archive whose SHA-256 differs: nothing unpacked or installed" "$(find "$WORK/stage-badsum" -path '*bin*' -o -path '*release*' | head)"
else
  pass "a release archive whose SHA-256 differs is refused before anything is unpacked or installed"
fi
if archive_play "$WORK/stage-nosum" ""; then
  fail "a release archive without metronome_release_archive_sha256 is refused" "the play succeeded"
elif ! grep -qF "metronome_release_archive needs metronome_release_archive_sha256" "$LAST" \
     || [ -e "$WORK/stage-nosum" ]; then
  fail "a release archive without its SHA-256 is refused before anything is written" "$(play_failure)"
else
  pass "a release archive without metronome_release_archive_sha256 is refused before anything is written"
fi
if archive_run && cmp -s "$WORK/bin/metronome-worker-agent" "$WORK/stage-archive/gpu-node-2/usr/local/bin/metronome-worker-agent" \
  && archive_run && recap_changed | grep -q '^gpu-node-2 changed=0$'; then
  pass "binaries install from a release archive (metronome_release_archive), idempotently"
else
  fail "binaries install from a release archive (metronome_release_archive), idempotently" "$(tail -n 40 "$LAST")"
fi

}

other_inventories_lane() {
local INV
INV=$(inventory_copy others)
# --- every model-server kind, reachable model servers --------------------------------
# gpu-node-2 runs one GPU of each kind the roles know and its model servers listen on all
# its addresses: each kind gets the metrics flag it needs (SGLang --enable-metrics,
# llama.cpp --metrics; vLLM and TGI serve /metrics unasked), and gpu-node-1's Prometheus
# scrapes gpu-node-2's model servers on its address.
KINDS_INV="$WORK/inventory-kinds"
cp -r "$INV" "$KINDS_INV"
cat > "$KINDS_INV/host_vars/gpu-node-2.yml" <<'EOF2'
---
metronome_gpu_count: 5
model_server_host: 0.0.0.0
metronome_gpus:
  - {gpu: 0, model: Qwen/Qwen2.5-7B-Instruct, port: 8000, server: sglang}
  - {gpu: 1, model: /var/lib/models/qwen2.5-7b-q4.gguf, port: 8001, server: llamacpp}
  - {gpu: 2, model: llama-3.1-8b-sim, port: 8002, server: simulator}
  - {gpu: 3, model: Qwen/Qwen2.5-7B-Instruct, port: 8003, server: tgi}
  - {gpu: 4, model: meta-llama/Llama-3.1-8B-Instruct, port: 8004, server: vllm}
EOF2
KSTAGE="$WORK/stage-kinds"
if ANSIBLE_STRATEGY=linear play "$KINDS_INV" "$KSTAGE" site.yml; then
  units="$KSTAGE/gpu-node-2/etc/systemd/system"
  exec_of() { grep '^ExecStart=' "$units/metronome-model-gpu$1.service"; }
  bad=""
  exec_of 0 | grep -qF '"--enable-metrics"' || bad+="sglang has no --enable-metrics; "
  exec_of 1 | grep -qF '"--metrics"' || bad+="llama.cpp has no --metrics; "
  exec_of 3 | grep -qF 'text-generation-launcher' || bad+="no TGI unit; "
  exec_of 4 | grep -qF '"serve"' || bad+="no vLLM unit; "
  if out=$(model_scrape_check "$KSTAGE/gpu-node-1/etc/prometheus/prometheus.yml" "127.0.0.1:8000 gpu-node-1-gpu0 vllm
127.0.0.1:8001 gpu-node-1-gpu1 vllm
127.0.0.1:8002 gpu-node-1-gpu2 vllm
127.0.0.1:8003 gpu-node-1-gpu3 vllm
10.0.0.12:8000 gpu-node-2-gpu0 sglang
10.0.0.12:8001 gpu-node-2-gpu1 llamacpp
10.0.0.12:8002 gpu-node-2-gpu2 simulator
10.0.0.12:8003 gpu-node-2-gpu3 tgi
10.0.0.12:8004 gpu-node-2-gpu4 vllm" 2>&1) \
     && out=$(promtool check config "$KSTAGE/gpu-node-1/etc/prometheus/prometheus.yml" 2>&1) && [ -z "$bad" ]; then
    pass "every model-server kind starts with its metrics flag, and Prometheus (promtool-checked) scrapes the reachable model servers of both hosts (a fresh install with Ansible's own strategy)"
  else
    fail "every model-server kind starts with its metrics flag, and Prometheus scrapes the reachable model servers" "$bad$out"
  fi
else
  fail "site.yml on an inventory with every model-server kind" "$(play_failure)"
fi

# --- broken inventories fail before anything is written ----------------------------------
broken() { # $1 = name, $2 = expected message, $3 = Python edit of gpu-node-2's GPU list `g`
  local name=$1 msg=$2 edit=$3 inv="$WORK/broken-$1" stage="$WORK/broken-stage-$1"
  cp -r "$ANSIBLE_DIR/inventories/example" "$inv"
  "$PY" - "$inv/host_vars/gpu-node-2.yml" "$edit" <<'PYEOF'
import sys, yaml
path, edit = sys.argv[1:3]
data = yaml.safe_load(open(path))
g = data["metronome_gpus"]
exec(edit)
yaml.safe_dump(data, open(path, "w"), sort_keys=False)
PYEOF
  if play "$inv" "$stage" site.yml; then
    fail "broken inventory ($name) fails the play" "the play succeeded"
  elif ! grep -qF "$msg" "$LAST"; then
    fail "broken inventory ($name) fails with a clear message" "expected \"$msg\" in:"$'\n'"$(grep -E 'fatal|msg' "$LAST")"
  elif [ -e "$stage" ]; then
    fail "broken inventory ($name) writes nothing" "$(find "$stage" | head)"
  else
    pass "broken inventory ($name) fails before anything is written: \"$msg\""
  fi
}
broken port-out-of-range "got 70000" 'g[0]["port"] = 70000'
broken duplicate-gpu "GPU 0 is listed more than once" 'g[1]["gpu"] = 0'
broken unknown-server-kind "got vllmx" 'g[0]["server"] = "vllmx"'
broken duplicate-port "port 8000 is used by more than one GPU" 'g[1]["port"] = 8000'
broken verify-clients-not-boolean "metronome_nats_verify_clients must be true or false" 'data["metronome_nats_verify_clients"] = "maybe"'
broken renew-beyond-validity "below metronome_tls_server_days and metronome_tls_client_days" 'data["metronome_tls_renew_days"] = 400'

# --- a NATS cluster of three control hosts -----------------------------------------------
# Three control hosts (and a GPU host): each renders a nats-server of one JetStream cluster
# (routes to the other two with the route credential, over TLS) and every component gets
# the three URLs and three replicas. The three rendered configs (addresses, ports and
# stores moved to loopback, nothing else changed) must form a cluster in which a stream with
# three replicas can be created; the route credential is no client login.
CL_INV="$WORK/inventory-cluster"
CL_STAGE="$WORK/stage-cluster"
cp -r "$ANSIBLE_DIR/inventories/example" "$CL_INV"
rm -f "$CL_INV/host_vars/gpu-node-1.yml"
cat > "$CL_INV/hosts.yml" <<'EOF2'
---
metronome:
  children:
    metronome_control:
      hosts:
        ctl-1:
          ansible_host: 10.0.0.11
        ctl-2:
          ansible_host: 10.0.0.21
        ctl-3:
          ansible_host: 10.0.0.22
    metronome_gpu_nodes:
      hosts:
        gpu-node-2:
          ansible_host: 10.0.0.12
EOF2
sed -i 's|^metronome_nats_url: .*|metronome_nats_url: nats://10.0.0.11:4222,nats://10.0.0.21:4222,nats://10.0.0.22:4222|' "$CL_INV/group_vars/all.yml"

cluster_check() { # $1 = inventory, $2 = staging base
  "$PY" - "$1" "$2" "$WORK" <<'PYEOF'
import asyncio, json, pathlib, re, socket, ssl, subprocess, sys, time, tomllib, urllib.request
import yaml

inv, stage, work = map(pathlib.Path, sys.argv[1:4])
errors = []
def expect(cond, msg):
    if not cond:
        errors.append(msg)

hosts = yaml.safe_load((inv / "hosts.yml").read_text())["metronome"]["children"]
control = hosts["metronome_control"]["hosts"]
addr = {h: v["ansible_host"] for h, v in control.items()}
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

# What every component was given: all three nodes and three replicas; the dispatchers a
# heartbeat timeout above a stream's election.
want_url = ",".join(f"nats://{addr[h]}:4222" for h in control)
configs = [stage / h / "etc/metronome/gateway.toml" for h in control]
configs += [stage / h / f"etc/metronome/dispatcher/{d}.toml" for h in control for d in "ab"]
configs += list((stage / "gpu-node-2/etc/metronome/worker-agent").glob("*.toml"))
for c in configs:
    t = tomllib.loads(c.read_text())
    where = c.relative_to(stage)
    expect(t.get("nats_url") == want_url, f"{where}: nats_url {t.get('nats_url')!r}, want {want_url!r}")
    expect(t.get("stream_replicas") == 3, f"{where}: stream_replicas {t.get('stream_replicas')!r}, want 3")
    if "/dispatcher/" in str(c):
        hb = t.get("scheduler", {}).get("heartbeat_timeout_ms")
        expect(hb == 12000, f"{where}: scheduler.heartbeat_timeout_ms {hb!r}, want 12000")

route_pw = (inv / ".secrets/nats-route.password").read_text().strip()
for h in control:
    text = (stage / h / "etc/metronome/nats/nats-server.conf").read_text()
    names = re.findall(r'nats-route://[^@]+@([^:"]+):(\d+)', text)
    expect(sorted(a for a, _ in names) == sorted(addr[o] for o in control if o != h),
           f"{h}: routes to {names}, want the other two control hosts")
    expect(f'server_name: "{h}"' in text, f"{h}: server_name is not {h}")
    expect(re.search(r"(?ms)^cluster \{.*^  tls \{", text) is not None, f"{h}: the routes have no TLS")

def start(ports, attempt):  # the three rendered configs on loopback ports, each node started
    started = []
    for h in control:
        text = (stage / h / "etc/metronome/nats/nats-server.conf").read_text()
        client, route, mon = ports[h]
        text = re.sub(r"(?m)^listen: .*$", f'listen: "127.0.0.1:{client}"', text)
        text = re.sub(r"(?m)^http: .*$", f'http: "127.0.0.1:{mon}"', text)
        text = re.sub(r'(?m)^(\s*)store_dir: .*$', f'\\1store_dir: "{work / f"js-{h}-{attempt}"}"', text)
        text = re.sub(r'(?m)^  listen: .*$', f'  listen: "127.0.0.1:{route}"', text)
        for o in control:
            text = text.replace(f"@{addr[o]}:6222", f"@127.0.0.1:{ports[o][1]}")
        conf = work / f"nats-{h}.conf"
        conf.write_text(text)
        started.append(subprocess.Popen(["nats-server", "-c", str(conf), "-l", str(work / f"nats-{h}.log")]))
    return started

def listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0

# A port found free may be taken by another process before its node binds it (the drills
# start systems beside this suite): a node that exits instead of listening is started again,
# all three on new ports.
procs = []
try:
    for attempt in range(3):
        ports = {h: (free_port(), free_port(), free_port()) for h in control}  # client, route, monitor
        procs = start(ports, attempt)
        until = time.time() + 20
        while time.time() < until and all(p.poll() is None for p in procs) \
                and not all(listening(ports[h][2]) for h in control):
            time.sleep(0.1)
        exited = [h for h, p in zip(control, procs) if p.poll() is not None]
        if not exited:
            break
        print(f"  ..    nats-server of {', '.join(exited)} exited on start (attempt {attempt + 1}): "
              + (work / f"nats-{exited[0]}.log").read_text()[-300:].replace("\n", " "), file=sys.stderr)
        for p in procs:
            p.terminate()
            p.wait()

    def jsz(h):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[h][2]}/jsz", timeout=2) as r:
                return json.load(r)
        except OSError:
            return {}
    def routes(h):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[h][2]}/routez", timeout=2) as r:
                return json.load(r).get("num_routes", 0)
        except OSError:
            return 0
    deadline = time.time() + 60
    formed = False
    while time.time() < deadline and not formed:
        metas = [jsz(h).get("meta_cluster", {}) for h in control]
        formed = all(m.get("leader") and m.get("cluster_size") == 3 for m in metas) \
            and all(routes(h) == 2 for h in control)
        if not formed:
            time.sleep(0.25)
    expect(formed, "the three rendered nats-servers did not form a JetStream cluster of 3 within 60 s: "
           + "; ".join(f"{h}: {jsz(h).get('meta_cluster')} routes {routes(h)}" for h in control)
           + " | " + (work / f"nats-{next(iter(control))}.log").read_text()[-1500:])

    import nats
    sec = inv / ".secrets"
    ctx = ssl.create_default_context(cafile=str(sec / "tls/ca.pem"))
    ctx.load_cert_chain(str(sec / "tls/clients/admin.pem"), str(sec / "tls/clients/admin.key"))
    async def js_checks():
        urls = [f"tls://127.0.0.1:{ports[h][0]}" for h in control]
        nc = await nats.connect(servers=urls, user="admin", password=(sec / "admin.password").read_text().strip(),
                                tls=ctx, tls_hostname="127.0.0.1", inbox_prefix=b"_INBOX.admin",
                                connect_timeout=5, max_reconnect_attempts=1)
        js = nc.jetstream(timeout=10)
        info, last = None, None
        for _ in range(40):
            try:
                info = await js.add_stream(name="CLUSTERCHECK", subjects=["clustercheck.>"], num_replicas=3)
                break
            except Exception as e:  # no meta leader yet, or not every peer current
                last = e
                await asyncio.sleep(0.5)
        expect(info is not None, f"creating a stream with 3 replicas failed: {last!r}")
        if info is not None:
            expect(info.config.num_replicas == 3, f"the stream has {info.config.num_replicas} replicas")
            ack = await js.publish("clustercheck.x", b"1")
            expect(ack.stream == "CLUSTERCHECK", f"publish: {ack}")
            for _ in range(40):
                info = await js.stream_info("CLUSTERCHECK")
                peers = info.cluster.replicas or []
                if len(peers) == 2 and all(p.current for p in peers):
                    break
                await asyncio.sleep(0.5)
            expect(info.cluster.leader in control and len(info.cluster.replicas or []) == 2
                   and all(p.current for p in info.cluster.replicas),
                   f"the stream is not kept on three current nodes: {info.cluster}")
        await nc.close()
        # The route credential logs no client in.
        try:
            rc = await nats.connect(servers=urls[:1], user="nats-route", password=route_pw, tls=ctx,
                                    tls_hostname="127.0.0.1", connect_timeout=5, max_reconnect_attempts=0,
                                    allow_reconnect=False)
            await rc.close()
            errors.append("a client logged in with the route credential")
        except Exception:
            pass
    if formed:
        asyncio.run(js_checks())
finally:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=20)
print("\n".join(errors))
sys.exit(1 if errors else 0)
PYEOF
}
if play "$CL_INV" "$CL_STAGE" site.yml; then
  if out=$(cluster_check "$CL_INV" "$CL_STAGE" 2>&1); then
    pass "three control hosts: a NATS cluster (routes with their own credential, over TLS) that forms from the rendered configs and keeps a stream on 3 replicas; every component gets the three URLs and stream_replicas = 3"
  else
    fail "three control hosts: the rendered NATS cluster forms and keeps a stream on 3 replicas" "$out"
  fi
else
  fail "site.yml on an inventory of three control hosts (a NATS cluster)" "$(tail -n 40 "$LAST")"
fi
# Two control hosts: refused before anything is written (a two-node cluster cannot elect a
# leader once one is gone).
CL2_INV="$WORK/inventory-cluster2"
cp -r "$CL_INV" "$CL2_INV"
"$PY" - "$CL2_INV/hosts.yml" <<'PYEOF'
import sys, yaml
path = sys.argv[1]
data = yaml.safe_load(open(path))
del data["metronome"]["children"]["metronome_control"]["hosts"]["ctl-3"]
yaml.safe_dump(data, open(path, "w"), sort_keys=False)
PYEOF
if play "$CL2_INV" "$WORK/stage-cluster2" site.yml; then
  fail "two control hosts are refused" "the play succeeded"
elif ! grep -qF "a NATS cluster needs 1, 3 or 5" "$LAST"; then
  fail "two control hosts are refused with a clear message" "$(grep -E 'fatal|msg' "$LAST")"
elif [ -e "$WORK/stage-cluster2" ]; then
  fail "two control hosts: nothing written" "$(find "$WORK/stage-cluster2" | head)"
else
  pass "two control hosts are refused before anything is written: \"a NATS cluster needs 1, 3 or 5\""
fi

}

start_lane static static_checks

# --- a real run into a staging root ----------------------------------------------------
INV="$WORK/inventory"
cp -r "$ANSIBLE_DIR/inventories/example" "$INV"
STAGE="$WORK/stage"

if play "$INV" "$STAGE" site.yml; then
  pass "site.yml runs on the example inventory (2 hosts, 8 GPUs) into a staging root"
else
  fail "site.yml runs on the example inventory (2 hosts, 8 GPUs) into a staging root" "$(cat "$LAST")"
  finish
fi
cp "$LAST" "$WORK/first-run.log"

cp -a "$INV" "$WORK/inventory-first"
start_lane variants variants_lane
start_lane other-inventories other_inventories_lane

# --- the main lane: the first run's staging root, checked, run again, edited ----------------
# Every binary of the package, the operator CLI included, on every host.
missing_bins=()
for host in gpu-node-1 gpu-node-2; do
  for b in "${BINARIES[@]}"; do
    cmp -s "$WORK/bin/$b" "$STAGE/$host/usr/local/bin/$b" || missing_bins+=("$host:$b")
  done
done
if [ ${#missing_bins[@]} -eq 0 ]; then
  pass "every binary, the metronome CLI included, is installed on both hosts"
else
  fail "every binary, the metronome CLI included, is installed on both hosts" "missing or different: ${missing_bins[*]}"
fi

# A rolling upgrade: the GPU play runs one node per batch (serial 1 by default), and each
# node drains exactly the workers it restarts, with the CLI, before restarting them (a
# first install restarts every assigned GPU; the second run below drains nothing).
drain_plan() { # $1 = log; prints "host: [GPUs]" for each drain plan of the run
  grep -oE '[A-Za-z0-9_.-]+: drain before restart GPUs \[[0-9, ]*\]' "$1" | sed 's/ drain before restart GPUs//'
}
plan=$(drain_plan "$WORK/first-run.log")
want_plan="gpu-node-1: [0, 1, 2, 3]
gpu-node-2: [0, 1, 2]"
batches=$(grep -c '^PLAY \[GPU nodes' "$WORK/first-run.log")
if [ "$plan" = "$want_plan" ] && [ "$batches" = 2 ] \
   && grep -q 'max_fail_percentage: 0' site.yml; then
  pass "GPU nodes are changed one at a time (2 batches, a failure stops the rollout), each draining exactly the workers it restarts"
else
  fail "GPU nodes are changed one at a time, each draining the workers it restarts" \
    "batches of the GPU play: $batches (want 2); drain plans:
$plan
want:
$want_plan"
fi

# The metrics flag of each model server that needs one (vLLM and TGI serve /metrics
# unasked): SGLang here; llama.cpp in the all-kinds inventory below.
sglang_units=$(grep -l 'sglang.launch_server' "$STAGE"/gpu-node-2/etc/systemd/system/metronome-model-gpu*.service)
if [ -n "$sglang_units" ] && ! grep -L -- '"--enable-metrics"' $sglang_units | grep -q .; then
  pass "SGLang model servers start with --enable-metrics ($(wc -w <<<"$sglang_units") units)"
else
  fail "SGLang model servers start with --enable-metrics" "${sglang_units:-no SGLang unit rendered}"
fi

prom1="$STAGE/gpu-node-1/etc/prometheus/prometheus.yml"
if out=$(model_scrape_check "$prom1" "127.0.0.1:8000 gpu-node-1-gpu0 vllm
127.0.0.1:8001 gpu-node-1-gpu1 vllm
127.0.0.1:8002 gpu-node-1-gpu2 vllm
127.0.0.1:8003 gpu-node-1-gpu3 vllm" 2>&1) \
   && grep -q '^# Not scraped (model_server_host is loopback on another node): gpu-node-2-gpu0, gpu-node-2-gpu1, gpu-node-2-gpu2$' "$prom1"; then
  pass "Prometheus scrapes the model servers on its own host (labelled worker_id, model, server) and lists those it cannot reach"
else
  fail "Prometheus scrapes the model servers it can reach" "$out$(grep -A20 metronome-model-server "$prom1")"
fi

# The rendered files against the inventory: every assigned GPU has its two units, the
# model server listens on the GPU's port with the GPU pinned, the worker-agent config
# names the model, port, kind and GPU, the agent is bound to its own model server only,
# and unassigned GPUs have nothing.
check_mapping() { # $1 = inventory, $2 = staging base
  "$PY" - "$1" "$2" <<'PYEOF'
import pathlib, re, sys, tomllib, yaml

inv, stage = map(pathlib.Path, sys.argv[1:3])
errors = []
def expect(cond, msg):
    if not cond:
        errors.append(msg)

for host_file in sorted((inv / "host_vars").glob("*.yml")):
    host = host_file.stem
    gpus = yaml.safe_load(host_file.read_text()).get("metronome_gpus", [])
    root = stage / host
    units = root / "etc/systemd/system"
    for g in gpus:
        n, port, model, server = g["gpu"], g["port"], g["model"], g["server"]
        where = f"{host} gpu{n}"
        mu_path = units / f"metronome-model-gpu{n}.service"
        au_path = units / f"metronome-worker-agent-gpu{n}.service"
        cfg_path = root / f"etc/metronome/worker-agent/gpu{n}.toml"
        for p in (mu_path, au_path, cfg_path):
            expect(p.is_file(), f"{where}: {p.relative_to(root)} missing")
        if errors:
            continue
        mu, au = mu_path.read_text(), au_path.read_text()
        expect(f"Environment=CUDA_VISIBLE_DEVICES={n}\n" in mu, f"{where}: model unit does not pin CUDA_VISIBLE_DEVICES={n}")
        expect(f"Environment=CUDA_VISIBLE_DEVICES={n}\n" in au, f"{where}: agent unit does not pin CUDA_VISIBLE_DEVICES={n}")
        expect("Restart=on-failure\n" in mu and "Restart=on-failure\n" in au, f"{where}: Restart=on-failure missing")
        for key in ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes"):
            expect(key in mu and key in au, f"{where}: {key} missing")
        # The model server runs as a user of its own: it cannot read its agent's credential.
        expect("\nUser=metronome-model\nGroup=metronome-model\n" in mu, f"{where}: model server not run as metronome-model")
        expect("\nUser=metronome-agent\nGroup=metronome-agent\n" in au, f"{where}: worker-agent not run as metronome-agent")
        if server == "simulator":
            sim = tomllib.loads((root / f"etc/metronome/model-server/gpu{n}.toml").read_text())
            expect(sim["gpu"][0]["port"] == port and sim["gpu"][0]["model"] == model,
                   f"{where}: simulator config does not serve {model} on {port}: {sim}")
            expect(f"/etc/metronome/model-server/gpu{n}.toml" in mu, f"{where}: simulator unit does not read its config")
        else:
            expect(f'"--port" "{port}"' in mu, f"{where}: model unit does not listen on port {port}")
            expect(f'"{model}"' in mu, f"{where}: model unit does not load {model}")
        # The agent is bound to its own model server and references no neighbour.
        expect(f"BindsTo=metronome-model-gpu{n}.service\n" in au, f"{where}: agent not bound to its model server")
        refs = set(re.findall(r"metronome-model-gpu(\d+)", au))
        expect(refs == {str(n)}, f"{where}: agent unit references model servers {sorted(refs)}")
        refs = set(re.findall(r"metronome-worker-agent-gpu(\d+)", mu))
        expect(refs <= {str(n)}, f"{where}: model unit references agents {sorted(refs)}")
        cfg = tomllib.loads(cfg_path.read_text())
        want = {
            "worker_id": f"{host}-gpu{n}",
            "model": model,
            "model_server_url": f"http://127.0.0.1:{port}",
            "model_server_kind": server,
            "gpu_index": n,
        }
        if "max_concurrency" in g:
            want["max_concurrency"] = g["max_concurrency"]
        for k, v in want.items():
            expect(cfg.get(k) == v, f"{where}: worker-agent {k} = {cfg.get(k)!r}, want {v!r}")
    listed = {g["gpu"] for g in gpus}
    present = {int(m) for p in root.rglob("*gpu*") for m in re.findall(r"gpu(\d+)", p.name)}
    expect(present == listed, f"{host}: files exist for GPUs {sorted(present)}, inventory lists {sorted(listed)}")

for e in errors:
    print(e)
sys.exit(1 if errors else 0)
PYEOF
}

if out=$(check_mapping "$INV" "$STAGE"); then
  pass "units and configs match the inventory's GPU -> model -> port mapping (spare GPU has none)"
else
  fail "units and configs match the inventory's GPU -> model -> port mapping (spare GPU has none)" "$out"
fi

# The provisioning record the dispatchers read (workers.json, control host only): every
# assigned GPU's worker id with the model and the concurrency ceiling its own worker-agent
# config has, nothing else; readable by root and the service group only; named by every
# dispatcher config.
provisioning_check() { # $1 = staging base
  "$PY" - "$1" <<'PYEOF'
import json, pathlib, stat, sys, tomllib
stage = pathlib.Path(sys.argv[1])
errors = []
record = stage / "gpu-node-1/etc/metronome/dispatcher/workers.json"
if not record.is_file():
    sys.exit(f"{record.relative_to(stage)} is missing")
got = json.loads(record.read_text())["workers"]
want = {}
for agent in stage.glob("*/etc/metronome/worker-agent/*.toml"):
    c = tomllib.loads(agent.read_text())
    want[c["worker_id"]] = {"model": c["model"], "max_concurrency": c["max_concurrency"]}
if got != want:
    errors.append(f"workers.json {got}\nwant (from the agents' configs) {want}")
mode = stat.S_IMODE(record.stat().st_mode)
if mode != 0o640:
    errors.append(f"workers.json is mode {mode:o}, want 640")
if list(stage.glob("gpu-node-2/etc/metronome/dispatcher/workers.json")):
    errors.append("workers.json reached a GPU-only host")
for conf in stage.glob("*/etc/metronome/dispatcher/*.toml"):
    named = tomllib.loads(conf.read_text()).get("provisioning_file")
    if named != str(record).replace(str(stage / "gpu-node-1"), "", 1) and named != str(record):
        errors.append(f"{conf.relative_to(stage)}: provisioning_file = {named!r}")
print("\n".join(errors))
sys.exit(1 if errors else 0)
PYEOF
}
if out=$(provisioning_check "$STAGE" 2>&1); then
  pass "the dispatchers' provisioning record lists every assigned GPU's worker with its agent's model and ceiling (0640, control host only, named by each dispatcher config)"
else
  fail "the dispatchers' provisioning record matches the inventory" "$out"
fi

# Control plane files on the control host only.
ctl="$STAGE/gpu-node-1"
missing=""
for f in etc/systemd/system/metronome-nats.service etc/systemd/system/metronome-redis.service \
  etc/systemd/system/metronome-gateway.service "etc/systemd/system/metronome-dispatcher@.service" \
  etc/metronome/nats/nats-server.conf etc/metronome/redis/redis.conf etc/metronome/gateway.toml \
  etc/metronome/dispatcher/a.toml etc/metronome/dispatcher/b.toml; do
  [ -f "$ctl/$f" ] || missing+=" $f"
done
[ -d "$STAGE/gpu-node-2/etc/metronome/dispatcher" ] && missing+=" (dispatcher files on gpu-node-2)"
if [ -z "$missing" ]; then
  pass "control plane (NATS, Redis, dispatcher a+b, gateway) rendered on the control host only"
else
  fail "control plane (NATS, Redis, dispatcher a+b, gateway) rendered on the control host only" "missing:$missing"
fi

# One Unix user per role (the GPU roles' in check_mapping): no process reads another
# role's config, credential or key.
bad=""
for unit_user in metronome-nats.service:metronome-nats metronome-redis.service:metronome-redis \
  metronome-gateway.service:metronome-gateway "metronome-dispatcher@.service:metronome-dispatcher"; do
  unit=${unit_user%%:*} user=${unit_user#*:}
  grep -qx "User=$user" "$ctl/etc/systemd/system/$unit" && grep -qx "Group=$user" "$ctl/etc/systemd/system/$unit" \
    || bad+="$unit does not run as $user; "
done
if [ -z "$bad" ]; then
  pass "each control-plane role runs as its own user (metronome-nats, -redis, -gateway, -dispatcher)"
else
  fail "each control-plane role runs as its own user" "$bad"
fi

# Redis keeps Metronome's state (no key has a TTL): it must refuse writes when full, never
# evict, in every way the system is started.
redis_conf="$ctl/etc/metronome/redis/redis.conf"
evicting=$(grep -hE '^[[:space:]]*maxmemory-policy' "$redis_conf" 2>/dev/null | grep -v 'noeviction')
if grep -qE '^[[:space:]]*maxmemory-policy[[:space:]]+noeviction[[:space:]]*$' "$redis_conf" 2>/dev/null \
  && [ -z "$evicting" ] \
  && grep -q -- '--maxmemory-policy noeviction' "$ROOT/scripts/up.sh" \
  && grep -qE '"--maxmemory-policy", *"noeviction"' "$ROOT/compose.yaml"; then
  pass "Redis never evicts: maxmemory-policy noeviction in the rendered redis.conf, ./dev up and compose.yaml"
else
  fail "Redis never evicts: maxmemory-policy noeviction in the rendered redis.conf, ./dev up and compose.yaml" \
    "rendered: $(grep -h maxmemory-policy "$redis_conf" 2>/dev/null || echo none)"
fi
# --- credentials: accepted by the servers as rendered, never world-readable ----------
# nats-server and redis-server start on the rendered configs (ports and storage moved to
# the work folder); each identity's rendered credentials work, and the servers refuse
# anonymous connections and what a role may not do.
auth_check() { # $1 = inventory, $2 = staging base
  "$PY" - "$1" "$2" "$WORK" <<'PYEOF'
import os, pathlib, socket, stat, subprocess, sys, time, tomllib, json

inv, stage, work = map(pathlib.Path, sys.argv[1:4])
errors = []
def expect(cond, msg):
    if not cond:
        errors.append(msg)

secrets_dir = inv / ".secrets"
secrets = {p.stem: p.read_text().strip() for p in secrets_dir.glob("*.password")}
expect(len(secrets) >= 10, f"expected a credential per identity in {secrets_dir}, found {sorted(secrets)}")
expect(stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700, f"{secrets_dir} is not mode 0700")
for p in secrets_dir.rglob("*"):
    want = 0o700 if p.is_dir() else 0o600
    expect(stat.S_IMODE(p.stat().st_mode) == want, f"{p} is not mode {want:o}")
# Every private key on a host is readable by its owner and the service group only.
for p in stage.rglob("*.key"):
    expect(stat.S_IMODE(p.stat().st_mode) & 0o037 == 0, f"{p.relative_to(stage)} is mode {stat.S_IMODE(p.stat().st_mode):o}")
# Each component's password is a systemd credential of its own (root's: folder 0700, file
# 0600) that its unit loads and points both password settings at; no config holds one.
installed = {}  # NATS and Redis user -> the password installed for its component
for conf in stage.glob("*/etc/metronome/**/*.toml"):
    c, rel = tomllib.loads(conf.read_text()), conf.relative_to(stage)
    host, name = rel.parts[0], str(pathlib.Path(*rel.parts[3:]).with_suffix(""))
    user = c.get("nats_auth", {}).get("user")
    for pw in secrets.values():
        expect(pw not in conf.read_text(), f"{rel} holds a password")
    if user is None:
        continue
    cred = stage / host / "etc/metronome/credentials" / f"{name}.password"
    expect(cred.is_file() and cred.read_text().strip() == secrets.get(user), f"{rel}: no credential {cred.relative_to(stage)} holding {user}'s password")
    if cred.is_file():
        installed[user] = cred.read_text().strip()
        expect(stat.S_IMODE(cred.stat().st_mode) == 0o600, f"{cred.relative_to(stage)} is mode {stat.S_IMODE(cred.stat().st_mode):o}")
        expect(stat.S_IMODE(cred.parent.stat().st_mode) == 0o700, f"{cred.parent.relative_to(stage)} is not mode 0700")
    unit = stage / host / "etc/systemd/system" / {"gateway": "metronome-gateway.service"}.get(
        name, "metronome-dispatcher@.service" if name.startswith("dispatcher/") else f"metronome-worker-agent-{name.split('/')[-1]}.service")
    text = unit.read_text() if unit.is_file() else ""
    loaded = f"/etc/metronome/credentials/{'dispatcher/%i' if name.startswith('dispatcher/') else name}.password"
    expect(f"LoadCredential=password:{loaded}\n" in text, f"{unit.relative_to(stage)} does not load {loaded}")
    for var in ("METRONOME_NATS_PASSWORD_FILE", "METRONOME_REDIS_PASSWORD_FILE"):
        expect(f"Environment={var}=%d/password\n" in text, f"{unit.relative_to(stage)}: {var} is not the credential")
expect(len(installed) >= 10, f"credentials installed for {sorted(installed)} only")
# No secret in a file anyone may read, on any host.
for p in stage.rglob("*"):
    if p.is_file() and not p.is_symlink() and p.stat().st_mode & stat.S_IROTH:
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for user, pw in secrets.items():
            expect(pw not in text, f"{p.relative_to(stage)} is world-readable and holds {user}'s password")

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

ctl = stage / "gpu-node-1"
nats_port, mon_port, redis_port = free_port(), free_port(), free_port()
# The rendered files with only the addresses and state folders moved; the users,
# permissions and ACLs stay exactly as rendered.
import re
nats_conf = (ctl / "etc/metronome/nats/nats-server.conf").read_text()
nats_conf = re.sub(r"(?m)^listen: .*$", f'listen: "127.0.0.1:{nats_port}"', nats_conf)
nats_conf = re.sub(r"(?m)^http: .*$", f'http: "127.0.0.1:{mon_port}"', nats_conf)
nats_conf = re.sub(r'(?m)^(\s*)store_dir: .*$', f'\\1store_dir: "{work / "nats-js"}"', nats_conf)
(work / "nats-check.conf").write_text(nats_conf)
redis_conf = (ctl / "etc/metronome/redis/redis.conf").read_text()
# With TLS the plain port stays closed (port 0) and the TLS port moves.
tls = "\ntls-port " in redis_conf
for key, value in (("bind", "127.0.0.1"), ("tls-port" if tls else "port", str(redis_port)),
                   ("dir", str(work)), ("supervised", "no"), ("logfile", str(work / "redis.log"))):
    redis_conf = re.sub(rf"(?m)^{key} .*$", f"{key} {value}", redis_conf)
(work / "redis-check.conf").write_text(redis_conf)
procs = [
    subprocess.Popen(["nats-server", "-c", str(work / "nats-check.conf"), "-l", str(work / "nats.log")]),
    subprocess.Popen(["redis-server", str(work / "redis-check.conf")]),
]
# The CA a component of the control host trusts, and the name it reaches NATS by: the
# server must present a certificate for that name, from that CA.
import ssl
from urllib.parse import urlsplit
gw_config = tomllib.loads((ctl / "etc/metronome/gateway.toml").read_text())
ca_file = gw_config["nats_auth"].get("ca_file")
expect(bool(ca_file) == tls, f"gateway ca_file {ca_file!r} while Redis TLS is {tls}")
# Mutual TLS: nats-server asks every client for a certificate from the cluster's CA.
verify = bool(re.search(r"(?m)^\s*verify: true$", nats_conf))
expect(verify == tls, f"nats-server.conf verify: true is {verify} while TLS is {tls}")
def own_cert(auth):
    return (auth["cert_file"], auth["key_file"]) if auth.get("cert_file") else None
def tls_context(cert):
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert:
        ctx.load_cert_chain(*cert)
    return ctx
gw_cert = own_cert(gw_config["nats_auth"])
expect(bool(gw_cert) == tls, f"gateway nats_auth cert_file {gw_cert!r} while TLS is {tls}")
try:
    def nats_session(user, password, lines, plain=False, server_name=None, cert=gw_cert):
        deadline = time.time() + 20
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", nats_port), timeout=5)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        info = json.loads(s.recv(4096).decode().split(" ", 1)[1])
        if info.get("tls_required") and not plain:
            # nats-server 2.9: the TLS handshake follows the plain INFO line.
            s = tls_context(cert).wrap_socket(
                s, server_hostname=server_name or urlsplit(gw_config["nats_url"]).hostname)
        with s:
            connect = {"verbose": False, "pedantic": False}
            if user:
                connect.update(user=user, **{"pass": password})
            payload = "CONNECT " + json.dumps(connect) + "\r\n" + "".join(lines) + "PING\r\n"
            s.sendall(payload.encode())
            out = b""
            while b"PONG" not in out and b"Authorization Violation" not in out:
                chunk = s.recv(4096)
                if not chunk:
                    break
                out += chunk
            return out.decode(errors="replace")

    gw = {**gw_config["nats_auth"], "password": installed.get("gateway")}
    if tls:
        out = nats_session(gw["user"], gw["password"], [], plain=True)
        expect("TLS Required" in out or "PONG" not in out, f"NATS accepted a plain-text client: {out!r}")
        for name in ("127.0.0.1", "localhost"):
            out = nats_session(gw["user"], gw["password"], [], server_name=name)
            expect("PONG" in out, f"the NATS certificate does not hold {name}: {out!r}")
        # Without a certificate, or with one from another CA, the TLS handshake fails
        # (TLS 1.3: the server's alert, or its hanging up, arrives with the first read) and
        # no password is read.
        other = work / "other-ca"
        other.mkdir(exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(other / "c.key"), "-out", str(other / "c.pem"), "-days", "2",
                        "-subj", "/CN=gateway", "-addext", "extendedKeyUsage=clientAuth"],
                       check=True, capture_output=True)
        for what, cert in (("no certificate", None), ("a certificate from another CA", (other / "c.pem", other / "c.key"))):
            try:
                out = nats_session(gw["user"], gw["password"], [], cert=cert)
                errors.append(f"NATS accepted a client with {what}: {out!r}")
            except (ssl.SSLError, ConnectionError):
                pass  # an alert (certificate required, bad certificate) or the server hanging up
    expect("Authorization Violation" in nats_session(None, None, []), "NATS accepted an anonymous connection")
    expect("Authorization Violation" in nats_session("gateway", "wrong", []), "NATS accepted a wrong password")
    out = nats_session(gw["user"], gw["password"], ["PUB jobs.submit.acme 2\r\n{}\r\n"])
    expect("PONG" in out and "Violation" not in out, f"the gateway's rendered credential: {out!r}")
    agent = tomllib.loads((stage / "gpu-node-2/etc/metronome/worker-agent/gpu0.toml").read_text())
    own, na = agent["worker_id"], agent["nats_auth"]
    na = {**na, "password": installed.get(na["user"])}
    na_cert = own_cert(na)
    out = nats_session(na["user"], na["password"], [f"PUB $KV.workers.{own} 2\r\n{{}}\r\n"], cert=na_cert)
    expect("PONG" in out and "Violation" not in out, f"{own} writing its own heartbeat: {out!r}")
    out = nats_session(na["user"], na["password"], ["PUB $KV.workers.gpu-node-1-gpu0 2\r\n{}\r\n"], cert=na_cert)
    expect("Permissions Violation" in out, f"{own} writing another worker's heartbeat was not refused: {out!r}")
    out = nats_session(na["user"], na["password"], ["SUB work.gpu-node-1-gpu0 1\r\n"], cert=na_cert)
    expect("Permissions Violation" in out, f"{own} reading another worker's work was not refused: {out!r}")
    # Results only under its own id (protocol v3): readers trust the subject's publisher.
    out = nats_session(na["user"], na["password"], [f"PUB results.acme.j1.{own}.chunk 2\r\n{{}}\r\n"], cert=na_cert)
    expect("PONG" in out and "Violation" not in out, f"{own} publishing a result under its own id: {out!r}")
    for forged in ("results.acme.j1.gpu-node-1-gpu0.final", "results.acme.j1._dispatcher.final"):
        out = nats_session(na["user"], na["password"], [f"PUB {forged} 2\r\n{{}}\r\n"], cert=na_cert)
        expect("Permissions Violation" in out, f"{own} publishing {forged} was not refused: {out!r}")
    # One direct-NATS client per tenant of metronome_client_tenants: its own tenant only.
    # Its certificate stays on the controller (metronome_secrets_dir/tls/clients/) for the
    # operator to hand out with the password.
    ca = secrets.get("client-acme")
    expect(ca is not None, f"no client-acme identity rendered: {sorted(secrets)}")
    acme_cert = (secrets_dir / "tls/clients/client-acme.pem", secrets_dir / "tls/clients/client-acme.key") if tls else None
    if ca is not None:
        out = nats_session("client-acme", ca, ["PUB jobs.submit.acme 2\r\n{}\r\n"], cert=acme_cert)
        expect("PONG" in out and "Violation" not in out, f"client-acme submitting for acme: {out!r}")
        out = nats_session("client-acme", ca, ["SUB results._anon.> 1\r\n"], cert=acme_cert)
        expect("Permissions Violation" in out, f"client-acme reading another tenant's results was not refused: {out!r}")
        out = nats_session("client-acme", ca, ["PUB jobs.submit._anon 2\r\n{}\r\n"], cert=acme_cert)
        expect("Permissions Violation" in out, f"client-acme submitting for another tenant was not refused: {out!r}")
        out = nats_session("client-acme", ca, ["PUB cancel.acme.j1 0\r\n\r\n"], cert=acme_cert)
        expect("PONG" in out and "Violation" not in out, f"client-acme cancelling for acme: {out!r}")
        out = nats_session("client-acme", ca, ["PUB cancel._anon.j1 0\r\n\r\n"], cert=acme_cert)
        expect("Permissions Violation" in out, f"client-acme cancelling another tenant's job was not refused: {out!r}")

    from urllib.parse import urlsplit
    def redis(*args, url=None):
        # The rendered URL's user and its installed credential, against the server started here.
        cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(redis_port), "--no-auth-warning"]
        if tls:
            cmd += ["--tls", "--cacert", ca_file]
        if url:
            u = urlsplit(url)
            cmd += ["--user", u.username, "--pass", u.password or installed.get(u.username, "")]
        r = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=20)
        return (r.stdout + r.stderr).strip()
    deadline = time.time() + 20
    while "NOAUTH" not in redis("PING") and time.time() < deadline:
        time.sleep(0.1)
    expect("NOAUTH" in redis("PING"), "Redis answered without authentication")
    if tls:
        plain = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(redis_port), "PING"],
                               capture_output=True, text=True, timeout=20)
        expect("NOAUTH" not in plain.stdout + plain.stderr, "Redis answered a plain-text client on its TLS port")
        for config in [ctl / "etc/metronome/dispatcher/a.toml", *stage.glob("*/etc/metronome/worker-agent/*.toml")]:
            c = tomllib.loads(config.read_text())
            expect(c["redis_url"].startswith("rediss://") and c["redis_tls"].get("ca_file")
                   and c["nats_auth"].get("ca_file"), f"{config.relative_to(stage)} does not use TLS")
    url = agent["redis_url"]
    expect(redis("HSET", f"metronome:ewma:{own}", "ttft_ms", "1", url=url) == "1",
           f"{own} writing its own EWMA with its rendered Redis URL")
    expect("NOPERM" in redis("HSET", "metronome:ewma:gpu-node-1-gpu0", "ttft_ms", "1", url=url),
           f"{own} writing another worker's EWMA was not refused")
    disp = tomllib.loads((ctl / "etc/metronome/dispatcher/a.toml").read_text())["redis_url"]
    expect(redis("HGET", f"metronome:ewma:{own}", "ttft_ms", url=disp) == "1", "the dispatcher reads the EWMAs")
    expect("NOPERM" in redis("DEL", f"metronome:ewma:{own}", url=disp), "the dispatcher deleting a key was not refused")
    gw_redis = tomllib.loads((ctl / "etc/metronome/gateway.toml").read_text())["redis_url"]
    expect("ttft_ms" in redis("HGETALL", f"metronome:ewma:{own}", url=gw_redis), "the gateway (console) reads the EWMAs")
    expect("NOPERM" in redis("HSET", f"metronome:ewma:{own}", "ttft_ms", "2", url=gw_redis),
           "the gateway writing an EWMA was not refused")
finally:
    for p in procs:
        p.terminate()
        p.wait(timeout=20)
print("\n".join(errors))
sys.exit(1 if errors else 0)
PYEOF
}
if out=$(auth_check "$INV" "$STAGE" 2>&1); then
  pass "nats-server and redis-server accept the rendered credentials and permissions (and refuse what a role may not do); no secret is world-readable"
else
  fail "nats-server and redis-server accept the rendered credentials and permissions (and refuse what a role may not do); no secret is world-readable" "$out"
fi

if out=$(tls_check "$STAGE" on 2>&1); then
  pass "TLS on by default: nats-server tls {}, Redis on TLS only, every component trusts the CA (config and unit), the server key 0640 on the control host only, its certificate names the control host"
else
  fail "TLS on by default: nats-server tls {}, Redis on TLS only, every component trusts the CA (config and unit), the server key 0640 on the control host only, its certificate names the control host" "$out"
fi
# --- each config accepted by its own binary -------------------------------------------
config_check() { # $1 = binary, rest = config files
  local bin=$1 f out
  shift
  if [[ " ${MISSING[*]} " == *" $bin "* ]]; then
    fail "$bin --check-config accepts the rendered configs" "target/debug/$bin is missing: cargo build -p ${PACKAGE_OF[$bin]}"
    return
  fi
  local cred envs
  for f in "$@"; do
    # The unit hands the binary its passwords as a systemd credential
    # (METRONOME_{NATS,REDIS}_PASSWORD_FILE=%d/password); the check reads the staged
    # credential of the same config the same way: /etc/metronome/<x>.toml's is
    # /etc/metronome/credentials/<x>.password.
    cred="${f%/etc/metronome/*}/etc/metronome/credentials/${f#*/etc/metronome/}"
    cred="${cred%.toml}.password"
    envs=()
    [ -f "$cred" ] && envs=(METRONOME_NATS_PASSWORD_FILE="$cred" METRONOME_REDIS_PASSWORD_FILE="$cred")
    if ! out=$(env "${envs[@]}" "$WORK/bin/$bin" --check-config --config "$f" 2>&1); then
      fail "$bin --check-config accepts the rendered configs" "${f#"$STAGE"/}:"$'\n'"$out"
      return
    fi
  done
  pass "$bin --check-config accepts the $# rendered config(s)"
}
shopt -s nullglob
config_check metronome-worker-agent "$STAGE"/*/etc/metronome/worker-agent/*.toml
config_check metronome-dispatcher "$STAGE"/*/etc/metronome/dispatcher/*.toml
config_check metronome-gateway "$STAGE"/*/etc/metronome/gateway.toml
config_check metronome-gpu-sim "$STAGE"/*/etc/metronome/model-server/*.toml
shopt -u nullglob

# --- the Prometheus scrape config, by promtool, with every worker-agent as a target ----
prom="$STAGE/gpu-node-1/etc/prometheus/prometheus.yml"
agents=$(grep -c '^ *- "10\.0\.0\.1[12]:93' "$prom" 2>/dev/null)
if out=$(promtool check config "$prom" 2>&1) && [ "$agents" = 7 ]; then
  pass "promtool accepts the rendered Prometheus config, which scrapes all 7 worker-agents"
else
  fail "promtool accepts the rendered Prometheus config with all 7 worker-agents ($agents found)" "$out"
fi

# --- systemd-analyze verify ------------------------------------------------------------
# Each host's staging root is copied into a verify root that also holds the system's own
# units (for multi-user.target and friends) and stand-ins for executables the playbook
# does not install (nats-server, redis-server, vLLM, SGLang: packages or images).
verify_host() { # $1 = host
  local host=$1 v="$WORK/verify/$1" units=() u exe
  mkdir -p "$WORK/verify"
  cp -a "$STAGE/$host" "$v"
  mkdir -p "$v/usr/lib/systemd"
  cp -a /usr/lib/systemd/system "$v/usr/lib/systemd/"
  for u in "$v"/etc/systemd/system/metronome-*.service; do
    for exe in $(sed -n 's/^Exec[A-Za-z]*=[-@+!]*\([^ ]*\).*/\1/p' "$u"); do
      if [ ! -e "$v$exe" ]; then
        mkdir -p "$(dirname "$v$exe")"
        printf '#!/bin/sh\nexit 0\n' > "$v$exe"
        chmod +x "$v$exe"
      fi
    done
    case "$(basename "$u")" in
      *@.service) # a template: verify its configured instances
        for i in "$v"/etc/metronome/dispatcher/*.toml; do
          units+=("$(basename "$u" .service | sed 's/@$//')@$(basename "$i" .toml).service")
        done ;;
      *) units+=("$(basename "$u")") ;;
    esac
  done
  local out rc
  out=$(systemd-analyze verify --root="$v" "${units[@]}" 2>&1)
  rc=$?
  # Warnings (an unknown or misspelt key, an ignored line) fail the check too.
  if [ $rc -eq 0 ] && ! grep -qiE 'unknown|ignoring|invalid|failed' <<<"$out"; then
    pass "systemd-analyze verify: ${#units[@]} units of $host"
  else
    fail "systemd-analyze verify: units of $host" "$out"
  fi
}
verify_host gpu-node-1
verify_host gpu-node-2

# --- idempotence, check mode, diff mode -----------------------------------------------
if play "$INV" "$STAGE" site.yml; then
  if recap_changed | grep -qv 'changed=0'; then
    fail "second run reports changed=0" "$(recap_changed)"
  else
    pass "second run reports changed=0 on every host"
  fi
  if [ "$(grep -cE 'gpu-node-[12]: restart (model servers|worker-agents) \[\]' "$LAST")" -eq 4 ]; then
    pass "second run restarts nothing"
  else
    fail "second run restarts nothing" "$(grep -E ': restart ' "$LAST")"
  fi
  if [ "$(drain_plan "$LAST")" = 'gpu-node-1: []
gpu-node-2: []' ]; then
    pass "second run drains nothing"
  else
    fail "second run drains nothing" "$(drain_plan "$LAST")"
  fi
else
  fail "second run reports changed=0" "$(tail -n 40 "$LAST")"
fi

# --- changing the inventory: check mode first, then for real ---------------------------
# Three edits at once: gpu-node-2's GPU 1 leaves the inventory (drained, its units and
# config removed), gpu-node-1's GPU 2 gets another model-server argument (its model
# server restarts and its agent comes back with it), gpu-node-2's GPU 0 gets another
# concurrency cap (only that agent restarts). Nothing else may change or restart.
snapshot() { (cd "$STAGE" && find . -type f -print0 | sort -z | xargs -0 md5sum); }
snapshot > "$WORK/before.txt"
"$PY" - "$INV/host_vars" <<'PYEOF'
import sys, yaml
base = sys.argv[1]
def edit(host, fn):
    path = f"{base}/{host}.yml"
    data = yaml.safe_load(open(path))
    data["metronome_gpus"] = fn(data["metronome_gpus"])
    yaml.safe_dump(data, open(path, "w"), sort_keys=False)
def node1(gpus):
    next(g for g in gpus if g["gpu"] == 2)["args"].append("--enforce-eager")
    return gpus
def node2(gpus):
    next(g for g in gpus if g["gpu"] == 0)["max_concurrency"] = 12
    return [g for g in gpus if g["gpu"] != 1]
edit("gpu-node-1", node1)
edit("gpu-node-2", node2)
PYEOF

out=""
if play "$INV" "$STAGE" site.yml --check --diff && grep -q '^+.*"--enforce-eager"' "$LAST" \
  && grep -q '^+max_concurrency = 12' "$LAST" && out=$(no_secret_in_log "$INV" "$LAST"); then
  snapshot > "$WORK/after-check.txt"
  if cmp -s "$WORK/before.txt" "$WORK/after-check.txt"; then
    pass "--check --diff shows the inventory edits as diffs and writes nothing"
  else
    fail "--check --diff writes nothing" "$(diff "$WORK/before.txt" "$WORK/after-check.txt")"
  fi
else
  fail "--check --diff shows the inventory edits as diffs, no password" "${out:-}$(tail -n 60 "$LAST")"
fi

if play "$INV" "$STAGE" site.yml; then
  snapshot > "$WORK/after.txt"
  removed=$(diff "$WORK/before.txt" "$WORK/after.txt" | sed -n 's/^< [0-9a-f]*  \.\///p' | sort | tr '\n' ' ')
  added=$(diff "$WORK/before.txt" "$WORK/after.txt" | sed -n 's/^> [0-9a-f]*  \.\///p' | sort | tr '\n' ' ')
  # The control host's Prometheus scrape config and the dispatchers' provisioning record
  # follow the inventory (they lose the retired GPU's worker, the record takes GPU 0's new
  # ceiling), and the removed GPU's worker identity is revoked: NATS's users and Redis's
  # ACL change too.
  edited="gpu-node-1/etc/metronome/dispatcher/workers.json gpu-node-1/etc/metronome/nats/nats-server.conf gpu-node-1/etc/metronome/redis/redis.conf gpu-node-1/etc/prometheus/prometheus.yml gpu-node-1/etc/systemd/system/metronome-model-gpu2.service gpu-node-2/etc/metronome/worker-agent/gpu0.toml "
  gone="gpu-node-2/etc/metronome/credentials/worker-agent/gpu1.password gpu-node-2/etc/metronome/tls/worker-agent/gpu1.key gpu-node-2/etc/metronome/tls/worker-agent/gpu1.pem gpu-node-2/etc/metronome/worker-agent/gpu1.toml gpu-node-2/etc/systemd/system/metronome-model-gpu1.service gpu-node-2/etc/systemd/system/metronome-worker-agent-gpu1.service "
  want_removed=$(printf '%s\n' $edited $gone | sort | tr '\n' ' ')
  if [ "$removed" = "$want_removed" ] && [ "$added" = "$edited" ]; then
    pass "removing gpu-node-2's GPU 1 removes exactly its two units, its config, its client certificate and its credential; the edits change exactly their two files and the scrape config"
  else
    fail "removing a GPU removes exactly its files; edits change exactly their files" \
      "removed or changed: $removed"$'\n'"want:               $want_removed"$'\n'"written: $added"$'\n'"want:    $edited"
  fi
  want=("gpu-node-1: restart model servers [2]" "gpu-node-1: restart worker-agents []"
    "gpu-node-2: restart model servers []" "gpu-node-2: restart worker-agents [0]")
  bad=""
  for w in "${want[@]}"; do grep -qF "$w" "$LAST" || bad+="missing \"$w\""$'\n'; done
  if [ -z "$bad" ]; then
    pass "only the instances whose files changed restart (model server gpu-node-1/2, agent gpu-node-2/0)"
  else
    fail "only the instances whose files changed restart" "$bad$(grep -E ': restart ' "$LAST")"
  fi
  if out=$(check_mapping "$INV" "$STAGE") && out=$(provisioning_check "$STAGE" 2>&1); then
    pass "after the edits the files and the provisioning record still match the inventory"
  else
    fail "after the edits the files still match the inventory" "$out"
  fi
else
  fail "site.yml after editing the inventory" "$(tail -n 40 "$LAST")"
fi

# --- certificate renewal -------------------------------------------------------------------
# On the controller, gpu-node-2 GPU 0's client certificate is replaced by one that expires
# tomorrow (same CA and key) and dispatcher a's by one from another CA: the next run issues
# both again, installs exactly those two certificates and restarts only that agent.
SEC="$INV/.secrets/tls"
snapshot > "$WORK/before-renew.txt"
old_serial=$(openssl x509 -noout -serial -in "$SEC/clients/worker-gpu-node-2-gpu0.pem")
if openssl req -x509 -CA "$SEC/ca.pem" -CAkey "$SEC/ca.key" -key "$SEC/clients/worker-gpu-node-2-gpu0.key"      -days 1 -subj /CN=worker-gpu-node-2-gpu0 -addext extendedKeyUsage=clientAuth      -out "$SEC/clients/worker-gpu-node-2-gpu0.pem" >/dev/null 2>&1   && openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 300      -subj /CN=dispatcher-gpu-node-1-a -keyout "$SEC/clients/dispatcher-gpu-node-1-a.key"      -out "$SEC/clients/dispatcher-gpu-node-1-a.pem" >/dev/null 2>&1   && play "$INV" "$STAGE" site.yml; then
  snapshot > "$WORK/after-renew.txt"
  written=$(diff "$WORK/before-renew.txt" "$WORK/after-renew.txt" | sed -n 's/^> [0-9a-f]*  \.\///p' | sort | tr '\n' ' ')
  want_written="gpu-node-1/etc/metronome/tls/dispatcher/a.key gpu-node-1/etc/metronome/tls/dispatcher/a.pem gpu-node-2/etc/metronome/tls/worker-agent/gpu0.key gpu-node-2/etc/metronome/tls/worker-agent/gpu0.pem "
  bad=""
  [ "$written" = "$want_written" ] || bad+="written: $written"$'\n'"want:    $want_written"$'\n'
  for f in "$STAGE/gpu-node-2/etc/metronome/tls/worker-agent/gpu0.pem" "$STAGE/gpu-node-1/etc/metronome/tls/dispatcher/a.pem"; do
    openssl verify -CAfile "$SEC/ca.pem" "$f" >/dev/null 2>&1 || bad+="${f#"$STAGE"/} does not verify against the CA"$'\n'
    openssl x509 -noout -checkend $((300 * 86400)) -in "$f" >/dev/null || bad+="${f#"$STAGE"/} expires within 300 days"$'\n'
  done
  [ "$(openssl x509 -noout -serial -in "$SEC/clients/worker-gpu-node-2-gpu0.pem")" != "$old_serial" ] || bad+="gpu0's certificate was not issued again"$'\n'
  grep -qF "gpu-node-2: restart worker-agents [0]" "$LAST" || bad+="agent gpu-node-2/0 not restarted"$'\n'
  grep -qF "gpu-node-1: restart worker-agents []" "$LAST" || bad+="gpu-node-1's agents restarted"$'\n'
  if [ -z "$bad" ]; then
    pass "a client certificate near expiry or from another CA is issued again: exactly its files change, only its agent restarts"
  else
    fail "a client certificate near expiry or from another CA is issued again" "$bad$(grep -E ': restart ' "$LAST")"
  fi
else
  fail "a client certificate near expiry or from another CA is issued again" "$(tail -n 40 "$LAST")"
fi

# --- drain.yml ---------------------------------------------------------------------------
if play "$INV" "$STAGE" drain.yml --limit gpu-node-2 -e gpu=2 && grep -q 'drained GPU(s) 2' "$LAST"; then
  pass "drain.yml --limit gpu-node-2 -e gpu=2 runs (no systemd here: it reports, stops nothing)"
else
  fail "drain.yml --limit gpu-node-2 -e gpu=2 runs" "$(tail -n 40 "$LAST")"
fi
if ! play "$INV" "$STAGE" drain.yml --limit gpu-node-2 -e gpu=3 && grep -q 'GPU 3 is not assigned' "$LAST"; then
  pass "drain.yml refuses a GPU that is not assigned"
else
  fail "drain.yml refuses a GPU that is not assigned" "$(tail -n 40 "$LAST")"
fi

finish_lanes
finish
