//! The compromised-worker drill: one worker's NATS and Redis credentials, as the drill's
//! system provisions them (`<state>/auth/worker-<id>.password`, the agent's config), in
//! the hands of an attacker while the normal load runs. Each attack below is made against
//! the running system and must fail, visibly:
//!
//! - (a) list other tenants' job ids: `$JS.API.STREAM.INFO` of DECISIONS, JOBS and RESULTS
//!   with a `subjects_filter` — refused by the server (a permissions violation, no answer);
//! - (b) a forged refusal (with a copy of the job) and a forged `done` with a huge
//!   `output_tokens` on `events.done.<own id>`, about a job another worker runs — the leader
//!   drops both and counts them (`worker_claims_dropped`, `unvouched_refusal_jobs`); the
//!   victim ends once, with the result of the worker its decision names, and no attempt 2;
//! - (c) heartbeats claiming another model, `max_concurrency` 100,000 and near-zero step
//!   times, then its own model with that cap — never eligible: jobs of the other model are
//!   never assigned to it (they wait and expire), its own model's decisions list it rejected
//!   `not_provisioned`, and the heartbeats are counted (`unprovisioned_heartbeats`);
//! - (d) every forged heartbeat carries `max_epoch` = 2^64-1 while the leader is SIGKILLed:
//!   the next leader's epoch is the lease's, a few revisions above the last;
//! - (e) Redis: `EVAL` of its own Lua and a write of the model's shared output-length key
//!   `<prefix>:outlen:<model>` — both refused (`NOPERM`);
//! - (f) a push consumer under its own consumer name delivering on `jobs.submit.demo` (which
//!   nats-server does not check against its publish permissions) — deleted by the leader's
//!   sweep within [`SWEEP_WITHIN`].
//!
//! To make (c) to (f) crisp, the attacker first does what a compromised model server next to
//! the agent can: its agent is drained (by the operator's request, as for maintenance) and
//! SIGSTOPped once idle, so the attacker's heartbeats are the only ones under its id and no
//! job of the load runs there. For (f) the stopped agent's own (pull) consumer is deleted
//! with the operator's identity first: while it exists nats-server refuses any other
//! consumer under the name, so this stands for a worker whose agent has not created it yet.
//! At the end the agent is restarted (it creates its consumer again and registers).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use metronome_protocol::names::{
    self, event_done_subject, submit_subject, work_consumer, work_subject, BUCKET_WORKERS,
    HEADER_MSG_ID, STREAM_WORK,
};
use metronome_protocol::{
    CompletionEvent, CompletionOutcome, Decision, Endpoint, Job, Outcome, PerfCoefficients,
    RejectionCode, WorkerStatus, PROTOCOL_VERSION,
};
use metronome_runtime::nats::NatsAuth;
use serde_json::json;

use metronome_loadgen::process::{signal, Image};
use metronome_loadgen::system::System;

use crate::{metric_sum, scrape_all, DrillPlan, Target};

/// The model the drill's system serves.
const MODEL: &str = "llama-3.1-8b";
/// A model no worker of the drill's system is provisioned for, which the attacker claims.
const OTHER_MODEL: &str = "qwen2.5-7b";
/// The tenant whose jobs the attacker goes after.
const VICTIM_TENANT: &str = "demo";
/// How long the leader's sweep may take to delete a push consumer (it sweeps every second).
pub const SWEEP_WITHIN: Duration = Duration::from_secs(5);
/// How often the attacker stores a forged heartbeat.
const FORGE_EVERY: Duration = Duration::from_millis(100);
/// Time for the leader to read a stored heartbeat before decisions count against it.
const SEEN_AFTER: Duration = Duration::from_millis(500);

/// The attacker: one worker identity's connections.
struct Attacker {
    worker_id: String,
    client: async_nats::Client,
    js: jetstream::Context,
    /// Server errors on the attacker's connection (permission violations).
    errors: Arc<Mutex<Vec<String>>>,
    redis_url: String,
    redis_prefix: String,
}

