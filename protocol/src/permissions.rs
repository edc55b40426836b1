//! Who may do what: the least-privilege NATS permissions and Redis ACL of every role, as
//! rules over the contract's names, and their rendering into the two servers' own config
//! syntax (nats-server 2.9 `authorization { users = [...] }`, Redis 7 ACL `user` lines).
//!
//! Roles: the gateway, each dispatcher instance, each worker-agent (one identity per
//! worker), a direct-NATS client (one identity per tenant), an auditor (decisions only) and
//! an admin (the operator CLI). Rules are templates over `{user}`, `{worker_id}`,
//! `{tenant}` (a subject token, `names::tenant_token`), `{prefix}` and `{model}`, so the
//! same rules can be written out as data ([`rules_json`], committed as
//! `ansible/roles/metronome/files/permissions.json`) for provisioning to render without
//! a second copy of them.
//!
//! Invariants (tested against real servers in `tests/tests/permissions.rs`):
//! - a worker publishes only under its own id (heartbeat key `$KV.workers.<id>`,
//!   `workers.<id>.heartbeat`, `events.done.<id>`, results
//!   `results.*.*.<id>.{chunk,final}`) and pulls only its own consumer
//!   `worker-<id>`, which it can create only with the filter `work.<id>` (nats-server
//!   checks the filter in the create subject against the request body);
//! - only dispatchers write `work.*`, `decisions.*` and the `leader`, `fairness` and
//!   `queues` buckets; the gateway (console), auditors and admins read `queues`;
//! - the gateway's Redis user reads the workers' EWMA hashes and writes nothing;
//! - only dispatchers and admins create streams: a stream is a subscription to stored
//!   messages, so creating one on `results.>` would read every result;
//! - every identity reads replies only on its own inbox (`names::inbox_prefix`);
//! - a client of tenant `t` submits only on `jobs.submit.<t>` (the dispatcher takes the
//!   job's tenant from that subject) and reads only `results.<t>.>` and `decisions.<t>.>`,
//!   live or stored (direct get with the subject in the request subject, which the server
//!   matches against the permission; the body-addressed `STREAM.MSG.GET` is not granted,
//!   since its subject or sequence travels in the body, where no permission looks), and
//!   cancels only on `cancel.<t>.*`;
//! - only dispatchers publish results under [`names::DISPATCHER_PUBLISHER`];
//! - a worker reads the info of WORK, EVENTS and its two buckets only: the info of JOBS,
//!   DECISIONS or RESULTS, asked with a subjects filter, lists every tenant's job ids.
//!
//! What permissions cannot say, readers and the dispatcher check: a worker may publish
//! results for any job under its own id (the server does not know which jobs it holds), so
//! readers accept a job's results only from the worker its decision names; a client may
//! name any job id under its own tenant's `cancel.<t>.<job>`, so the dispatcher and the
//! agent act only when the job is tenant `t`'s.

use serde::Serialize;

use crate::names::{
    self, tenant_token, BUCKET_API_KEYS, BUCKET_FAIRNESS, BUCKET_LEADER, BUCKET_QUEUES,
    BUCKET_WORKERS, CONTROL_CANCEL, CONTROL_REVOKE, LEADER_KEY, STREAM_CACHE_DELTAS,
    STREAM_CACHE_SNAPSHOTS, STREAM_DECISIONS, STREAM_EVENTS, STREAM_JOBS, STREAM_RESULTS,
    STREAM_WORK, SUBJECT_CANCEL_ALL, SUBJECT_DEAD_LETTER, SUBJECT_DECISIONS_ALL,
    SUBJECT_JOBS_RETRY, SUBJECT_JOBS_SUBMIT_ALL, SUBJECT_JOBS_SUBMIT_PREFIX,
};

/// One kind of identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Gateway,
    Dispatcher,
    WorkerAgent,
    Client,
    Auditor,
    Admin,
}

impl Role {
    pub const ALL: [Role; 6] = [
        Role::Gateway,
        Role::Dispatcher,
        Role::WorkerAgent,
        Role::Client,
        Role::Auditor,
        Role::Admin,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Dispatcher => "dispatcher",
            Role::WorkerAgent => "worker-agent",
            Role::Client => "client",
            Role::Auditor => "auditor",
            Role::Admin => "admin",
        }
    }
}

