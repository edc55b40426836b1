//! Prefix-aware placement, on the engine alone (no server, simulated time): a job whose
//! prompt starts like one placed before is predicted without that prefill on the worker
//! that holds it, the SLO rules still decide, and a job without a fingerprint is placed
//! exactly as before.

use metronome_dispatcher::engine::testing::*;
use metronome_dispatcher::engine::{Engine, Event};
use metronome_protocol::prefix::PrefixFingerprint;
use metronome_protocol::{AffinityOutcome, Decision, Job, PrefixSource};

const PROMPT: u32 = 2_000;

/// Token ids of a prompt: `shared` tokens common to every prompt of `family`, then
/// `own` tokens of this prompt alone (`seed`).
fn tokens(family: u32, shared: u32, seed: u32, own: u32) -> Vec<u32> {
    let head = (0..shared).map(|i| family * 1_000_000 + i);
    let tail = (0..own).map(|i| 500_000_000 + seed * 10_000 + i);
    head.chain(tail).collect()
}

/// A completion job of `tokens.len()` prompt tokens with their fingerprint.
fn with_prefix(id: &str, tokens: &[u32], at: u64) -> Job {
    let mut j = body(id, "m", None, tokens.len() as u32, 20, at);
    j.prefix = Some(PrefixFingerprint::of_tokens(tokens, 16));
    j
}

/// Two equal idle workers of model `m`, four jobs at once each.
fn two_workers() -> Engine {
    two_workers_with(|_| {})
}

/// [`two_workers`] under `configure`d settings.
fn two_workers_with(configure: impl FnOnce(&mut metronome_dispatcher::config::Config)) -> Engine {
    let mut e = engine(configure);
    let workers = vec![
        heartbeat_of("w0", "m", 4, &[], 1, T0),
        heartbeat_of("w1", "m", 4, &[], 1, T0),
    ];
    step(&mut e, workers, T0);
    e
}

/// A heartbeat of `id` changed by `change`.
fn heartbeat_with(
    id: &str,
    seq: u64,
    at: u64,
    change: impl FnOnce(&mut metronome_protocol::WorkerStatus),
) -> Event {
    let mut s = status(id, "m", 4, &[], seq, at);
    change(&mut s);
    put(s, seq, at)
}

/// `first` (job `p1`) ran on w1 and finished: w1 holds its prefix. `w0` was busy meanwhile
/// with a job without a prefix, so `p1` went to w1.
fn placed_on_w1_and_finished(e: &mut Engine, first: Job) {
    let busy = step(e, vec![small_job("busy", "m", T0 + 1)], T0 + 1);
    assert_eq!(assigned(&busy), [("busy".to_string(), "w0".to_string())]);
    let out = step(e, vec![arrival(first, T0 + 2, T0 + 2)], T0 + 2);
    assert_eq!(assigned(&out), [("p1".to_string(), "w1".to_string())]);
    step(
        e,
        vec![
            done("busy", "w0", "m", 10, 10, T0 + 500),
            done("p1", "w1", "m", PROMPT, 20, T0 + 500),
        ],
        T0 + 500,
    );
    assert!(e.ledger().reservations_on("w0").next().is_none());
    assert!(e.ledger().reservations_on("w1").next().is_none());
}

fn cached_on(d: &Decision, worker: &str) -> Option<(u32, PrefixSource)> {
    let c = d.candidates.iter().find(|c| c.worker_id == worker)?;
    c.cached_prefix.map(|p| (p.tokens, p.source))
}

#[test]
fn a_job_sharing_a_long_prefix_goes_to_the_idle_worker_that_holds_it() {
    let mut e = two_workers();
    let first = tokens(1, 1_600, 1, PROMPT - 1_600);
    placed_on_w1_and_finished(&mut e, with_prefix("p1", &first, T0 + 2));
    assert_eq!(e.prefix_index().blocks_on("w1"), (PROMPT / 16) as usize);

    // Both idle and equal: by worker id w0 would win (see the job without a fingerprint
    // below); w1 holds the first 1,600 tokens of the new prompt.
    let second = tokens(1, 1_600, 2, PROMPT + 100 - 1_600);
    let out = step(
        &mut e,
        vec![arrival(
            with_prefix("p2", &second, T0 + 600),
            T0 + 600,
            T0 + 600,
        )],
        T0 + 600,
    );
    assert_eq!(assigned(&out), [("p2".to_string(), "w1".to_string())]);
    let d = assignment_decisions(&out)[0];
    assert_eq!(cached_on(d, "w1"), Some((1_600, PrefixSource::Placements)));
    assert_eq!(cached_on(d, "w0"), Some((0, PrefixSource::Placements)));
    let ttft = |w: &str| {
        let c = d.candidates.iter().find(|c| c.worker_id == w).unwrap();
        c.prediction.unwrap().ttft_ms
    };
    // 1,600 tokens at 0.1 ms each not prefilled on w1.
    assert!(
        (ttft("w0") - ttft("w1") - 160.0).abs() < 1e-6,
        "{} vs {}",
        ttft("w0"),
        ttft("w1")
    );

    // The same prompt without a fingerprint: nothing is known, w0 wins the tie.
    let mut plain = with_prefix("p3", &second, T0 + 700);
    plain.prefix = None;
    let out = step(
        &mut e,
        vec![
            done("p2", "w1", "m", PROMPT + 100, 20, T0 + 700),
            arrival(plain, T0 + 700, T0 + 700),
        ],
        T0 + 700,
    );
    assert_eq!(assigned(&out), [("p3".to_string(), "w0".to_string())]);
    assert_eq!(cached_on(assignment_decisions(&out)[0], "w1"), None);
}

