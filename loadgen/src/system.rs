//! One Metronome system under test, started with `./dev up --no-build` as a child process in
//! its own process group and stopped with SIGTERM (which `./dev up` turns into a graceful
//! stop of everything it started), plus the probes the benchmark (`metronome-bench`) and
//! the fault drills (`metronome-drill`) need: the simulated GPUs'
//! Prometheus metrics, their idleness, the dispatchers' queue depth (each dispatcher's
//! `metrics_addr`, which `./dev up` writes to `<state>/config/dispatcher-*.toml`), the
//! decisions on the record, and every process's resident memory.
//!
//! Invariant: a [`System`] is stopped when dropped, so a failed benchmark never leaves a
//! cluster running; `stop` waits for `./dev up` to exit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use metronome_protocol::prometheus;

/// How to start a system.
#[derive(Debug, Clone)]
pub struct SystemSpec {
    pub repo: PathBuf,
    pub gpus: usize,
    pub model: String,
    /// Speed factor per GPU (`--speeds`).
    pub speeds: Vec<String>,
    pub policy: String,
    pub state_dir: PathBuf,
    /// Extra `--sim-arg` values.
    pub sim_args: Vec<String>,
    /// `WORKER_MAX_CONCURRENCY` for the worker-agents, when set (experiments only: the
    /// published figures use `./dev up`'s default).
    pub worker_max_concurrency: Option<u32>,
    /// Build profile whose binaries run (`release` for published figures).
    pub profile: String,
    /// `./dev up --keep-going`: a process that exits does not stop the system (fault
    /// drills kill and restart processes).
    pub keep_going: bool,
    /// TOML appended to the gateway's config (`[[tenants]]` and `[[keys]]`: the fairness
    /// drill's API keys); `None` leaves `./dev up`'s gateway config as it is.
    pub gateway_extra_toml: Option<String>,
    /// NATS servers: 1, or a cluster of 3 with every stream and bucket R3
    /// (`./dev up --nats-cluster 3`).
    pub nats_cluster: usize,
    /// The gateway's port for the first start (`None`: a free one). A second start, after
    /// a failed first, always takes a free one. Set only by the test that makes the first
    /// start fail on a port another process holds.
    pub first_gateway_port: Option<u16>,
}

/// `./dev up` exited before it wrote `<state>/env`: a process of the system did not start
/// (its log says why).
#[derive(Debug)]
pub struct ExitedBeforeReady {
    pub status: std::process::ExitStatus,
    pub log: PathBuf,
}

impl std::fmt::Display for ExitedBeforeReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "./dev up exited with {} before the system was ready: see {}",
            self.status,
            self.log.display()
        )
    }
}

impl std::error::Error for ExitedBeforeReady {}

/// Environment variable of `./dev up` that appends TOML to every dispatcher config. The
/// runner removes it from the systems it starts so published figures come from defaults.
pub const EXTRA_TOML_ENV: &str = "METRONOME_DISPATCHER_EXTRA_TOML";

/// Environment variable of `./dev up` that appends TOML to the gateway config.
pub const GATEWAY_EXTRA_TOML_ENV: &str = "METRONOME_GATEWAY_EXTRA_TOML";

/// A running system.
pub struct System {
    child: Option<tokio::process::Child>,
    pub state_dir: PathBuf,
    pub gateway_url: String,
    /// Base URL of each simulated GPU's OpenAI API (`http://127.0.0.1:PORT`), GPU order.
    pub sim_urls: Vec<String>,
    /// Model each simulated GPU serves, GPU order.
    pub sim_models: Vec<String>,
    /// Each dispatcher's `/metrics` URL.
    pub dispatcher_metrics: Vec<String>,
    /// Each worker-agent's `/metrics` URL, GPU order.
    pub agent_metrics: Vec<String>,
    http: reqwest::Client,
    /// The `workers` KV bucket (latest heartbeat per worker): the dispatcher's view.
    workers: Option<async_nats::jetstream::kv::Store>,
    /// The DECISIONS stream, for direct gets by job id.
    decisions: Option<async_nats::jetstream::stream::Stream>,
}

