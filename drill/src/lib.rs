//! Fault drills: a real system (`./dev up --keep-going`, simulated GPUs, real NATS and
//! Redis) under a steady stream of jobs, one fault per drill, and an account of every job
//! by its id.
//!
//! Jobs are submitted on `jobs.submit._anon` (the NATS contract, no tenant, `Nats-Msg-Id` = job id); in the
//! rolling deploy, which restarts the gateway, a quarter go through the gateway over HTTP
//! (`gateway_client`), and their clients' view counts too: a stream that broke without an
//! error is lost, an error status or event is a failure with a reason. The account reads the RESULTS stream (every final result of the drill's jobs, from the
//! stream's sequence at the drill's start) and the chunks the drill's own client received
//! on `results.<tenant>.<job>.chunk`; never logs. Per job:
//! - *completed exactly once*: exactly one final result, a success;
//! - *failed with a reason*: final results, none a success (the client got an error);
//! - *lost*: no final result once the system has been idle for the settle time (or an HTTP
//!   stream that broke without an error);
//! - *duplicated*: more than one successful final result, or chunks from more than one run
//!   (worker and attempt) — a client would have seen output twice.
//!
//! The load runs for the plan's `load`, and for at least a third of it after the fault ends.
//! Time to recover: from the fault (leader kill) or the repair (restart, SIGCONT, end of
//! the rolling deploy) to the next decision on `decisions.>` (dispatcher kills) or the
//! next successful final result.
//!
//! Processes are killed and restarted by their pid files (`process`). The drill stops
//! what it started when the system stops.
//!
//! The drills that need a NATS cluster (`kill-nats-leader`) run on a second system,
//! started with `./dev up --nats-cluster 3` (three nats-servers, every stream and bucket
//! R3), after the others. Its time to recover runs from the kill to the first successful
//! result of a job submitted after it: JOBS took the job (a new stream leader), the
//! dispatcher read and assigned it, a worker ran it and RESULTS stored its result.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use async_nats::jetstream;
use futures::StreamExt;
use metronome_protocol::names::{submit_subject, BUCKET_WORKERS, HEADER_MSG_ID, STREAM_RESULTS};
use metronome_protocol::prometheus;
use metronome_protocol::{Endpoint, FinalResult, Job, ResultChunk, WorkerStatus, PROTOCOL_VERSION};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use metronome_loadgen::system::{System, SystemSpec};

mod compromised;
pub mod flood;
mod gateway_client;
pub mod hostile;

use gateway_client::HttpOutcome;
use metronome_loadgen::process::{alive, read_env, signal, stop_restarted, Image};

/// The faults a drill can inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the leading dispatcher; the standby takes over; the killed one is restarted.
    KillLeader,
    /// The leader's SIGKILL amid worker faults: one agent is SIGSTOPped (alive but silent,
    /// its WORK consumer filling with the dying term's assignments), then the leader and a
    /// second agent (with jobs in flight) are SIGKILLed together, both restarted 1 s
    /// later; the silent agent gets SIGCONT after the pause, into the next term, and
    /// refuses what it may not run. The next leader must settle every job exactly once.
    KillLeaderAmidFaults,
    /// SIGKILL a worker-agent with jobs in flight and restart it within 2 s.
    RestartAgent,
    /// SIGSTOP a worker-agent (alive but silent), SIGCONT after the pause.
    StopAgent,
    /// SIGKILL redis-server, start it again after the pause.
    RedisDown,
    /// SIGTERM nats-server (file storage), start it again at once.
    RestartNats,
    /// SIGKILL both dispatchers (no leader, no standby), restart both 2 s later.
    KillDispatchers,
    /// SIGKILL one GPU's model server (the simulator) under its agent, restart it after
    /// the pause.
    StopModelServer,
    /// SIGTERM every process of Metronome one at a time (standby dispatcher, leader,
    /// gateway, each agent), each restarted and back before the next; part of the load
    /// goes through the gateway over HTTP.
    RollingDeploy,
    /// A seeded flood of hostile messages on every subject and bucket a client with the
    /// admin identity can write (`hostile`): no component may stop, the leader may not
    /// change, every class must be rejected visibly.
    Hostile,
    /// Many more chat requests through the gateway at once than the system can serve
    /// (`gateway-flood`): every one is answered 200 or 429, and the gateway's peak RSS stays
    /// under its documented ceiling.
    GatewayFlood,
    /// One worker identity's credentials in an attacker's hands (`compromised-worker`,
    /// [`compromised`]): every attack of the threat model against the running system under
    /// load fails, visibly.
    CompromisedWorker,
    /// On a three-node NATS cluster (streams and buckets R3): SIGKILL the nats-server that
    /// leads the JOBS stream, start it again after the pause; the service goes on.
    KillNatsLeader,
}

impl Fault {
    pub const ALL: [Fault; 13] = [
        Fault::KillLeader,
        Fault::KillLeaderAmidFaults,
        Fault::RestartAgent,
        Fault::StopAgent,
        Fault::RedisDown,
        Fault::RestartNats,
        Fault::KillDispatchers,
        Fault::StopModelServer,
        Fault::RollingDeploy,
        Fault::Hostile,
        Fault::GatewayFlood,
        Fault::CompromisedWorker,
        Fault::KillNatsLeader,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillLeader => "kill-leader",
            Fault::KillLeaderAmidFaults => "kill-leader-amid-faults",
            Fault::RestartAgent => "restart-agent",
            Fault::StopAgent => "stop-agent",
            Fault::RedisDown => "redis-down",
            Fault::RestartNats => "restart-nats",
            Fault::KillDispatchers => "kill-dispatchers",
            Fault::StopModelServer => "stop-model-server",
            Fault::RollingDeploy => "rolling-deploy",
            Fault::Hostile => "hostile",
            Fault::GatewayFlood => "gateway-flood",
            Fault::CompromisedWorker => "compromised-worker",
            Fault::KillNatsLeader => "kill-nats-leader",
        }
    }

    /// What the drill does and what must hold, in one sentence (RELIABILITY.md's list).
    pub fn purpose(self) -> &'static str {
        match self {
            Fault::KillLeader => "SIGKILL the leading dispatcher mid-run, restart it 1 s later as a standby: the standby takes over and every job ends exactly once.",
            Fault::KillLeaderAmidFaults => "SIGSTOP one agent, then SIGKILL the leader and a second agent with jobs in flight together, both restarted 1 s later, SIGCONT the first after the pause: the next leader settles every job exactly once and the silent agent runs nothing the new term did not give it.",
            Fault::RestartAgent => "SIGKILL a worker-agent with jobs in flight, restart it 1 s later: its jobs that had streamed fail `WorkerLost`, the others run elsewhere, none twice.",
            Fault::StopAgent => "SIGSTOP a worker-agent (alive but silent), SIGCONT after the pause: the fenced agent starts nothing more, its jobs end once.",
            Fault::RedisDown => "SIGKILL redis-server, start it again after the pause: placement goes on without the shared performance store.",
            Fault::RestartNats => "Restart nats-server (SIGTERM, file storage kept): no job lost or run twice across the restart.",
            Fault::KillDispatchers => "SIGKILL both dispatchers (no leader, no standby), restart both 2 s later: queued jobs wait in JOBS and are decided after.",
            Fault::StopModelServer => "SIGKILL one GPU's model server under its agent, restart it after the pause: the jobs it was generating fail at once with a reason, the agent reports itself unhealthy until the server answers.",
            Fault::RollingDeploy => "SIGTERM every process in turn (standby, leader, gateway, each agent), each back before the next, part of the load over HTTP through the gateway: no stream broken, no job lost.",
            Fault::Hostile => "A seeded flood of malformed and forged messages on every subject and bucket the admin identity can write: no process stops, the leader does not change, every hostile message is rejected visibly and counted.",
            Fault::GatewayFlood => "Many more chat requests through the gateway at once than the system can serve (10,000, 2,000 at a time; 2,000 in the short run), during the normal load: every request is answered 200 or 429, none lost, and the gateway's peak RSS stays under 256 MiB.",
            Fault::CompromisedWorker => "With nothing but one worker's NATS and Redis credentials, under load: listing job ids through stream info, Lua and the shared output-length key in Redis, a forged refusal and done for another worker's job, heartbeats claiming another model, a 100,000 cap, near-zero step times and the highest epoch across the leader's SIGKILL, a push consumer delivering on another tenant's submit subject: each refused or dropped and counted, the victim ends once with its worker's result, the epoch stays the lease's.",
            Fault::KillNatsLeader => "On a three-node NATS cluster (every stream and bucket R3), SIGKILL the node leading JOBS and every other stream, start it again after the pause: no job lost, failed or run twice, and JOBS keeps three copies.",
        }
    }

    /// NATS servers of the system the drill runs on: a cluster of three, or one.
    pub fn nats_nodes(self) -> usize {
        match self {
            Fault::KillNatsLeader => CLUSTER_NODES,
            _ => 1,
        }
    }
}

/// Nodes of the cluster the cluster drills run on (`./dev up --nats-cluster 3`).
pub const CLUSTER_NODES: usize = 3;

/// Sizes of a drill run.
#[derive(Debug, Clone)]
pub struct DrillPlan {
    pub repo: PathBuf,
    pub profile: String,
    pub gpus: usize,
    /// Jobs per second offered during each drill.
    pub rate: f64,
    /// How long jobs are offered in each drill; the fault comes at a third of it.
    pub load: Duration,
    /// SIGSTOP length, and how long a killed model server or NATS node stays down.
    pub pause: Duration,
    /// Redis outage length.
    pub redis_outage: Duration,
    /// Longest wait for the last jobs to settle after the load ends.
    pub settle: Duration,
    pub faults: Vec<Fault>,
    /// Hostile messages the `hostile` drill publishes, their seed and their rate (per s).
    pub hostile_messages: usize,
    pub hostile_seed: u64,
    pub hostile_rate: f64,
    /// Requests the `gateway-flood` drill sends, and how many at a time.
    pub flood_requests: usize,
    pub flood_concurrency: usize,
    /// `kill-nats-leader`: the node killed leads the dispatchers' lease bucket too (else the
    /// lease is led by another node, so the leader keeps deciding through the failover).
    pub lease_on_killed_node: bool,
    pub state_dir: PathBuf,
    /// The command line, for the report.
    pub command: String,
}