#[test]
fn a_worker_holding_the_prefix_but_missing_the_slo_loses_to_one_that_meets_it() {
    let mut e = two_workers();
    let first = tokens(1, PROMPT, 1, 0);
    placed_on_w1_and_finished(&mut e, with_prefix("p1", &first, T0 + 2));
    // w1 now runs a job and has 60,000 prompt tokens waiting for prefill: 6 s before the
    // job's first token there, against a 2 s target, cached prefix or not.
    let slow = heartbeat_with("w1", 2, T0 + 600, |s| {
        s.prefill_pending_tokens = 60_000;
        s.in_flight = vec!["x".into()];
        s.active = 1;
    });
    let second = tokens(1, PROMPT, 2, 200);
    let out = step(
        &mut e,
        vec![
            slow,
            arrival(with_prefix("p2", &second, T0 + 600), T0 + 600, T0 + 600),
        ],
        T0 + 600,
    );
    assert_eq!(assigned(&out), [("p2".to_string(), "w0".to_string())]);
    let d = assignment_decisions(&out)[0];
    let refused = d
        .rejected
        .iter()
        .find(|r| r.worker_id == "w1")
        .expect("w1 refused");
    assert_eq!(refused.code.as_str(), "ttft_over_budget");
    let affinity = d.affinity.as_ref().expect("affinity recorded");
    assert_eq!(
        (affinity.worker_id.as_str(), affinity.cached_tokens),
        ("w1", 2_000)
    );
    assert_eq!(affinity.outcome, AffinityOutcome::Overridden);
    assert_eq!(affinity.reason_code.as_deref(), Some("ttft_over_budget"));
    let reason = d.reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains(
            "prefix affinity overridden: w1 holds 2000 cached prompt tokens, not eligible:"
        ),
        "{reason}"
    );
}

/// w1 holds `p1`'s whole prompt and runs one job, w0 is idle; `p2` starts with that
/// prompt. What the engine decides for `p2`.
fn busy_holder_decides(e: &mut Engine) -> (Vec<(String, String)>, Decision) {
    let first = tokens(1, PROMPT, 1, 0);
    placed_on_w1_and_finished(e, with_prefix("p1", &first, T0 + 2));
    let busy = heartbeat_with("w1", 2, T0 + 600, |s| {
        s.in_flight = vec!["x".into()];
        s.active = 1;
    });
    let second = tokens(1, PROMPT, 2, 200);
    let out = step(
        e,
        vec![
            busy,
            arrival(with_prefix("p2", &second, T0 + 600), T0 + 600, T0 + 600),
        ],
        T0 + 600,
    );
    (assigned(&out), assignment_decisions(&out)[0].clone())
}

#[test]
fn the_holder_with_one_more_running_job_wins_on_predicted_cost() {
    // The score alone prefers the idle w0 (one request fewer); in milliseconds w1 is
    // cheaper by the prefill it skips, so affinity gives it the job and the decision says so.
    let (placed, d) = busy_holder_decides(&mut two_workers());
    assert_eq!(placed, [("p2".to_string(), "w1".to_string())]);
    let affinity = d.affinity.as_ref().expect("affinity recorded");
    assert_eq!(affinity.worker_id, "w1");
    assert_eq!(affinity.outcome, AffinityOutcome::Chosen);
    assert_eq!(
        d.candidates[0].worker_id, "w1",
        "the winner is listed first"
    );
    assert!(
        d.candidates[0].total > d.candidates[1].total,
        "the score alone preferred w0"
    );

    // With affinity off, the same inputs go to w0 and no record is made.
    let mut off = two_workers_with(|s| s.scheduler.affinity_max_share = 0.0);
    let (placed, d) = busy_holder_decides(&mut off);
    assert_eq!(placed, [("p2".to_string(), "w0".to_string())]);
    assert_eq!(d.affinity, None);
}

