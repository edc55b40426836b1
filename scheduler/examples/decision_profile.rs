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

use metronome_scheduler::{evaluate, JobRequest, SchedulerConfig};
use std::hint::black_box;

#[path = "../benches/common/pool.rs"]
mod common;
use common::{pool, NOW};

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
        slo: metronome_protocol::Slo {
            ttft_ms: 2_000,
            min_tok_s: 30.0,
        },
        ttft_remaining_ms: Some(2_000.0),
        prefix: None,
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
