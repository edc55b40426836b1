#!/usr/bin/env python3
"""Generate Metronome's NATS and Redis credentials and render the servers' auth config.

    render-auth.py --dir DIR [--prefix metronome] [--rotate] [--route-user USER] IDENTITY...

IDENTITY is `user:role`; for a worker-agent `user:worker-agent:<worker_id>:<model>[:<max_concurrency>]`
(the model it may serve and the highest concurrency cap it may claim); for a
direct-NATS client `user:client:<tenant>` (its tenant's subjects only; `_anon` is the
tenant token of jobs submitted without a tenant).
Roles and their permissions come from ansible/roles/metronome/files/permissions.json,
generated from protocol/src/permissions.rs (the one definition; its tests run the same
rules against real servers). Used by `./dev up` and by the Ansible playbook.

Writes, all mode 0600 in DIR (mode 0700):
  <user>.password          a generated password (kept across runs; --rotate makes new ones)
  nats-authorization.conf  the nats-server `authorization` block (passwords in clear:
                           nats-server 2.9 compares them as given)
  redis-acl.conf           Redis `user` lines, passwords as SHA-256 (`#<hex>`)
  workers.json             the provisioning record the dispatcher reads
                           (`provisioning_file`): each worker id's model and
                           concurrency ceiling (null: none given); no secret in it

With --route-user (a NATS cluster), also <USER>.password: the credential the cluster's
nodes present to each other on their routes (the `cluster { authorization }` block and
the `nats-route://USER:<password>@host:port` route URLs). It is not a client identity:
no client can log in with it, and it is in no `authorization` users list.
"""
import argparse
import hashlib
import json
import os
import secrets
import string
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RULES = os.path.join(HERE, "..", "ansible", "roles", "metronome", "files", "permissions.json")
ALPHABET = string.ascii_letters + string.digits
# protocol::names::NO_TENANT_TOKEN, protocol::job::MAX_TENANT_BYTES and
# protocol::names::DISPATCHER_PUBLISHER (the leader's results: no worker may be called so).
NO_TENANT_TOKEN = "_anon"
MAX_TENANT_BYTES = 64
DISPATCHER_PUBLISHER = "_dispatcher"


def glob_escape(s):
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def write_private(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def password_for(directory, user, rotate):
    path = os.path.join(directory, f"{user}.password")
    if rotate or not os.path.exists(path):
        write_private(path, "".join(secrets.choice(ALPHABET) for _ in range(40)) + "\n")
    with open(path) as f:
        return f.read().strip()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--prefix", default="metronome")
    p.add_argument("--rules", default=RULES)
    p.add_argument("--rotate", action="store_true")
    p.add_argument("--route-user", default="")
    p.add_argument("identities", nargs="+")
    a = p.parse_args()
    with open(a.rules) as f:
        roles = json.load(f)["roles"]
    os.makedirs(a.dir, mode=0o700, exist_ok=True)
    os.chmod(a.dir, 0o700)
    identity_users = {spec.split(":")[0] for spec in a.identities}
    if a.route_user:
        if not all(c in ALPHABET + "-_" for c in a.route_user) or a.route_user in identity_users:
            sys.exit(f"render-auth: --route-user {a.route_user!r} must be letters, digits, '-' and '_', "
                     "and no client identity's name")
        password_for(a.dir, a.route_user, a.rotate)
    nats = ["authorization {", "  users = ["]
    redis = ["user default off"]
    provisioned = {}
    for spec in a.identities:
        parts = spec.split(":")
        user, role = parts[0], parts[1] if len(parts) > 1 else ""
        if role not in roles:
            sys.exit(f"render-auth: {spec}: unknown role {role!r} ({', '.join(roles)})")
        if not user or not all(c in ALPHABET + "-_" for c in user):
            sys.exit(f"render-auth: {spec}: a user is letters, digits, '-' and '_'")
        worker_id, model = (parts[2], parts[3]) if role == "worker-agent" and len(parts) in (4, 5) else ("", "")
        if role == "worker-agent" and not (worker_id and model):
            sys.exit(f"render-auth: {spec}: a worker-agent is "
                     "user:worker-agent:<worker_id>:<model>[:<max_concurrency>]")
        ceiling = None
        if role == "worker-agent" and len(parts) == 5:
            if not (parts[4].isdigit() and int(parts[4]) >= 1):
                sys.exit(f"render-auth: {spec}: max_concurrency is a whole number, at least 1")
            ceiling = int(parts[4])
        if role == "worker-agent" and worker_id in provisioned:
            sys.exit(f"render-auth: {spec}: worker id {worker_id!r} is given twice")
        if role == "worker-agent" and (
            worker_id == DISPATCHER_PUBLISHER or not all(c in ALPHABET + "-_" for c in worker_id)
        ):
            # It would be allowed to publish results readers take for the leader's.
            sys.exit(f"render-auth: {spec}: a worker id is letters, digits, '-' and '_', "
                     f"and not {DISPATCHER_PUBLISHER}")
        tenant = parts[2] if role == "client" and len(parts) == 3 else ""
        if role == "client" and not (
            tenant and len(tenant) <= MAX_TENANT_BYTES and all(c in ALPHABET + "-_" for c in tenant)
        ):
            sys.exit(f"render-auth: {spec}: a client is user:client:<tenant> (letters, digits, "
                     f"'-' and '_', at most {MAX_TENANT_BYTES}; {NO_TENANT_TOKEN} for no tenant)")
        if role == "worker-agent":
            provisioned[worker_id] = {"model": model, "max_concurrency": ceiling}
        rules = roles[role]
        pw = password_for(a.dir, user, a.rotate)

        def fill(t):
            return (t.replace("{user}", user).replace("{worker_id}", worker_id)
                    .replace("{tenant}", tenant)
                    .replace("{prefix}", a.prefix).replace("{model}", glob_escape(model)))

        pub = ", ".join(json.dumps(fill(s)) for s in rules["publish"])
        sub = ", ".join(json.dumps(fill(s)) for s in rules["subscribe"])
        resp = ", allow_responses: true" if rules["allow_responses"] else ""
        nats.append(f"    {{user: {json.dumps(user)}, password: {json.dumps(pw)}, "
                    f"permissions: {{publish: {{allow: [{pub}]}}, subscribe: {{allow: [{sub}]}}{resp}}}}}")
        if rules["redis"]:
            digest = hashlib.sha256(pw.encode()).hexdigest()
            redis.append(f"user {user} on #{digest} {fill(rules['redis'])}")
    nats += ["  ]", "}"]
    write_private(os.path.join(a.dir, "nats-authorization.conf"), "\n".join(nats) + "\n")
    write_private(os.path.join(a.dir, "redis-acl.conf"), "\n".join(redis) + "\n")
    # scheduler::provisioning::Provisioning, version 1.
    write_private(os.path.join(a.dir, "workers.json"),
                  json.dumps({"v": 1, "workers": provisioned}, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
