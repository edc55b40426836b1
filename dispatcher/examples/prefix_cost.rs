//! What knowing each worker's prefix cache costs the leader: the memory of its per-worker
//! indexes and the time of one decision, at `--workers` idle workers of one model.
//!
//! The dispatcher's engine alone, in process (no NATS, no clock but the one that times
//! each decision). Per worker count, three runs of `--jobs` jobs of 4,200 prompt tokens,
//! each decided and then completed at once (so every decision sees idle workers):
//!
//! - `none`: jobs without a prefix fingerprint (the cost of a decision before any of this);
//! - `placements`: jobs with a 256-block fingerprint, each worker's cache estimated from the
//!   leader's placements (what the jobs placed there left);
//! - `events`: the same jobs, every worker reporting a cache of `--blocks` blocks (a
//!   snapshot, as its agent sends it), one of which holds the job's whole prefix.
//!
//! It prints per run the mean and p50/p99 time per decision and the index memory per
//! worker (`ReportedCaches::memory_bytes`, `PrefixIndex::memory_bytes`: the hash tables'
//! allocated slots). Run:
//!
//! `cargo run --release -p metronome-dispatcher --example prefix_cost -- --workers 64,1000`
//!
//! (`--modes events` runs one kind alone, to profile it; `--repeat 3` runs each three
//! times, interleaved, as the figures of a shared machine vary from run to run.)

use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use metronome_dispatcher::engine::testing;
use metronome_dispatcher::engine::{Effect, Engine, EngineSettings, Event, Incoming, Outcome};
use metronome_dispatcher::{Config, Metrics};
use metronome_protocol::cache_state::{CacheUpdate, CacheUpdateKind, CACHE_UPDATE_VERSION};
use metronome_protocol::prefix::PrefixFingerprint;
use metronome_protocol::{CompletionEvent, CompletionOutcome, Endpoint, Job, PROTOCOL_VERSION};

#[derive(Parser, Debug)]
#[command(about = "Index memory and decision time of prefix-aware placement")]
struct Args {
    /// Worker counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "64,1000")]
    workers: Vec<usize>,
    /// Jobs decided per run.
    #[arg(long, default_value_t = 2_000)]
    jobs: usize,
    /// Blocks each reporting worker's cache holds (2,500: a 40,000-token cache).
    #[arg(long, default_value_t = 2_500)]
    blocks: usize,
    /// Runs to make per worker count, of `none`, `placements` and `events` (to profile one).
    #[arg(long, value_delimiter = ',', default_value = "none,placements,events")]
    modes: Vec<String>,
    /// Times to repeat every run (the runs of one worker count interleaved, so a noisy
    /// neighbour slows them alike).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
}

const T0: u64 = 1_800_000_000_000;
const EPOCH: u64 = 7;
const PROMPT: u32 = 4_200;

/// An idle worker of model `m` taking up to 256 jobs at once, with the engine tests'
/// fitted GPU ([`testing::status`]).
fn worker(id: &str, seq: u64, at: u64) -> Event {
    testing::heartbeat_of(id, "m", 256, &[], seq, at)
}