impl Attacker {
    /// Connect as GPU `gpu`'s worker identity, with the password file and Redis URL `./dev
    /// up` wrote for its agent.
    async fn connect(state_dir: &Path, nats_url: &str, gpu: usize) -> anyhow::Result<Attacker> {
        let worker_id = format!("local-gpu{gpu}");
        let user = format!("worker-{worker_id}");
        let password = std::fs::read_to_string(state_dir.join(format!("auth/{user}.password")))
            .with_context(|| format!("{user}'s password file"))?;
        let config =
            std::fs::read_to_string(state_dir.join(format!("config/worker-gpu{gpu}.toml")))
                .context("the agent's config")?;
        let value = |key: &str| {
            config.lines().find_map(|l| {
                l.strip_prefix(key)
                    .and_then(|r| r.trim_start().strip_prefix('='))
                    .map(|v| v.trim().trim_matches('"').to_string())
            })
        };
        let redis_url = value("redis_url").context("redis_url in the agent's config")?;
        let redis_prefix = value("redis_prefix")
            .unwrap_or_else(|| metronome_protocol::redis_keys::DEFAULT_PREFIX.to_string());
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        let auth = NatsAuth {
            user: Some(user),
            password: Some(password.trim().to_string()),
            ..NatsAuth::default()
        };
        let client = auth
            .connect_options()?
            .event_callback(move |event| {
                let sink = sink.clone();
                async move {
                    if let async_nats::Event::ServerError(async_nats::ServerError::Other(e)) = event
                    {
                        sink.lock().unwrap().push(e);
                    }
                }
            })
            .connect(metronome_runtime::nats::server_urls(nats_url))
            .await?;
        Ok(Attacker {
            worker_id,
            js: jetstream::new(client.clone()),
            client,
            errors,
            redis_url,
            redis_prefix,
        })
    }

