//! The lab's own guarantees: exact replays, one record per request, and the dispatcher's
//! engine behaving in it as it does live (a burst on idle GPUs spreads over all of them).

use metronome_gpu_sim::SimGpuConfig;
use metronome_lab::{run, Cluster, LabConfig, Latencies, MaxTokens};
use metronome_loadgen::PlannedRequest;
use metronome_scheduler::PolicyKind;

fn config(policy: PolicyKind, gpus: usize) -> LabConfig {
    LabConfig {
        dispatcher: metronome_dispatcher::Config {
            policy,
            ..Default::default()
        },
        agent: metronome_worker_agent::Config::default(),
        gpus: (0..gpus).map(|_| SimGpuConfig::new("m")).collect(),
        latencies: Latencies::default(),
        sample_ms: 100.0,
        warmup_ms: 3_000.0,
        max_tokens: MaxTokens::Exact,
        tenants: Vec::new(),
        queue_timeout_ms: None,
    }
}

fn plan(n: u64, gap_s: f64) -> Vec<PlannedRequest> {
    (0..n)
        .map(|i| PlannedRequest {
            id: i,
            at_s: i as f64 * gap_s,
            prompt_tokens: 200 + (i as u32 * 331) % 1_500,
            output_tokens: 20 + (i as u32 * 97) % 300,
            tenant: None,
            messages: Vec::new(),
        })
        .collect()
}

#[test]
fn a_run_replays_exactly() {
    let c = config(PolicyKind::Metronome, 2);
    let p = plan(60, 0.15);
    let a = run(&c, &p);
    let b = run(&c, &p);
    assert_eq!(a.records, b.records);
    assert_eq!(a.holds, b.holds);
}

#[test]
fn every_request_ends_in_one_record() {
    for policy in [PolicyKind::Metronome, PolicyKind::LeastConnections] {
        let p = plan(80, 0.05); // a burst well past what two GPUs take at once
        let out = run(&config(policy, 2), &p);
        assert_eq!(out.records.len(), p.len());
        for (r, planned) in out.records.iter().zip(&p) {
            assert_eq!(r.id, planned.id);
            assert!(
                r.ok || r.error.is_some() || r.error_kind.is_some(),
                "{policy:?}: request {} neither served nor answered: {r:?}",
                r.id
            );
            if r.ok {
                assert_eq!(r.output_tokens, planned.output_tokens);
            }
        }
    }
}

#[test]
fn simultaneous_requests_on_idle_gpus_land_on_distinct_gpus() {
    let mut cluster = Cluster::new(&config(PolicyKind::Metronome, 4));
    for round in 0..5u64 {
        let burst: Vec<PlannedRequest> = (0..4)
            .map(|i| PlannedRequest {
                id: i,
                at_s: 0.0,
                prompt_tokens: 500 + round as u32,
                output_tokens: 50,
                tenant: None,
                messages: Vec::new(),
            })
            .collect();
        let out = cluster.run(&burst);
        let mut workers: Vec<String> = out
            .records
            .iter()
            .filter_map(|r| r.worker.clone())
            .collect();
        workers.sort();
        workers.dedup();
        assert_eq!(workers.len(), 4, "round {round}: {:?}", out.per_worker);
    }
}
