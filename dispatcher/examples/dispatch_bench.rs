//! Sustained decisions per second of the dispatcher against a real nats-server.
//!
//! Starts nats-server and redis-server (metronome-testkit), registers `--workers` idle
//! workers (`--max-concurrency` each, an empty KV cache with room for every job, heartbeats
//! renewed every second), publishes `--jobs` jobs to `jobs.submit._anon` and then starts the dispatcher
//! in-process: the figure is jobs decided (Assignment published and acknowledged by
//! JetStream, JOBS acknowledged, Decision published) per second of wall time, from the
//! moment the dispatcher leads until the last decision is stored.
//!
//! The bench plays the workers' side too: each Assignment seen on `work.*` is answered at
//! once with a `done` completion event on `events.done.<worker>`, so reservations are
//! released as they would be in service and each worker holds only the jobs in the
//! pipeline. Without that (`--no-complete`) every job stays reserved, a worker's book grows
//! to `jobs / workers`, and the forecast, which predicts every running job's rate, costs
//! that much per candidate: the figure then measures the pile-up, not the dispatcher. Run:
//!
//! The line it prints gives decisions/s (wall time: on a shared machine, how much CPU the
//! run was given) and CPU time per decision in this process and in nats-server (what a
//! decision costs, whatever else runs). Run:
//!
//! `cargo run --release -p metronome-dispatcher --example dispatch_bench -- --workers 64 --jobs 30000`

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use clap::Parser;
use futures::StreamExt;
use metronome_dispatcher::config::Storage;
use metronome_dispatcher::Config;
use metronome_protocol::names;
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_protocol::{Assignment, CompletionEvent, CompletionOutcome, WorkerStatus};
use metronome_testkit::{NatsServer, RedisServer};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(about = "Sustained decisions/s of the dispatcher against a real nats-server")]
struct Args {
    /// Simulated workers (heartbeats in the workers bucket).
    #[arg(long, default_value_t = 64)]
    workers: usize,
    /// Jobs to decide.
    #[arg(long, default_value_t = 50_000)]
    jobs: usize,
    /// Models the workers are spread over (each job's candidates are the workers of its model).
    #[arg(long, default_value_t = 1)]
    models: usize,
    /// Stream storage: file (as in production) or memory.
    #[arg(long, default_value = "file")]
    storage: String,
    /// Most candidates listed per decision (0 = all).
    #[arg(long, default_value_t = 0)]
    max_candidates: usize,
    /// Leave workers of other models out of the decisions' rejected lists.
    #[arg(long)]
    hide_wrong_model: bool,
    /// Scheduling policy.
    #[arg(long, default_value = "metronome")]
    policy: String,
    /// Never complete a job: every reservation stays on its worker until the run ends.
    #[arg(long)]
    no_complete: bool,
    /// Concurrency cap each worker reports: a job waits for a slot when every worker is at
    /// its cap, as it would in service. With the whole backlog published up front and caps
    /// far above it (1000000), one placement pass of the leader takes the whole queue and
    /// runs for seconds: the lease is not renewed meanwhile and the leader fences itself.
    #[arg(long, default_value_t = 8)]
    max_concurrency: u32,
}

fn worker_status(i: usize, models: usize, cap: u32, seq: u64) -> WorkerStatus {
    WorkerStatus {
        v: 1,
        worker_id: format!("bench-{i}"),
        model: format!("model-{}", i % models),
        node: None,
        gpu_index: Some(i as u32),
        healthy: true,
        draining: false,
        max_concurrency: cap,
        active: 0,
        queued: 0,
        in_flight: Vec::new(),
        // Room for every job of the run, and an empty cache: the forecast counts the
        // reported share of the capacity as context held, so a vast capacity with any share
        // used would predict every stream at a crawl.
        kv: Some(metronome_protocol::KvUsage {
            used_frac: 0.0,
            capacity_tokens: Some(1 << 30),
        }),
        gpu: None,
        prefill_pending_tokens: 0,
        perf: None,
        decoding: None,
        seq,
        sent_ms: metronome_protocol::time::unix_ms(),
        max_epoch: 0,
    }
}

/// Renew every worker's heartbeat each second (the `workers` bucket forgets a key after
/// 15 s), as its agent would.
async fn heartbeats(
    workers: jetstream::kv::Store,
    n: usize,
    models: usize,
    cap: u32,
    token: CancellationToken,
) {
    let mut seq = 1;
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        seq += 1;
        for i in 0..n {
            let status = worker_status(i, models, cap, seq);
            let body = serde_json::to_vec(&status).unwrap_or_default();
            let _ = workers.put(status.worker_id.as_str(), body.into()).await;
        }
    }
}