/// A free TCP port on 127.0.0.1 (bound then released).
pub fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Moves a failed start's state folder and `./dev up` log aside, to
/// `<state>.failed-start` and `<state>.failed-start.up.log` (replacing an earlier pair),
/// so the next start begins clean and the reason stays readable. Returns the folder.
fn keep_failed_start(state_dir: &Path) -> anyhow::Result<PathBuf> {
    let kept = state_dir.with_extension("failed-start");
    let _ = std::fs::remove_dir_all(&kept);
    if state_dir.exists() {
        std::fs::rename(state_dir, &kept)
            .with_context(|| format!("moving {} aside", state_dir.display()))?;
    }
    let log = state_dir.with_extension("up.log");
    if log.exists() {
        std::fs::rename(&log, kept.with_extension("failed-start.up.log"))
            .with_context(|| format!("moving {} aside", log.display()))?;
    }
    Ok(kept)
}

fn read_env_file(path: &Path, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let prefix = format!("{key}=");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .map(str::to_string)
}

fn config_str(path: &Path, key: &str) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let table: toml::Table = toml::from_str(&text)?;
    table
        .get(key)
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .with_context(|| format!("no {key} in {}", path.display()))
}

/// `(model server URL, model)` of each GPU, from the worker configs `./dev up` wrote.
fn sim_urls(state_dir: &Path, gpus: usize) -> anyhow::Result<Vec<(String, String)>> {
    (0..gpus)
        .map(|g| {
            let path = state_dir.join(format!("config/worker-gpu{g}.toml"));
            Ok((
                config_str(&path, "model_server_url")?,
                config_str(&path, "model")?,
            ))
        })
        .collect()
}

/// Each dispatcher's `/metrics` URL, from `metrics_addr` in the configs `./dev up` wrote
/// (none when this `./dev up` predates it).
fn dispatcher_metrics(state_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir(state_dir.join("config")) {
        let mut paths: Vec<PathBuf> = dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("dispatcher-") && n.ends_with(".toml"))
            })
            .collect();
        paths.sort();
        for p in paths {
            if let Ok(addr) = config_str(&p, "metrics_addr") {
                out.push(format!("http://{addr}/metrics"));
            }
        }
    }
    out
}

/// Each worker-agent's `/metrics` URL, GPU order, from `metrics_port` in the configs
/// `./dev up` wrote (none for an agent whose config names no port).
fn agent_metrics(state_dir: &Path, gpus: usize) -> Vec<String> {
    (0..gpus)
        .filter_map(|g| {
            let path = state_dir.join(format!("config/worker-gpu{g}.toml"));
            let table: toml::Table = toml::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
            let port = table.get("metrics_port")?.as_integer()?;
            Some(format!("http://127.0.0.1:{port}/metrics"))
        })
        .collect()
}

impl System {
    /// Starts `./dev up` and waits (up to 120 s) until it has written `<state>/env`; when
    /// `./dev up` exits before that, starts it once more.
    ///
    /// Why once more: every port of the system (the gateway's, picked here, and those
    /// `./dev up` picks) is found free and bound seconds later, after the processes started
    /// before it; another process can take it in between ("Address already in use"). That
    /// happened once in a benchmark run of hours and ended the run. A second start picks
    /// fresh ports; a failure that is not such a race fails the same way again and is
    /// reported. The failed start's files are kept beside the state folder.
    pub async fn up(spec: &SystemSpec) -> anyhow::Result<System> {
        let first = Self::start(spec, spec.first_gateway_port).await;
        let Err(e) = first else { return first };
        if e.downcast_ref::<ExitedBeforeReady>().is_none() {
            return Err(e);
        }
        let kept = keep_failed_start(&spec.state_dir)?;
        eprintln!(
            "{e:#}\n  starting the system once more, on fresh ports (the failed start's files: {})",
            kept.display()
        );
        Self::start(spec, None)
            .await
            .with_context(|| format!("second start, after a first that failed ({e:#})"))
    }