/// The account of one drill.
#[derive(Debug, Clone, Default)]
pub struct DrillReport {
    pub fault: String,
    pub what: String,
    pub sent: usize,
    pub exactly_once: usize,
    pub failed_with_reason: usize,
    pub lost: usize,
    pub duplicated: usize,
    pub recover_ms: Option<u64>,
    /// Error classes of the failed jobs, counted.
    pub failure_reasons: BTreeMap<String, usize>,
    /// One line per lost or duplicated job: its id, the final results stored for it
    /// (worker, error) and the runs its chunks came from, so a failed drill says where to
    /// look in the logs.
    pub anomalies: Vec<String>,
    /// The jobs sent through the gateway over HTTP, as the client saw them (rolling deploy).
    pub http: Option<HttpAccount>,
    /// What else the drill noticed (a process that had to be killed).
    pub notes: Vec<String>,
    /// Checks the drill failed beyond lost and duplicated jobs (the hostile drill: a
    /// process exited, the leader changed, a class was not visibly rejected).
    pub failures: Vec<String>,
}

/// What the drill's HTTP client saw of the jobs it sent through the gateway.
#[derive(Debug, Clone, Default)]
pub struct HttpAccount {
    /// Requests the gateway took (answered with a job id).
    pub sent: usize,
    /// Streams that ended with `[DONE]`.
    pub complete: usize,
    /// Error statuses or error events: the client knows why.
    pub clear_error: usize,
    /// Streams that broke without an error: counted lost.
    pub broken: usize,
    /// Tries the gateway did not take (no connection, 503), tried again by the client.
    pub refused: usize,
    /// Requests never taken within a minute.
    pub not_taken: usize,
}

impl DrillReport {
    /// A drill passes when no job was lost or duplicated.
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.failures.is_empty()
            && self.http.as_ref().is_none_or(|h| h.not_taken == 0)
    }
}

/// What the drill's client saw of its jobs (chunks by run, decisions' arrival times).
#[derive(Default)]
struct Seen {
    runs: BTreeMap<String, BTreeSet<(String, Option<u32>)>>,
    decisions: Vec<Instant>,
    /// (arrival, worker, job) of successful final results seen live.
    finals: Vec<(Instant, Option<String>, String)>,
    /// (arrival, worker) of the refusals agents published (`events.done.*`, outcome
    /// `refused`).
    refusals: Vec<(Instant, String)>,
}

/// Run every drill of `plan`, those on one NATS server on one system and those on a
/// cluster on a second; returns the reports in the order of [`Fault::ALL`].
pub async fn run_drills(plan: &DrillPlan) -> anyhow::Result<Vec<DrillReport>> {
    let mut reports = Vec::new();
    for nodes in [1, CLUSTER_NODES] {
        let faults: Vec<Fault> = plan
            .faults
            .iter()
            .copied()
            .filter(|f| f.nats_nodes() == nodes)
            .collect();
        if faults.is_empty() {
            continue;
        }
        let state_dir = if nodes == 1 {
            plan.state_dir.clone()
        } else {
            let mut dir = plan.state_dir.clone().into_os_string();
            dir.push("-cluster");
            PathBuf::from(dir)
        };
        reports.extend(run_on_one_system(plan, &faults, nodes, &state_dir).await?);
    }
    reports.sort_by_key(|r| Fault::ALL.iter().position(|f| f.name() == r.fault));
    Ok(reports)
}

/// Run `faults` in order on one system of `nats_nodes` NATS servers.
async fn run_on_one_system(
    plan: &DrillPlan,
    faults: &[Fault],
    nats_nodes: usize,
    state_dir: &Path,
) -> anyhow::Result<Vec<DrillReport>> {
    let spec = SystemSpec {
        repo: plan.repo.clone(),
        gpus: plan.gpus,
        model: "llama-3.1-8b".into(),
        speeds: vec!["1.0".into(); plan.gpus],
        policy: "metronome".into(),
        state_dir: state_dir.to_path_buf(),
        sim_args: Vec::new(),
        worker_max_concurrency: None,
        profile: plan.profile.clone(),
        keep_going: true,
        gateway_extra_toml: None,
        nats_cluster: nats_nodes,
        first_gateway_port: None,
    };
    let mut system = System::up(&spec).await.context("starting the system")?;
    let env = read_env(&state_dir.join("env"))?;
    let nats_url = env
        .get("NATS_URL")
        .context("NATS_URL in the env file")?
        .clone();
    // The operator's identity `./dev up` wrote beside the URL (`METRONOME_NATS_*`).
    let auth = metronome_runtime::nats::NatsAuth::from_env(|k| env.get(k).cloned());
    let client = auth
        .connect_options()
        .context("NATS credentials")?
        .retry_on_initial_connect()
        .connect(metronome_runtime::nats::server_urls(&nats_url))
        .await?;
    let js = jetstream::new(client.clone());
    let seen = Arc::new(Mutex::new(Seen::default()));
    spawn_watchers(&client, seen.clone()).await?;
    let mut restarted = Vec::new();
    let mut reports = Vec::new();
    for fault in faults {
        // Job ids and the GPU a fault touches follow the drill's place in the whole plan.
        let i = plan.faults.iter().position(|f| f == fault).unwrap_or(0);
        let r = run_one(
            plan,
            &system,
            &client,
            &js,
            &seen,
            *fault,
            i,
            &mut restarted,
        )
        .await;
        match r {
            Ok(report) => {
                tracing::warn!(?report, "drill done");
                reports.push(report);
            }
            Err(e) => {
                stop_restarted(&restarted);
                system.stop().await;
                return Err(e.context(format!("drill {}", fault.name())));
            }
        }
    }
    stop_restarted(&restarted);
    system.stop().await;
    Ok(reports)
}

async fn spawn_watchers(client: &async_nats::Client, seen: Arc<Mutex<Seen>>) -> anyhow::Result<()> {
    let mut results = client.subscribe("results.>").await?;
    let s = seen.clone();
    tokio::spawn(async move {
        while let Some(m) = results.next().await {
            let now = Instant::now();
            if m.subject.ends_with(".chunk") {
                if let Ok(c) = serde_json::from_slice::<ResultChunk>(&m.payload) {
                    s.lock()
                        .unwrap()
                        .runs
                        .entry(c.job_id)
                        .or_default()
                        .insert((c.worker_id, c.attempt));
                }
            } else if let Ok(f) = serde_json::from_slice::<FinalResult>(&m.payload) {
                if f.error.is_none() {
                    s.lock().unwrap().finals.push((now, f.worker_id, f.job_id));
                }
            }
        }
    });
    let mut events = client
        .subscribe(metronome_protocol::names::SUBJECT_EVENTS_DONE_ALL)
        .await?;
    let s = seen.clone();
    tokio::spawn(async move {
        while let Some(m) = events.next().await {
            let refused = serde_json::from_slice::<metronome_protocol::CompletionEvent>(&m.payload)
                .ok()
                .filter(|e| e.outcome == metronome_protocol::CompletionOutcome::Refused);
            if let Some(e) = refused {
                s.lock()
                    .unwrap()
                    .refusals
                    .push((Instant::now(), e.worker_id));
            }
        }
    });
    let mut decisions = client.subscribe("decisions.>").await?;
    tokio::spawn(async move {
        while decisions.next().await.is_some() {
            seen.lock().unwrap().decisions.push(Instant::now());
        }
    });
    client.flush().await?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    plan: &DrillPlan,
    system: &System,
    client: &async_nats::Client,
    js: &jetstream::Context,
    seen: &Arc<Mutex<Seen>>,
    fault: Fault,
    index: usize,
    restarted: &mut Vec<u32>,
) -> anyhow::Result<DrillReport> {
    let start_seq = read_until(
        "reading the RESULTS stream's last sequence",
        Instant::now() + plan.settle,
        || results_last_seq(js),
    )
    .await?;
    let mut gathered = Vec::new();
    if fault == Fault::KillNatsLeader {
        gathered = gather_leaders(client, js, plan.lease_on_killed_node).await?;
    }
    let prefix = format!("drill{index}-{}-{}", fault.name(), std::process::id());
    // The load runs for `load`, and at least a third of it past the end of the fault (a
    // rolling deploy or an outage can outlast the rest of it), so recovery is seen.
    let stop = CancellationToken::new();
    let started = Instant::now();
    let streaming = Arc::new(AtomicUsize::new(0));
    let sender = {
        let client = client.clone();
        // A quarter of the rolling deploy's jobs go through the gateway, which it restarts.
        let gateway = (fault == Fault::RollingDeploy).then(|| system.gateway_url.clone());
        let (rate, prefix, stop) = (plan.rate, prefix.clone(), stop.clone());
        let streaming = streaming.clone();
        tokio::spawn(
            async move { send_jobs(client, gateway, rate, stop, streaming, &prefix).await },
        )
    };
    tokio::time::sleep(plan.load / 3).await;
    let agent = format!("worker-gpu{}", index % plan.gpus);
    let extra_ids = Mutex::new(Vec::new());
    let failures = Mutex::new(Vec::new());
    let target = Target {
        gpu: index % plan.gpus,
        streaming: &streaming,
        extra_ids: &extra_ids,
        failures: &failures,
        victims: &prefix,
    };
    let injected = inject(plan, system, client, js, fault, target, restarted).await;
    let (what, mark, notes) = match injected {
        Ok(i) => i,
        Err(e) => {
            stop.cancel();
            return Err(e);
        }
    };
    let stop_at = (started + plan.load).max(Instant::now() + plan.load / 3);
    tokio::time::sleep_until(stop_at.into()).await;
    stop.cancel();
    let mut sent = sender.await??;
    sent.ids.extend(extra_ids.into_inner().unwrap());
    let recover_ms = recovery(seen, fault, mark, &agent, &sent, plan.settle).await;
    let mut notes = notes;
    if !gathered.is_empty() {
        notes.insert(0, format!(
            "before the load, the leadership of every stream{} was moved to the JOBS leader (stream leader stepdowns: {})",
            if plan.lease_on_killed_node { "" } else { " but the lease bucket (KV_leader, moved to another node)" },
            gathered.join(", ")
        ));
    }
    if fault == Fault::KillNatsLeader {
        notes.extend(outage_notes(seen, mark, &sent));
    }
    if fault == Fault::KillLeaderAmidFaults {
        notes.push(refusals_after(seen, mark, recover_ms));
    }
    let finals = settle(js, start_seq, &sent.ids, plan.settle).await?;
    let runs = seen.lock().unwrap().runs.clone();
    let mut report = account(&sent, &finals, &runs);
    report.fault = fault.name().into();
    report.what = what;
    report.recover_ms = recover_ms;
    report.notes = notes;
    report.failures = failures.into_inner().unwrap();
    // A NATS node is one of three copies: losing it may delay jobs, never fail them.
    if fault == Fault::KillNatsLeader && report.failed_with_reason > 0 {
        report.failures.push(format!(
            "{} jobs failed while a NATS node was down ({:?}): the service did not go on for them",
            report.failed_with_reason, report.failure_reasons
        ));
    }
    if fault == Fault::Hostile && report.recover_ms.is_none() {
        report
            .failures
            .push("no normal job succeeded after the flood".into());
    }
    if fault == Fault::Hostile {
        // The flood cancels the load's jobs only under other tenants than theirs: none may
        // end cancelled.
        let cancelled: Vec<&String> = sent
            .ids
            .iter()
            .filter(|id| {
                finals.get(*id).is_some_and(|list| {
                    list.iter().any(|f| {
                        f.error.as_ref().map(|e| e.code)
                            == Some(metronome_protocol::ErrorCode::Cancelled)
                    })
                })
            })
            .collect();
        if !cancelled.is_empty() {
            report.failures.push(format!(
                "{} of the load's jobs were cancelled by the flood's cancels under other tenants: {:?}",
                cancelled.len(),
                &cancelled[..cancelled.len().min(5)]
            ));
        }
    }
    Ok(report)
}

