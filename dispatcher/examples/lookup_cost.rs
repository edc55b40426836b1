//! What the intake's per-job DECISIONS lookup (`decisions.<tenant>.<job>`, a direct get,
//! 64 in flight, as `dispatcher/src/intake.rs` does it) costs nats-server, beside what
//! storing the job's Decision costs it.
//!
//! Starts nats-server (metronome-testkit, file storage as in production), stores `--stored`
//! decisions (a day's audit trail stand-in), then looks up `--lookups` ids that have none
//! (new jobs, the common case) and as many that have one (repeats), and prints nats-server
//! CPU time per lookup and per stored decision. Run:
//!
//! `cargo run -p metronome-dispatcher --example lookup_cost -- --stored 100000 --lookups 20000`

use std::time::Instant;

use async_nats::jetstream;
use clap::Parser;
use futures::StreamExt;
use metronome_protocol::names;
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_testkit::NatsServer;

#[derive(Parser, Debug)]
struct Args {
    /// Decisions stored before the lookups.
    #[arg(long, default_value_t = 100_000)]
    stored: usize,
    /// Lookups of ids without a decision (and as many of ids with one).
    #[arg(long, default_value_t = 20_000)]
    lookups: usize,
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(11) + tick(12)) / 100.0
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let nats = NatsServer::start()?;
    let pid = nats.pid().expect("nats-server pid");
    let client = async_nats::connect(nats.url()).await?;
    let js = jetstream::new(client.clone());
    ensure_all(&js, &StreamSettings::default()).await?;
    let body = serde_json::to_vec(&serde_json::json!({
        "v": 3, "job_id": "x", "outcome": "assigned", "attempt": 1, "worker_id": "w",
        "policy": "metronome", "queue_wait_ms": 0, "decision_latency_us": 1, "epoch": 1,
        "dispatcher_id": "d", "decided_ms": 1, "reason": "x".repeat(2000)
    }))?;

    let cpu = cpu_seconds(pid);
    let wall = Instant::now();
    let mut acks = futures::stream::iter(0..args.stored)
        .map(|i| {
            let js = js.clone();
            let body = body.clone();
            async move {
                let mut h = async_nats::HeaderMap::new();
                h.insert(names::HEADER_MSG_ID, format!("s{i}:1").as_str());
                js.publish_with_headers(
                    names::decision_subject(Some("acme"), &format!("s{i}")),
                    h,
                    body.into(),
                )
                .await?
                .await
            }
        })
        .buffer_unordered(256);
    while let Some(r) = acks.next().await {
        r?;
    }
    let store_cpu = cpu_seconds(pid) - cpu;
    let store_wall = wall.elapsed().as_secs_f64();

    let decisions = js.get_stream(names::STREAM_DECISIONS).await?;
    for (what, prefix) in [("absent (new job)", "n"), ("present (repeat)", "s")] {
        let cpu = cpu_seconds(pid);
        let wall = Instant::now();
        let mut found = 0usize;
        let mut gets = futures::stream::iter(0..args.lookups)
            .map(|i| {
                let decisions = decisions.clone();
                async move {
                    decisions
                        .direct_get_last_for_subject(names::decision_subject(
                            Some("acme"),
                            &format!("{prefix}{i}"),
                        ))
                        .await
                        .is_ok()
                }
            })
            .buffered(64);
        while let Some(hit) = gets.next().await {
            found += usize::from(hit);
        }
        let used = cpu_seconds(pid) - cpu;
        let secs = wall.elapsed().as_secs_f64();
        println!(
            "lookup {what}: {} lookups ({found} found), nats-server {:.1} us CPU each, {:.0}/s wall",
            args.lookups,
            used * 1e6 / args.lookups as f64,
            args.lookups as f64 / secs
        );
    }
    println!(
        "store decision (~2 kB): {} stored, nats-server {:.1} us CPU each, {:.0}/s wall",
        args.stored,
        store_cpu * 1e6 / args.stored as f64,
        args.stored as f64 / store_wall
    );
    Ok(())
}