/// What one role may do, as templates (see the module docs for the placeholders).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RoleRules {
    /// Subjects the identity may publish to.
    pub publish: Vec<String>,
    /// Subjects the identity may subscribe to.
    pub subscribe: Vec<String>,
    /// May answer requests it received (a worker-agent answers `control.<id>.*`).
    pub allow_responses: bool,
    /// Its Redis ACL rules after `user <name> on <password>`; `None`: no Redis user.
    pub redis: Option<String>,
}

const INBOX: &str = "_INBOX.{user}.>";

fn js(api: &str) -> String {
    format!("$JS.API.{api}")
}

/// Reading every key of KV bucket `bucket`: open it (its stream's info), list the keys
/// (an ordered consumer, with its flow control) and get each value (direct get).
fn read_bucket(bucket: &str) -> Vec<String> {
    vec![
        js(&format!("STREAM.INFO.KV_{bucket}")),
        js(&format!("CONSUMER.CREATE.KV_{bucket}")),
        js(&format!("CONSUMER.CREATE.KV_{bucket}.>")),
        js(&format!("CONSUMER.DELETE.KV_{bucket}.*")),
        format!("$JS.FC.KV_{bucket}.>"),
        js(&format!("DIRECT.GET.KV_{bucket}")),
        js(&format!("DIRECT.GET.KV_{bucket}.>")),
    ]
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// The rules of `role`.
pub fn rules(role: Role) -> RoleRules {
    // Every component opens the streams and buckets at start-up (`setup::ensure_all`):
    // reading their configuration is harmless, creating them is not.
    let stream_info = js("STREAM.INFO.*");
    match role {
        Role::Gateway => RoleRules {
            publish: vec![
                // Every tenant's: the gateway submits (and cancels when its client goes
                // away) for the tenant of each API key.
                SUBJECT_JOBS_SUBMIT_ALL.into(),
                SUBJECT_CANCEL_ALL.into(),
                stream_info,
                // `GET /v1/models` watches the `workers` bucket (an ordered consumer).
                js(&format!("CONSUMER.CREATE.KV_{BUCKET_WORKERS}")),
                js(&format!("CONSUMER.CREATE.KV_{BUCKET_WORKERS}.>")),
                js(&format!("CONSUMER.DELETE.KV_{BUCKET_WORKERS}.*")),
                format!("$JS.FC.KV_{BUCKET_WORKERS}.>"),
                // Readiness: is there a leader? (The lease is no secret.)
                js(&format!(
                    "DIRECT.GET.KV_{BUCKET_LEADER}.$KV.{BUCKET_LEADER}.{LEADER_KEY}"
                )),
                // The operator console (`/console`): each worker's heartbeat, the recorded
                // decisions and results it explains, and the live decision feed.
                js(&format!("DIRECT.GET.KV_{BUCKET_WORKERS}.>")),
                js(&format!("DIRECT.GET.{STREAM_DECISIONS}")),
                js(&format!("DIRECT.GET.{STREAM_DECISIONS}.>")),
                js(&format!("DIRECT.GET.{STREAM_RESULTS}")),
                js(&format!("DIRECT.GET.{STREAM_RESULTS}.>")),
                js(&format!("CONSUMER.CREATE.{STREAM_DECISIONS}")),
                js(&format!("CONSUMER.CREATE.{STREAM_DECISIONS}.>")),
                js(&format!("CONSUMER.MSG.NEXT.{STREAM_DECISIONS}.*")),
                js(&format!("CONSUMER.DELETE.{STREAM_DECISIONS}.*")),
                format!("$JS.FC.{STREAM_DECISIONS}.>"),
                // The explain view's actuals: the job's completion event.
                js(&format!("CONSUMER.CREATE.{STREAM_EVENTS}")),
                js(&format!("CONSUMER.CREATE.{STREAM_EVENTS}.>")),
                js(&format!("CONSUMER.MSG.NEXT.{STREAM_EVENTS}.*")),
                js(&format!("CONSUMER.DELETE.{STREAM_EVENTS}.*")),
                format!("$JS.FC.{STREAM_EVENTS}.>"),
            ]
            .into_iter()
            // The console's queue table: the leader's per-model queue snapshots.
            .chain(read_bucket(BUCKET_QUEUES))
            // API keys managed live (`metronome keys`): watched, never written.
            .chain(read_bucket(BUCKET_API_KEYS))
            .collect(),
            subscribe: strings(&[INBOX, "results.>", SUBJECT_DECISIONS_ALL]),
            allow_responses: false,
            // The console's EWMA columns: it reads each worker's EWMA hash, nothing else.
            redis: Some(
                "resetkeys %R~{prefix}:ewma:* resetchannels -@all +@connection +hgetall".into(),
            ),
        },
        Role::Dispatcher => RoleRules {
            publish: vec![
                js("INFO"),
                stream_info,
                js("STREAM.CREATE.*"),
                js("CONSUMER.>"),
                js("DIRECT.GET.>"),
                js("STREAM.MSG.GET.*"),
                // A dead worker's pending assignments are purged before its jobs go
                // elsewhere.
                js(&format!("STREAM.PURGE.{STREAM_WORK}")),
                format!("$JS.ACK.{STREAM_JOBS}.>"),
                "$JS.FC.>".into(),
                format!("$KV.{BUCKET_LEADER}.>"),
                // A silent worker is declared dead by deleting its heartbeat key, on the
                // condition that no later heartbeat was stored (the agent's next
                // conditional put then fails, and it drops what it held).
                format!("$KV.{BUCKET_WORKERS}.*"),
                // Fair-share counters, saved for the next leader.
                format!("$KV.{BUCKET_FAIRNESS}.>"),
                // Per-model queue snapshots, for operators.
                format!("$KV.{BUCKET_QUEUES}.>"),
                // Completion events are read through a durable consumer and acknowledged.
                format!("$JS.ACK.{STREAM_EVENTS}.>"),
                // A JOBS stream of an older version gains `jobs.retry` and
                // `jobs.submit.*`, a RESULTS stream of version 1 the tenant in its subjects;
                // the lease bucket gets the configured lease TTL.
                js(&format!("STREAM.UPDATE.{STREAM_JOBS}")),
                js(&format!("STREAM.UPDATE.{STREAM_RESULTS}")),
                // RESULTS and EVENTS get their byte and per-worker bounds.
                js(&format!("STREAM.UPDATE.{STREAM_EVENTS}")),
                js(&format!("STREAM.UPDATE.KV_{BUCKET_LEADER}")),
                // A refused or rescued job goes back on JOBS (`jobs.retry`, which only
                // dispatchers may publish); a client's cancel is relayed to the worker
                // holding the job, on that worker's own control subject (workers hear no
                // other cancels); a worker declared dead has its jobs revoked.
                SUBJECT_JOBS_RETRY.into(),
                format!("control.*.{CONTROL_CANCEL}"),
                format!("control.*.{CONTROL_REVOKE}"),
                "work.*".into(),
                "decisions.*.*".into(),
                // Final results of the jobs it rejects or declares lost, under its own
                // publisher token, never a worker's.
                format!("results.*.*.{}.final", names::DISPATCHER_PUBLISHER),
                SUBJECT_DEAD_LETTER.into(),
            ],
            subscribe: strings(&[INBOX, SUBJECT_CANCEL_ALL, "workers.*.heartbeat"]),
            allow_responses: false,
            // Reads the EWMAs, output lengths and fitted models; writes no key. Loads the
            // EWMA update function workers call (`redis_keys::EWMA_LIBRARY`).
            redis: Some(
                "resetkeys %R~{prefix}:* resetchannels -@all +@connection +@read +function|load"
                    .into(),
            ),
        },
        Role::WorkerAgent => RoleRules {
            publish: vec![
                // The info of the streams and buckets it uses (`setup::ensure_for_worker`)
                // only: that of JOBS, DECISIONS or RESULTS, asked with a subjects filter,
                // lists every tenant's job ids.
                js(&format!("STREAM.INFO.{STREAM_WORK}")),
                js(&format!("STREAM.INFO.{STREAM_EVENTS}")),
                js(&format!("STREAM.INFO.{STREAM_CACHE_DELTAS}")),
                js(&format!("STREAM.INFO.{STREAM_CACHE_SNAPSHOTS}")),
                js(&format!("STREAM.INFO.KV_{BUCKET_WORKERS}")),
                js(&format!("STREAM.INFO.KV_{BUCKET_LEADER}")),
                js(&format!("CONSUMER.INFO.{STREAM_WORK}.worker-{{worker_id}}")),
                js(&format!(
                    "CONSUMER.CREATE.{STREAM_WORK}.worker-{{worker_id}}.work.{{worker_id}}"
                )),
                js(&format!("CONSUMER.MSG.NEXT.{STREAM_WORK}.worker-{{worker_id}}")),
                format!("$JS.ACK.{STREAM_WORK}.worker-{{worker_id}}.>"),
                format!("$KV.{BUCKET_WORKERS}.{{worker_id}}"),
                // It reads back its own heartbeat key.
                js(&format!(
                    "DIRECT.GET.KV_{BUCKET_WORKERS}.$KV.{BUCKET_WORKERS}.{{worker_id}}"
                )),
                // It checks an assignment's new, higher epoch against the leader lease
                // (`lease::lease_vouches_for`); the lease is no secret.
                js(&format!(
                    "DIRECT.GET.KV_{BUCKET_LEADER}.$KV.{BUCKET_LEADER}.{LEADER_KEY}"
                )),
                "workers.{worker_id}.heartbeat".into(),
                "events.done.{worker_id}".into(),
                // Its model server's prefix cache, under its own id only: a worker cannot
                // tell the leader what another worker holds.
                "kvcache.{worker_id}.delta".into(),
                "kvcache.{worker_id}.snapshot".into(),
                // Results of any tenant's job, but only under its own id: which jobs it
                // holds the server cannot know, so readers check the job's decision.
                "results.*.*.{worker_id}.chunk".into(),
                "results.*.*.{worker_id}.final".into(),
                SUBJECT_DEAD_LETTER.into(),
            ],
            // Cancels of its own jobs only, relayed by the leader on
            // `control.{worker_id}.cancel`: `cancel.*.*` would tell it every job's id.
            subscribe: strings(&[INBOX, "control.{worker_id}.*"]),
            allow_responses: true,
            // Its own EWMA hash, fitted model and output-length average of its model (the
            // dispatcher takes the median over the model's workers); the update is the function the
            // dispatcher loads (`FCALL`, under this ACL), never Lua of its own (`EVAL` of a
            // loop would hold Redis for every role).
            redis: Some(
                "resetkeys ~{prefix}:ewma:{worker_id} ~{prefix}:perf:{worker_id} ~{prefix}:outlen:{model}:{worker_id} \
                 resetchannels -@all +@connection +get +set +hget +hmget +hgetall +hset +fcall"
                    .into(),
            ),
        },
        // One identity per tenant: only its own tenant's subjects.
        Role::Client => RoleRules {
            publish: vec![
                format!("{SUBJECT_JOBS_SUBMIT_PREFIX}{{tenant}}"),
                // Its own tenant's cancellations only; the dispatcher and the agent check
                // that the job named is that tenant's.
                "cancel.{tenant}.*".into(),
                js(&format!("STREAM.INFO.{STREAM_JOBS}")),
                // Stored records by subject, the subject in the request subject (a direct
                // get "last by subject" carries no body, nats-server refuses one), so the
                // permission sees whose record it is. Not the body-addressed
                // `DIRECT.GET.<stream>` or `STREAM.MSG.GET.<stream>`: they read any record.
                js(&format!("DIRECT.GET.{STREAM_RESULTS}.results.{{tenant}}.>")),
                js(&format!("DIRECT.GET.{STREAM_DECISIONS}.decisions.{{tenant}}.>")),
            ],
            subscribe: strings(&[INBOX, "results.{tenant}.>", "decisions.{tenant}.>"]),
            allow_responses: false,
            redis: None,
        },
        Role::Auditor => RoleRules {
            publish: vec![
                js(&format!("STREAM.INFO.{STREAM_DECISIONS}")),
                js(&format!("DIRECT.GET.{STREAM_DECISIONS}.>")),
                js(&format!("CONSUMER.CREATE.{STREAM_DECISIONS}")),
                js(&format!("CONSUMER.CREATE.{STREAM_DECISIONS}.>")),
                js(&format!("CONSUMER.INFO.{STREAM_DECISIONS}.*")),
                js(&format!("CONSUMER.MSG.NEXT.{STREAM_DECISIONS}.*")),
                js(&format!("CONSUMER.DELETE.{STREAM_DECISIONS}.*")),
                format!("$JS.FC.{STREAM_DECISIONS}.>"),
            ]
            .into_iter()
            // What waits, per model (the leader's queue snapshots).
            .chain(read_bucket(BUCKET_QUEUES))
            .collect(),
            subscribe: strings(&[INBOX, "decisions.>"]),
            allow_responses: false,
            redis: None,
        },
        Role::Admin => RoleRules {
            publish: strings(&[">"]),
            subscribe: strings(&[">"]),
            allow_responses: false,
            redis: Some("resetkeys ~* resetchannels &* +@all".into()),
        },
    }
}

/// Streams the rules name, so a renamed stream breaks the tests rather than the fleet.
pub const STREAMS_NAMED: [&str; 7] = [
    STREAM_JOBS,
    STREAM_WORK,
    STREAM_DECISIONS,
    STREAM_RESULTS,
    STREAM_EVENTS,
    STREAM_CACHE_DELTAS,
    STREAM_CACHE_SNAPSHOTS,
];

/// One identity to render: a user of `role` with its password; `worker_id` and `model`
/// for a worker-agent, `tenant` for a client (`None`: the jobs of no tenant,
/// `names::NO_TENANT_TOKEN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub password: String,
    pub role: Role,
    pub worker_id: Option<String>,
    pub model: Option<String>,
    pub tenant: Option<String>,
}