#[test]
fn jobs_without_a_fingerprint_are_placed_exactly_as_if_nothing_were_cached() {
    // Two engines see the same inputs, except that in one the first jobs carry their
    // fingerprints: its index holds their blocks, the other's holds nothing.
    let run = |fingerprints: bool| {
        let mut e = two_workers();
        let mut at = T0 + 1;
        for i in 0..3 {
            let id = format!("f{i}");
            let mut j = with_prefix(&id, &tokens(i, PROMPT, i, 0), at);
            if !fingerprints {
                j.prefix = None;
            }
            let out = step(&mut e, vec![arrival(j, at, at)], at);
            let (_, worker) = assigned(&out).pop().expect("placed");
            at += 10;
            step(&mut e, vec![done(&id, &worker, "m", PROMPT, 20, at)], at);
            at += 10;
        }
        let burst: Vec<Event> = (0..6)
            .map(|i| {
                arrival(
                    body(&format!("b{i}"), "m", None, PROMPT, 50, at),
                    at + i,
                    at,
                )
            })
            .collect();
        let out = step(&mut e, burst, at);
        let decisions: Vec<Decision> = assignment_decisions(&out).into_iter().cloned().collect();
        (
            e.prefix_index().blocks_on("w0") + e.prefix_index().blocks_on("w1"),
            decisions,
        )
    };
    let (indexed, with) = run(true);
    let (nothing, without) = run(false);
    assert!(indexed > 0 && nothing == 0, "{indexed} {nothing}");
    assert!(with.len() >= 2, "the burst is placed: {}", with.len());
    assert_eq!(with, without);
    assert!(with
        .iter()
        .all(|d| d.candidates.iter().all(|c| c.cached_prefix.is_none())));
}

/// A cache report of `worker` (run 1): a snapshot of `blocks`, after delta `seq`.
fn snapshot(worker: &str, seq: u64, blocks: &[u64]) -> Event {
    use metronome_protocol::cache_state::{CacheUpdate, CacheUpdateKind, CACHE_UPDATE_VERSION};
    Event::Cache(Box::new(CacheUpdate {
        v: CACHE_UPDATE_VERSION,
        worker_id: worker.into(),
        run: 1,
        seq,
        kind: CacheUpdateKind::Snapshot,
        block_size: 16,
        cleared: false,
        stored: blocks.to_vec(),
        removed: Vec::new(),
        truncated: false,
        sent_ms: 0,
    }))
}

#[test]
fn a_worker_that_reports_its_cache_is_judged_by_its_report_the_others_by_placements() {
    let mut e = two_workers();
    // w1 ran p1: the placements say it holds p1's prefix. But its server's report says it
    // holds only the first 800 tokens (the rest was evicted for requests the leader did
    // not place), and w0's server reports holding all of it.
    let first = tokens(1, 1_600, 1, PROMPT - 1_600);
    placed_on_w1_and_finished(&mut e, with_prefix("p1", &first, T0 + 2));
    let hashes = PrefixFingerprint::of_tokens(&first, 16).hashes;
    let second = tokens(1, 1_600, 2, PROMPT + 100 - 1_600);
    let out = step(
        &mut e,
        vec![
            snapshot("w1", 0, &hashes[..50]),
            arrival(with_prefix("p2", &second, T0 + 600), T0 + 600, T0 + 600),
        ],
        T0 + 600,
    );
    let d = assignment_decisions(&out)[0];
    assert_eq!(cached_on(d, "w1"), Some((800, PrefixSource::Events)));
    assert_eq!(cached_on(d, "w0"), Some((0, PrefixSource::Placements)));
    assert_eq!(e.reported_caches().blocks_on("w1"), 50);

    // The report goes stale (no message for longer than it is believed): w1 is judged by
    // the placements again, which now include p2 wherever it went.
    let later = T0 + 600 + metronome_scheduler::reported_cache::DEFAULT_STALE_AFTER_MS + 1;
    let third = tokens(1, 1_600, 3, PROMPT - 1_600);
    let out = step(
        &mut e,
        vec![
            heartbeat_of("w0", "m", 4, &[], 2, later),
            heartbeat_of("w1", "m", 4, &[], 2, later),
            arrival(with_prefix("p3", &third, later), later, later),
        ],
        later,
    );
    let d = assignment_decisions(&out)[0];
    assert_eq!(
        cached_on(d, "w1").map(|(_, s)| s),
        Some(PrefixSource::Placements)
    );
}
