//! The worker pool shared by `benches/decision.rs` and `examples/decision_profile.rs`, so
//! the wall-clock benchmark and the instruction count measure the same decision.

use metronome_protocol::{GpuStats, KvUsage, WorkerStatus};
use metronome_scheduler::{EwmaSnapshot, Ledger, WorkerView};

pub const NOW: u64 = 1_700_000_000_000;

/// A realistic pool: varied load, KV, GPU and EWMAs; some workers busy with reported and
/// reserved jobs, one in eight on another model.
pub fn pool(n: usize) -> (Vec<WorkerView>, Ledger) {
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
                    prefill_pending_tokens: 0,
                    perf: None,
                    decoding: None,
                    seq: 1,
                    sent_ms: NOW,
                    max_epoch: 0,
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
                not_provisioned: None,
            }
        })
        .collect();
    (workers, ledger)
}