/// The account of one drill's jobs from their final results in RESULTS, the runs their
/// chunks came from, and what the HTTP client saw of the jobs sent through the gateway.
fn account(
    sent: &Sent,
    finals: &BTreeMap<String, Vec<FinalResult>>,
    runs: &BTreeMap<String, BTreeSet<(String, Option<u32>)>>,
) -> DrillReport {
    let mut report = DrillReport {
        sent: sent.ids.len(),
        ..Default::default()
    };
    if sent.http_tries > 0 {
        let mut http = HttpAccount {
            refused: sent.http_refused,
            ..Default::default()
        };
        for outcome in sent.http.values() {
            match outcome {
                HttpOutcome::Complete => http.complete += 1,
                HttpOutcome::ClearError(_) => http.clear_error += 1,
                HttpOutcome::Broken(_) => http.broken += 1,
            }
        }
        http.sent = sent.http.len();
        http.not_taken = sent.http_not_taken;
        report.http = Some(http);
    }
    for id in &sent.ids {
        let list = finals.get(id).map(Vec::as_slice).unwrap_or_default();
        let ok = list.iter().filter(|f| f.error.is_none()).count();
        let run_count = runs.get(id).map_or(0, BTreeSet::len);
        let client = sent.http.get(id);
        // Two successes, a success next to an error, or chunks of two runs: the job ran
        // twice as far as a client can tell.
        let duplicated = ok > 1 || run_count > 1 || (ok >= 1 && list.len() > 1);
        // An HTTP client whose stream broke without an error has no answer, whatever the
        // system stored; one that got a clear error before the job was queued has no final.
        let broken = matches!(client, Some(HttpOutcome::Broken(_)));
        let client_error = match client {
            Some(HttpOutcome::ClearError(code)) => Some(code.clone()),
            _ => None,
        };
        let lost = broken || (list.is_empty() && client_error.is_none());
        if duplicated {
            report.duplicated += 1;
        }
        if duplicated || lost {
            let finals: Vec<String> = list
                .iter()
                .map(|f| {
                    let who = f.worker_id.as_deref().unwrap_or("dispatcher");
                    match &f.error {
                        Some(e) => format!("{who}: {:?}", e.code),
                        None => format!("{who}: ok"),
                    }
                })
                .collect();
            let runs: Vec<String> = runs
                .get(id)
                .into_iter()
                .flatten()
                .map(|(w, a)| format!("{w}#{}", a.map_or("?".into(), |a| a.to_string())))
                .collect();
            let client = match client {
                Some(HttpOutcome::Broken(why)) => format!(", HTTP client: {why}"),
                _ => String::new(),
            };
            report.anomalies.push(format!(
                "{id}: {} — finals [{}], chunk runs [{}]{client}",
                if duplicated { "duplicated" } else { "lost" },
                finals.join(", "),
                runs.join(", ")
            ));
        }
        // Each job lands in one column (a duplicated one, counted above, is not also
        // "exactly once"), except a lost HTTP job that also ran twice, which counts in both.
        if lost {
            report.lost += 1;
        } else if duplicated {
            // Counted above.
        } else if let Some(code) = client_error {
            // The client's error is what it saw; the stored final (if any) agrees or is
            // absent (refused before the job was queued).
            report.failed_with_reason += 1;
            *report.failure_reasons.entry(code).or_default() += 1;
        } else if ok == 1 && list.len() == 1 {
            report.exactly_once += 1;
        } else if ok == 0 {
            report.failed_with_reason += 1;
            let code = list[0]
                .error
                .as_ref()
                .map(|e| format!("{:?}", e.code))
                .unwrap_or_default();
            *report.failure_reasons.entry(code).or_default() += 1;
        }
    }
    report
}

/// What a fault is aimed at: the GPU whose agent or model server it touches, and the count
/// of HTTP responses being read (the gateway's restart notes it).
struct Target<'a> {
    gpu: usize,
    streaming: &'a AtomicUsize,
    /// Jobs the fault itself submitted that must be served (the hostile drill's valid
    /// ones): they join the account.
    extra_ids: &'a Mutex<Vec<String>>,
    /// Checks the fault failed.
    failures: &'a Mutex<Vec<String>>,
    /// Id prefix of the load's jobs (`<victims>-<n>`), which the hostile flood names in
    /// cancels under other tenants.
    victims: &'a str,
}