    fn refused(&self, subject: &str) -> bool {
        let needle = format!("\"{subject}\"");
        self.errors
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.contains("Permissions Violation") && e.contains(&needle))
    }

    /// (a) Ask for each stream's subjects (at once: a refused request is never answered);
    /// returns the streams that answered.
    async fn list_jobs(&self) -> Vec<String> {
        let asks = [
            names::STREAM_DECISIONS,
            names::STREAM_JOBS,
            names::STREAM_RESULTS,
        ]
        .map(|stream| async move {
            let subject = format!("$JS.API.STREAM.INFO.{stream}");
            let body = json!({"subjects_filter": ">"}).to_string();
            let reply = tokio::time::timeout(
                Duration::from_secs(1),
                self.client.request(subject, body.into()),
            )
            .await;
            let listed = matches!(&reply, Ok(Ok(m)) if serde_json::from_slice::<serde_json::Value>(&m.payload)
                .is_ok_and(|v| v.get("state").is_some()));
            listed.then(|| stream.to_string())
        });
        futures::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// (e) What Redis answered to `EVAL` and to a write of the model's shared key: `Ok`
    /// when it ran.
    async fn redis_attacks(&self) -> anyhow::Result<Vec<(String, Result<(), String>)>> {
        let client = redis::Client::open(self.redis_url.as_str())?;
        let mut con = client.get_multiplexed_async_connection().await?;
        let mut out = Vec::new();
        let eval = redis::cmd("EVAL")
            .arg("return 1")
            .arg(0)
            .query_async::<redis::Value>(&mut con)
            .await;
        out.push((
            "EVAL".to_string(),
            eval.map(|_| ()).map_err(|e| e.to_string()),
        ));
        let shared = format!("{}:outlen:{MODEL}", self.redis_prefix);
        let set = redis::cmd("SET")
            .arg(&shared)
            .arg(1)
            .query_async::<redis::Value>(&mut con)
            .await;
        out.push((
            format!("SET {shared}"),
            set.map(|_| ()).map_err(|e| e.to_string()),
        ));
        Ok(out)
    }

    /// (b) A refusal carrying `job` and a `done` with a huge output, both about `job`'s
    /// attempt `attempt` at `epoch`, on the attacker's own events subject.
    async fn forge_events(&self, job: &Job, attempt: u32, epoch: u64) -> anyhow::Result<()> {
        let now = metronome_protocol::time::unix_ms();
        let event = |outcome, output_tokens, copy: Option<Box<Job>>| CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: job.id.clone(),
            worker_id: self.worker_id.clone(),
            model: job.model.clone(),
            epoch,
            attempt,
            outcome,
            streamed: false,
            error: None,
            prompt_tokens: job.prompt_tokens,
            output_tokens,
            ttft_ms: Some(1.0),
            tpot_ms: Some(0.01),
            e2e_ms: 1.0,
            finished_ms: now,
            job: copy,
        };
        let subject = event_done_subject(&self.worker_id);
        for e in [
            event(CompletionOutcome::Refused, 0, Some(Box::new(job.clone()))),
            event(CompletionOutcome::Done, u32::MAX / 2, None),
        ] {
            self.js
                .publish(subject.clone(), serde_json::to_vec(&e)?.into())
                .await?
                .await?;
        }
        Ok(())
    }

    /// (f) A push consumer under its own consumer name, delivering on another tenant's
    /// submit subject.
    async fn push_consumer(&self) -> Result<(), String> {
        let stream = self
            .js
            .get_stream(STREAM_WORK)
            .await
            .map_err(|e| e.to_string())?;
        stream
            .create_consumer(consumer::push::Config {
                durable_name: Some(work_consumer(&self.worker_id)),
                filter_subject: work_subject(&self.worker_id),
                deliver_subject: submit_subject(Some(VICTIM_TENANT)),
                ..Default::default()
            })
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// A forged heartbeat: the worker's last real one, claiming `model`, a cap of 100,000,
/// near-zero step times, not draining, and the highest epoch there is.
fn forged(real: &WorkerStatus, model: &str, seq: u64) -> WorkerStatus {
    let mut s = real.clone();
    s.model = model.to_string();
    s.max_concurrency = 100_000;
    s.draining = false;
    s.healthy = true;
    s.active = 0;
    s.queued = 0;
    s.perf = Some(PerfCoefficients {
        step_base_ms: 0.001,
        step_per_stream_ms: 0.0,
        step_per_ktok_ms: 0.0,
        stall_per_prefill_token_ms: 0.0,
        ttft_base_ms: 0.001,
        prefill_per_token_ms: 0.0,
        ttft_per_stream_ms: 0.0,
        step_error_ms: 0.0,
        samples: 100_000,
    });
    s.max_epoch = u64::MAX;
    s.seq = seq;
    s.sent_ms = metronome_protocol::time::unix_ms();
    s
}

/// Forge heartbeats under the attacker's id every [`FORGE_EVERY`] until `stop`; the model
/// claimed is read from `model` at each one.
fn spawn_forger(
    attacker: &Attacker,
    real: WorkerStatus,
    model: Arc<Mutex<String>>,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<anyhow::Result<usize>> {
    let js = attacker.js.clone();
    let id = attacker.worker_id.clone();
    tokio::spawn(async move {
        let bucket = js.get_key_value(BUCKET_WORKERS).await?;
        let mut seq = real.seq + 1;
        let mut stored = 0;
        while !stop.is_cancelled() {
            let status = forged(&real, &model.lock().unwrap().clone(), seq);
            seq += 1;
            if bucket
                .put(id.as_str(), serde_json::to_vec(&status)?.into())
                .await
                .is_ok()
            {
                stored += 1;
            }
            tokio::select! {
                _ = tokio::time::sleep(FORGE_EVERY) => {}
                _ = stop.cancelled() => {}
            }
        }
        Ok(stored)
    })
}

/// A job of the victim tenant.
fn victim_job(id: &str, model: &str, max_tokens: u32, deadline_ms: u64) -> Job {
    Job {
        v: PROTOCOL_VERSION,
        id: id.to_string(),
        model: model.into(),
        endpoint: Endpoint::Chat,
        request: json!({"model": model, "stream": true,
            "messages": [{"role": "user", "content": "a tenant's private prompt"}],
            "max_tokens": max_tokens}),
        prompt_tokens: 8,
        max_tokens,
        submitted_ms: metronome_protocol::time::unix_ms(),
        deadline_ms: Some(deadline_ms),
        slo: None,
        tenant: Some(VICTIM_TENANT.into()),
        priority: Default::default(),
        prefix: None,
        traceparent: None,
    }
}

async fn submit(js: &jetstream::Context, job: &Job) -> anyhow::Result<()> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(HEADER_MSG_ID, job.id.as_str());
    js.publish_with_headers(
        submit_subject(job.tenant.as_deref()),
        headers,
        serde_json::to_vec(job)?.into(),
    )
    .await?
    .await?;
    Ok(())
}

/// Every decision on `decisions.>`, with when it arrived.
type Decisions = Arc<Mutex<Vec<(Instant, Decision)>>>;

async fn watch_decisions(
    client: &async_nats::Client,
) -> anyhow::Result<(Decisions, tokio::task::JoinHandle<()>)> {
    let mut sub = client.subscribe("decisions.>").await?;
    client.flush().await?;
    let seen: Decisions = Arc::default();
    let sink = seen.clone();
    let task = tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Ok(d) = serde_json::from_slice::<Decision>(&m.payload) {
                sink.lock().unwrap().push((Instant::now(), d));
            }
        }
    });
    Ok((seen, task))
}

