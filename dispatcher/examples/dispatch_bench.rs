//! Sustained decisions per second of the dispatcher against a real nats-server.
//!
//! Starts nats-server and redis-server (metronome-testkit), registers `--workers` idle
//! workers (high caps, so no job waits), publishes `--jobs` jobs to `jobs.submit._anon` and then
//! starts the dispatcher in-process: the figure is jobs decided (Assignment published and
//! acknowledged by JetStream, JOBS acknowledged, Decision published) per second of wall
//! time, from the moment the dispatcher leads until the last decision is stored. Run:
//!
//! `cargo run --release -p metronome-dispatcher --example dispatch_bench -- --workers 64 --jobs 50000`

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use clap::Parser;
use metronome_dispatcher::config::Storage;
use metronome_dispatcher::Config;
use metronome_protocol::names;
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_protocol::WorkerStatus;
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
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
        let status = WorkerStatus {
            v: 1,
            worker_id: format!("bench-{i}"),
            model: format!("model-{}", i % args.models),
            node: None,
            gpu_index: Some(i as u32),
            healthy: true,
            draining: false,
            max_concurrency: 1_000_000,
            active: 0,
            queued: 0,
            in_flight: Vec::new(),
            kv: Some(metronome_protocol::KvUsage {
                used_frac: 0.1,
                capacity_tokens: Some(u64::MAX / 4),
            }),
            gpu: None,
            prefill_pending_tokens: 0,
            perf: None,
            seq: 1,
            sent_ms: metronome_protocol::time::unix_ms(),
            max_epoch: 0,
        };
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
    let token = CancellationToken::new();
    let running = metronome_dispatcher::start(config, token.clone()).await?;
    let metrics = running.metrics.clone();
    while metrics.is_leader.load(Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let start = Instant::now();
    let mut last = (Instant::now(), 0u64);
    loop {
        let done = metrics.decisions_total();
        if done >= args.jobs as u64 {
            break;
        }
        if last.0.elapsed() > Duration::from_secs(1) {
            eprintln!(
                "  {done} decided ({:.0}/s in the last second)",
                (done - last.1) as f64 / last.0.elapsed().as_secs_f64()
            );
            last = (Instant::now(), done);
        }
        if start.elapsed() > Duration::from_secs(300) {
            anyhow::bail!("only {done} of {} decided in 300 s", args.jobs);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    let mut decisions = js.get_stream(names::STREAM_DECISIONS).await?;
    let stored = decisions.info().await?.state.clone();
    println!(
        "workers={} models={} jobs={} policy={} storage={} max_candidates={} hide_wrong_model={}: {:.0} decisions/s ({:.2} s); decisions stored: {} ({} bytes, {:.0} bytes/decision)",
        args.workers,
        args.models,
        args.jobs,
        args.policy,
        args.storage,
        args.max_candidates,
        args.hide_wrong_model,
        args.jobs as f64 / secs,
        secs,
        stored.messages,
        stored.bytes,
        stored.bytes as f64 / stored.messages.max(1) as f64
    );
    print!(
        "{}",
        metrics
            .render()
            .lines()
            .filter(|l| l.contains("latency_seconds_") || l.contains("decisions_total{"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    println!();
    token.cancel();
    let _ = running.join().await;
    Ok(())
}