/// Answer each Assignment with a `done` completion event, as a worker finishing the job at
/// once would.
async fn complete(
    client: async_nats::Client,
    mut work: async_nats::Subscriber,
    completed: Arc<AtomicU64>,
    token: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = token.cancelled() => return,
            msg = work.next() => match msg {
                Some(m) => m,
                None => return,
            },
        };
        let Ok(a) = serde_json::from_slice::<Assignment>(&msg.payload) else {
            continue;
        };
        let event = CompletionEvent {
            v: metronome_protocol::PROTOCOL_VERSION,
            job_id: a.job.id.to_string(),
            worker_id: a.worker_id.clone(),
            model: a.job.model.clone(),
            epoch: a.epoch,
            attempt: a.attempt,
            outcome: CompletionOutcome::Done,
            streamed: true,
            error: None,
            prompt_tokens: a.job.prompt_tokens,
            output_tokens: a.job.max_tokens,
            ttft_ms: Some(50.0),
            tpot_ms: Some(20.0),
            e2e_ms: 50.0 + 20.0 * f64::from(a.job.max_tokens),
            finished_ms: metronome_protocol::time::unix_ms(),
            job: None,
        };
        let body = serde_json::to_vec(&event).unwrap_or_default();
        // Stored by the EVENTS stream, which the dispatcher reads through its durable
        // consumer: no acknowledgement is needed here.
        if client
            .publish(names::event_done_subject(&a.worker_id), body.into())
            .await
            .is_ok()
        {
            completed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// CPU time (user + system, all threads) a process has used so far, in seconds; `None`
/// where `/proc` cannot tell. Wall time on a shared machine says how much CPU the run was
/// given; CPU time per decision says what a decision costs.
fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let stat = std::fs::read_to_string(match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".to_string(),
    })
    .ok()?;
    // Fields after the command name (which may hold spaces, so split after its ')'):
    // utime and stime are the 12th and 13th, in clock ticks (USER_HZ, 100 on Linux).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The dispatcher's own warnings (publish failures, a stale lease) explain a run that
    // stalls.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let nats = NatsServer::start()?;
    let redis = RedisServer::start()?;
    let client = async_nats::connect(nats.url()).await?;
    let js = jetstream::new(client.clone());
    let storage = if args.storage == "memory" {
        jetstream::stream::StorageType::Memory
    } else {
        jetstream::stream::StorageType::File
    };
    let buckets = ensure_all(
        &js,
        &StreamSettings {
            storage,
            ..Default::default()
        },
    )
    .await?;
    for i in 0..args.workers {
        let status = worker_status(i, args.models, args.max_concurrency, 1);
        buckets
            .workers
            .put(
                status.worker_id.as_str(),
                serde_json::to_vec(&status)?.into(),
            )
            .await?;
    }
    eprintln!("publishing {} jobs...", args.jobs);
    let t = Instant::now();
    let mut acks = Vec::with_capacity(args.jobs);
    for i in 0..args.jobs {
        let id = format!("bench-job-{i}");
        let job = serde_json::json!({
            "v": metronome_protocol::PROTOCOL_VERSION, "id": id, "model": format!("model-{}", i % args.models), "endpoint": "chat",
            "request": {"messages": [{"role": "user", "content": "hello"}]},
            "prompt_tokens": 200, "max_tokens": 200,
            "submitted_ms": metronome_protocol::time::unix_ms(),
        });
        let mut h = async_nats::HeaderMap::new();
        h.insert(names::HEADER_MSG_ID, id.as_str());
        acks.push(
            js.publish_with_headers(
                names::submit_subject(None),
                h,
                serde_json::to_vec(&job)?.into(),
            )
            .await?,
        );
        if acks.len() >= 2000 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks.drain(..) {
        a.await?;
    }
    eprintln!("published in {:.2}s", t.elapsed().as_secs_f64());

    let token = CancellationToken::new();
    tokio::spawn(heartbeats(
        buckets.workers.clone(),
        args.workers,
        args.models,
        args.max_concurrency,
        token.clone(),
    ));
    let completed = Arc::new(AtomicU64::new(0));
    if !args.no_complete {
        // A connection of its own, so the completions do not queue behind the reads.
        let workers_side = async_nats::connect(nats.url()).await?;
        let work = workers_side.subscribe(names::SUBJECT_WORK_ALL).await?;
        tokio::spawn(complete(
            workers_side,
            work,
            completed.clone(),
            token.clone(),
        ));
    }

    let mut config = Config {
        nats_url: nats.url(),
        redis_url: redis.url(),
        dispatcher_id: "bench".into(),
        policy: args.policy.parse().map_err(anyhow::Error::msg)?,
        queue_bound_per_model: args.jobs + 1,
        decision_max_candidates: args.max_candidates,
        decision_list_wrong_model: !args.hide_wrong_model,
        storage: if args.storage == "memory" {
            Storage::Memory
        } else {
            Storage::File
        },
        ..Config::default()
    };
    config.scheduler.heartbeat_timeout_ms = 600_000;
    // This measures the decision pipeline, not admission: the bench's "workers" finish a
    // job the moment they see it (or never), nothing like what the prior predicts, so the
    // SLO is one every placement meets. The forecasts are still computed and recorded.
    config.scheduler.slo = metronome_scheduler::config::SloConfig {
        ttft_ms: 3_600_000,
        min_tok_s: 0.001,
    };
    let running = metronome_dispatcher::start(config, token.clone()).await?;
    let metrics = running.metrics.clone();
    while metrics.is_leader.load(Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let start = Instant::now();
    let cpu_start = (cpu_seconds(None), cpu_seconds(nats.pid()));
    let mut last = (Instant::now(), 0u64);
    let mut progress = (Instant::now(), 0u64);
    loop {
        let done = metrics.decisions_total();
        if done >= args.jobs as u64 {
            break;
        }
        if last.0.elapsed() > Duration::from_secs(1) {
            eprintln!(
                "  {done} decided ({:.0}/s in the last second), {} completions sent, {} reservations held",
                (done - last.1) as f64 / last.0.elapsed().as_secs_f64(),
                completed.load(Ordering::Relaxed),
                metrics.ledger_reservations.load(Relaxed),
            );
            last = (Instant::now(), done);
        }
        if done != progress.1 {
            progress = (Instant::now(), done);
        } else if progress.0.elapsed() > Duration::from_secs(10) {
            let holds: Vec<String> = metrics
                .render()
                .lines()
                .filter(|l| l.contains("holds_total"))
                .map(str::to_string)
                .collect();
            anyhow::bail!(
                "no decision for 10 s at {done} of {} decided (held: {holds:?}; is the dispatcher still leading? {})",
                args.jobs,
                metrics.is_leader.load(Relaxed) == 1
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu_end = (cpu_seconds(None), cpu_seconds(nats.pid()));
    let per_decision_us = |a: Option<f64>, b: Option<f64>| {
        a.zip(b)
            .map(|(a, b)| format!("{:.0}", (b - a) * 1e6 / args.jobs as f64))
            .unwrap_or_else(|| "?".into())
    };
    let mut decisions = js.get_stream(names::STREAM_DECISIONS).await?;
    let stored = decisions.info().await?.state.clone();
    let last: metronome_protocol::Decision = serde_json::from_slice(
        &decisions
            .get_raw_message(stored.last_sequence)
            .await?
            .payload,
    )?;
    println!(
        "workers={} models={} jobs={} policy={} storage={} max_candidates={} hide_wrong_model={} complete={}: {:.0} decisions/s ({:.2} s); CPU per decision: {} µs in this process (dispatcher and the workers' side), {} µs in nats-server; decisions stored: {} ({} bytes, {:.0} bytes/decision); completions sent: {}; last decision: {:?} {}",
        args.workers,
        args.models,
        args.jobs,
        args.policy,
        args.storage,
        args.max_candidates,
        args.hide_wrong_model,
        !args.no_complete,
        args.jobs as f64 / secs,
        secs,
        per_decision_us(cpu_start.0, cpu_end.0),
        per_decision_us(cpu_start.1, cpu_end.1),
        stored.messages,
        stored.bytes,
        stored.bytes as f64 / stored.messages.max(1) as f64,
        completed.load(Ordering::Relaxed),
        last.outcome,
        last.reason.as_deref().unwrap_or(""),
    );
    print!(
        "{}",
        metrics
            .render()
            .lines()
            .filter(|l| l.contains("latency_seconds_")
                || l.contains("decisions_total{")
                || l.contains("holds_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    println!();
    token.cancel();
    let _ = running.join().await;
    Ok(())
}
