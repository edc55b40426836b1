//! A whole Metronome system for end-to-end tests, built from the real binaries: a
//! `nats-server`, a `redis-server`, one simulator process serving N GPUs, one worker-agent per
//! GPU, dispatchers and the gateway, each a child process with its own config file and log,
//! all killed on drop.
//!
//! Processes (rather than in-process tasks) because the tests kill and restart them the way
//! an operator's machine would: SIGKILL is a crash, SIGTERM a drain.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use metronome_protocol::{names, redis_keys, Decision};
use metronome_testkit::{bin_path, free_ports, wait_for, ChildGuard, NatsServer, RedisServer};

/// One simulated GPU.
#[derive(Debug, Clone)]
pub struct GpuSpec {
    pub model: String,
    pub speed: f64,
}

/// Shape of the system to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    pub gpus: Vec<GpuSpec>,
    pub dispatchers: usize,
    pub policy: String,
    pub worker_max_concurrency: u32,
    /// Extra `key = value` lines for every simulated GPU (e.g. `base_step_ms = 5.0`).
    pub sim_knobs: Vec<String>,
    /// Extra `key = value` lines for one simulated GPU, by index (after `sim_knobs`).
    pub gpu_knobs: Vec<Vec<String>>,
    /// Extra top-level `key = value` lines of every dispatcher's config.
    pub dispatcher_knobs: Vec<String>,
    /// Extra top-level `key = value` lines of the gateway's config.
    pub gateway_knobs: Vec<String>,
    /// Environment variables of every Metronome process (e.g. `METRONOME_LOG_FORMAT`).
    pub env: Vec<(String, String)>,
    /// Extra nats-server configuration (an operator, users).
    pub nats_config: String,
    /// The `.creds` file the test's own NATS connections use (with `nats_config`'s
    /// operator; the processes get theirs through `env`).
    pub nats_creds: Option<PathBuf>,
}

impl ClusterSpec {
    /// `n` full-speed GPUs serving `model`.
    pub fn uniform(n: usize, model: &str) -> Self {
        ClusterSpec {
            gpus: (0..n)
                .map(|_| GpuSpec {
                    model: model.to_string(),
                    speed: 1.0,
                })
                .collect(),
            dispatchers: 1,
            policy: "metronome".into(),
            worker_max_concurrency: 4,
            sim_knobs: Vec::new(),
            gpu_knobs: Vec::new(),
            dispatcher_knobs: Vec::new(),
            gateway_knobs: Vec::new(),
            env: Vec::new(),
            nats_config: String::new(),
            nats_creds: None,
        }
    }
}

/// A running system.
pub struct Cluster {
    pub spec: ClusterSpec,
    pub nats: NatsServer,
    pub redis: RedisServer,
    pub dir: tempfile::TempDir,
    pub gateway_url: String,
    gateway_port: u16,
    gpu_ports: Vec<u16>,
    sim: Option<ChildGuard>,
    workers: Vec<Option<ChildGuard>>,
    dispatchers: Vec<Option<ChildGuard>>,
    gateway: Option<ChildGuard>,
}

/// Worker id of GPU `i` in a test cluster.
pub fn worker_id(i: usize) -> String {
    format!("e2e-gpu{i}")
}

impl Cluster {
    /// Start everything and wait until the gateway serves every model.
    pub async fn start(spec: ClusterSpec) -> Cluster {
        let nats = NatsServer::start_with_config(&spec.nats_config).expect("nats-server");
        let redis = RedisServer::start().expect("redis-server");
        let dir = tempfile::Builder::new()
            .prefix("metronome-e2e-")
            .tempdir()
            .expect("temp dir");
        let mut ports = free_ports(1 + spec.gpus.len());
        let gateway_port = ports.remove(0);
        let gpu_ports = ports;
        let mut cluster = Cluster {
            gateway_url: format!("http://127.0.0.1:{gateway_port}"),
            gateway_port,
            gpu_ports,
            workers: (0..spec.gpus.len()).map(|_| None).collect(),
            dispatchers: (0..spec.dispatchers).map(|_| None).collect(),
            spec,
            nats,
            redis,
            dir,
            sim: None,
            gateway: None,
        };
        cluster.start_simulator();
        for i in 0..cluster.spec.dispatchers {
            cluster.start_dispatcher(i);
        }
        for i in 0..cluster.spec.gpus.len() {
            cluster.start_worker(i);
        }
        cluster.start_gateway();
        cluster.wait_ready().await;
        cluster
    }