    async fn start(spec: &SystemSpec, gateway_port: Option<u16>) -> anyhow::Result<System> {
        let port = match gateway_port {
            Some(p) => p,
            None => free_port()?,
        };
        let _ = std::fs::remove_dir_all(&spec.state_dir);
        std::fs::create_dir_all(&spec.state_dir)?;
        let log = std::fs::File::create(spec.state_dir.with_extension("up.log"))?;
        let mut cmd = tokio::process::Command::new(spec.repo.join("dev"));
        cmd.current_dir(&spec.repo)
            .args(["up", "--no-build", "--profile", &spec.profile])
            .args(["--gpus", &spec.gpus.to_string()])
            .args(["--models", &spec.model])
            .args(["--speeds", &spec.speeds.join(",")])
            .args(["--policy", &spec.policy])
            .arg("--state-dir")
            .arg(&spec.state_dir)
            .args(["--gateway-port", &port.to_string()])
            // Components log at warn: info-level per-request logs would cost CPU the
            // measured system needs on a small machine. METRONOME_SYSTEM_LOG overrides it
            // (a `RUST_LOG` filter) to investigate a failed drill.
            .env(
                "RUST_LOG",
                std::env::var("METRONOME_SYSTEM_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(false);
        if spec.keep_going {
            cmd.arg("--keep-going");
        }
        if spec.nats_cluster > 1 {
            cmd.args(["--nats-cluster", &spec.nats_cluster.to_string()]);
        }
        for a in &spec.sim_args {
            cmd.args(["--sim-arg", a]);
        }
        cmd.env_remove(EXTRA_TOML_ENV);
        cmd.env_remove(GATEWAY_EXTRA_TOML_ENV);
        if let Some(extra) = &spec.gateway_extra_toml {
            cmd.env(GATEWAY_EXTRA_TOML_ENV, extra);
        }
        cmd.env_remove("WORKER_MAX_CONCURRENCY");
        if let Some(c) = spec.worker_max_concurrency {
            cmd.env("WORKER_MAX_CONCURRENCY", c.to_string());
        }
        let mut child = cmd.spawn().context("starting ./dev up")?;
        let env_file = spec.state_dir.join("env");
        let deadline = Instant::now() + Duration::from_secs(120);
        let gateway_url = loop {
            if let Some(url) = read_env_file(&env_file, "METRONOME_GATEWAY_URL") {
                break url;
            }
            if let Some(status) = child.try_wait()? {
                return Err(ExitedBeforeReady {
                    status,
                    log: spec.state_dir.with_extension("up.log"),
                }
                .into());
            }
            if Instant::now() > deadline {
                let mut s = System::from_child(child, spec, String::new(), Vec::new());
                s.stop().await;
                bail!("./dev up not ready after 120 s");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let urls = sim_urls(&spec.state_dir, spec.gpus)?;
        let mut sys = System::from_child(child, spec, gateway_url, urls);
        sys.dispatcher_metrics = dispatcher_metrics(&spec.state_dir);
        sys.agent_metrics = agent_metrics(&spec.state_dir, spec.gpus);
        if let Some(nats_url) = read_env_file(&env_file, "NATS_URL") {
            // The bench reads the system with the credentials `./dev up` wrote beside
            // the URL (`METRONOME_NATS_*` in the same env file).
            let auth = metronome_runtime::nats::NatsAuth::from_env(|k| read_env_file(&env_file, k));
            let client = auth
                .connect_options()
                .context("NATS credentials")?
                .connect(metronome_runtime::nats::server_urls(&nats_url))
                .await
                .context("connecting to the system's NATS")?;
            let js = async_nats::jetstream::new(client);
            sys.workers = Some(
                js.get_key_value(metronome_protocol::names::BUCKET_WORKERS)
                    .await
                    .context("opening the workers bucket")?,
            );
            sys.decisions = js
                .get_stream(metronome_protocol::names::STREAM_DECISIONS)
                .await
                .ok();
        }
        Ok(sys)
    }

    fn from_child(
        child: tokio::process::Child,
        spec: &SystemSpec,
        gateway_url: String,
        sims: Vec<(String, String)>,
    ) -> System {
        let (sim_urls, sim_models) = sims.into_iter().unzip();
        System {
            child: Some(child),
            state_dir: spec.state_dir.clone(),
            gateway_url,
            sim_urls,
            sim_models,
            dispatcher_metrics: Vec::new(),
            agent_metrics: Vec::new(),
            http: reqwest::Client::new(),
            workers: None,
            decisions: None,
        }
    }

    /// Every worker-agent's `/metrics` text, each after a `# from <url>` line (an agent
    /// that does not answer says why there): the agents' own histograms (time to first
    /// token, the wait for the heartbeat that reports a job, a heartbeat's store) for
    /// looking into a run after it.
    pub async fn agent_metrics_text(&self) -> String {
        let mut out = String::new();
        for url in &self.agent_metrics {
            out.push_str(&format!("# from {url}\n"));
            match self.get_text(url).await {
                Ok(text) => out.push_str(&text),
                Err(e) => out.push_str(&format!("# not read: {e:#}\n")),
            }
        }
        out
    }

    async fn get_text(&self, url: &str) -> anyhow::Result<String> {
        Ok(self
            .http
            .get(url)
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?)
    }

    /// One sample of every GPU's running/waiting requests and the leader dispatcher's
    /// queue depth per model (`t_s` is left at 0 for the caller to set). Every endpoint is
    /// scraped concurrently so the sample is close to one instant.
    pub async fn sample(&self) -> anyhow::Result<ClusterSample> {
        let gpus = futures::future::join_all(
            self.sim_urls
                .iter()
                .map(|u| self.get_text_owned(format!("{u}/metrics"))),
        );
        let disp = futures::future::join_all(
            self.dispatcher_metrics
                .iter()
                .map(|u| self.get_text_owned(u.clone())),
        );
        let (gpus, disp) = tokio::join!(gpus, disp);
        let mut sample = ClusterSample::default();
        for (text, model) in gpus.into_iter().zip(&self.sim_models) {
            let text = text?;
            sample.gpus.push((
                model.clone(),
                prometheus::sum(&text, "vllm:num_requests_running"),
                prometheus::sum(&text, "vllm:num_requests_waiting"),
            ));
        }
        // The leader's queues; a standby keeps none (or a stale copy), so only when no
        // instance says it leads are all of them summed.
        let texts: Vec<String> = disp.into_iter().filter_map(Result::ok).collect();
        if texts.is_empty() && !self.dispatcher_metrics.is_empty() {
            bail!("no dispatcher metrics endpoint answered");
        }
        let leaders: Vec<&String> = texts
            .iter()
            .filter(|t| prometheus::sum(t, "metronome_dispatcher_leader") > 0.0)
            .collect();
        let chosen: Vec<&String> = if leaders.is_empty() {
            texts.iter().collect()
        } else {
            leaders
        };
        for t in chosen {
            for (m, q) in parse_queue_depths(t) {
                *sample.queued.entry(m).or_insert(0.0) += q;
            }
        }
        Ok(sample)
    }

    async fn get_text_owned(&self, url: String) -> anyhow::Result<String> {
        self.get_text(&url).await
    }

    /// The last decision recorded for `job_id` (on `decisions.<tenant>.<job_id>`, any tenant), as
    /// untyped JSON so fields newer than this build are kept.
    pub async fn decision_json(&self, job_id: &str) -> Option<serde_json::Value> {
        let stream = self.decisions.as_ref()?;
        let msg = stream
            .get_last_raw_message_by_subject(
                &metronome_protocol::names::decision_subject_any_tenant(job_id),
            )
            .await
            .ok()?;
        serde_json::from_slice(&msg.payload).ok()
    }

    /// The gateway's OpenAI base URL.
    pub fn base_url(&self) -> String {
        format!("{}/v1", self.gateway_url.trim_end_matches('/'))
    }

    /// Sum of a metric's samples over every simulated GPU.
    pub async fn sim_metric_sum(&self, name: &str) -> anyhow::Result<f64> {
        let mut total = 0.0;
        for url in &self.sim_urls {
            let text = self.get_text(&format!("{url}/metrics")).await?;
            total += prometheus::sum(&text, name);
        }
        Ok(total)
    }

    /// Which dispatcher leads (`metronome_dispatcher_leader` 1 on its `/metrics`); one that
    /// does not answer (killed, restarting) is passed over.
    pub async fn leader_name(&self) -> anyhow::Result<String> {
        for (i, url) in self.dispatcher_metrics.iter().enumerate() {
            let Ok(text) = self.get_text(url).await else {
                continue;
            };
            if prometheus::sum(&text, "metronome_dispatcher_leader") > 0.0 {
                // `./dev up` starts dispatcher-a then -b; their metrics URLs sort the same way.
                return Ok(format!("dispatcher-{}", ["a", "b"][i.min(1)]));
            }
        }
        bail!("no dispatcher says it leads")
    }

    /// Samples the cluster every `interval` (see [`System::sample`]) until `stop` is
    /// cancelled, each stamped with the seconds since `start`; samples after `until_s`
    /// seconds are not taken.
    pub async fn sample_until(
        &self,
        stop: &tokio_util::sync::CancellationToken,
        start: Instant,
        interval: Duration,
        until_s: Option<f64>,
    ) -> Vec<ClusterSample> {
        let mut samples = Vec::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let t_s = start.elapsed().as_secs_f64();
            if until_s.is_some_and(|u| t_s > u) {
                continue;
            }
            if let Ok(mut s) = self.sample().await {
                s.t_s = t_s;
                samples.push(s);
            }
        }
        samples
    }

    /// What made jobs wait, from every dispatcher: `metronome_dispatcher_holds_total`
    /// summed per reason over models and instances (a standby holds nothing, so the sum is
    /// the leaders' across a takeover). Empty when no dispatcher answers.
    pub async fn dispatcher_holds(&self) -> BTreeMap<String, f64> {
        let mut holds = BTreeMap::new();
        for url in &self.dispatcher_metrics {
            if let Ok(text) = self.get_text(url).await {
                for (reason, n) in parse_holds(&text) {
                    *holds.entry(reason).or_insert(0.0) += n;
                }
            }
        }
        holds
    }

    /// Waits until no simulated GPU has a running or waiting request.
    pub async fn wait_idle(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let busy = self.sim_metric_sum("vllm:num_requests_running").await?
                + self.sim_metric_sum("vllm:num_requests_waiting").await?;
            if busy == 0.0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("simulated GPUs still busy ({busy} requests) after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every worker's latest heartbeat reports nothing active, queued or in
    /// flight, so the dispatcher sees the GPUs idle too (a heartbeat comes every ~1 s; the
    /// simulators are idle a moment earlier).
    pub async fn wait_workers_idle(&self, timeout: Duration) -> anyhow::Result<()> {
        let Some(kv) = &self.workers else {
            return Ok(());
        };
        let deadline = Instant::now() + timeout;
        loop {
            let mut busy = 0usize;
            let mut seen = 0usize;
            let mut keys = kv.keys().await?;
            let mut names = Vec::new();
            while let Some(k) = futures::StreamExt::next(&mut keys).await {
                names.push(k?);
            }
            for key in names {
                if let Some(bytes) = kv.get(&key).await? {
                    seen += 1;
                    match serde_json::from_slice::<metronome_protocol::WorkerStatus>(&bytes) {
                        Ok(s) if s.active == 0 && s.queued == 0 && s.in_flight.is_empty() => {}
                        _ => busy += 1,
                    }
                }
            }
            if busy == 0 && seen >= self.sim_urls.len() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{busy} workers still report work after {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The pid of one process `./dev up` (or a drill restarting it) recorded.
    pub fn pid_of(&self, name: &str) -> Option<u32> {
        std::fs::read_to_string(self.state_dir.join(format!("run/{name}.pid")))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// `(process name, pid)` from `<state>/run/*.pid`.
    pub fn pids(&self) -> Vec<(String, u32)> {
        let mut out = Vec::new();
        if let Ok(dir) = std::fs::read_dir(self.state_dir.join("run")) {
            for e in dir.flatten() {
                let path = e.path();
                let Some(name) = path.file_stem().and_then(|s| s.to_str()) else {
                    continue;
                };
                if let Some(pid) = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| t.trim().parse().ok())
                {
                    out.push((name.to_string(), pid));
                }
            }
        }
        out.sort();
        out
    }

    /// SIGTERM to `./dev up` and wait for it (it stops everything it started).
    pub async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
            if tokio::time::timeout(Duration::from_secs(40), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

impl Drop for System {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            if let Some(pid) = child.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
        }
    }
}

/// One sample of the cluster.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClusterSample {
    /// Seconds since the run's start.
    pub t_s: f64,
    /// Per GPU: (model, running, waiting).
    pub gpus: Vec<(String, f64, f64)>,
    /// Dispatcher queue depth per model.
    pub queued: BTreeMap<String, f64>,
}

/// Queue depth per model from a dispatcher's Prometheus text
/// (`metronome_dispatcher_queue_depth{model="m"} 3`).
pub fn parse_queue_depths(text: &str) -> BTreeMap<String, f64> {
    prometheus::sum_by_label(text, "metronome_dispatcher_queue_depth", "model")
}

/// `metronome_dispatcher_holds_total`, summed per reason over models.
pub fn parse_holds(text: &str) -> BTreeMap<String, f64> {
    prometheus::sum_by_label(text, "metronome_dispatcher_holds_total", "reason")
}

/// VmRSS of a process in KiB, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_summed_per_reason_over_models() {
        let text = "# TYPE metronome_dispatcher_holds counter\n\
metronome_dispatcher_holds_total{model=\"a\",reason=\"below_slo_floor\"} 3\n\
metronome_dispatcher_holds_total{model=\"b\",reason=\"below_slo_floor\"} 2\n\
metronome_dispatcher_holds_total{model=\"a\",reason=\"insufficient_kv\"} 1\n\
metronome_dispatcher_leader 1\n";
        let h = parse_holds(text);
        assert_eq!(h.get("below_slo_floor"), Some(&5.0));
        assert_eq!(h.get("insufficient_kv"), Some(&1.0));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn parses_queue_depth_per_model() {
        let text = "# HELP metronome_dispatcher_queue_depth x\n\
                    # TYPE metronome_dispatcher_queue_depth gauge\n\
                    metronome_dispatcher_queue_depth{model=\"llama-3.1-8b\"} 4\n\
                    metronome_dispatcher_queue_depth{model=\"bench-model\"} 0\n\
                    metronome_dispatcher_queue_depth_other{model=\"x\"} 9\n\
                    metronome_dispatcher_leader 1\n";
        let q = parse_queue_depths(text);
        assert_eq!(q.len(), 2);
        assert_eq!(q["llama-3.1-8b"], 4.0);
        assert_eq!(q["bench-model"], 0.0);
    }

    #[test]
    fn reads_own_rss() {
        assert!(rss_kib(std::process::id()).unwrap() > 0);
    }
}
