//! Fault drills: a real system (`./dev up --keep-going`, simulated GPUs, real NATS and
//! Redis) under a steady stream of jobs, one fault per drill, and an account of every job
//! by its id.
//!
//! Jobs are submitted on `jobs.submit` (the NATS contract, `Nats-Msg-Id` = job id). The
//! account reads the RESULTS stream (every final result of the drill's jobs, from the
//! stream's sequence at the drill's start) and the chunks the drill's own client received
//! on `results.<job>.chunk`; never logs. Per job:
//! - *completed exactly once*: exactly one final result, a success;
//! - *failed with a reason*: final results, none a success (the client got an error);
//! - *lost*: no final result once the system has been idle for the settle time;
//! - *duplicated*: more than one successful final result, or chunks from more than one run
//!   (worker and attempt) — a client would have seen output twice.
//!
//! Time to recover: from the fault (leader kill) or the repair (restart, SIGCONT) to the
//! next decision on `decisions.>` (leader kill) or the next successful final result.
//!
//! Processes are killed and restarted by their pid files under `<state>/run/`; a restarted
//! process gets the command line, environment and working folder of the one it replaces
//! (read from `/proc`), its log appended, and its new pid written back, so a later drill
//! finds it. The drill stops what it started when the system stops.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use async_nats::jetstream;
use futures::StreamExt;
use metronome_protocol::names::{HEADER_MSG_ID, STREAM_RESULTS, SUBJECT_JOBS_SUBMIT};
use metronome_protocol::{Endpoint, FinalResult, Job, ResultChunk, PROTOCOL_VERSION};
use serde_json::json;

use crate::bench::system::{prometheus_sum, System, SystemSpec};

/// The faults a drill can inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the leading dispatcher; the standby takes over; the killed one is restarted.
    KillLeader,
    /// SIGKILL a worker-agent with jobs in flight and restart it within 2 s.
    RestartAgent,
    /// SIGSTOP a worker-agent (alive but silent), SIGCONT after the pause.
    StopAgent,
    /// SIGKILL redis-server, start it again after the pause.
    RedisDown,
    /// SIGTERM nats-server (file storage), start it again at once.
    RestartNats,
}

impl Fault {
    pub const ALL: [Fault; 5] = [
        Fault::KillLeader,
        Fault::RestartAgent,
        Fault::StopAgent,
        Fault::RedisDown,
        Fault::RestartNats,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillLeader => "kill-leader",
            Fault::RestartAgent => "restart-agent",
            Fault::StopAgent => "stop-agent",
            Fault::RedisDown => "redis-down",
            Fault::RestartNats => "restart-nats",
        }
    }
}

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
    /// SIGSTOP length.
    pub pause: Duration,
    /// Redis outage length.
    pub redis_outage: Duration,
    /// Longest wait for the last jobs to settle after the load ends.
    pub settle: Duration,
    pub faults: Vec<Fault>,
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
}

impl DrillReport {
    /// A drill passes when no job was lost or duplicated.
    pub fn passed(&self) -> bool {
        self.lost == 0 && self.duplicated == 0
    }
}

/// What the drill's client saw of its jobs (chunks by run, decisions' arrival times).
#[derive(Default)]
struct Seen {
    runs: BTreeMap<String, BTreeSet<(String, Option<u32>)>>,
    decisions: Vec<Instant>,
    /// (arrival, worker) of successful final results seen live.
    finals: Vec<(Instant, Option<String>)>,
}