/// Waits until `check` finds something in the decisions seen, up to `within`.
async fn wait_decision<T>(
    seen: &Decisions,
    within: Duration,
    check: impl Fn(&[(Instant, Decision)]) -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(t) = check(&seen.lock().unwrap()) {
            return Some(t);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The highest epoch any dispatcher reports, and the sum of `counter` over them.
async fn dispatchers(system: &System, counters: &[&str]) -> (f64, BTreeMap<String, f64>) {
    let texts = scrape_all(&system.dispatcher_metrics).await;
    let epoch = texts
        .iter()
        .map(|t| metronome_protocol::prometheus::sum(t, "metronome_dispatcher_epoch"))
        .fold(0.0, f64::max);
    let sums = counters
        .iter()
        .map(|c| (c.to_string(), metric_sum(&texts, c)))
        .collect();
    (epoch, sums)
}

const CLAIMS_DROPPED: &str = "metronome_dispatcher_worker_claims_dropped_total";
const COPIES_DROPPED: &str = "metronome_dispatcher_unvouched_refusal_jobs_total";
const UNPROVISIONED: &str = "metronome_dispatcher_unprovisioned_heartbeats_total";
const EPOCH_CLAIMS: &str = "metronome_dispatcher_epoch_claims_above_record_total";

/// The drill's fault: every attack, then its checks. Returns what was done; what was seen
/// goes to `notes`, failed checks to `target.failures`.
pub(crate) async fn attack(
    plan: &DrillPlan,
    system: &System,
    admin: &async_nats::Client,
    js: &jetstream::Context,
    target: &Target<'_>,
    restarted: &mut Vec<u32>,
    notes: &mut Vec<String>,
) -> anyhow::Result<String> {
    let gpu = target.gpu;
    let fail = |s: String| target.failures.lock().unwrap().push(s);
    let env = metronome_loadgen::process::read_env(&system.state_dir.join("env"))?;
    let nats_url = env.get("NATS_URL").context("NATS_URL")?;
    let attacker = Attacker::connect(&system.state_dir, nats_url, gpu).await?;
    let me = attacker.worker_id.clone();
    let (decisions, watcher) = watch_decisions(admin).await?;
    let prefix = format!("{}-victim", target.victims);

    // (a) Other tenants' job ids through stream info.
    let answered = attacker.list_jobs().await;
    if !answered.is_empty() {
        fail(format!(
            "(a) the server listed the subjects of {answered:?} to {me}"
        ));
    }
    for stream in [
        names::STREAM_DECISIONS,
        names::STREAM_JOBS,
        names::STREAM_RESULTS,
    ] {
        if !attacker.refused(&format!("$JS.API.STREAM.INFO.{stream}")) {
            fail(format!(
                "(a) no permissions violation for {me}'s STREAM.INFO.{stream}"
            ));
        }
    }
    notes.push(format!(
        "(a) {me} asked STREAM.INFO of DECISIONS, JOBS and RESULTS with subjects_filter: {} answered, {} permissions violations",
        answered.len(),
        attacker.errors.lock().unwrap().len()
    ));

    // (e) Redis: Lua of its own, the model's shared output length.
    for (what, outcome) in attacker.redis_attacks().await? {
        match outcome {
            Ok(()) => fail(format!("(e) Redis ran {me}'s {what}")),
            Err(e) if e.to_ascii_uppercase().contains("NOPERM") => {
                notes.push(format!("(e) Redis refused {me}'s {what}: NOPERM"))
            }
            Err(e) => fail(format!("(e) {me}'s {what} failed other than NOPERM: {e}")),
        }
    }

    // (b) Forged refusal and done for a job another worker runs.
    let (_, before) = dispatchers(system, &[CLAIMS_DROPPED, COPIES_DROPPED]).await;
    let now = metronome_protocol::time::unix_ms();
    let mut victims = Vec::new();
    for i in 0..3 {
        let job = victim_job(&format!("{prefix}-{i}"), MODEL, 64, now + 60_000);
        submit(js, &job).await?;
        victims.push(job);
    }
    target
        .extra_ids
        .lock()
        .unwrap()
        .extend(victims.iter().map(|j| j.id.clone()));
    let assigned = wait_decision(&decisions, Duration::from_secs(10), |seen| {
        seen.iter().find_map(|(_, d)| {
            let ours = victims.iter().any(|v| v.id == d.job_id);
            let elsewhere = d.worker_id.as_deref().is_some_and(|w| w != me);
            (ours && d.outcome == Outcome::Assigned && elsewhere).then(|| d.clone())
        })
    })
    .await
    .context("(b) none of the victim jobs was assigned to another worker within 10 s")?;
    let victim = victims
        .iter()
        .find(|v| v.id == assigned.job_id)
        .context("the victim")?;
    let holder = assigned.worker_id.clone().unwrap_or_default();
    attacker
        .forge_events(victim, assigned.attempt, assigned.epoch)
        .await?;
    let (_, after) = wait_counters(
        system,
        &before,
        &[(CLAIMS_DROPPED, 2.0), (COPIES_DROPPED, 1.0)],
    )
    .await;
    for (name, want) in [(CLAIMS_DROPPED, 2.0), (COPIES_DROPPED, 1.0)] {
        let delta = after[name] - before[name];
        if delta < want {
            fail(format!("(b) {name} rose by {delta}, {want} forged"));
        }
    }
    notes.push(format!(
        "(b) {me} forged a refusal (with the job's copy) and a done with output_tokens {} for {} (attempt {}, running on {holder}): worker_claims_dropped +{}, unvouched_refusal_jobs +{}",
        u32::MAX / 2,
        victim.id,
        assigned.attempt,
        after[CLAIMS_DROPPED] - before[CLAIMS_DROPPED],
        after[COPIES_DROPPED] - before[COPIES_DROPPED],
    ));

    // The attacker's agent: drained, then stopped once idle.
    let agent = format!("worker-gpu{gpu}");
    let agent_pid = system.pid_of(&agent).context("agent pid")?;
    let agent_image = Image::read(agent_pid)?;
    let reply = admin
        .request(names::control_subject(&me, names::CONTROL_DRAIN), "".into())
        .await
        .context("draining the attacker's agent")?;
    tracing::info!(reply = ?String::from_utf8_lossy(&reply.payload), "drained");
    let workers = js.get_key_value(BUCKET_WORKERS).await?;
    let deadline = Instant::now() + plan.settle;
    let real = loop {
        let status = match workers.get(me.as_str()).await? {
            Some(v) => serde_json::from_slice::<WorkerStatus>(&v).ok(),
            None => None,
        };
        if let Some(s) = status.filter(|s| s.draining && s.active == 0 && s.in_flight.is_empty()) {
            break s;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{me} did not become idle after its drain"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    signal(agent_pid, "STOP")?;

    // (c) Another model, then its own with a cap above its ceiling; (d) the highest epoch,
    // across a leader's SIGKILL.
    let (epoch_before, before) = dispatchers(system, &[UNPROVISIONED]).await;
    let claimed = Arc::new(Mutex::new(OTHER_MODEL.to_string()));
    let stop = tokio_util::sync::CancellationToken::new();
    let forger = spawn_forger(&attacker, real, claimed.clone(), stop.clone());
    // The leader has read a forged heartbeat once it counted one.
    wait_counters(system, &before, &[(UNPROVISIONED, 1.0)]).await;
    let other_from = Instant::now();
    let now = metronome_protocol::time::unix_ms();
    let mut others = Vec::new();
    for i in 0..2 {
        let job = victim_job(&format!("{prefix}-other-{i}"), OTHER_MODEL, 16, now + 1_500);
        submit(js, &job).await?;
        others.push(job.id);
    }
    let other_decisions = wait_decision(&decisions, Duration::from_secs(10), |seen| {
        let got: Vec<Decision> = seen
            .iter()
            .filter(|(_, d)| others.contains(&d.job_id))
            .map(|(_, d)| d.clone())
            .collect();
        (got.len() >= others.len()).then_some(got)
    })
    .await
    .unwrap_or_default();
    let outcomes: Vec<String> = other_decisions
        .iter()
        .map(|d| {
            format!(
                "{:?} {}",
                d.outcome,
                d.worker_id
                    .as_deref()
                    .or(d.reason_code.as_deref())
                    .unwrap_or("")
            )
        })
        .collect();
    if other_decisions.len() < others.len() {
        fail(format!(
            "(c) {} of the {} {OTHER_MODEL} jobs were decided within 10 s",
            other_decisions.len(),
            others.len()
        ));
    }
    if other_decisions
        .iter()
        .any(|d| d.outcome == Outcome::Assigned)
    {
        fail(format!(
            "(c) a {OTHER_MODEL} job was assigned on {me}'s claim: {outcomes:?}"
        ));
    }
    if !other_decisions
        .iter()
        .any(|d| d.reason_code.as_deref() != Some("unknown_model"))
    {
        // Rejected at once as a model nobody serves: the claim was not seen.
        fail(format!(
            "(c) no {OTHER_MODEL} job waited for {me} (the claim was not seen): {outcomes:?}"
        ));
    }
    notes.push(format!(
        "(c) {me} heartbeated as {OTHER_MODEL}, max_concurrency 100000, a 0.001 ms step, max_epoch 2^64-1: its {OTHER_MODEL} jobs {outcomes:?}"
    ));

    *claimed.lock().unwrap() = MODEL.to_string();
    tokio::time::sleep(SEEN_AFTER).await;
    let own_from = Instant::now();
    let leader = system.leader_name().await?;
    let leader_pid = system.pid_of(&leader).context("leader pid")?;
    let leader_image = Image::read(leader_pid)?;
    let listed = wait_decision(&decisions, Duration::from_secs(10), |seen| {
        seen.iter()
            .filter(|(at, _)| *at >= own_from)
            .find(|(_, d)| {
                d.rejected
                    .iter()
                    .any(|r| r.worker_id == me && r.code == RejectionCode::NotProvisioned)
            })
            .map(|(_, d)| d.job_id.clone())
    })
    .await;
    let (_, counted) = dispatchers(system, &[UNPROVISIONED]).await;
    signal(leader_pid, "KILL")?;
    let killed_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    restarted.push(leader_image.spawn(&system.state_dir, &leader)?);
    // The next term: a dispatcher leads again and decides.
    let next = wait_decision(&decisions, plan.settle, |seen| {
        seen.iter()
            .filter(|(at, d)| *at > killed_at && d.epoch as f64 > epoch_before)
            .map(|(_, d)| d.epoch)
            .next()
    })
    .await;
    tokio::time::sleep(SEEN_AFTER).await;
    let (epoch_after, after) = dispatchers(system, &[EPOCH_CLAIMS]).await;
    stop.cancel();
    let forging_ended = Instant::now();
    let forged_count = forger.await??;
    match listed {
        Some(job) => notes.push(format!(
            "(c) then as {MODEL} with max_concurrency 100000: decisions list it rejected not_provisioned (first: {job})"
        )),
        None => fail(format!(
            "(c) no decision listed {me} rejected not_provisioned while it claimed max_concurrency 100000"
        )),
    }
    let unprovisioned = counted[UNPROVISIONED] - before[UNPROVISIONED];
    if unprovisioned < 1.0 {
        fail(format!(
            "(c) {UNPROVISIONED} did not rise ({unprovisioned})"
        ));
    }
    let to_me: Vec<String> = decisions
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, d)| {
            *at >= other_from && *at < forging_ended && d.worker_id.as_deref() == Some(me.as_str())
        })
        .map(|(_, d)| d.job_id.clone())
        .collect();
    if !to_me.is_empty() {
        fail(format!(
            "(c) {} jobs were assigned to {me} on its forged heartbeats: {:?}",
            to_me.len(),
            &to_me[..to_me.len().min(5)]
        ));
    }
    let high_epochs = decisions
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, d)| d.epoch > 1 << 53)
        .count();
    match next {
        Some(epoch) if (epoch as f64) < epoch_before + 1_000.0 && epoch_after < 9.0e15 && high_epochs == 0 => {
            notes.push(format!(
                "(d) leader {leader} SIGKILLed while every heartbeat of {me} claimed max_epoch 2^64-1: epoch {epoch_before} before, {epoch} in the next term's decisions; epoch_claims_above_record +{} ({forged_count} forged heartbeats stored)",
                after[EPOCH_CLAIMS]
            ));
        }
        Some(epoch) => fail(format!(
            "(d) the epoch moved from {epoch_before} to {epoch} (metric {epoch_after}, {high_epochs} decisions above 2^53) after {me} claimed max_epoch 2^64-1"
        )),
        None => fail(format!(
            "(d) no decision of a new term within {} s of the leader's SIGKILL",
            plan.settle.as_secs()
        )),
    }

    // (f) A push consumer delivering beyond an inbox. First the worker falls silent and the
    // leader declares it dead and purges its WORK subject, so the consumer has none of the
    // load's assignments to deliver (an assignment made as it drained could wait there).
    let stream = js.get_stream(STREAM_WORK).await?;
    let deadline = Instant::now() + plan.settle;
    loop {
        let alive = workers.get(me.as_str()).await?.is_some();
        let pending = stream
            .get_last_raw_message_by_subject(&work_subject(&me))
            .await
            .is_ok();
        if !alive && !pending {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{me} was not declared dead with its WORK subject purged (listed {alive}, work pending {pending})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stream.delete_consumer(&work_consumer(&me)).await?;
    match attacker.push_consumer().await {
        Err(e) => fail(format!(
            "(f) the server refused {me}'s push consumer, so the sweep was not exercised: {e}"
        )),
        Ok(()) => {
            let created = Instant::now();
            let mut gone = None;
            while created.elapsed() < SWEEP_WITHIN {
                if stream.consumer_info(work_consumer(&me)).await.is_err() {
                    gone = Some(created.elapsed());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            match gone {
                Some(t) => notes.push(format!(
                    "(f) {me}'s push consumer delivering on {} was deleted {} ms after it was created",
                    submit_subject(Some(VICTIM_TENANT)),
                    t.as_millis()
                )),
                None => fail(format!(
                    "(f) {me}'s push consumer delivering on {} still existed {} s after it was created",
                    submit_subject(Some(VICTIM_TENANT)),
                    SWEEP_WITHIN.as_secs()
                )),
            }
        }
    }

    // The agent comes back: a new process creates its consumer and registers.
    signal(agent_pid, "KILL")?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    restarted.push(agent_image.spawn(&system.state_dir, &agent)?);

    // The victim: one final, from the worker its decision names, and no second attempt.
    let finals = wait_victim(js, &victim.id, plan.settle).await?;
    let attempts: Vec<u32> = decisions
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, d)| d.job_id == victim.id)
        .map(|(_, d)| d.attempt)
        .collect();
    if attempts.iter().any(|a| *a > 1) {
        fail(format!(
            "(b) the victim {} was decided again: attempts {attempts:?}",
            victim.id
        ));
    }
    match finals.as_slice() {
        [f] if f.error.is_none() && f.worker_id.as_deref() == Some(holder.as_str()) => {}
        other => fail(format!(
            "(b) the victim {} did not end once with {holder}'s result: {:?}",
            victim.id,
            other
                .iter()
                .map(|f| (f.worker_id.clone(), f.error.as_ref().map(|e| e.code)))
                .collect::<Vec<_>>()
        )),
    }
    watcher.abort();
    Ok(format!(
        "with nothing but {me}'s credentials, under load: (a) list job ids via stream info, (e) EVAL and the shared outlen key in Redis, (b) a forged refusal and done for {}'s job on {holder}, {me}'s agent drained and SIGSTOPped, (c) heartbeats as {OTHER_MODEL} and as {MODEL} with max_concurrency 100000 and a 0.001 ms step, (d) max_epoch 2^64-1 across the leader's SIGKILL, (f) a push consumer delivering on {}; then {me}'s agent restarted",
        VICTIM_TENANT,
        submit_subject(Some(VICTIM_TENANT))
    ))
}

/// Waits until every counter rose by at least its want (or the deadline), and returns the
/// last reading.
async fn wait_counters(
    system: &System,
    before: &BTreeMap<String, f64>,
    wants: &[(&str, f64)],
) -> (f64, BTreeMap<String, f64>) {
    let names: Vec<&str> = wants.iter().map(|(n, _)| *n).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (epoch, now) = dispatchers(system, &names).await;
        let done = wants.iter().all(|(n, w)| now[*n] - before[*n] >= *w);
        if done || Instant::now() > deadline {
            return (epoch, now);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The final results stored for `job_id` (leader's and workers'), once at least one is.
async fn wait_victim(
    js: &jetstream::Context,
    job_id: &str,
    within: Duration,
) -> anyhow::Result<Vec<metronome_protocol::FinalResult>> {
    let stream = js.get_stream(names::STREAM_RESULTS).await?;
    let deadline = Instant::now() + within;
    loop {
        let mut out = Vec::new();
        let subject = names::result_final_subject_any_tenant(job_id);
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject: subject,
                ..Default::default()
            })
            .await?;
        let pending = consumer.cached_info().num_pending;
        if pending > 0 {
            let mut messages = consumer.messages().await?;
            while out.len() < pending as usize {
                match tokio::time::timeout(Duration::from_secs(5), messages.next()).await {
                    Ok(Some(Ok(m))) => {
                        if let Ok(f) = serde_json::from_slice(&m.payload) {
                            out.push(f);
                        }
                    }
                    _ => break,
                }
            }
            return Ok(out);
        }
        anyhow::ensure!(Instant::now() < deadline, "no final result for {job_id}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
