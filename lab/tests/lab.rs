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
        cache_reports: false,
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

/// A shared-system-prompt plan: 4 groups × 6 users, each a 1,000-token system prompt and
/// a short question of its own.
fn shared_prefix_plan() -> Vec<PlannedRequest> {
    metronome_loadgen::prefixes::shared_prefix_plan(
        2.0,
        4,
        6,
        1_000,
        &metronome_loadgen::LengthDist::Fixed(40),
        &metronome_loadgen::LengthDist::Fixed(50),
        3,
        None,
        None,
    )
}

#[test]
fn prefix_heavy_plans_hit_the_gpus_prefix_cache_and_others_do_not_query_it() {
    let p = shared_prefix_plan();
    let out = run(&config(PolicyKind::PrefixAffinity, 2), &p);
    assert!(out.records.iter().all(|r| r.ok));
    let cache = out
        .prefix_cache
        .expect("a prefix-heavy plan reports its cache");
    // Each group's first request on a GPU prefills its prompt; the others find the system
    // prompt cached (1,000 of ~1,050 tokens): well over half the tokens looked up.
    assert!(cache.hit_rate().unwrap() > 0.6, "{cache:?}");
    // The same lengths without messages: anonymous prompts, nothing reported.
    let plain: Vec<PlannedRequest> = p
        .iter()
        .map(|r| PlannedRequest {
            messages: Vec::new(),
            ..r.clone()
        })
        .collect();
    assert_eq!(
        run(&config(PolicyKind::PrefixAffinity, 2), &plain).prefix_cache,
        None
    );
    // Cached prefixes are prefill not paid: the first tokens come sooner.
    let ttft = |o: &metronome_lab::LabRun| -> f64 {
        o.records.iter().filter_map(|r| r.ttft_ms).sum::<f64>()
    };
    assert!(
        ttft(&out) < ttft(&run(&config(PolicyKind::PrefixAffinity, 2), &plain)),
        "cached prefixes did not shorten TTFT"
    );
}

/// With the agents reporting their GPUs' caches, every cached-token figure a decision
/// counted on comes from the events and matches what the GPU found at admission for at
/// least half the jobs (the rest: a job admitted before the report of a prefix stored
/// just before it arrived).
#[test]
fn reported_caches_predict_the_gpus_hits() {
    let p = shared_prefix_plan();
    let mut reporting = config(PolicyKind::Metronome, 2);
    reporting.cache_reports = true;
    let out = run(&reporting, &p);
    assert!(out.records.iter().all(|r| r.ok));
    assert_eq!(out.cached.len(), p.len(), "every job's admission checked");
    let e = metronome_lab::cached_errors(&out.cached).unwrap();
    assert_eq!((e.jobs, e.source), (p.len(), "events"));
    assert_eq!(e.p50_tokens, 0, "{:?}", out.cached);
    // Without reports the figures are the placements' estimate.
    let estimated = run(&config(PolicyKind::Metronome, 2), &p);
    let e = metronome_lab::cached_errors(&estimated.cached).unwrap();
    assert_eq!(e.source, "placements");
}