impl Identity {
    pub fn new(user: &str, password: &str, role: Role) -> Identity {
        Identity {
            user: user.into(),
            password: password.into(),
            role,
            worker_id: None,
            model: None,
            tenant: None,
        }
    }

    /// The direct-NATS client of `tenant` (`None`: of no tenant), user
    /// `client-<tenant token>`.
    pub fn client(tenant: Option<&str>, password: &str) -> Identity {
        Identity {
            user: client_user(tenant),
            password: password.into(),
            role: Role::Client,
            worker_id: None,
            model: None,
            tenant: tenant.map(str::to_string),
        }
    }

    /// The worker-agent of `worker_id` serving `model`, user `worker-<worker_id>`.
    ///
    /// Panics when `worker_id` is not a worker id ([`names::is_worker_id`]): such an
    /// identity could publish results readers take for the leader's.
    pub fn worker(worker_id: &str, model: &str, password: &str) -> Identity {
        assert!(
            names::is_worker_id(worker_id),
            "{worker_id:?} cannot be a worker id"
        );
        Identity {
            user: format!("worker-{worker_id}"),
            password: password.into(),
            role: Role::WorkerAgent,
            worker_id: Some(worker_id.into()),
            model: Some(model.into()),
            tenant: None,
        }
    }

    fn fill(&self, template: &str, prefix: &str) -> String {
        template
            .replace("{user}", &self.user)
            .replace("{worker_id}", self.worker_id.as_deref().unwrap_or(""))
            .replace("{tenant}", tenant_token(self.tenant.as_deref()))
            .replace("{prefix}", prefix)
            .replace(
                "{model}",
                &redis_glob_escape(self.model.as_deref().unwrap_or("")),
            )
    }
}

