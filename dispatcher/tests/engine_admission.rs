//! Admission and bursts, on the engine alone (no server, simulated time): the behaviours
//! `admission.rs` and `burst.rs` check through NATS, here as properties of the decisions.

use metronome_dispatcher::engine::testing::*;
use metronome_dispatcher::engine::Event;
use metronome_protocol::{ErrorCode, Outcome};

/// Model `a` on two workers that take one job each, model `b` on one; queues of at most 3.
fn two_models() -> metronome_dispatcher::engine::Engine {
    let mut e = engine(|c| c.queue_bound_per_model = 3);
    let workers = vec![
        heartbeat_of("a-0", "a", 1, &[], 1, T0),
        heartbeat_of("a-1", "a", 1, &[], 1, T0),
        heartbeat_of("b-0", "b", 1, &[], 1, T0),
    ];
    step(&mut e, workers, T0);
    e
}

#[test]
fn a_full_model_queues_in_order_refuses_past_its_bound_and_never_holds_another_model() {
    let mut e = two_models();
    let first = step(
        &mut e,
        vec![small_job("a1", "a", T0 + 1), small_job("a2", "a", T0 + 2)],
        T0 + 2,
    );
    let mut on: Vec<String> = assigned(&first).into_iter().map(|(_, w)| w).collect();
    on.sort();
    assert_eq!(on, ["a-0", "a-1"]);

    // Three more wait (the bound is 3), a fourth is refused; model b's job goes at once.
    let more = (3..=6)
        .map(|i| small_job(&format!("a{i}"), "a", T0 + 2 + i))
        .collect();
    let out = step(&mut e, more, T0 + 10);
    assert!(assigned(&out).is_empty());
    let refused = rejected(&out);
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].0.job_id, "a6");
    assert_eq!(refused[0].0.reason_code.as_deref(), Some("queue_full"));
    assert_eq!(refused[0].1, ErrorCode::QueueFull);
    let b = step(&mut e, vec![small_job("b1", "b", T0 + 11)], T0 + 11);
    assert_eq!(assigned(&b), [("b1".to_string(), "b-0".to_string())]);

    // Each completion frees a worker for the oldest waiting job of model a.
    let mut running = [("a1", "a-0"), ("a2", "a-1")]
        .map(|(j, w)| (j.to_string(), w.to_string()))
        .to_vec();
    let mut at = T0 + 20;
    for next in ["a3", "a4", "a5"] {
        let (finished, worker) = running.remove(0);
        at += 10;
        let out = step(&mut e, vec![done(&finished, &worker, "a", 10, 10, at)], at);
        let placed = assigned(&out);
        assert_eq!(
            placed,
            [(next.to_string(), worker.clone())],
            "after {finished}"
        );
        running.push((next.to_string(), worker));
    }
}

#[test]
fn a_job_past_its_deadline_a_cancelled_one_and_one_for_an_unknown_model_are_answered_why() {
    let mut e = two_models();
    // Both workers of model a busy: the next jobs wait.
    step(
        &mut e,
        vec![small_job("a1", "a", T0 + 1), small_job("a2", "a", T0 + 2)],
        T0 + 2,
    );
    let mut late = body("late", "a", None, 10, 10, T0 + 3);
    late.deadline_ms = Some(T0 + 500);
    let waiting = vec![
        arrival(late, T0 + 3, T0 + 3),
        small_job("cancel-me", "a", T0 + 4),
        small_job("nobody", "no-such-model", T0 + 5),
    ];
    let out = step(&mut e, waiting, T0 + 5);
    let cancel = Event::Cancel {
        tenant: None,
        job_id: "cancel-me".into(),
    };
    let mut all = out;
    all.extend(step(&mut e, vec![cancel], T0 + 6));
    e.tick(T0 + 1_000);
    all.extend(e.take_effects());
    let why: Vec<(String, Outcome, Option<String>, ErrorCode)> = rejected(&all)
        .into_iter()
        .map(|(d, error)| (d.job_id.clone(), d.outcome, d.reason_code.clone(), error))
        .collect();
    let expect = |id: &str, outcome, code: &str, error| {
        (id.to_string(), outcome, Some(code.to_string()), error)
    };
    assert_eq!(
        why,
        [
            expect(
                "nobody",
                Outcome::Rejected,
                "unknown_model",
                ErrorCode::UnknownModel
            ),
            expect(
                "cancel-me",
                Outcome::Rejected,
                "cancelled",
                ErrorCode::Cancelled
            ),
            expect(
                "late",
                Outcome::Expired,
                "deadline_exceeded",
                ErrorCode::DeadlineExceeded
            ),
        ]
    );
    assert!(assigned(&all).is_empty());
}

/// N jobs arriving together on N idle equal workers land on N distinct workers, round
/// after round: each round's jobs arrive in one batch once the previous round finished.
#[test]
fn n_simultaneous_jobs_land_on_n_distinct_idle_workers_round_after_round() {
    for n in [2usize, 5, 16] {
        let mut e = engine(|_| {});
        let ids: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        let hb = |seq, at| {
            ids.iter()
                .map(|w| heartbeat_of(w, "m", 256, &[], seq, at))
                .collect()
        };
        step(&mut e, hb(1, T0), T0);
        let mut at = T0;
        for round in 0..20u64 {
            at += 1_000;
            let burst = (0..n)
                .map(|i| {
                    arrival(
                        body(&format!("r{round}-{i}"), "m", None, 500, 100, at),
                        at + i as u64,
                        at,
                    )
                })
                .collect();
            let placed = assigned(&step(&mut e, burst, at));
            let mut on: Vec<String> = placed.iter().map(|(_, w)| w.clone()).collect();
            on.sort();
            let mut expected = ids.clone();
            expected.sort();
            assert_eq!(on, expected, "n = {n}, round {round}");
            at += 500;
            // Every job finishes, and every worker reports itself idle again.
            let mut finished: Vec<Event> = placed
                .iter()
                .map(|(j, w)| done(j, w, "m", 500, 100, at))
                .collect();
            finished.extend(hb(round + 2, at));
            step(&mut e, finished, at);
            assert!(e.ledger().is_empty(), "n = {n}, round {round}");
        }
    }
}

/// Jobs arriving while the earlier ones' workers have not reported them yet (their
/// heartbeats still show them idle) still spread: the engine counts its own
/// reservations, not the heartbeats, until the workers report.
#[test]
fn jobs_arriving_before_the_workers_report_earlier_ones_still_spread() {
    for n in 2..=16usize {
        let mut e = engine(|_| {});
        let ids: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
        let idle = |seq, at| {
            ids.iter()
                .map(|w| heartbeat_of(w, "m", 256, &[], seq, at))
                .collect()
        };
        step(&mut e, idle(1, T0), T0);
        let jobs = |from: usize, to: usize, at| {
            (from..to)
                .map(|i| {
                    arrival(
                        body(&format!("j{i}"), "m", None, 500, 100, at),
                        i as u64,
                        at,
                    )
                })
                .collect()
        };
        let mut on: Vec<String> = assigned(&step(&mut e, jobs(0, n / 2, T0 + 1), T0 + 1))
            .into_iter()
            .map(|(_, w)| w)
            .collect();
        // Heartbeats sent before the workers saw their Assignments.
        step(&mut e, idle(2, T0 + 2), T0 + 2);
        on.extend(
            assigned(&step(&mut e, jobs(n / 2, n, T0 + 3), T0 + 3))
                .into_iter()
                .map(|(_, w)| w),
        );
        on.sort();
        let mut expected = ids.clone();
        expected.sort();
        assert_eq!(on, expected, "n = {n}");
    }
}
