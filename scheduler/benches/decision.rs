//! One full scheduling decision (evaluate, build the candidate list, reserve the winner)
//! at 8, 64 and 512 workers. The reservation is released after each iteration so every
//! iteration sees the same pool.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use metronome_scheduler::{evaluate, JobRequest, SchedulerConfig};

#[path = "common/pool.rs"]
mod common;
use common::{pool, NOW};

fn decision(c: &mut Criterion) {
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
    let mut group = c.benchmark_group("decision");
    for n in [8usize, 64, 512] {
        let (workers, mut ledger) = pool(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let e = evaluate(black_box(&job), black_box(&workers), &ledger, &config, NOW);
                let winner = e.winner.as_deref().expect("a worker is eligible");
                ledger
                    .reserve(winner, &job.job_id, job.kv_tokens(), NOW)
                    .unwrap();
                black_box(&e);
                ledger.release(&job.job_id);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);