/// Inject the fault on `target.gpu` (its agent or its model server, for the faults that touch
/// one); returns what was done, the instant recovery is measured from, and notes.
async fn inject(
    plan: &DrillPlan,
    system: &System,
    client: &async_nats::Client,
    js: &jetstream::Context,
    fault: Fault,
    target: Target<'_>,
    restarted: &mut Vec<u32>,
) -> anyhow::Result<(String, Instant, Vec<String>)> {
    let gpu = target.gpu;
    let agent = format!("worker-gpu{gpu}");
    let mut notes = Vec::new();
    let (what, mark) = match fault {
        Fault::KillLeader => {
            let leader = system.leader_name().await?;
            let pid = system.pid_of(&leader).context("leader pid")?;
            let image = Image::read(pid)?;
            signal(pid, "KILL")?;
            let at = Instant::now();
            // The killed instance comes back as a standby, as systemd would restart it.
            tokio::time::sleep(Duration::from_secs(1)).await;
            restarted.push(image.spawn(&system.state_dir, &leader)?);
            (
                format!("SIGKILL the leading dispatcher ({leader}) mid-run; restarted 1 s later as a standby"),
                at,
            )
        }
        Fault::KillLeaderAmidFaults => {
            anyhow::ensure!(
                plan.gpus >= 2,
                "kill-leader-amid-faults needs two GPUs: one agent falls silent while another dies"
            );
            let leader = system.leader_name().await?;
            let leader_pid = system.pid_of(&leader).context("leader pid")?;
            let leader_image = Image::read(leader_pid)?;
            let silent_pid = system.pid_of(&agent).context("agent pid")?;
            let dying_gpu = (gpu + 1) % plan.gpus;
            let dying = format!("worker-gpu{dying_gpu}");
            let dying_pid = system.pid_of(&dying).context("dying agent pid")?;
            let dying_image = Image::read(dying_pid)?;
            let running = wait_running(system, dying_gpu).await;
            // The silent agent's last heartbeat stays fresh for a while, so the leader
            // goes on placing there; those assignments wait in its WORK consumer under the
            // killed leader's epoch, and the agent refuses what it may not run when it
            // wakes into the next term.
            signal(silent_pid, "STOP")?;
            tokio::time::sleep(SILENT_BEFORE_KILL).await;
            signal(leader_pid, "KILL")?;
            signal(dying_pid, "KILL")?;
            let at = Instant::now();
            tokio::time::sleep(Duration::from_secs(1)).await;
            restarted.push(leader_image.spawn(&system.state_dir, &leader)?);
            restarted.push(dying_image.spawn(&system.state_dir, &dying)?);
            tokio::time::sleep((at + plan.pause).saturating_duration_since(Instant::now())).await;
            signal(silent_pid, "CONT")?;
            (
                format!(
                    "SIGSTOP {agent}; {} ms later SIGKILL the leading dispatcher ({leader}) and {dying} (generating {running}) together, both restarted 1 s later; SIGCONT {agent} {} s after the kill",
                    SILENT_BEFORE_KILL.as_millis(),
                    plan.pause.as_secs()
                ),
                at,
            )
        }
        Fault::KillDispatchers => {
            let mut images = Vec::new();
            for name in DISPATCHERS {
                let pid = system.pid_of(name).context("dispatcher pid")?;
                images.push((name, pid, Image::read(pid)?));
            }
            for (_, pid, _) in &images {
                signal(*pid, "KILL")?;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            for (name, _, image) in &images {
                restarted.push(image.spawn(&system.state_dir, name)?);
            }
            (
                "SIGKILL both dispatchers (leader and standby) mid-run; both restarted 2 s later"
                    .into(),
                Instant::now(),
            )
        }
        Fault::RestartAgent => {
            let pid = system.pid_of(&agent).context("agent pid")?;
            let image = Image::read(pid)?;
            signal(pid, "KILL")?;
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            restarted.push(image.spawn(&system.state_dir, &agent)?);
            (
                format!("SIGKILL {agent} with jobs in flight, restarted 1 s later"),
                Instant::now(),
            )
        }
        Fault::StopAgent => {
            let pid = system.pid_of(&agent).context("agent pid")?;
            signal(pid, "STOP")?;
            tokio::time::sleep(plan.pause).await;
            signal(pid, "CONT")?;
            (
                format!(
                    "SIGSTOP {agent} for {} s (alive but silent), then SIGCONT",
                    plan.pause.as_secs()
                ),
                Instant::now(),
            )
        }
        Fault::StopModelServer => {
            let sim = format!("sim-gpu{gpu}");
            let pid = system.pid_of(&sim).context("model server pid")?;
            let image = Image::read(pid)?;
            // Killed while generating, so jobs break mid-stream, not only fail to connect.
            let running = wait_running(system, gpu).await;
            signal(pid, "KILL")?;
            if running == 0 {
                notes.push(format!("{sim} ran no request when it was killed"));
            }
            tokio::time::sleep(plan.pause).await;
            restarted.push(image.spawn(&system.state_dir, &sim)?);
            (
                format!(
                    "SIGKILL the model server of {agent} ({sim}) while it generated {running}, restarted {} s later",
                    plan.pause.as_secs()
                ),
                Instant::now(),
            )
        }
        Fault::RedisDown => {
            let pid = system.pid_of("redis").context("redis pid")?;
            let image = Image::redis(pid, &system.state_dir)?;
            signal(pid, "KILL")?;
            tokio::time::sleep(plan.redis_outage).await;
            restarted.push(image.spawn(&system.state_dir, "redis")?);
            (
                format!(
                    "SIGKILL redis-server, started again {} s later",
                    plan.redis_outage.as_secs()
                ),
                Instant::now(),
            )
        }
        Fault::RestartNats => {
            let pid = system.pid_of("nats").context("nats pid")?;
            let image = Image::read(pid)?;
            signal(pid, "TERM")?;
            let deadline = Instant::now() + Duration::from_secs(20);
            while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            restarted.push(image.spawn(&system.state_dir, "nats")?);
            (
                "restart nats-server (SIGTERM, file storage kept, started again at once)".into(),
                Instant::now(),
            )
        }
        Fault::Hostile => {
            let what = hostile_flood(plan, system, client, js, &target, &mut notes).await?;
            (what, Instant::now())
        }
        Fault::GatewayFlood => {
            let pid = system.pid_of("gateway").context("gateway pid")?;
            let model = system.sim_models.first().context("a model")?.clone();
            let account = flood::flood(
                &system.gateway_url,
                &model,
                plan.flood_requests,
                plan.flood_concurrency,
                pid,
            )
            .await?;
            target.failures.lock().unwrap().extend(account.failures());
            (account.describe(), Instant::now())
        }
        Fault::CompromisedWorker => {
            let what =
                compromised::attack(plan, system, client, js, &target, restarted, &mut notes)
                    .await?;
            (what, Instant::now())
        }
        Fault::KillNatsLeader => {
            kill_nats_leader(plan, system, client, js, &target, restarted, &mut notes).await?
        }
        Fault::RollingDeploy => {
            let leader = system.leader_name().await?;
            let standby = DISPATCHERS
                .into_iter()
                .find(|d| *d != leader)
                .context("a standby dispatcher")?;
            let mut order = vec![standby.to_string(), leader, "gateway".to_string()];
            order.extend((0..plan.gpus).map(|g| format!("worker-gpu{g}")));
            let mut longest = Duration::ZERO;
            for name in &order {
                if name == "gateway" {
                    notes.push(format!(
                        "the gateway got SIGTERM with {} HTTP responses of the drill being read",
                        target.streaming.load(Ordering::SeqCst)
                    ));
                }
                let away = redeploy(system, js, name, restarted, &mut notes).await?;
                longest = longest.max(away);
            }
            (
                format!(
                    "SIGTERM each process and start it again once it exited, the next once it is back: {} (longest away {:.1} s)",
                    order.join(", "),
                    longest.as_secs_f64()
                ),
                Instant::now(),
            )
        }
    };
    Ok((what, mark, notes))
}

/// Prometheus text of every dispatcher (or agent) `/metrics` URL, one per entry.
async fn scrape_all(urls: &[String]) -> Vec<String> {
    let http = reqwest::Client::new();
    let mut out = Vec::new();
    for url in urls {
        let text = match http.get(url).timeout(Duration::from_secs(5)).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        out.push(text);
    }
    out
}

fn metric_sum(texts: &[String], name: &str) -> f64 {
    texts.iter().map(|t| prometheus::sum(t, name)).sum()
}

/// Sum of the samples of `name` carrying every `key="value"` pair given, whatever other labels.
fn metric_sum_labelled(texts: &[String], name: &str, labels: &[(&str, &str)]) -> f64 {
    texts
        .iter()
        .map(|t| prometheus::sum_where(t, name, labels))
        .sum()
}

/// The agents' `/metrics` URLs, from the config files `./dev up` wrote.
fn agent_metrics_urls(system: &System, gpus: usize) -> Vec<String> {
    (0..gpus)
        .filter_map(|g| {
            let text = std::fs::read_to_string(
                system.state_dir.join(format!("config/worker-gpu{g}.toml")),
            )
            .ok()?;
            let port = text
                .lines()
                .find_map(|l| l.strip_prefix("metrics_port = "))?
                .trim()
                .to_string();
            Some(format!("http://127.0.0.1:{port}/metrics"))
        })
        .collect()
}

/// What the hostile drill watches before and after the flood.
struct Watch {
    leader: String,
    epoch: f64,
    pids: Vec<(String, u32)>,
    rss_kib: BTreeMap<String, u64>,
    dispatchers: Vec<String>,
    agents: Vec<String>,
}

async fn watch(system: &System, gpus: usize) -> anyhow::Result<Watch> {
    let dispatchers = scrape_all(&system.dispatcher_metrics).await;
    let agents = scrape_all(&agent_metrics_urls(system, gpus)).await;
    // Only processes running now: an earlier drill's restart can leave a pid file naming a
    // process that has gone (a server that forked), which the flood did not stop.
    let pids: Vec<(String, u32)> = system
        .pids()
        .into_iter()
        .filter(|(_, p)| alive(*p))
        .collect();
    let rss_kib = pids
        .iter()
        .filter(|(n, _)| {
            n.starts_with("dispatcher") || n.starts_with("worker") || n.as_str() == "gateway"
        })
        .filter_map(|(n, p)| Some((n.clone(), metronome_loadgen::system::rss_kib(*p)?)))
        .collect();
    Ok(Watch {
        leader: system.leader_name().await?,
        epoch: dispatchers
            .iter()
            .map(|t| prometheus::sum(t, "metronome_dispatcher_epoch"))
            .fold(0.0, f64::max),
        pids,
        rss_kib,
        dispatchers,
        agents,
    })
}

/// The hostile drill's fault: the flood, then the checks. Returns what was done; the
/// per-class account goes to `notes`, failed checks to `target.failures`.
async fn hostile_flood(
    plan: &DrillPlan,
    system: &System,
    client: &async_nats::Client,
    js: &jetstream::Context,
    target: &Target<'_>,
    notes: &mut Vec<String>,
) -> anyhow::Result<String> {
    use hostile::{Class, Sink};
    let before = watch(system, plan.gpus).await?;
    let ctx = hostile::Context {
        prefix: format!("hostile{}", std::process::id()),
        model: "llama-3.1-8b".into(),
        workers: (0..plan.gpus).map(|g| format!("local-gpu{g}")).collect(),
        epoch: before.epoch as u64,
        victims: target.victims.to_string(),
        max_job_bytes: metronome_protocol::JobLimits::default().max_job_bytes,
        now_ms: metronome_protocol::time::unix_ms(),
    };
    let a = hostile::flood(
        client,
        plan.hostile_seed,
        plan.hostile_messages,
        plan.hostile_rate,
        &ctx,
        plan.settle,
    )
    .await?;
    target
        .extra_ids
        .lock()
        .unwrap()
        .extend(a.served_ids.iter().cloned());
    // The JOBS backlog the flood left is worked off before the checks.
    let deadline = Instant::now() + plan.settle;
    let mut jobs = js
        .get_stream(metronome_protocol::names::STREAM_JOBS)
        .await?;
    let mut backlog = u64::MAX;
    while Instant::now() < deadline {
        backlog = jobs.info().await?.state.messages;
        if backlog <= 50 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The agents work off their WORK messages and the dispatchers their events and
    // heartbeats at their own pace: wait (up to the settle time) until each counter has
    // seen what was sent, so a shortfall below is one for good.
    let sent_stored = |classes: &[Class]| -> f64 {
        classes
            .iter()
            .map(|c| {
                a.sent.get(c).copied().unwrap_or(0) - a.server_refused.get(c).copied().unwrap_or(0)
            })
            .sum::<usize>() as f64
    };
    let wants = [
        (
            "metronome_worker_malformed_assignments_total",
            true,
            sent_stored(&[Class::WorkMalformed, Class::WorkInvalidJob]),
        ),
        (
            "metronome_worker_stale_epoch_refusals_total",
            true,
            sent_stored(&[Class::WorkStaleEpoch]),
        ),
        (
            "metronome_worker_unvouched_epoch_refusals_total",
            true,
            sent_stored(&[Class::WorkFutureEpoch]),
        ),
        (
            "metronome_dispatcher_ignored_worker_messages_total",
            false,
            sent_stored(&[
                Class::EventMalformed,
                Class::EventForged,
                Class::HeartbeatMalformed,
                Class::HeartbeatForeignKey,
                Class::HeartbeatBadFields,
            ]),
        ),
        (
            "metronome_dispatcher_unvouched_refusal_jobs_total",
            false,
            sent_stored(&[Class::EventRefusalMadeUpJob]),
        ),
    ];
    let deadline = Instant::now() + plan.settle;
    let agent_urls = agent_metrics_urls(system, plan.gpus);
    while Instant::now() < deadline {
        let agents = scrape_all(&agent_urls).await;
        let dispatchers = scrape_all(&system.dispatcher_metrics).await;
        let done = wants.iter().all(|(name, on_agents, want)| {
            let (b, now) = if *on_agents {
                (&before.agents, &agents)
            } else {
                (&before.dispatchers, &dispatchers)
            };
            metric_sum(now, name) - metric_sum(b, name) >= *want
        });
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = watch(system, plan.gpus).await?;
    let fail = |s: String| target.failures.lock().unwrap().push(s);
    if backlog > 50 {
        fail(format!(
            "JOBS still held {backlog} messages {} s after the flood",
            plan.settle.as_secs()
        ));
    }
    if after.leader != before.leader || after.epoch != before.epoch {
        fail(format!(
            "the leader changed: {} (epoch {}) before, {} (epoch {}) after",
            before.leader, before.epoch, after.leader, after.epoch
        ));
    }
    for (name, pid) in &before.pids {
        let now = after.pids.iter().find(|(n, _)| n == name).map(|(_, p)| *p);
        if now != Some(*pid) || !alive(*pid) {
            fail(format!(
                "{name} (pid {pid}) exited or restarted during the flood"
            ));
        }
    }
    let delta = |name: &str, on_agents: bool| {
        let (b, a) = if on_agents {
            (&before.agents, &after.agents)
        } else {
            (&before.dispatchers, &after.dispatchers)
        };
        metric_sum(a, name) - metric_sum(b, name)
    };
    let stored = |class: Class| {
        a.sent.get(&class).copied().unwrap_or(0)
            - a.server_refused.get(&class).copied().unwrap_or(0)
    };
    let stored_of = |classes: &[Class]| classes.iter().map(|c| stored(*c)).sum::<usize>();
    // jobs.submit: every stored hostile job is decided (those with a readable id) or
    // dead-lettered; no class may go unanswered.
    for (class, n) in &a.undecided {
        if class.sink() == Sink::Decision || class.sink() == Sink::Served {
            fail(format!(
                "{}: {n} jobs with a readable id got no decision",
                class.name()
            ));
        }
    }
    // Every stored hostile job is answered exactly once: a decision for those whose id
    // can be read, a dead letter for the rest.
    let answerable = |c: &Class| {
        matches!(
            c.sink(),
            Sink::Decision | Sink::DeadLetter | Sink::DecisionOrDeadLetter
        ) && *c != Class::DuplicateId
    };
    let stored_total: usize = Class::ALL
        .iter()
        .filter(|c| answerable(c))
        .map(|c| stored(*c))
        .sum();
    let decided: usize = Class::ALL
        .iter()
        .filter(|c| answerable(c) && c.sink() != Sink::DeadLetter)
        .map(|c| stored(*c) - a.undecided.get(c).copied().unwrap_or(0))
        .sum();
    if decided + a.dead_letters_dispatcher < stored_total {
        fail(format!(
            "jobs.submit: {stored_total} hostile jobs stored, {decided} decided and {} dead-lettered: {} unanswered",
            a.dead_letters_dispatcher,
            stored_total - decided - a.dead_letters_dispatcher
        ));
    }
    let expired_assigned: usize = a
        .decisions
        .get(&Class::ExpiredDeadline)
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.starts_with("assigned"))
        .map(|(_, n)| *n)
        .sum();
    if expired_assigned > 0 {
        fail(format!(
            "{expired_assigned} jobs whose start deadline had passed before they were submitted were assigned"
        ));
    }
    let refused = a
        .server_refused
        .get(&Class::OverServerLimit)
        .copied()
        .unwrap_or(0);
    if refused != a.sent.get(&Class::OverServerLimit).copied().unwrap_or(0) {
        fail(format!(
            "{refused} of the jobs above the server's payload limit were refused"
        ));
    }
    let ignored = delta("metronome_dispatcher_ignored_worker_messages_total", false);
    let want_ignored = stored_of(&[
        Class::EventMalformed,
        Class::EventForged,
        Class::HeartbeatMalformed,
        Class::HeartbeatForeignKey,
        Class::HeartbeatBadFields,
    ]);
    if ignored < want_ignored as f64 {
        fail(format!(
            "heartbeats and events: the dispatchers counted {ignored} ignored, {want_ignored} sent"
        ));
    }
    // A refusal's made-up job: its copy dropped and counted, and the job never decided
    // (a decision would mean a worker could submit work).
    let dropped = delta("metronome_dispatcher_unvouched_refusal_jobs_total", false);
    let want_dropped = stored(Class::EventRefusalMadeUpJob);
    if dropped < want_dropped as f64 {
        fail(format!(
            "events: the dispatchers dropped {dropped} refusals' made-up jobs, {want_dropped} sent"
        ));
    }
    let made_up_decided: usize = a
        .decisions
        .get(&Class::EventRefusalMadeUpJob)
        .into_iter()
        .flatten()
        .map(|(_, n)| *n)
        .sum();
    if made_up_decided > 0 {
        fail(format!(
            "events: {made_up_decided} jobs that workers made up in their refusals were decided"
        ));
    }
    let malformed_work = delta("metronome_worker_malformed_assignments_total", true);
    let want_malformed = stored_of(&[Class::WorkMalformed, Class::WorkInvalidJob]);
    if malformed_work < want_malformed as f64 {
        fail(format!(
            "work: the agents counted {malformed_work} malformed assignments, {want_malformed} sent"
        ));
    }
    let stale = delta("metronome_worker_stale_epoch_refusals_total", true);
    let want_stale = stored(Class::WorkStaleEpoch);
    if stale < want_stale as f64 {
        fail(format!(
            "work: {stale} stale-epoch refusals, {want_stale} stale assignments sent"
        ));
    }
    if stale > want_stale as f64 {
        fail(format!(
            "work: the agents refused {} real assignments as stale after the flood's impossible epoch",
            stale - want_stale as f64
        ));
    }
    let unvouched = delta("metronome_worker_unvouched_epoch_refusals_total", true);
    let want_unvouched = stored(Class::WorkFutureEpoch);
    if unvouched < want_unvouched as f64 {
        fail(format!(
            "work: {unvouched} assignments refused for an epoch the lease does not vouch for, {want_unvouched} sent"
        ));
    }
    notes.push(format!(
        "flood: {} messages (seed {}) in {:.1} s; JOBS backlog {} after it; leader {} epoch {} before and {} epoch {} after",
        a.sent.values().sum::<usize>(),
        plan.hostile_seed,
        a.elapsed.as_secs_f64(),
        backlog,
        before.leader,
        before.epoch,
        after.leader,
        after.epoch
    ));
    notes.push(format!(
        "rejections seen: {} dead letters from the dispatcher, {} from agents; dispatchers: malformed_jobs +{}, ignored_worker_messages +{ignored}, unvouched_refusal_jobs +{dropped}, cancels_of_another_tenant +{}; agents: malformed_assignments +{malformed_work}, stale_epoch_refusals +{stale}, unvouched_epoch_refusals +{unvouched}, cancels_of_another_tenant +{}, refused jobs +{}",
        a.dead_letters_dispatcher,
        a.dead_letters_agents,
        delta("metronome_dispatcher_malformed_jobs_total", false),
        delta("metronome_dispatcher_cancels_of_another_tenant_total", false),
        delta("metronome_worker_cancels_of_another_tenant_total", true),
        metric_sum_labelled(&after.agents, "metronome_worker_jobs_total", &[("outcome", "refused")])
            - metric_sum_labelled(&before.agents, "metronome_worker_jobs_total", &[("outcome", "refused")]),
    ));
    let rss: Vec<String> = before
        .rss_kib
        .iter()
        .map(|(n, b)| {
            let a = after.rss_kib.get(n).copied().unwrap_or(0);
            format!("{n} {:.0}→{:.0}", *b as f64 / 1024.0, a as f64 / 1024.0)
        })
        .collect();
    notes.push(format!("RSS (MiB) before→after: {}", rss.join(", ")));
    for class in Class::ALL {
        let sent = a.sent.get(&class).copied().unwrap_or(0);
        let decisions: Vec<String> = a
            .decisions
            .get(&class)
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{v} {k}"))
            .collect();
        notes.push(format!(
            "class `{}` ({:?}): sent {sent}, server refused {}, decisions [{}], undecided {}",
            class.name(),
            class.sink(),
            a.server_refused.get(&class).copied().unwrap_or(0),
            decisions.join(", "),
            a.undecided.get(&class).copied().unwrap_or(0)
        ));
    }
    Ok(format!(
        "{} hostile messages (seed {}, up to {:.0}/s) on jobs.submit, cancel.*.*, events.done.*, the workers bucket and work.* with the admin identity",
        plan.hostile_messages, plan.hostile_seed, plan.hostile_rate
    ))
}

/// The JOBS stream's cluster as the drill's client reads it: its leader, and each other
/// copy (server name, whether it is current). `None` while it cannot be read or has no
/// leader (during an election).
async fn jobs_cluster(js: &jetstream::Context) -> Option<(String, Vec<(String, bool)>)> {
    let mut stream = js
        .get_stream(metronome_protocol::names::STREAM_JOBS)
        .await
        .ok()?;
    let info = stream.info().await.ok()?;
    let cluster = info.cluster.clone()?;
    let copies = cluster
        .replicas
        .iter()
        .map(|p| (p.name.clone(), p.current))
        .collect();
    Some((cluster.leader?, copies))
}

/// Move the leadership of every stream of the contract to the node that leads JOBS
/// (`$JS.API.STREAM.LEADER.STEPDOWN.<stream>` until that node is elected), so that killing
/// it takes every leader at once: the same placement in every run, and the worst one for
/// the jobs. Unless `lease_too`, the dispatchers' lease bucket is moved to another node
/// instead, so the leading dispatcher keeps its lease and decides through the failover
/// (with the lease on the killed node it stops deciding until the lease is back, and does
/// not meet the other streams' elections). Returns `stream ×stepdowns` for each stream moved.
async fn gather_leaders(
    client: &async_nats::Client,
    js: &jetstream::Context,
    lease_too: bool,
) -> anyhow::Result<Vec<String>> {
    const TRIES: usize = 20;
    let leader_of = |name: &'static str| async move {
        let mut stream = js.get_stream(name).await.ok()?;
        let info = stream.info().await.ok()?;
        info.cluster.clone()?.leader
    };
    let wait_leader = |name: &'static str| async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(l) = leader_of(name).await {
                return Ok(l);
            }
            if Instant::now() > deadline {
                bail!("{name} has no leader 30 s after a stepdown");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let target = wait_leader(metronome_protocol::names::STREAM_JOBS).await?;
    let mut moved = Vec::new();
    for name in metronome_protocol::setup::ALL_STREAMS {
        let mut stepdowns = 0;
        let mut now = wait_leader(name).await?;
        let elsewhere = name == "KV_leader" && !lease_too;
        while (now != target) != elsewhere {
            if stepdowns == TRIES {
                bail!("{name} still led by {now} after {TRIES} stepdowns (target {target})");
            }
            client
                .request(format!("$JS.API.STREAM.LEADER.STEPDOWN.{name}"), "".into())
                .await
                .with_context(|| format!("stepdown of {name}"))?;
            stepdowns += 1;
            // The old leader answers at once and leaves; wait for the one elected next.
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                tokio::time::sleep(Duration::from_millis(50)).await;
                match leader_of(name).await {
                    Some(l) if l != now => {
                        now = l;
                        break;
                    }
                    _ if Instant::now() > deadline => {
                        bail!("{name}: no new leader 30 s after a stepdown")
                    }
                    _ => {}
                }
            }
        }
        if stepdowns > 0 {
            moved.push(format!("{name} ×{stepdowns}"));
        }
    }
    Ok(moved)
}