    fn spawn(&self, name: &str, binary: &str, config: &str) -> ChildGuard {
        let config_path = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&config_path, config).expect("write config");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(name))
            .expect("log file");
        let mut cmd = Command::new(bin_path(binary));
        cmd.arg("--config")
            .arg(&config_path)
            .env("RUST_LOG", "info")
            .env_remove("NATS_URL")
            .env_remove("REDIS_URL")
            .envs(self.spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        ChildGuard::spawn(name, cmd).unwrap_or_else(|e| panic!("spawning {binary}: {e}"))
    }

    /// The base URL of simulated GPU `i` (its model server, without `/v1`).
    pub fn gpu_url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.gpu_ports[i])
    }

    /// Where process `name` (`gateway`, `dispatcher-0`, `gpu-sim`, a worker id) logs.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// The last lines of every process log, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let mut entries: Vec<_> = std::fs::read_dir(self.dir.path())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "log"))
            .collect();
        entries.sort_by_key(|e| e.path());
        for e in entries {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("==== {} ====\n", e.path().display()));
            out.push_str(&lines[lines.len().saturating_sub(30)..].join("\n"));
            out.push('\n');
        }
        out
    }

    fn start_simulator(&mut self) {
        let mut config = String::from("seed = 7\n");
        for (i, gpu) in self.spec.gpus.iter().enumerate() {
            config.push_str(&format!(
                "\n[[gpu]]\nmodel = \"{}\"\nport = {}\nspeed = {}\n",
                gpu.model, self.gpu_ports[i], gpu.speed
            ));
            let own = self.spec.gpu_knobs.get(i).into_iter().flatten();
            for knob in self.spec.sim_knobs.iter().chain(own) {
                config.push_str(knob);
                config.push('\n');
            }
        }
        self.sim = Some(self.spawn("gpu-sim", "metronome-gpu-sim", &config));
    }

    /// Start (or restart) dispatcher `i`.
    pub fn start_dispatcher(&mut self, i: usize) {
        let mut config = format!(
            "nats_url = \"{}\"\nredis_url = \"{}\"\ndispatcher_id = \"e2e-dispatcher-{i}\"\npolicy = \"{}\"\newma_refresh_ms = 200\n",
            self.nats.url(),
            self.redis.url(),
            self.spec.policy
        );
        append_lines(&mut config, &self.spec.dispatcher_knobs);
        self.dispatchers[i] =
            Some(self.spawn(&format!("dispatcher-{i}"), "metronome-dispatcher", &config));
    }

    /// Start (or restart) the worker-agent of GPU `i`.
    pub fn start_worker(&mut self, i: usize) {
        let config = format!(
            "worker_id = \"{}\"\nmodel = \"{}\"\ngpu_index = {i}\nmodel_server_url = \"http://127.0.0.1:{}\"\nmodel_server_kind = \"simulator\"\nmax_concurrency = {}\nnats_url = \"{}\"\nredis_url = \"{}\"\n",
            worker_id(i),
            self.spec.gpus[i].model,
            self.gpu_ports[i],
            self.spec.worker_max_concurrency,
            self.nats.url(),
            self.redis.url(),
        );
        self.workers[i] = Some(self.spawn(&worker_id(i), "metronome-worker-agent", &config));
    }

    /// Start (or restart) the gateway.
    pub fn start_gateway(&mut self) {
        // Loopback test cluster: no API keys, requests are served as tenant `anonymous`.
        let mut config = format!(
            "listen = \"127.0.0.1:{}\"\nnats_url = \"{}\"\nallow_anonymous = true\n",
            self.gateway_port,
            self.nats.url()
        );
        append_lines(&mut config, &self.spec.gateway_knobs);
        self.gateway = Some(self.spawn("gateway", "metronome-gateway", &config));
    }

    /// SIGKILL the worker-agent of GPU `i` (a crash: no drain, no goodbye).
    pub fn kill_worker(&mut self, i: usize) {
        if let Some(mut w) = self.workers[i].take() {
            w.signal_and_wait(9, Duration::from_secs(10));
        }
    }

    /// SIGKILL dispatcher `i`.
    pub fn kill_dispatcher(&mut self, i: usize) {
        if let Some(mut d) = self.dispatchers[i].take() {
            d.signal_and_wait(9, Duration::from_secs(10));
        }
    }

    /// Stop every Metronome process (SIGTERM, drained) and start them all again; NATS,
    /// Redis and the simulated GPUs keep running.
    pub async fn restart_metronome(&mut self) {
        let mut all: Vec<ChildGuard> = Vec::new();
        all.extend(self.gateway.take());
        all.extend(self.workers.iter_mut().filter_map(Option::take));
        all.extend(self.dispatchers.iter_mut().filter_map(Option::take));
        for mut p in all {
            assert!(
                p.signal_and_wait(15, Duration::from_secs(30)),
                "{} did not stop on SIGTERM",
                p.name()
            );
        }
        for i in 0..self.spec.dispatchers {
            self.start_dispatcher(i);
        }
        for i in 0..self.spec.gpus.len() {
            self.start_worker(i);
        }
        self.start_gateway();
        self.wait_ready().await;
    }

    /// Wait until the gateway is ready and lists every model, and every live worker has a
    /// heartbeat in the `workers` bucket.
    pub async fn wait_ready(&self) {
        let http = reqwest::Client::new();
        let models: std::collections::BTreeSet<String> =
            self.spec.gpus.iter().map(|g| g.model.clone()).collect();
        let url = self.gateway_url.clone();
        let logs_dir = self.dir.path().to_path_buf();
        wait_for(
            &format!(
                "gateway ready with models {models:?} (logs in {})",
                logs_dir.display()
            ),
            // Generous: after a NATS restart on two loaded cores (the whole suite runs in
            // parallel), the gateway's reconnect backoff and its KV watches take a while.
            Duration::from_secs(120),
            || {
                let http = http.clone();
                let url = url.clone();
                let models = models.clone();
                async move {
                    let ready = http.get(format!("{url}/readyz")).send().await.ok()?;
                    if !ready.status().is_success() {
                        return None;
                    }
                    let list: serde_json::Value = http
                        .get(format!("{url}/v1/models"))
                        .send()
                        .await
                        .ok()?
                        .json()
                        .await
                        .ok()?;
                    let served: std::collections::BTreeSet<String> = list["data"]
                        .as_array()?
                        .iter()
                        .filter_map(|m| m["id"].as_str().map(String::from))
                        .collect();
                    models.is_subset(&served).then_some(())
                }
            },
        )
        .await;
        let live: Vec<String> = (0..self.spec.gpus.len())
            .filter(|i| self.workers[*i].is_some())
            .map(worker_id)
            .collect();
        let js = self.jetstream().await;
        let kv = js
            .get_key_value(names::BUCKET_WORKERS)
            .await
            .expect("workers bucket");
        let all_beating = tokio::time::timeout(Duration::from_secs(30), async {
            'poll: loop {
                for id in &live {
                    if !matches!(kv.get(id.as_str()).await, Ok(Some(_))) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue 'poll;
                    }
                }
                break;
            }
        })
        .await;
        assert!(
            all_beating.is_ok(),
            "not every worker of {live:?} sent a heartbeat within 30 s:\n{}",
            self.logs()
        );
    }

    pub async fn nats_client(&self) -> async_nats::Client {
        let options = match &self.spec.nats_creds {
            Some(path) => async_nats::ConnectOptions::with_credentials_file(path)
                .await
                .expect("the test's .creds file"),
            None => async_nats::ConnectOptions::new(),
        };
        options
            .connect(self.nats.url())
            .await
            .expect("connect to nats")
    }

    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(self.nats_client().await)
    }

    /// The latest decision of `job_id`, waiting for it to be recorded.
    pub async fn decision(&self, job_id: &str) -> Decision {
        let js = self.jetstream().await;
        let stream = js
            .get_stream(names::STREAM_DECISIONS)
            .await
            .expect("DECISIONS");
        let subject = names::decision_subject_any_tenant(job_id);
        wait_for(
            &format!("decision of {job_id}"),
            Duration::from_secs(30),
            || {
                let stream = stream.clone();
                let subject = subject.clone();
                async move {
                    let msg = stream
                        .get_last_raw_message_by_subject(&subject)
                        .await
                        .ok()?;
                    serde_json::from_slice(&msg.payload).ok()
                }
            },
        )
        .await
    }

    /// Wait until every worker's latest heartbeat in the `workers` bucket reports nothing
    /// running, queued or held: the dispatcher's own view of an idle cluster.
    pub async fn wait_idle(&self) {
        let js = self.jetstream().await;
        let bucket = js
            .get_key_value(names::BUCKET_WORKERS)
            .await
            .expect("workers bucket");
        let ids: Vec<String> = (0..self.spec.gpus.len()).map(worker_id).collect();
        wait_for("every worker idle", Duration::from_secs(30), || {
            let bucket = bucket.clone();
            let ids = ids.clone();
            async move {
                for id in &ids {
                    let entry = bucket.get(id).await.ok()??;
                    let s: metronome_protocol::WorkerStatus =
                        serde_json::from_slice(&entry).ok()?;
                    if s.active > 0 || s.queued > 0 || !s.in_flight.is_empty() {
                        return None;
                    }
                }
                Some(())
            }
        })
        .await
    }

    /// Every decision recorded so far, in stream order.
    pub async fn all_decisions(&self) -> Vec<Decision> {
        let js = self.jetstream().await;
        let mut stream = js
            .get_stream(names::STREAM_DECISIONS)
            .await
            .expect("DECISIONS");
        let last = stream.info().await.expect("info").state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(msg) = stream.get_raw_message(seq).await {
                if let Ok(d) = serde_json::from_slice(&msg.payload) {
                    out.push(d);
                }
            }
        }
        out
    }

    /// The EWMA hash of a worker in Redis.
    pub async fn ewma(&self, worker: &str) -> HashMap<String, f64> {
        let client = redis::Client::open(self.redis.url()).expect("redis url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection");
        let raw: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(redis_keys::ewma_key(redis_keys::DEFAULT_PREFIX, worker))
            .query_async(&mut conn)
            .await
            .expect("HGETALL");
        raw.into_iter()
            .filter_map(|(k, v)| v.parse().ok().map(|v| (k, v)))
            .collect()
    }
}

/// Top-level TOML keys must come before any table: the knobs are plain `key = value` lines
/// appended to a config that has no tables.
fn append_lines(config: &mut String, lines: &[String]) {
    for line in lines {
        config.push_str(line);
        config.push('\n');
    }
}

/// A chat completion request body.
pub fn chat_body(model: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about predictable scheduling."}],
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": stream},
    })
}