/// NATS user of the direct-NATS client of `tenant`: `client-<tenant token>`.
pub fn client_user(tenant: Option<&str>) -> String {
    format!("client-{}", tenant_token(tenant))
}

/// `s` matched literally by a Redis key pattern (model names may hold `*`, `?`, `[`).
pub fn redis_glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn quoted_list(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|s| format!("{s:?}")).collect();
    format!("[{}]", quoted.join(", "))
}

/// The nats-server `authorization` block granting each identity its role's rules.
/// Passwords are written as given (generate them from `[A-Za-z0-9]`).
pub fn nats_authorization(identities: &[Identity]) -> String {
    let mut out = String::from("authorization {\n  users = [\n");
    for id in identities {
        let r = rules(id.role);
        let fill = |v: &[String]| v.iter().map(|t| id.fill(t, "")).collect::<Vec<_>>();
        out.push_str(&format!(
            "    {{user: {:?}, password: {:?}, permissions: {{publish: {{allow: {}}}, subscribe: {{allow: {}}}{}}}}}\n",
            id.user,
            id.password,
            quoted_list(&fill(&r.publish)),
            quoted_list(&fill(&r.subscribe)),
            if r.allow_responses { ", allow_responses: true" } else { "" },
        ));
    }
    out.push_str("  ]\n}\n");
    out
}