/// Run every drill of `plan` on one system; returns the reports in order.
pub async fn run_drills(plan: &DrillPlan) -> anyhow::Result<Vec<DrillReport>> {
    let spec = SystemSpec {
        repo: plan.repo.clone(),
        gpus: plan.gpus,
        model: "llama-3.1-8b".into(),
        speeds: vec!["1.0".into(); plan.gpus],
        policy: "metronome".into(),
        state_dir: plan.state_dir.clone(),
        sim_args: Vec::new(),
        worker_max_concurrency: None,
        profile: plan.profile.clone(),
        keep_going: true,
        gateway_extra_toml: None,
    };
    let mut system = System::up(&spec).await.context("starting the system")?;
    let env = read_env(&plan.state_dir.join("env"))?;
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
        .connect(nats_url.as_str())
        .await?;
    let js = jetstream::new(client.clone());
    let seen = Arc::new(Mutex::new(Seen::default()));
    spawn_watchers(&client, seen.clone()).await?;
    let mut restarted = Vec::new();
    let mut reports = Vec::new();
    for (i, fault) in plan.faults.iter().enumerate() {
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
                    s.lock().unwrap().finals.push((now, f.worker_id));
                }
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
    let start_seq = results_last_seq(js).await?;
    let prefix = format!("drill{index}-{}-{}", fault.name(), std::process::id());
    let sender = {
        let client = client.clone();
        let (rate, load, prefix) = (plan.rate, plan.load, prefix.clone());
        tokio::spawn(async move { send_jobs(client, rate, load, &prefix).await })
    };
    tokio::time::sleep(plan.load / 3).await;
    let agent = format!("worker-gpu{}", index % plan.gpus);
    let (what, mark) = inject(plan, system, fault, &agent, restarted).await?;
    let sent = sender.await??;
    let recover_ms = recovery(seen, fault, mark, &agent, plan.settle).await;
    let finals = settle(js, start_seq, &sent, plan.settle).await?;
    let runs = seen.lock().unwrap().runs.clone();
    let mut report = DrillReport {
        fault: fault.name().into(),
        what,
        sent: sent.len(),
        recover_ms,
        ..Default::default()
    };
    for id in &sent {
        let list = finals.get(id).map(Vec::as_slice).unwrap_or_default();
        let ok = list.iter().filter(|f| f.error.is_none()).count();
        let run_count = runs.get(id).map_or(0, BTreeSet::len);
        // Two successes, a success next to an error, or chunks of two runs: the job ran
        // twice as far as a client can tell.
        let duplicated = ok > 1 || run_count > 1 || (ok >= 1 && list.len() > 1);
        if duplicated {
            report.duplicated += 1;
        }
        if duplicated || list.is_empty() {
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
            report.anomalies.push(format!(
                "{id}: {} — finals [{}], chunk runs [{}]",
                if duplicated { "duplicated" } else { "lost" },
                finals.join(", "),
                runs.join(", ")
            ));
        }
        if list.is_empty() {
            report.lost += 1;
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
    Ok(report)
}

/// Inject `fault`; returns what was done and the instant recovery is measured from.
async fn inject(
    plan: &DrillPlan,
    system: &System,
    fault: Fault,
    agent: &str,
    restarted: &mut Vec<u32>,
) -> anyhow::Result<(String, Instant)> {
    Ok(match fault {
        Fault::KillLeader => {
            let leader = leader_name(system).await?;
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
        Fault::RestartAgent => {
            let pid = system.pid_of(agent).context("agent pid")?;
            let image = Image::read(pid)?;
            signal(pid, "KILL")?;
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            restarted.push(image.spawn(&system.state_dir, agent)?);
            (
                format!("SIGKILL {agent} with jobs in flight, restarted 1 s later"),
                Instant::now(),
            )
        }
        Fault::StopAgent => {
            let pid = system.pid_of(agent).context("agent pid")?;
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
    })
}

/// Milliseconds from `mark` to the next decision (leader kill) or the next successful final
/// result (from `agent`'s worker for agent faults).
async fn recovery(
    seen: &Arc<Mutex<Seen>>,
    fault: Fault,
    mark: Instant,
    agent: &str,
    wait: Duration,
) -> Option<u64> {
    let worker = agent.strip_prefix("worker-").map(|g| format!("local-{g}"));
    let deadline = Instant::now() + wait;
    loop {
        {
            let s = seen.lock().unwrap();
            let next = match fault {
                Fault::KillLeader => s.decisions.iter().copied().find(|t| *t > mark),
                Fault::RestartAgent | Fault::StopAgent => s
                    .finals
                    .iter()
                    .find(|(t, w)| *t > mark && w.as_deref() == worker.as_deref())
                    .map(|(t, _)| *t),
                Fault::RedisDown | Fault::RestartNats => {
                    s.finals.iter().map(|(t, _)| *t).find(|t| *t > mark)
                }
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
        let finals = read_finals(js, start_seq).await?;
        let missing = sent.iter().filter(|id| !finals.contains_key(*id)).count();
        if missing == 0 || Instant::now() > deadline {
            return Ok(finals);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
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
        if let Ok(f) = serde_json::from_slice::<FinalResult>(&m.payload) {
            out.entry(f.job_id.clone()).or_default().push(f);
        }
        if seq >= last {
            break;
        }
    }
    Ok(out)
}

/// Offer jobs at `rate` per second for `load`; returns their ids.
async fn send_jobs(
    client: async_nats::Client,
    rate: f64,
    load: Duration,
    prefix: &str,
) -> anyhow::Result<Vec<String>> {
    let js = jetstream::new(client);
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = tokio::time::Instant::now();
    let mut ids = Vec::new();
    let mut n = 0u64;
    while start.elapsed() < load {
        let id = format!("{prefix}-{n}");
        n += 1;
        let job = Job {
            v: PROTOCOL_VERSION,
            id: id.clone(),
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
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(HEADER_MSG_ID, id.as_str());
        // A submission during a NATS restart is retried until JetStream takes it: the
        // client knows it was not accepted, so it is not counted as sent before then.
        let body: bytes::Bytes = serde_json::to_vec(&job)?.into();
        let mut accepted = false;
        for _ in 0..200 {
            let ack = match js
                .publish_with_headers(SUBJECT_JOBS_SUBMIT, headers.clone(), body.clone())
                .await
            {
                Ok(f) => f.await.is_ok(),
                Err(_) => false,
            };
            if ack {
                accepted = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if accepted {
            ids.push(id);
        }
        tokio::time::sleep_until(start + interval.mul_f64(n as f64)).await;
    }
    Ok(ids)
}

/// Which dispatcher leads (`metronome_dispatcher_leader` 1 on its `/metrics`).
pub(crate) async fn leader_name(system: &System) -> anyhow::Result<String> {
    let http = reqwest::Client::new();
    for (i, url) in system.dispatcher_metrics.iter().enumerate() {
        let text = http
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .text()
            .await?;
        if prometheus_sum(&text, "metronome_dispatcher_leader") > 0.0 {
            // `./dev up` starts dispatcher-a then -b; their metrics URLs sort the same way.
            return Ok(format!("dispatcher-{}", ["a", "b"][i.min(1)]));
        }
    }
    bail!("no dispatcher says it leads")
}

pub(crate) fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill -{sig} {pid} failed");
    }
    Ok(())
}

pub(crate) fn stop_restarted(pids: &[u32]) {
    for pid in pids.iter().rev() {
        let _ = signal(*pid, "TERM");
    }
    // A process that does not end on SIGTERM within 5 s (an agent whose NATS is already
    // gone waits for it) is killed: a drill leaves nothing running behind it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && pids.iter().any(|p| alive(*p)) {
        std::thread::sleep(Duration::from_millis(100));
    }
    for pid in pids {
        if alive(*pid) {
            let _ = signal(*pid, "KILL");
        }
    }
}

/// Whether `pid` runs (an exited child not yet reaped, a zombie, does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next())
        })
        .is_some_and(|state| state != 'Z')
}

/// What it takes to start a process again as it was.
pub(crate) struct Image {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
}

impl Image {
    pub(crate) fn read(pid: u32) -> anyhow::Result<Image> {
        let split = |bytes: Vec<u8>| -> Vec<String> {
            // NUL-terminated entries; an empty argument (`--save ""`) is kept.
            let body = bytes.strip_suffix(&[0]).unwrap_or(&bytes);
            if body.is_empty() {
                return Vec::new();
            }
            body.split(|b| *b == 0)
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        let argv = split(std::fs::read(format!("/proc/{pid}/cmdline"))?);
        let env = split(std::fs::read(format!("/proc/{pid}/environ"))?)
            .into_iter()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.into(), v.into())))
            .collect();
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"))?;
        if argv.is_empty() {
            bail!("process {pid} has no command line");
        }
        Ok(Image { argv, env, cwd })
    }

    /// redis-server rewrites its command line (`redis-server 127.0.0.1:PORT`), so its
    /// arguments are rebuilt as `./dev up` passes them, with the port from the env file.
    fn redis(pid: u32, state_dir: &Path) -> anyhow::Result<Image> {
        let mut image = Image::read(pid)?;
        let env = read_env(&state_dir.join("env"))?;
        let url = env.get("REDIS_URL").context("REDIS_URL in the env file")?;
        let port = url
            .trim_end_matches('/')
            .rsplit(':')
            .next()
            .context("a port in REDIS_URL")?
            .to_string();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
        let dir = state_dir.join("redis");
        image.argv = vec![
            exe.display().to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port,
            "--dir".into(),
            dir.display().to_string(),
            "--appendonly".into(),
            "yes".into(),
            "--save".into(),
            String::new(),
            "--maxmemory".into(),
            "256mb".into(),
            "--maxmemory-policy".into(),
            "noeviction".into(),
        ];
        Ok(image)
    }

    /// Start it again, appending to `<state>/logs/<name>.log`, and record its pid.
    pub(crate) fn spawn(&self, state_dir: &Path, name: &str) -> anyhow::Result<u32> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(state_dir.join(format!("logs/{name}.log")))?;
        let child = std::process::Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&self.cwd)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("restarting {name}"))?;
        let pid = child.id();
        std::fs::write(state_dir.join(format!("run/{name}.pid")), pid.to_string())?;
        Ok(pid)
    }
}

fn read_env(path: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}

/// RELIABILITY.md from the reports.
pub fn render_report(plan: &DrillPlan, reports: &[DrillReport]) -> String {
    let mut out = String::new();
    out.push_str("# Reliability: fault drills\n\n");
    out.push_str(&format!(
        "Produced by `{}` on a real system (`./dev up --keep-going`, {} simulated GPUs, real \
         nats-server with file storage and redis-server, dispatcher leader + standby), \
         {:.0} jobs/s offered on `jobs.submit` for {} s per drill, fault at a third of it.\n\n",
        plan.command,
        plan.gpus,
        plan.rate,
        plan.load.as_secs()
    ));
    out.push_str(
        "Counted by job id from the RESULTS stream (every final result) and the chunks the \
         drill's client received, never from logs. *Exactly once*: one final result, a \
         success. *Failed*: final results, none a success (the client got an error with a \
         reason). *Lost*: no final result. *Duplicated*: two successful final results, or \
         chunks from two runs (worker, attempt). *Recover*: fault (leader kill) or repair to \
         the next decision (leader kill) or the next successful result (of the faulted \
         worker for agent drills).\n\n",
    );
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
