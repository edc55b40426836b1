//! A fixed number of full decisions (evaluate, build the candidate list, reserve, release)
//! at 64 workers, on the same pool as `benches/decision.rs`, for instruction-level
//! profiling on a shared machine where wall-clock benchmarks are noisy:
//!
//! ```text
//! cargo build --release -p metronome-scheduler --example decision_profile
//! valgrind --tool=callgrind target/release/examples/decision_profile 1000
//! ```
//!
//! Instructions per decision = (total for N - total for 0) / N.

use metronome_protocol::{GpuStats, KvUsage, WorkerStatus};
use metronome_scheduler::{
    evaluate, EwmaSnapshot, JobRequest, Ledger, SchedulerConfig, WorkerView,
};
use std::hint::black_box;

const NOW: u64 = 1_700_000_000_000;

/// A realistic pool: varied load, KV, GPU and EWMAs; some workers busy with reported and
/// reserved jobs, one in eight on another model.
fn pool(n: usize) -> (Vec<WorkerView>, Ledger) {
    let mut ledger = Ledger::new();
    let workers = (0..n)
        .map(|i| {
            let id = format!("node{}-gpu{}", i / 8, i % 8);
            let active = (i % 5) as u32;
            let in_flight: Vec<String> = (0..active).map(|k| format!("{id}-job-{k}")).collect();
            for job in &in_flight {
                ledger.reserve(&id, job, 1_000, NOW - 500).unwrap();
            }
            if i % 3 == 0 {
                ledger
                    .reserve(&id, &format!("{id}-fresh"), 1_500, NOW - 10)
                    .unwrap();
            }
            WorkerView {
                status: WorkerStatus {
                    v: 1,
                    worker_id: id,
                    model: if i % 8 == 7 {
                        "other".into()
                    } else {
                        "llama-3.1-8b".into()
                    },
                    node: None,
                    gpu_index: Some((i % 8) as u32),
                    healthy: true,
                    draining: false,
                    max_concurrency: 16,
                    active,
                    queued: (i % 3) as u32,
                    in_flight,
                    kv: Some(KvUsage {
                        used_frac: (i % 10) as f64 / 20.0,
                        capacity_tokens: Some(200_000),
                    }),
                    gpu: Some(GpuStats {
                        util_frac: (i % 7) as f64 / 7.0,
                        mem_used_bytes: 1,
                        mem_total_bytes: 2,
                    }),
                    seq: 1,
                    sent_ms: NOW,
                },
                last_seen_ms: NOW - 200,
                ewma: (i % 4 != 0).then(|| EwmaSnapshot {
                    ttft_ms: 80.0 + i as f64,
                    tpot_ms: 15.0 + (i % 6) as f64,
                    tok_s: 1000.0 / (15.0 + (i % 6) as f64),
                    e2e_ms: 3_000.0,
                    samples: 100,
                    updated_ms: NOW - 1_000,
                }),
            }
        })
        .collect();
    (workers, ledger)
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("usage: decision_profile [DECISIONS]"))
        .unwrap_or(1000);
    let config = SchedulerConfig::default();
    let job = JobRequest {
        job_id: "bench-job".into(),
        model: "llama-3.1-8b".into(),
        prompt_tokens: 500,
        max_tokens: 512,
        predicted_output_tokens: 200.0,
    };
    let (workers, mut ledger) = pool(64);
    for _ in 0..n {
        let e = evaluate(black_box(&job), black_box(&workers), &ledger, &config, NOW);
        let winner = e.winner.as_deref().expect("a worker is eligible");
        ledger
            .reserve(winner, &job.job_id, job.kv_tokens(), NOW)
            .unwrap();
        black_box(&e);
        ledger.release(&job.job_id);
    }
}