/// A JetStream context on its own connection to one node other than `avoid`, which it
/// never leaves (no reconnection elsewhere), with short request timeouts: it sees the
/// cluster as a client of a surviving node does, without waiting out the reconnection of
/// a client that was on the killed node. Returns the node's name too.
async fn probe_off(system: &System, avoid: &str) -> anyhow::Result<(String, jetstream::Context)> {
    let env = read_env(&system.state_dir.join("env"))?;
    let urls = env.get("NATS_URL").context("NATS_URL in the env file")?;
    let auth = metronome_runtime::nats::NatsAuth::from_env(|k| env.get(k).cloned());
    for url in metronome_runtime::nats::server_urls(urls) {
        let client = auth
            .connect_options()?
            .ignore_discovered_servers()
            .connect(url)
            .await?;
        let name = client.server_info().server_name;
        if name != avoid {
            let js = jetstream::ContextBuilder::new()
                .timeout(Duration::from_secs(1))
                .build(client);
            return Ok((name, js));
        }
    }
    bail!("no NATS node other than {avoid} in {urls}")
}

/// The cluster drill's fault: find the nats-server leading JOBS (its server name is the
/// process name `./dev up` gave it, `nats-<n>`), SIGKILL it under load, watch the other
/// copies elect a leader (from a client of a surviving node), start it again after the
/// pause and watch it catch up. Checks (to `target.failures`): JOBS keeps three copies, a
/// leader is elected, the restarted node holds a current copy within the settle time.
async fn kill_nats_leader(
    plan: &DrillPlan,
    system: &System,
    client: &async_nats::Client,
    js: &jetstream::Context,
    target: &Target<'_>,
    restarted: &mut Vec<u32>,
    notes: &mut Vec<String>,
) -> anyhow::Result<(String, Instant)> {
    let fail = |s: String| target.failures.lock().unwrap().push(s);
    // One read of the stream's info gives both its copies and its leader.
    let (replicas, leader) = read_until(
        "reading the JOBS stream's configuration and cluster",
        Instant::now() + plan.settle,
        || async {
            let mut jobs = js
                .get_stream(metronome_protocol::names::STREAM_JOBS)
                .await?;
            let info = jobs.info().await?;
            let leader = info
                .cluster
                .as_ref()
                .and_then(|c| c.leader.clone())
                .context("the JOBS stream has no cluster leader (is NATS a cluster?)")?;
            Ok((info.config.num_replicas, leader))
        },
    )
    .await?;
    if replicas != CLUSTER_NODES {
        fail(format!(
            "JOBS keeps {replicas} copies on a cluster of {CLUSTER_NODES}: losing its node loses it"
        ));
    }
    let pid = system
        .pid_of(&leader)
        .with_context(|| format!("no pid file for the JOBS leader {leader}"))?;
    let image = Image::read(pid)?;
    // What else loses its leader with it: the streams are spread over the nodes, and the
    // failover of the workers or leader bucket is what tests the components' timeouts.
    let mut led = Vec::new();
    for name in metronome_protocol::setup::ALL_STREAMS {
        if let Ok(mut stream) = js.get_stream(name).await {
            if let Ok(info) = stream.info().await {
                if info.cluster.as_ref().and_then(|c| c.leader.as_deref()) == Some(leader.as_str())
                {
                    led.push(name);
                }
            }
        }
    }
    notes.push(format!("{leader} led {}", led.join(", ")));
    let (survivor, probe) = probe_off(system, &leader).await?;
    notes.push(format!(
        "the drill's client (submissions, live results and decisions) was connected to {}; the election was watched from {survivor}",
        client.server_info().server_name
    ));
    signal(pid, "KILL")?;
    let at = Instant::now();
    let restart_at = at + plan.pause;
    let deadline = at + plan.settle;
    let mut back = None;
    let mut elected = None;
    while elected.is_none() && Instant::now() < deadline {
        if back.is_none() && Instant::now() >= restart_at {
            restarted.push(image.spawn(&system.state_dir, &leader)?);
            back = Some(Instant::now());
        }
        // Before the restart a leader is a new one; after it, the old one may win again.
        if let Some((new, _)) = jobs_cluster(&probe)
            .await
            .filter(|(l, _)| *l != leader || back.is_some())
        {
            elected = Some((new, at.elapsed(), back.is_some()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match &elected {
        Some((new, after, restarted)) => notes.push(format!(
            "{new} leads JOBS {:.1} s after {leader} was killed{}",
            after.as_secs_f64(),
            if *restarted {
                " (after its restart)"
            } else {
                ""
            }
        )),
        None => fail(format!(
            "no JOBS leader {} s after {leader} was killed",
            plan.settle.as_secs()
        )),
    }
    if back.is_none() {
        tokio::time::sleep_until(restart_at.into()).await;
        restarted.push(image.spawn(&system.state_dir, &leader)?);
        back = Some(Instant::now());
    }
    let back = back.unwrap_or_else(Instant::now);
    let deadline = back + plan.settle;
    let mut current = false;
    while Instant::now() < deadline {
        if let Some((l, copies)) = jobs_cluster(&probe).await {
            let all = std::iter::once(l)
                .chain(copies.iter().filter(|(_, c)| *c).map(|(n, _)| n.clone()))
                .collect::<BTreeSet<_>>();
            if all.len() == CLUSTER_NODES && all.contains(&leader) {
                current = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if current {
        notes.push(format!(
            "{leader}, started again, holds a current copy of JOBS {:.1} s after its restart",
            back.elapsed().as_secs_f64()
        ));
    } else {
        fail(format!(
            "{leader} holds no current copy of JOBS {} s after its restart",
            plan.settle.as_secs()
        ));
    }
    Ok((
        format!(
            "SIGKILL the nats-server leading the JOBS stream ({leader}) of a {CLUSTER_NODES}-node cluster (every stream and bucket R{replicas}) mid-run; started again {:.0} s later",
            back.duration_since(at).as_secs_f64()
        ),
        at,
    ))
}

/// Requests the model server of `gpu` is running, once it runs any (polled for up to 10 s);
/// 0 if it ran none in that time.
async fn wait_running(system: &System, gpu: usize) -> u64 {
    let Some(url) = system.sim_urls.get(gpu) else {
        return 0;
    };
    let http = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let text = match http
            .get(format!("{url}/metrics"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let running = prometheus::sum(&text, metronome_gpu_sim::metrics::NUM_REQUESTS_RUNNING);
        if running >= 1.0 {
            return running as u64;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    0
}

/// The dispatchers `./dev up` starts, in the order of their metrics URLs.
const DISPATCHERS: [&str; 2] = ["dispatcher-a", "dispatcher-b"];

/// `kill-leader-amid-faults`: from the silent agent's SIGSTOP to the leader's SIGKILL:
/// within the dispatcher's death timeout, so the leader places on the silent agent
/// meanwhile.
const SILENT_BEFORE_KILL: Duration = Duration::from_millis(1_000);

/// How long a process may take to drain and exit on SIGTERM before the drill kills it (and
/// says so): above the agent's drain of its running jobs.
const STOP_WITHIN: Duration = Duration::from_secs(40);

/// How long a restarted process may take to be back.
const BACK_WITHIN: Duration = Duration::from_secs(60);

/// SIGTERM `name`, start it again once it has exited, and wait until it is back: a
/// dispatcher serves its metrics and some dispatcher leads, the gateway is ready, an agent
/// has stored a fresh heartbeat. Returns how long it was away.
async fn redeploy(
    system: &System,
    js: &jetstream::Context,
    name: &str,
    restarted: &mut Vec<u32>,
    notes: &mut Vec<String>,
) -> anyhow::Result<Duration> {
    let pid = system.pid_of(name).with_context(|| format!("{name} pid"))?;
    let image = Image::read(pid)?;
    let worker = name.strip_prefix("worker-").map(|g| format!("local-{g}"));
    let workers = js.get_key_value(BUCKET_WORKERS).await?;
    let t0 = Instant::now();
    signal(pid, "TERM")?;
    while alive(pid) && t0.elapsed() < STOP_WITHIN {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if alive(pid) {
        notes.push(format!(
            "{name} did not exit within {} s of SIGTERM and was killed",
            STOP_WITHIN.as_secs()
        ));
        signal(pid, "KILL")?;
    }
    let stopped_in = t0.elapsed();
    // The revision of the last heartbeat of the agent that stopped: the new one's is later.
    let before = match &worker {
        Some(w) => workers.entry(w.as_str()).await?.map_or(0, |e| e.revision),
        None => 0,
    };
    restarted.push(image.spawn(&system.state_dir, name)?);
    let http = reqwest::Client::new();
    let get_ok = |url: String| {
        let http = http.clone();
        async move {
            http.get(url)
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    };
    let deadline = Instant::now() + BACK_WITHIN;
    loop {
        let back = if let Some(w) = &worker {
            match workers.entry(w.as_str()).await {
                Ok(Some(e)) if e.revision > before => {
                    serde_json::from_slice::<WorkerStatus>(&e.value).is_ok_and(|s| !s.draining)
                }
                _ => false,
            }
        } else if name == "gateway" {
            get_ok(format!("{}/readyz", system.gateway_url)).await
        } else {
            let i = DISPATCHERS.iter().position(|d| *d == name).unwrap_or(0);
            let url = system
                .dispatcher_metrics
                .get(i)
                .cloned()
                .unwrap_or_default();
            get_ok(url).await && system.leader_name().await.is_ok()
        };
        if back {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{name} not back {} s after its restart",
                BACK_WITHIN.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::warn!(
        name,
        stopped_in_ms = stopped_in.as_millis() as u64,
        away_ms = t0.elapsed().as_millis() as u64,
        "redeployed"
    );
    Ok(t0.elapsed())
}

/// What the clients saw of a NATS node's loss at `mark`: how long no submission was
/// acknowledged (the sender waits for each acknowledgement, so this is how long JOBS took
/// nothing), and how long until the next decision.
fn outage_notes(seen: &Arc<Mutex<Seen>>, mark: Instant, sent: &Sent) -> Vec<String> {
    let secs = |t: Option<Instant>| {
        t.map_or("not seen".to_string(), |t| {
            format!("{:.1} s", t.duration_since(mark).as_secs_f64())
        })
    };
    let first_ack = sent.acked_at.values().copied().filter(|t| *t > mark).min();
    let first_decision = seen
        .lock()
        .unwrap()
        .decisions
        .iter()
        .copied()
        .find(|t| *t > mark);
    vec![format!(
        "after the kill: first submission acknowledged by JOBS {}, first decision {}",
        secs(first_ack),
        secs(first_decision)
    )]
}

/// The refusals agents published from the leader's kill at `mark` to the end of the
/// drill, by worker, and how many of them before the next leader's first decision
/// (`recover_ms` after the kill).
fn refusals_after(seen: &Arc<Mutex<Seen>>, mark: Instant, recover_ms: Option<u64>) -> String {
    let first_decision = recover_ms.map(|ms| mark + Duration::from_millis(ms));
    let mut by_worker: BTreeMap<String, usize> = BTreeMap::new();
    let mut leaderless = 0;
    for (at, worker) in &seen.lock().unwrap().refusals {
        if *at < mark {
            continue;
        }
        *by_worker.entry(worker.clone()).or_default() += 1;
        leaderless += usize::from(first_decision.is_none_or(|d| *at < d));
    }
    let total: usize = by_worker.values().sum();
    let list: Vec<String> = by_worker
        .iter()
        .map(|(w, n)| format!("{n} by {w}"))
        .collect();
    format!(
        "assignments refused after the leader's kill: {total} ({}), {leaderless} of them before the next leader's first decision",
        if list.is_empty() { "none".to_string() } else { list.join(", ") }
    )
}

/// Milliseconds from `mark` to the next decision (dispatcher kills), the next successful
/// final result (from `agent`'s worker for agent and model-server faults), or the first
/// successful final result of a job JetStream took after `mark` (a NATS node's kill).
async fn recovery(
    seen: &Arc<Mutex<Seen>>,
    fault: Fault,
    mark: Instant,
    agent: &str,
    sent: &Sent,
    wait: Duration,
) -> Option<u64> {
    let worker = agent.strip_prefix("worker-").map(|g| format!("local-{g}"));
    let deadline = Instant::now() + wait;
    loop {
        {
            let s = seen.lock().unwrap();
            let next = match fault {
                Fault::KillLeader | Fault::KillLeaderAmidFaults | Fault::KillDispatchers => {
                    s.decisions.iter().copied().find(|t| *t > mark)
                }
                Fault::RestartAgent | Fault::StopAgent | Fault::StopModelServer => s
                    .finals
                    .iter()
                    .find(|(t, w, _)| *t > mark && w.as_deref() == worker.as_deref())
                    .map(|(t, _, _)| *t),
                Fault::RedisDown
                | Fault::RestartNats
                | Fault::RollingDeploy
                | Fault::Hostile
                | Fault::GatewayFlood
                | Fault::CompromisedWorker => {
                    s.finals.iter().map(|(t, _, _)| *t).find(|t| *t > mark)
                }
                Fault::KillNatsLeader => s
                    .finals
                    .iter()
                    .find(|(t, _, job)| {
                        *t > mark && sent.acked_at.get(job).is_some_and(|a| *a > mark)
                    })
                    .map(|(t, _, _)| *t),
            };
            if let Some(t) = next {
                return Some(t.duration_since(mark).as_millis() as u64);
            }
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until every sent job has a final result, or until nothing new arrived for a while
/// after `settle`; returns the final results by job id.
async fn settle(
    js: &jetstream::Context,
    start_seq: u64,
    sent: &[String],
    settle: Duration,
) -> anyhow::Result<BTreeMap<String, Vec<FinalResult>>> {
    let deadline = Instant::now() + settle;
    loop {
        let finals = read_until(
            "reading the drill's final results from RESULTS",
            deadline.max(Instant::now() + READ_GRACE),
            || read_finals(js, start_seq),
        )
        .await?;
        let missing = sent.iter().filter(|id| !finals.contains_key(*id)).count();
        if missing == 0 || Instant::now() > deadline {
            return Ok(finals);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The least time [`read_until`] is given for a read, even past the caller's deadline.
const READ_GRACE: Duration = Duration::from_secs(10);

/// `read` (a JetStream read of the drill's own client) again, 250 ms apart, until it
/// succeeds or `deadline` has passed; then its last error, saying what was read and how
/// often. A NATS node killed or restarted (`kill-nats-leader`, `restart-nats`) leaves the
/// client reconnecting, and the cluster electing leaders, for some seconds: a read that
/// times out then says nothing about the jobs, and must not end the drill.
async fn read_until<T, F, Fut>(what: &str, deadline: Instant, mut read: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        tries += 1;
        match read().await {
            Ok(v) => {
                if tries > 1 {
                    tracing::warn!(what, tries, "drill read succeeded after failures");
                }
                return Ok(v);
            }
            Err(e) if Instant::now() < deadline => {
                tracing::warn!(what, tries, error = %format!("{e:#}"), "drill read failed, trying again");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => {
                return Err(e.context(format!(
                    "{what}: failed {tries} times in {:.1} s",
                    started.elapsed().as_secs_f64()
                )))
            }
        }
    }
}

async fn results_last_seq(js: &jetstream::Context) -> anyhow::Result<u64> {
    let mut stream = js.get_stream(STREAM_RESULTS).await?;
    Ok(stream.info().await?.state.last_sequence)
}

/// Every final result in RESULTS after `start_seq`, by job id.
async fn read_finals(
    js: &jetstream::Context,
    start_seq: u64,
) -> anyhow::Result<BTreeMap<String, Vec<FinalResult>>> {
    let mut stream = js.get_stream(STREAM_RESULTS).await?;
    let last = stream.info().await?.state.last_sequence;
    let mut out: BTreeMap<String, Vec<FinalResult>> = BTreeMap::new();
    if last <= start_seq {
        return Ok(out);
    }
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start_seq + 1,
            },
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    while let Some(m) = tokio::time::timeout(Duration::from_secs(5), messages.next())
        .await
        .ok()
        .flatten()
    {
        let m = m?;
        let seq = m.info().map(|i| i.stream_sequence).unwrap_or(last);
        // RESULTS keeps one final per job and publisher; readers accept the first stored
        // of the leader's and the assigned worker's (`metronome_protocol::stored`). No
        // drill forges results, so that is the job's first stored final: a later one is a
        // worker finishing a job the leader had already settled (declared lost, or
        // re-assigned after a pause), which no reader accepts and the runs account for.
        if let Ok(f) = serde_json::from_slice::<FinalResult>(&m.payload) {
            let list = out.entry(f.job_id.clone()).or_default();
            if list.is_empty() {
                list.push(f);
            }
        }
        if seq >= last {
            break;
        }
    }
    Ok(out)
}

/// The jobs a drill offered, and what its HTTP client saw of those sent through the gateway.
#[derive(Debug, Default)]
struct Sent {
    /// Every job the system took (JetStream acknowledged it, or the gateway answered with
    /// its id), in order.
    ids: Vec<String>,
    /// When JetStream acknowledged each job submitted on `jobs.submit` (not over HTTP).
    acked_at: BTreeMap<String, Instant>,
    /// What the HTTP client saw, by job id.
    http: BTreeMap<String, HttpOutcome>,
    /// HTTP requests made (each tried until the gateway took it).
    http_tries: usize,
    /// Tries the gateway did not take (no connection, no response, 503), tried again.
    http_refused: usize,
    /// Requests the gateway never took within a minute (no job id).
    http_not_taken: usize,
}

/// Offer jobs at `rate` per second until `stop`; every fourth goes through `gateway` over
/// HTTP when given, the rest on `jobs.submit._anon`.
async fn send_jobs(
    client: async_nats::Client,
    gateway: Option<String>,
    rate: f64,
    stop: CancellationToken,
    streaming: Arc<AtomicUsize>,
    prefix: &str,
) -> anyhow::Result<Sent> {
    let js = jetstream::new(client);
    let http = reqwest::Client::new();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = tokio::time::Instant::now();
    let mut sent = Sent::default();
    let mut over_http = Vec::new();
    let mut n = 0u64;
    while !stop.is_cancelled() {
        let id = format!("{prefix}-{n}");
        n += 1;
        if let Some(url) = gateway.as_ref().filter(|_| n % 4 == 0) {
            let (http, url, streaming) = (http.clone(), url.clone(), streaming.clone());
            over_http.push(tokio::spawn(async move {
                gateway_client::stream_chat(&http, &url, "llama-3.1-8b", &streaming).await
            }));
        } else if submit(&js, &id).await? {
            sent.acked_at.insert(id.clone(), Instant::now());
            sent.ids.push(id);
        }
        tokio::select! {
            _ = tokio::time::sleep_until(start + interval.mul_f64(n as f64)) => {}
            _ = stop.cancelled() => {}
        }
    }
    for task in over_http {
        let job = task.await?;
        sent.http_tries += 1;
        sent.http_refused += job.refused;
        match job.job_id {
            Some(id) => {
                sent.ids.push(id.clone());
                sent.http.insert(id, job.outcome);
            }
            None => sent.http_not_taken += 1,
        }
    }
    Ok(sent)
}

/// Submit job `id` (no tenant) on `jobs.submit._anon`; whether JetStream took it.
async fn submit(js: &jetstream::Context, id: &str) -> anyhow::Result<bool> {
    let job = Job {
        v: PROTOCOL_VERSION,
        id: id.to_string(),
        model: "llama-3.1-8b".into(),
        endpoint: Endpoint::Chat,
        request: json!({"model": "llama-3.1-8b", "stream": true,
            "messages": [{"role": "user", "content": "a fault drill, tell me a story"}],
            "max_tokens": 24}),
        prompt_tokens: 12,
        max_tokens: 24,
        submitted_ms: metronome_protocol::time::unix_ms(),
        deadline_ms: Some(metronome_protocol::time::unix_ms() + 120_000),
        slo: None,
        tenant: None,
        priority: Default::default(),
        prefix: None,
        traceparent: None,
    };
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(HEADER_MSG_ID, id);
    // A submission during a NATS restart is retried until JetStream takes it: the client
    // knows it was not accepted, so it is not counted as sent before then.
    let body: bytes::Bytes = serde_json::to_vec(&job)?.into();
    for _ in 0..200 {
        let ack = match js
            .publish_with_headers(submit_subject(None), headers.clone(), body.clone())
            .await
        {
            Ok(f) => f.await.is_ok(),
            Err(_) => false,
        };
        if ack {
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(false)
}

/// The command line as the report shows it: without the options that name this machine's
/// folders (`--repo`, `--report`), which say nothing about what was run.
pub fn shown_command(command: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut skip_value = false;
    for word in command.split_whitespace() {
        if skip_value {
            skip_value = false;
            continue;
        }
        if word == "--repo" || word == "--report" {
            skip_value = true;
            continue;
        }
        if word.starts_with("--repo=") || word.starts_with("--report=") {
            continue;
        }
        out.push(word);
    }
    out.join(" ")
}

/// How to run the drills, as RELIABILITY.md says it.
pub const HOW_TO_RUN: &str = "## How to run\n\n\
Build the binaries first; the drills start whole systems with `./dev up` and need nats-server and redis-server on PATH.\n\n\
```sh\n\
./dev test                                   # runs tests/suites/drills.sh: every drill at CI size (--short)\n\
cargo build --release --bins\n\
target/release/metronome-drill --profile release                  # every drill, full size, writes RELIABILITY.md\n\
target/release/metronome-drill --profile release --only kill-leader --rate 40 --load-secs 250   # one drill, 10,000 jobs\n\
```\n\n\
`--short` is the CI size (8 s of load per drill, 3 s outages), `--only` picks drills, `--rate` and `--load-secs` size the load, `--report FILE` writes elsewhere. The exit status is non-zero when a job is lost or run twice, or a drill's own check fails.\n\n";

/// RELIABILITY.md from the reports: what the drills are, how to run them, then this run.
pub fn render_report(plan: &DrillPlan, reports: &[DrillReport]) -> String {
    let mut out = String::new();
    out.push_str("# Reliability: fault drills\n\n");
    out.push_str(
        "Each drill starts a real system, offers it jobs, injects one fault mid-run and \
         then counts by job id, from the RESULTS stream (every final result) and the chunks \
         the drill's client received, never from logs. *Exactly once*: one final result, a \
         success. *Failed*: final results, none a success (the client got an error with a \
         reason). *Lost*: no final result. *Duplicated*: two successful final results, or \
         chunks from two runs (worker, attempt). *Recover*: from the fault (leader kill, also \
         amid faults) or the repair (restart, SIGCONT, end of the rolling deploy) to the next \
         decision (dispatcher kills) or the next successful result (of the faulted worker for \
         agent and model-server drills); for a NATS node's kill, from the kill to the first \
         successful result of a job JetStream took after it. A drill fails on any lost or \
         duplicated job.\n\n",
    );
    out.push_str("## The drills\n\n| drill | what it does and what must hold |\n|---|---|\n");
    for f in Fault::ALL {
        out.push_str(&format!("| {} | {} |\n", f.name(), f.purpose()));
    }
    out.push('\n');
    out.push_str(HOW_TO_RUN);
    out.push_str("## Results\n\n");
    out.push_str(&format!(
        "Produced by `{}` on a real system (`./dev up --keep-going`, {} simulated GPUs, real \
         nats-server with file storage and redis-server, dispatcher leader + standby), \
         {:.0} jobs/s offered on `jobs.submit._anon` for {} s per drill, fault at a third of it.\n\n",
        shown_command(&plan.command),
        plan.gpus,
        plan.rate,
        plan.load.as_secs()
    ));
    if plan.faults.iter().any(|f| f.nats_nodes() > 1) {
        out.push_str(&format!(
            "The NATS cluster drills run on a second system, `./dev up --keep-going \
             --nats-cluster {CLUSTER_NODES}`: {CLUSTER_NODES} nats-servers clustered on \
             loopback, each with its own file store, every stream and bucket with \
             {CLUSTER_NODES} replicas, every component given every node's URL.\n\n"
        ));
    }
    out.push_str("| drill | what was done | sent | exactly once | failed (reason) | lost | duplicated | recover |\n");
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|\n");
    for r in reports {
        let reasons: Vec<String> = r
            .failure_reasons
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {}{} | {} | {} | {} |\n",
            r.fault,
            r.what,
            r.sent,
            r.exactly_once,
            r.failed_with_reason,
            if reasons.is_empty() {
                String::new()
            } else {
                format!(" ({})", reasons.join(", "))
            },
            r.lost,
            r.duplicated,
            r.recover_ms
                .map_or("not seen".into(), |ms| format!("{:.1} s", ms as f64 / 1e3)),
        ));
    }
    for r in reports {
        if let Some(h) = &r.http {
            out.push_str(&format!(
                "\n{}: of its jobs, {} went through the gateway over HTTP (streaming): {} \
                 complete, {} ended with a clear error, {} broke without one (counted lost); \
                 the gateway did not take {} tries (no connection or 503 while it restarted), \
                 which the client sent again; {} never taken.\n",
                r.fault, h.sent, h.complete, h.clear_error, h.broken, h.refused, h.not_taken
            ));
        }
        for note in &r.notes {
            out.push_str(&format!("\n{}: {note}\n", r.fault));
        }
        for failure in &r.failures {
            out.push_str(&format!("\n{}: **check failed**: {failure}\n", r.fault));
        }
    }
    let anomalies: Vec<(&str, &String)> = reports
        .iter()
        .flat_map(|r| r.anomalies.iter().map(move |a| (r.fault.as_str(), a)))
        .collect();
    if !anomalies.is_empty() {
        out.push_str(
            "\nLost or duplicated jobs (job: finals stored, runs whose chunks the client saw):\n\n",
        );
        for (fault, a) in anomalies {
            out.push_str(&format!("- {fault}: {a}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use metronome_protocol::{ErrorCode, ResultError, Usage};

    use super::*;

    fn fin(job: &str, worker: &str, error: Option<ErrorCode>) -> FinalResult {
        FinalResult {
            v: PROTOCOL_VERSION,
            job_id: job.into(),
            worker_id: Some(worker.into()),
            response: None,
            error: error.map(|code| ResultError {
                code,
                message: "why".into(),
            }),
            usage: Usage::default(),
            chunks: 0,
            ttft_ms: None,
            e2e_ms: None,
        }
    }

    #[test]
    fn the_report_lists_every_drill_and_how_to_run_it_without_this_machines_folders() {
        assert_eq!(
            shown_command(
                "metronome-drill --repo /srv/x --short --report=/var/r.md --only hostile"
            ),
            "metronome-drill --short --only hostile"
        );
        let plan = DrillPlan {
            command: "metronome-drill --short --report /srv/out/R.md".into(),
            faults: vec![Fault::KillLeader],
            gpus: 3,
            rate: 10.0,
            load: Duration::from_secs(8),
            repo: PathBuf::from("/srv/repo"),
            profile: "debug".into(),
            pause: Duration::from_secs(3),
            redis_outage: Duration::from_secs(3),
            settle: Duration::from_secs(30),
            hostile_messages: 5_000,
            hostile_seed: 9,
            hostile_rate: 1_000.0,
            flood_requests: 2_000,
            flood_concurrency: 2_000,
            lease_on_killed_node: false,
            state_dir: PathBuf::from("/srv/state"),
        };
        let report = DrillReport {
            fault: "kill-leader".into(),
            what: "SIGKILL the leader".into(),
            sent: 80,
            exactly_once: 80,
            recover_ms: Some(2_900),
            ..Default::default()
        };
        let md = render_report(&plan, &[report]);
        for f in Fault::ALL {
            assert!(
                md.contains(&format!("| {} | {} |", f.name(), f.purpose())),
                "{} is not listed:\n{md}",
                f.name()
            );
        }
        let (drills, how, results) = (
            md.find("## The drills").unwrap(),
            md.find("## How to run").unwrap(),
            md.find("## Results").unwrap(),
        );
        assert!(drills < how && how < results, "{md}");
        assert!(
            md.contains("Produced by `metronome-drill --short` on a real system"),
            "{md}"
        );
        assert!(
            md.contains("| kill-leader | SIGKILL the leader | 80 | 80 | 0 | 0 | 0 | 2.9 s |"),
            "{md}"
        );
        assert!(!md.contains("/srv/"), "{md}");
    }

    /// A read that fails while a NATS node is away is tried again until it succeeds; one
    /// that still fails at the deadline ends the drill with what was read and how often.
    #[tokio::test]
    async fn a_failed_read_is_tried_again_until_its_deadline() {
        let mut calls = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        let v = read_until("the answer", deadline, || {
            calls += 1;
            let n = calls;
            async move {
                if n < 3 {
                    bail!("request timed out")
                }
                Ok(n)
            }
        })
        .await
        .unwrap();
        assert_eq!(v, 3);

        let deadline = Instant::now() + Duration::from_millis(600);
        let e = read_until("RESULTS", deadline, || async {
            Err::<u64, _>(anyhow::anyhow!("request timed out"))
        })
        .await
        .unwrap_err();
        let text = format!("{e:#}");
        assert!(text.starts_with("RESULTS: failed "), "{text}");
        assert!(text.ends_with("request timed out"), "{text}");
        assert!(Instant::now() >= deadline);
    }

    /// Every job lands in exactly one of exactly once, failed, lost, duplicated (chunks of
    /// two runs next to one success used to count as exactly once too); an HTTP client's
    /// broken stream is lost whatever RESULTS holds, and its clear
    /// error is a failure with the client's code even without a stored final result.
    #[test]
    fn each_job_is_counted_once_and_the_http_clients_view_counts() {
        let ids = [
            "ok", "failed", "missing", "twice", "two-runs", "broken", "refused",
        ];
        let mut sent = Sent {
            ids: ids.iter().map(|s| s.to_string()).collect(),
            http_tries: 3,
            ..Default::default()
        };
        sent.http
            .insert("broken".into(), HttpOutcome::Broken("cut".into()));
        sent.http.insert(
            "refused".into(),
            HttpOutcome::ClearError("jobs_stream_full".into()),
        );
        sent.http.insert("ok".into(), HttpOutcome::Complete);
        let mut finals: BTreeMap<String, Vec<FinalResult>> = BTreeMap::new();
        finals.insert("ok".into(), vec![fin("ok", "w0", None)]);
        finals.insert(
            "failed".into(),
            vec![fin("failed", "w1", Some(ErrorCode::WorkerFailed))],
        );
        finals.insert(
            "twice".into(),
            vec![fin("twice", "w0", None), fin("twice", "w1", None)],
        );
        finals.insert("two-runs".into(), vec![fin("two-runs", "w0", None)]);
        finals.insert("broken".into(), vec![fin("broken", "w2", None)]);
        let mut runs: BTreeMap<String, BTreeSet<(String, Option<u32>)>> = BTreeMap::new();
        runs.entry("two-runs".into())
            .or_default()
            .extend([("w0".to_string(), Some(1)), ("w1".to_string(), Some(2))]);

        let r = account(&sent, &finals, &runs);
        assert_eq!(r.sent, 7);
        assert_eq!(r.exactly_once, 1, "{r:?}");
        assert_eq!(
            r.exactly_once + r.failed_with_reason + r.lost + r.duplicated,
            r.sent
        );
        assert_eq!(r.failed_with_reason, 2, "{r:?}");
        assert_eq!(r.lost, 2, "missing, broken: {r:?}");
        assert_eq!(r.duplicated, 2, "twice, two-runs: {r:?}");
        assert_eq!(r.failure_reasons.get("WorkerFailed"), Some(&1));
        assert_eq!(r.failure_reasons.get("jobs_stream_full"), Some(&1));
        assert_eq!(r.anomalies.len(), 4, "{:?}", r.anomalies);
        let http = r.http.expect("an HTTP account");
        assert_eq!(
            (http.sent, http.complete, http.clear_error, http.broken),
            (3, 1, 1, 1)
        );
        assert!(!DrillReport {
            lost: 0,
            duplicated: 0,
            http: Some(HttpAccount {
                not_taken: 1,
                ..Default::default()
            }),
            ..Default::default()
        }
        .passed());
    }
}