/// Redis ACL `user` lines (for `redis.conf` or an ACL file) for the identities whose role
/// uses Redis, after one that switches the passwordless `default` user off.
pub fn redis_acl(identities: &[Identity], prefix: &str) -> String {
    let mut out = String::from("user default off\n");
    for id in identities {
        if let Some(rules) = rules(id.role).redis {
            out.push_str(&format!(
                "user {} on >{} {}\n",
                id.user,
                id.password,
                id.fill(&rules, prefix)
            ));
        }
    }
    out
}

/// Every role's rules as data (JSON), for provisioning to render.
pub fn rules_json() -> serde_json::Value {
    let roles: serde_json::Map<String, serde_json::Value> = Role::ALL
        .iter()
        .map(|r| {
            (
                r.name().to_string(),
                serde_json::to_value(rules(*r)).expect("rules serialise"),
            )
        })
        .collect();
    serde_json::json!({
        "comment": "Generated from protocol/src/permissions.rs (METRONOME_UPDATE_PERMISSIONS=1 cargo test -p metronome-protocol permissions); do not edit.",
        "roles": roles,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_rules_name_only_its_own_id() {
        let id = Identity::worker("n1-gpu0", "llama-3.1-8b", "pw");
        let publish: Vec<String> = rules(Role::WorkerAgent)
            .publish
            .iter()
            .map(|t| id.fill(t, "m"))
            .collect();
        assert!(publish.contains(&"$KV.workers.n1-gpu0".to_string()));
        assert!(publish
            .contains(&"$JS.API.CONSUMER.CREATE.WORK.worker-n1-gpu0.work.n1-gpu0".to_string()));
        assert!(!publish.iter().any(|s| s.starts_with("decisions")
            || s.starts_with("work.")
            || s.contains("$KV.leader.>")));
        let results: Vec<&String> = publish
            .iter()
            .filter(|s| s.starts_with("results."))
            .collect();
        assert_eq!(
            results,
            ["results.*.*.n1-gpu0.chunk", "results.*.*.n1-gpu0.final"],
            "results under its own id only"
        );
        // Of the lease, it may only open the bucket and read the one key (to check a new
        // epoch).
        let leader: Vec<&String> = publish.iter().filter(|s| s.contains("leader")).collect();
        assert_eq!(
            leader,
            [
                "$JS.API.STREAM.INFO.KV_leader",
                "$JS.API.DIRECT.GET.KV_leader.$KV.leader.dispatcher"
            ],
            "{leader:?}"
        );
        // No stream info where the subjects name tenants' jobs.
        let infos: Vec<&String> = publish
            .iter()
            .filter(|s| s.contains("STREAM.INFO"))
            .collect();
        assert_eq!(
            infos,
            [
                "$JS.API.STREAM.INFO.WORK",
                "$JS.API.STREAM.INFO.EVENTS",
                "$JS.API.STREAM.INFO.CACHE_DELTAS",
                "$JS.API.STREAM.INFO.CACHE_SNAPSHOTS",
                "$JS.API.STREAM.INFO.KV_workers",
                "$JS.API.STREAM.INFO.KV_leader"
            ]
        );
        let cache: Vec<&String> = publish
            .iter()
            .filter(|s| s.starts_with("kvcache."))
            .collect();
        assert_eq!(
            cache,
            ["kvcache.n1-gpu0.delta", "kvcache.n1-gpu0.snapshot"],
            "its own cache state only"
        );
        let acl = redis_acl(&[id], "m");
        assert!(
            acl.contains("~m:ewma:n1-gpu0 ~m:perf:n1-gpu0 ~m:outlen:llama-3.1-8b:n1-gpu0 "),
            "{acl}"
        );
    }

    #[test]
    fn a_client_names_only_its_own_tenant() {
        let fill = |id: &Identity, v: &[String]| -> Vec<String> {
            v.iter().map(|t| id.fill(t, "m")).collect()
        };
        let r = rules(Role::Client);
        let acme = Identity::client(Some("acme"), "pw");
        assert_eq!(acme.user, "client-acme");
        let publish = fill(&acme, &r.publish);
        let subscribe = fill(&acme, &r.subscribe);
        assert!(publish.contains(&"jobs.submit.acme".to_string()));
        assert!(subscribe.contains(&"results.acme.>".to_string()));
        assert!(subscribe.contains(&"decisions.acme.>".to_string()));
        assert!(publish.contains(&"$JS.API.DIRECT.GET.RESULTS.results.acme.>".to_string()));
        assert!(publish.contains(&"cancel.acme.*".to_string()));
        for s in publish.iter().chain(&subscribe) {
            assert!(
                !s.contains('*') || s == "cancel.acme.*",
                "{s}: a wildcard would reach other tenants"
            );
            assert!(!s.contains("MSG.GET"), "{s}: body-addressed reads");
        }
        let anon = Identity::client(None, "pw");
        assert_eq!(anon.user, "client-_anon");
        assert!(fill(&anon, &r.subscribe).contains(&"results._anon.>".to_string()));
    }

    #[test]
    fn model_names_are_literal_in_key_patterns() {
        assert_eq!(redis_glob_escape("org/m*[x]?"), "org/m\\*\\[x\\]\\?");
    }

    #[test]
    fn only_redis_roles_get_redis_users() {
        let acl = redis_acl(
            &[
                Identity::new("client", "c", Role::Client),
                Identity::new("dispatcher-a", "b", Role::Dispatcher),
            ],
            "metronome",
        );
        assert_eq!(acl.lines().count(), 2, "{acl}");
        assert!(acl.starts_with("user default off\n"));
        assert!(acl.contains("user dispatcher-a on >b resetkeys %R~metronome:*"));
    }

    #[test]
    fn the_gateway_reads_ewmas_and_queues_and_writes_neither() {
        let acl = redis_acl(&[Identity::new("gateway", "a", Role::Gateway)], "m");
        assert!(
            acl.contains("user gateway on >a resetkeys %R~m:ewma:* resetchannels -@all +@connection +hgetall"),
            "{acl}"
        );
        let publish = rules(Role::Gateway).publish;
        assert!(publish.contains(&"$JS.API.DIRECT.GET.KV_queues.>".to_string()));
        assert!(!publish.iter().any(|s| s.starts_with("$KV.")));
        assert!(rules(Role::Dispatcher)
            .publish
            .contains(&"$KV.queues.>".to_string()));
    }

    /// The committed data file provisioning renders from is the rules above.
    #[test]
    fn committed_rules_file_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ansible/roles/metronome/files/permissions.json");
        let expected = format!(
            "{}\n",
            serde_json::to_string_pretty(&rules_json()).expect("json")
        );
        if std::env::var_os("METRONOME_UPDATE_PERMISSIONS").is_some() {
            std::fs::write(&path, &expected).expect("write permissions.json");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == expected,
            "{} is stale: run METRONOME_UPDATE_PERMISSIONS=1 cargo test -p metronome-protocol permissions",
            path.display()
        );
    }
}