/// The 256-block chain of prompt family `f` (distinct per family).
fn chain(f: usize) -> Vec<u64> {
    (0..256u64)
        .map(|i| ((f as u64) << 32 | i).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect()
}

fn job(i: usize, families: usize, fingerprint: bool, at: u64) -> Event {
    let job = Job {
        v: PROTOCOL_VERSION,
        id: format!("j{i}"),
        model: "m".into(),
        endpoint: Endpoint::Completion,
        request: serde_json::Value::Null,
        prompt_tokens: PROMPT,
        max_tokens: 100,
        submitted_ms: at,
        deadline_ms: None,
        slo: None,
        tenant: None,
        priority: None,
        prefix: fingerprint.then(|| PrefixFingerprint {
            block_size: 16,
            tokens: PROMPT,
            hashes: chain(i % families),
        }),
        traceparent: None,
    };
    Event::Job(Box::new(Incoming {
        job: Arc::new(job),
        acker: None,
        seq: i as u64 + 1,
        received_ms: at,
        attempt: 1,
        refused_by: Vec::new(),
    }))
}

fn done(id: &str, worker: &str, at: u64) -> Event {
    Event::Completion {
        event: Box::new(CompletionEvent {
            v: PROTOCOL_VERSION,
            job_id: id.into(),
            worker_id: worker.into(),
            model: "m".into(),
            epoch: EPOCH,
            attempt: 1,
            outcome: CompletionOutcome::Done,
            streamed: true,
            error: None,
            prompt_tokens: PROMPT,
            output_tokens: 100,
            ttft_ms: Some(300.0),
            tpot_ms: Some(20.0),
            e2e_ms: 2_300.0,
            finished_ms: at,
            job: None,
        }),
        acker: None,
    }
}

struct Run {
    placed: usize,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
    events_bytes_per_worker: f64,
    placements_bytes_per_worker: f64,
}

fn run(workers: usize, jobs: usize, blocks: usize, mode: &str) -> Run {
    let config = Config::default();
    let mut e = Engine::new(
        EngineSettings::from_config(&config, EPOCH, "bench".into()),
        Metrics::new(),
        None,
    );
    let ids: Vec<String> = (0..workers).map(|w| format!("w{w}")).collect();
    for id in &ids {
        e.handle(worker(id, 1, T0), T0);
    }
    if mode == "events" {
        // Worker k holds family k's whole prefix and `blocks - 256` blocks of its own.
        for (k, id) in ids.iter().enumerate() {
            let mut stored = chain(k);
            stored.extend(
                (0..blocks.saturating_sub(256) as u64)
                    .map(|i| (1 << 60 | (k as u64) << 24 | i).wrapping_mul(0xbf58_476d_1ce4_e5b9)),
            );
            let update = CacheUpdate {
                v: CACHE_UPDATE_VERSION,
                worker_id: id.clone(),
                run: 1,
                seq: 0,
                kind: CacheUpdateKind::Snapshot,
                block_size: 16,
                cleared: false,
                stored,
                removed: Vec::new(),
                truncated: false,
                sent_ms: T0,
            };
            e.handle(Event::Cache(Box::new(update)), T0);
        }
    }
    e.dispatch_if_changed(T0);
    e.take_effects();
    let mut times = Vec::with_capacity(jobs);
    for i in 0..jobs {
        let at = T0 + 1 + i as u64;
        let started = Instant::now();
        e.handle(job(i, workers, mode != "none", at), at);
        e.dispatch_if_changed(at);
        let elapsed = started.elapsed().as_secs_f64() * 1e6;
        let mut placed = false;
        for effect in e.take_effects() {
            if let Effect::Publish(Outcome::Assign { job, worker_id, .. }) = effect {
                placed = true;
                e.handle(done(&job.job.id, &worker_id, at), at);
            }
        }
        // Only decisions that placed their job count: one held or answered otherwise is
        // not the decision measured here.
        if placed {
            times.push(elapsed);
        }
        // Heartbeats stay fresh (a worker silent past its timeout is declared dead).
        if i % 500 == 499 {
            for id in &ids {
                e.handle(worker(id, 2 + i as u64 / 500, at), at);
            }
        }
        e.dispatch_if_changed(at);
        e.take_effects();
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((q * times.len() as f64) as usize).min(times.len() - 1)];
    let per_worker = |bytes: usize| bytes as f64 / workers as f64;
    Run {
        placed: times.len(),
        mean_us: times.iter().sum::<f64>() / times.len() as f64,
        p50_us: at(0.5),
        p99_us: at(0.99),
        events_bytes_per_worker: per_worker(
            ids.iter()
                .map(|id| e.reported_caches().memory_bytes(id))
                .sum(),
        ),
        placements_bytes_per_worker: per_worker(
            ids.iter().map(|id| e.prefix_index().memory_bytes(id)).sum(),
        ),
    }
}

fn main() {
    let args = Args::parse();
    println!(
        "{:>7} {:<10} {:>6} {:>9} {:>9} {:>9} {:>14} {:>14}",
        "workers", "index", "placed", "mean_us", "p50_us", "p99_us", "events_B/wkr", "placed_B/wkr"
    );
    for &workers in &args.workers {
        for mode in std::iter::repeat_n(&args.modes, args.repeat.max(1)).flatten() {
            let mode = mode.as_str();
            assert!(
                ["none", "placements", "events"].contains(&mode),
                "unknown mode {mode:?}: none, placements or events"
            );
            let r = run(workers, args.jobs, args.blocks, mode);
            println!(
                "{:>7} {:<10} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>14.0} {:>14.0}",
                workers,
                mode,
                r.placed,
                r.mean_us,
                r.p50_us,
                r.p99_us,
                r.events_bytes_per_worker,
                r.placements_bytes_per_worker
            );
        }
    }
}
