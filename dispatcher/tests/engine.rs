//! The engine as a state machine: inputs with the time they are applied at, effects out.
//! No NATS, no Redis, no clock: every test is exact and instant.

use std::sync::Arc;

use metronome_dispatcher::engine::testing::*;
use metronome_dispatcher::engine::{
    Effect, Engine, EngineSettings, Event, Outcome, RedisSnapshot, WorkerUpdate,
};
use metronome_dispatcher::{Config, Metrics};
use metronome_protocol::{CompletionOutcome, ErrorCode, SloRequest, PROTOCOL_VERSION};
use metronome_scheduler::FairnessSnapshot;

/// An engine on `configure`d defaults with one idle worker `w` registered at `T0`.
fn one_worker(configure: impl FnOnce(&mut Config)) -> Engine {
    let mut e = engine(configure);
    published(&mut e, vec![heartbeat("w", &[], 1, T0, |_| {})], T0);
    e
}

/// `worker` ended `id` with `outcome` after `output_tokens` (100 prompt tokens, at `T0`).
fn ended(id: &str, worker: &str, output_tokens: u32, outcome: CompletionOutcome) -> Event {
    completion(id, worker, "m", 100, output_tokens, outcome, T0)
}

/// The retry among `outcomes`, if any: the attempt it will be and the refusals it carries.
fn requeued(outcomes: &[Outcome]) -> Option<(u32, &[(String, u32)])> {
    outcomes.iter().find_map(|o| match o {
        Outcome::Requeue {
            job, refused_by, ..
        } => Some((job.attempt, refused_by.as_slice())),
        _ => None,
    })
}

/// What each outcome is, for failure messages (outcomes hold message handles, not Debug).
fn names(outcomes: &[Outcome]) -> Vec<&'static str> {
    outcomes
        .iter()
        .map(|o| match o {
            Outcome::Assign { .. } => "assign",
            Outcome::Reject { .. } => "reject",
            Outcome::DecisionOnly { .. } => "decision_only",
            Outcome::PurgeWork { .. } => "purge_work",
            Outcome::ExpireWorker { .. } => "expire_worker",
            Outcome::DeadLetter { .. } => "dead_letter",
            Outcome::Requeue { .. } => "requeue",
            Outcome::RelayCancel { .. } => "relay_cancel",
            Outcome::Revoke { .. } => "revoke",
            Outcome::FinalError { .. } => "final_error",
        })
        .collect()
}

#[test]
fn simultaneous_jobs_on_idle_workers_land_on_distinct_workers() {
    let mut e = engine(|_| {});
    let workers = ["w1", "w2", "w3", "w4"];
    published(
        &mut e,
        workers
            .iter()
            .map(|w| heartbeat(w, &[], 1, T0, |_| {}))
            .collect(),
        T0,
    );
    let out = published(
        &mut e,
        (0..4)
            .map(|i| job(&format!("j{i}"), 500, 100, T0 + 1))
            .collect(),
        T0 + 1,
    );
    let mut on: Vec<String> = assigned(&out).into_iter().map(|(_, w)| w).collect();
    on.sort();
    assert_eq!(on, workers, "{:?}", names(&out));
}

#[test]
fn the_same_inputs_give_the_same_decisions() {
    let run = || {
        let mut e = engine(|_| {});
        published(
            &mut e,
            vec![
                heartbeat("a", &[], 1, T0, |_| {}),
                heartbeat("b", &[], 1, T0, |_| {}),
            ],
            T0,
        );
        let mut all = Vec::new();
        for i in 0..20u64 {
            let at = T0 + 10 * i;
            all.extend(assigned(&published(
                &mut e,
                vec![job(
                    &format!("j{i}"),
                    200 + 97 * i as u32 % 900,
                    50 + i as u32,
                    at,
                )],
                at,
            )));
        }
        all
    };
    assert_eq!(run(), run());
}

#[test]
fn a_waiting_job_expires_when_time_passes_its_deadline() {
    // No worker listed for the model would reject it as unknown; one busy to its ceiling
    // keeps it waiting instead.
    let mut config = Config::default();
    config.scheduler.default_max_concurrency = 1;
    config.default_deadline_ms = 5_000;
    let mut e2 = engine(|c| *c = config.clone());
    let busy = heartbeat("w", &["running"], 1, T0, |_| {});
    let Event::Worker(WorkerUpdate::Put { mut status, .. }) = busy else {
        unreachable!()
    };
    status.max_concurrency = 1;
    published(
        &mut e2,
        vec![Event::Worker(WorkerUpdate::Put {
            status,
            seen_ms: T0,
            revision: 1,
            unvouched: Vec::new(),
            tenants: Default::default(),
        })],
        T0,
    );
    assert!(assigned(&published(&mut e2, vec![job("late", 100, 10, T0)], T0)).is_empty());
    // Before the deadline, a tick changes nothing; after it, the job is answered.
    e2.tick(T0 + 4_000);
    let before: Vec<_> = e2.take_effects();
    assert!(
        !before
            .iter()
            .any(|f| matches!(f, Effect::Publish(Outcome::Reject { .. }))),
        "nothing is due before the deadline"
    );
    e2.tick(T0 + 5_001);
    let rejected = e2.take_effects().into_iter().any(|f| {
        matches!(f, Effect::Publish(Outcome::Reject { error: ErrorCode::DeadlineExceeded, ref decision, .. }) if decision.job_id == "late")
    });
    assert!(rejected, "the job past its deadline is answered");
}

#[test]
fn a_refused_job_goes_back_through_jobs_for_another_attempt() {
    let mut e = engine(|_| {});
    published(&mut e, vec![heartbeat("w", &[], 1, T0, |_| {})], T0);
    let out = published(&mut e, vec![job("j", 100, 10, T0)], T0);
    assert_eq!(assigned(&out), vec![("j".to_string(), "w".to_string())]);
    let out = published(
        &mut e,
        vec![ended("j", "w", 0, CompletionOutcome::Refused)],
        T0 + 10,
    );
    let retry = requeued(&out).map(|(attempt, _)| attempt);
    assert_eq!(retry, Some(2), "{:?}", names(&out));
}

/// Refuse `j` on `worker` (attempt `attempt`) and hand its retry back to the engine, as
/// JOBS would; what the retry's placement published.
fn refuse_and_retry(e: &mut Engine, worker: &str, attempt: u32, at: u64) -> Vec<Outcome> {
    let mut refusal = ended("j", worker, 0, CompletionOutcome::Refused);
    if let Event::Completion { event, .. } = &mut refusal {
        event.attempt = attempt;
    }
    let out = published(e, vec![refusal], at);
    let (retry, _) = requeued(&out).unwrap_or_else(|| panic!("no retry: {:?}", names(&out)));
    assert_eq!(retry, attempt + 1);
    let mut again = job("j", 100, 10, at);
    if let Event::Job(inc) = &mut again {
        inc.attempt = retry;
    }
    published(e, vec![again], at + 1)
}

/// A job a worker refused goes to another worker on its next attempt, and the decision
/// says why the refusing one was left out. Before, the leader picked the worker that had
/// just refused (idle again, the best score), so one refusing worker used up every
/// attempt of the job.
#[test]
fn a_refused_job_goes_to_another_worker_while_one_can_take_it() {
    let mut e = engine(|_| {});
    published(
        &mut e,
        vec![
            heartbeat("w1", &[], 1, T0, |_| {}),
            heartbeat("w2", &[], 1, T0, |_| {}),
        ],
        T0,
    );
    let out = published(&mut e, vec![job("j", 100, 10, T0)], T0);
    let first = assigned(&out)[0].1.clone();
    let out = refuse_and_retry(&mut e, &first, 1, T0 + 10);
    let second = assigned(&out);
    assert_eq!(second.len(), 1, "{:?}", names(&out));
    assert_ne!(
        second[0].1, first,
        "given back to the worker that refused it"
    );
    let Some(Outcome::Assign { decision, .. }) = out.first() else {
        unreachable!()
    };
    let left_out = decision
        .rejected
        .iter()
        .find(|r| r.worker_id == first)
        .expect("the refusing worker is listed");
    assert_eq!(left_out.code, metronome_protocol::RejectionCode::RefusedJob);
    assert!(left_out.reason.contains("attempt 1"), "{}", left_out.reason);
    // Refused by both: either may try again (nobody else can take it).
    let out = refuse_and_retry(&mut e, &second[0].1, 2, T0 + 20);
    assert_eq!(assigned(&out).len(), 1, "{:?}", names(&out));
}

/// Only a worker of the job's own model counts as "another worker that can take it": a
/// refused job whose model has one worker goes back to it although another model's worker
/// is open. Decisions list other models' workers by default, and the job used to wait for
/// that worker, which could never take it.
#[test]
fn a_refused_job_goes_back_to_its_models_only_worker_while_another_models_is_open() {
    let mut e = engine(|_| {});
    let other = heartbeat("x1", &[], 1, T0, |s| s.model = "another-model".into());
    published(&mut e, vec![heartbeat("w1", &[], 1, T0, |_| {}), other], T0);
    let out = published(&mut e, vec![job("j", 100, 10, T0)], T0);
    assert_eq!(assigned(&out), vec![("j".to_string(), "w1".to_string())]);
    let out = refuse_and_retry(&mut e, "w1", 1, T0 + 10);
    assert_eq!(
        assigned(&out),
        vec![("j".to_string(), "w1".to_string())],
        "{:?}",
        names(&out)
    );
}

/// Issue 9: refusals outlive the leader that saw them. The retry a refusal causes carries
/// the job's refusals, and a new leader (another engine) reading that retry leaves the
/// refusing worker out although it scores best; reading the same retry without them, it
/// picks the refusing worker.
#[test]
fn a_retry_carries_its_refusals_to_the_next_leader() {
    let mut e = engine(|_| {});
    published(&mut e, vec![heartbeat("w1", &[], 1, T0, |_| {})], T0);
    let out = published(&mut e, vec![job("j", 100, 10, T0)], T0);
    assert_eq!(assigned(&out), vec![("j".to_string(), "w1".to_string())]);
    let out = published(
        &mut e,
        vec![ended("j", "w1", 0, CompletionOutcome::Refused)],
        T0 + 10,
    );
    let (_, refused_by) = requeued(&out).unwrap_or_else(|| panic!("no retry: {:?}", names(&out)));
    let refused_by = refused_by.to_vec();
    assert_eq!(refused_by, vec![("w1".to_string(), 1)]);

    let next_leader = |refused_by: Vec<(String, u32)>| {
        let mut e = engine(|_| {});
        let busy = heartbeat("w2", &[], 1, T0 + 20, |s| s.queued = 3);
        published(
            &mut e,
            vec![heartbeat("w1", &[], 2, T0 + 20, |_| {}), busy],
            T0 + 20,
        );
        let mut retry = job("j", 100, 10, T0 + 20);
        if let Event::Job(inc) = &mut retry {
            inc.attempt = 2;
            inc.refused_by = refused_by;
        }
        assigned(&published(&mut e, vec![retry], T0 + 21))
    };
    assert_eq!(
        next_leader(Vec::new()),
        vec![("j".to_string(), "w1".to_string())]
    );
    assert_eq!(
        next_leader(refused_by),
        vec![("j".to_string(), "w2".to_string())]
    );
}

/// With no other worker that can take it, the one that refused gets the job again (a
/// refusal may be passing: draining, a restart).
/// The job ids of the final errors among `outcomes`.
fn final_errors(outcomes: &[Outcome]) -> Vec<String> {
    outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::FinalError { job_id, .. } => Some(job_id.clone()),
            _ => None,
        })
        .collect()
}

/// A job an earlier leader assigned to `w` (adopted here from its heartbeat) is refused;
/// then `w`'s heartbeats say `later_lists` (whether they still list the job). Returns the
/// final errors published until well past the grace for the job's retry to come back.
fn orphan_refusal_then(later_lists: bool) -> Vec<String> {
    let mut e = one_worker(|_| {});
    published(
        &mut e,
        vec![heartbeat("w", &["j"], 2, T0 + 100, |_| {})],
        T0 + 100,
    );
    // A heartbeat sent before the refusal is applied after it: it books `j` on `w` again.
    let mut out = published(
        &mut e,
        vec![
            ended("j", "w", 0, CompletionOutcome::Refused),
            heartbeat("w", &["j"], 3, T0 + 200, |_| {}),
        ],
        T0 + 300,
    );
    let listed: &[&str] = if later_lists { &["j"] } else { &[] };
    let mut at = T0 + 300;
    for seq in 4..12 {
        at += 1_000;
        e.tick(at);
        out.extend(published(
            &mut e,
            vec![heartbeat("w", listed, seq, at, |_| {})],
            at,
        ));
    }
    final_errors(&out)
}

#[test]
fn a_refused_job_booked_again_by_a_stale_heartbeat_is_still_answered() {
    assert_eq!(
        orphan_refusal_then(false),
        ["j"],
        "nobody holds the job: its client is told"
    );
    assert!(
        orphan_refusal_then(true).is_empty(),
        "the worker still lists the job in later heartbeats: it holds another attempt"
    );
}

/// A job an earlier leader assigned to `w` is refused, and the refusal carries the job (the
/// intake kept the copy: the decision on record vouches for it). The new leader holds no
/// body of its own, yet the job is assigned again, not failed: a retry with the next
/// attempt that names `w`'s refusal, and no final error after the grace for a retry.
#[test]
fn a_refused_job_an_earlier_leader_assigned_comes_back_from_the_copy_it_carries() {
    let mut e = one_worker(|_| {});
    published(
        &mut e,
        vec![heartbeat("w", &["j"], 2, T0 + 100, |_| {})],
        T0 + 100,
    );
    let mut refusal = ended("j", "w", 0, CompletionOutcome::Refused);
    let Event::Job(incoming) = job("j", 100, 10, T0) else {
        unreachable!()
    };
    if let Event::Completion { event, .. } = &mut refusal {
        event.job = Some(Box::new((*incoming.job).clone()));
    }
    let mut out = published(
        &mut e,
        vec![refusal, heartbeat("w", &[], 3, T0 + 200, |_| {})],
        T0 + 300,
    );
    assert_eq!(
        requeued(&out).map(|(attempt, refused)| (attempt, refused.to_vec())),
        Some((2, vec![("w".to_string(), 1)])),
        "assigned again with the next attempt, away from the worker that refused it: {:?}",
        names(&out)
    );
    let mut at = T0 + 300;
    for seq in 4..12 {
        at += 1_000;
        e.tick(at);
        out.extend(published(
            &mut e,
            vec![heartbeat("w", &[], seq, at, |_| {})],
            at,
        ));
    }
    assert!(
        final_errors(&out).is_empty(),
        "its client is not told it failed: {:?}",
        names(&out)
    );
}

/// An Assignment as an earlier leader wrote it for `worker`.
fn earlier_assignment(id: &str, worker: &str, attempt: u32) -> metronome_protocol::Assignment {
    let Event::Job(incoming) = job(id, 100, 10, T0) else {
        unreachable!()
    };
    metronome_protocol::Assignment {
        v: PROTOCOL_VERSION,
        job: (*incoming.job).clone(),
        worker_id: worker.into(),
        epoch: 3,
        attempt,
        assigned_ms: T0,
        cached_prefix: None,
    }
}

#[test]
fn a_dead_workers_purge_hands_back_only_the_jobs_nobody_holds() {
    let mut e = engine(|_| {});
    // `w` runs `adopted` (reported), then falls silent; `other` stays alive.
    published(
        &mut e,
        vec![
            heartbeat("w", &["adopted"], 1, T0, |_| {}),
            heartbeat("other", &[], 1, T0, |_| {}),
        ],
        T0,
    );
    let timeout = Config::default().scheduler.heartbeat_timeout_ms;
    let at = T0 + timeout + 1;
    published(&mut e, vec![heartbeat("other", &[], 2, at, |_| {})], at);
    e.tick(at);
    // The leader's conditional delete of the silent worker's key, seen on the watch.
    let died = published(
        &mut e,
        vec![Event::Worker(WorkerUpdate::Gone {
            worker_id: "w".into(),
        })],
        at,
    );
    assert!(
        names(&died).contains(&"purge_work"),
        "a dead worker's WORK is purged: {:?}",
        names(&died)
    );
    // The purge read `adopted` (answered worker_lost at the death) and `never-reported`
    // (an earlier leader's, the only copy of that job).
    let out = published(
        &mut e,
        vec![Event::PurgedAssignments {
            worker_id: "w".into(),
            assignments: vec![
                earlier_assignment("adopted", "w", 1),
                earlier_assignment("never-reported", "w", 2),
            ],
        }],
        at + 10,
    );
    let requeues: Vec<(String, u32)> = out
        .iter()
        .filter_map(|o| match o {
            Outcome::Requeue { job, .. } => Some((job.job.id.clone(), job.attempt)),
            _ => None,
        })
        .collect();
    assert_eq!(requeues, [("never-reported".to_string(), 3)]);
    assert_eq!(
        requeued(&out).map(|(_, refused)| refused.to_vec()),
        Some(vec![("w".to_string(), 2)]),
        "the retry carries the dead worker, so it is placed elsewhere"
    );
    // A worker that was only silent may hold a delivered copy the purge could not remove:
    // the rescued attempt is revoked on it, so that copy never starts beside the retry.
    let revoked: Vec<(&str, &[metronome_protocol::RevokedJob])> = out
        .iter()
        .filter_map(|o| match o {
            Outcome::Revoke { worker_id, revoke } => {
                Some((worker_id.as_str(), revoke.jobs.as_slice()))
            }
            _ => None,
        })
        .collect();
    let expected = [metronome_protocol::RevokedJob {
        job_id: "never-reported".into(),
        attempt: Some(2),
    }];
    assert_eq!(revoked, [("w", &expected[..])], "{:?}", names(&out));
}

#[test]
fn a_refused_job_goes_back_to_its_worker_when_no_other_can_take_it() {
    let mut e = engine(|_| {});
    let draining = heartbeat("w2", &[], 1, T0, |s| s.draining = true);
    published(
        &mut e,
        vec![heartbeat("w1", &[], 1, T0, |_| {}), draining],
        T0,
    );
    let out = published(&mut e, vec![job("j", 100, 10, T0)], T0);
    assert_eq!(assigned(&out), vec![("j".to_string(), "w1".to_string())]);
    let out = refuse_and_retry(&mut e, "w1", 1, T0 + 10);
    assert_eq!(assigned(&out), vec![("j".to_string(), "w1".to_string())]);
}

/// A reservation its worker's heartbeats keep confirming lives as long as they list the
/// job, far past `reservation_ttl_ms` (10 s); unlisted, it goes one TTL after the last
/// heartbeat that listed it. (Issue 9 said confirmed reservations expired after 10 s
/// whatever the heartbeats said; each listing heartbeat renews it.)
#[test]
fn a_reservation_its_worker_keeps_reporting_outlives_the_reservation_ttl() {
    let mut e = one_worker(|_| {});
    let out = published(&mut e, vec![job("long", 100, 10, T0)], T0);
    assert_eq!(assigned(&out), vec![("long".to_string(), "w".to_string())]);
    let ttl = Config::default().scheduler.reservation_ttl_ms;
    let mut at = T0;
    for seq in 2..=60 {
        at = T0 + (seq - 1) * 1_000;
        published(&mut e, vec![heartbeat("w", &["long"], seq, at, |_| {})], at);
        assert_eq!(
            e.ledger().worker_of("long"),
            Some("w"),
            "expired {} ms after it was booked",
            at - T0
        );
    }
    assert!(at - T0 > 5 * ttl);
    // No longer listed: kept for one TTL after the last heartbeat that listed it.
    published(
        &mut e,
        vec![heartbeat("w", &[], 61, at + ttl, |_| {})],
        at + ttl,
    );
    assert_eq!(e.ledger().worker_of("long"), Some("w"));
    published(
        &mut e,
        vec![heartbeat("w", &[], 62, at + ttl + 1, |_| {})],
        at + ttl + 1,
    );
    assert_eq!(e.ledger().worker_of("long"), None);
}

#[test]
fn the_expected_output_follows_max_tokens_once_completions_show_it() {
    let mut e = engine(|_| {});
    // The model's outputs average 150 tokens (the agents' EWMA in Redis).
    let redis = Event::Redis(RedisSnapshot {
        ewmas: Default::default(),
        output_len: [("m".to_string(), 150.0)].into(),
    });
    published(&mut e, vec![heartbeat("w", &[], 1, T0, |_| {}), redis], T0);
    // Jobs that write exactly what they ask for.
    for i in 0..30u32 {
        let at = T0 + 100 * u64::from(i + 1);
        let id = format!("j{i}");
        let n = 50 + (i * 53) % 500;
        let beat = heartbeat("w", &[], u64::from(i) + 2, at, |_| {});
        published(&mut e, vec![beat, job(&id, 100, n, at)], at);
        published(
            &mut e,
            vec![ended(&id, "w", n, CompletionOutcome::Done)],
            at + 50,
        );
    }
    let at = T0 + 10_000;
    let out = published(
        &mut e,
        vec![
            heartbeat("w", &[], 100, at, |_| {}),
            job("probe", 100, 400, at),
        ],
        at,
    );
    let cost = out
        .iter()
        .find_map(|o| match o {
            Outcome::Assign { decision, .. } => decision.cost.clone(),
            _ => None,
        })
        .expect("assigned with a cost");
    let predicted = cost.predicted_output_tokens;
    assert!(
        (predicted - 400.0).abs() < 20.0,
        "a job asking for 400 is expected to write about 400, not the mean: {predicted}"
    );
}

/// A job of `tenant` (`None`: of no tenant), 100 prompt and 10 output tokens.
fn tenant_job(tenant: Option<&str>, id: &str, at: u64) -> Event {
    job_of(tenant, id, 100, 10, at)
}

fn cancel(tenant: Option<&str>, id: &str) -> Event {
    Event::Cancel {
        tenant: tenant.map(String::from),
        job_id: id.into(),
    }
}

/// Issue 10: a cancellation applies only to a job of the tenant it names (a client may name
/// any job id under its own tenant's subject). One that overtakes its job is remembered with
/// its tenant; one for an assigned job of another tenant is ignored and counted; the relay to
/// the worker that reports the job names the job's own tenant, once.
#[test]
fn a_cancel_applies_only_to_a_job_of_the_tenant_it_names() {
    let metrics = Metrics::new();
    let mut e = Engine::new(
        EngineSettings::from_config(&Config::default(), 7, "test".into()),
        metrics.clone(),
        None,
    );
    let acme = Some("acme");
    published(&mut e, vec![heartbeat("w1", &[], 1, T0, |_| {})], T0);
    let out = published(
        &mut e,
        vec![
            cancel(Some("globex"), "forged"),
            cancel(None, "forged"),
            cancel(acme, "own"),
            tenant_job(acme, "forged", T0 + 1),
            tenant_job(acme, "own", T0 + 1),
        ],
        T0 + 1,
    );
    let assigned_ids: Vec<String> = assigned(&out).into_iter().map(|(j, _)| j).collect();
    assert_eq!(assigned_ids, ["forged"], "{:?}", names(&out));
    let rejected: Vec<(String, Option<String>)> = out
        .iter()
        .filter_map(|o| match o {
            Outcome::Reject { decision, .. } => {
                Some((decision.job_id.clone(), decision.reason_code.clone()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        rejected,
        [("own".to_string(), Some("cancelled".to_string()))]
    );

    // Assigned to w1, not reported yet: another tenant's cancel is ignored, acme's is
    // relayed to w1 at once (its own control subject, naming acme), and again once w1
    // reports the job (the cancel may have overtaken the Assignment).
    let out = published(
        &mut e,
        vec![cancel(Some("globex"), "forged"), cancel(None, "forged")],
        T0 + 2,
    );
    assert!(out.is_empty(), "{:?}", names(&out));
    assert_eq!(
        metrics
            .cancels_of_another_tenant_total
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    let relays = |out: &[Outcome]| -> Vec<(String, Option<String>, String)> {
        out.iter()
            .filter_map(|o| match o {
                Outcome::RelayCancel {
                    worker_id,
                    tenant,
                    job_id,
                } => Some((worker_id.clone(), tenant.clone(), job_id.clone())),
                _ => None,
            })
            .collect()
    };
    let relayed = [(
        "w1".to_string(),
        Some("acme".to_string()),
        "forged".to_string(),
    )];
    let out = published(&mut e, vec![cancel(acme, "forged")], T0 + 3);
    assert_eq!(relays(&out), relayed);
    let out = published(
        &mut e,
        vec![heartbeat("w1", &["forged"], 2, T0 + 4, |_| {})],
        T0 + 4,
    );
    assert_eq!(relays(&out), relayed);
    let out = published(
        &mut e,
        vec![heartbeat("w1", &["forged"], 3, T0 + 5, |_| {})],
        T0 + 5,
    );
    assert!(relays(&out).is_empty(), "relayed once");
}

#[test]
fn a_small_job_goes_ahead_of_a_large_one_that_fits_nowhere_yet() {
    let run = |lookahead: usize| {
        let mut e = one_worker(|c| c.scheduler.lookahead = lookahead);
        // A 10-token job runs; a 6,000-token prompt would stall it 600 ms, far below its
        // floor; a 10-token prompt behind it would stall it 1 ms.
        let first = published(&mut e, vec![job("short", 100, 10, T0)], T0);
        assert_eq!(assigned(&first).len(), 1);
        let at = T0 + 5;
        assigned(&published(
            &mut e,
            vec![job("big", 6_000, 100, at), job("tiny", 10, 10, at + 1)],
            at + 1,
        ))
    };
    assert_eq!(
        run(0),
        vec![],
        "strict order: the small job waits behind the large"
    );
    assert_eq!(
        run(8),
        vec![("tiny".to_string(), "w".to_string())],
        "the small job that fits goes ahead; the large one keeps its place"
    );
}

/// Issue 10: a tenant running less than its share of the model is not made to wait for room
/// another tenant's flood holds. One worker runs the flood's job; the flood has two more
/// waiting; the steady tenant's job would stall the running one below its floor. With fair
/// sharing on, the flood's running job, above its tenant's share, is not protected against
/// the steady tenant's: that job is placed at once, and its decision says why; with
/// `light_tenant_window_ms = 0` (no fair shares) it waits like any other job.
#[test]
fn a_tenant_under_its_fair_share_is_judged_without_the_floors_of_a_tenant_above_it() {
    let run = |window_ms: u64| {
        let mut e = one_worker(|c| c.fairness.light_tenant_window_ms = window_ms);
        let first = published(&mut e, vec![tenant_job(Some("flood"), "f1", T0)], T0);
        assert_eq!(assigned(&first).len(), 1, "{:?}", names(&first));
        let big = |tenant: &str, id: &str, at: u64| job_of(Some(tenant), id, 6_000, 100, at);
        let at = T0 + 5;
        let out = published(
            &mut e,
            vec![
                big("flood", "f2", at),
                big("flood", "f3", at),
                big("steady", "s1", at + 1),
            ],
            at + 1,
        );
        out.iter()
            .filter_map(|o| match o {
                Outcome::Assign {
                    job,
                    worker_id,
                    decision,
                    ..
                } => Some((
                    job.job.id.clone(),
                    worker_id.clone(),
                    decision.reason.clone().unwrap_or_default(),
                )),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let placed = run(30_000);
    assert_eq!(placed.len(), 1, "{placed:?}");
    assert_eq!((placed[0].0.as_str(), placed[0].1.as_str()), ("s1", "w"));
    assert!(
        placed[0]
            .2
            .contains("above their fair share (0.5 of the model's 1 running jobs): flood runs 1"),
        "the decision says why: {:?}",
        placed[0].2
    );
    assert_eq!(run(0), vec![], "without fair shares every job waits");
}

/// Issue 10: a new leader counts the running jobs an earlier leader placed by the tenant
/// their decisions on record name. The worker runs two of the flood's jobs, placed in an
/// earlier term and listed by its heartbeat; the flood has two more waiting, the steady
/// tenant one, each too big to admit without a predicted miss. Knowing whose the adopted
/// jobs are, the steady tenant runs under its share and is placed at once where it does
/// least harm; counting them as nobody's (every tenant at zero), it waits like the flood.
#[test]
fn a_new_leader_counts_each_tenants_adopted_jobs() {
    let run = |tenants_known: bool| {
        let mut e = engine(|_| {});
        let mut beat = heartbeat("w", &["a1", "a2"], 1, T0, |_| {});
        if tenants_known {
            let Event::Worker(WorkerUpdate::Put { tenants, .. }) = &mut beat else {
                unreachable!()
            };
            tenants.insert("a1".into(), "flood".into());
            tenants.insert("a2".into(), "flood".into());
        }
        published(&mut e, vec![beat], T0);
        assert_eq!(e.ledger().len(), 2, "both listed jobs are adopted");
        let at = T0 + 5;
        // A 6,000-token prefill stalls the adopted jobs (judged on the new job's expected
        // output, 10 tokens) far below their floor.
        let big = |tenant: &str, id: &str| job_of(Some(tenant), id, 6_000, 10, at);
        let out = published(
            &mut e,
            vec![big("flood", "f1"), big("flood", "f2"), big("steady", "s1")],
            at + 1,
        );
        assigned(&out)
            .into_iter()
            .map(|(j, _)| j)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        run(false),
        Vec::<String>::new(),
        "every tenant at zero: all wait"
    );
    assert_eq!(run(true), ["s1"], "the steady tenant runs under its share");
}

/// Issue 10: how many running jobs of tenants at or under their fair share a tenant under
/// its share may push below their floor is `[fairness] light_tenant_traded_misses`. The
/// worker runs four of the flood's jobs and two of a calm tenant's, which is its share
/// (six jobs, three active tenants); the steady tenant's 6,000-token prompt would stall all
/// six below their floor. The flood's do not count (it runs above its share); the calm
/// tenant's two do. Allowed to trade one miss the steady job waits; allowed four (the
/// default) it is placed at once, and its decision says why.
#[test]
fn a_tenant_under_its_fair_share_may_trade_as_many_misses_as_configured() {
    let run = |traded: Option<u32>| {
        let mut e = one_worker(|c| {
            if let Some(t) = traded {
                c.fairness.light_tenant_traded_misses = t;
            }
        });
        let small = |tenant: &str, id: &str, at: u64| job_of(Some(tenant), id, 100, 40, at);
        let flood = (1..=4)
            .map(|i| small("flood", &format!("f{i}"), T0))
            .collect();
        let first = published(&mut e, flood, T0);
        let calm = vec![small("calm", "c1", T0 + 1), small("calm", "c2", T0 + 1)];
        let second = published(&mut e, calm, T0 + 1);
        assert_eq!(
            assigned(&first).len() + assigned(&second).len(),
            6,
            "{:?} {:?}",
            names(&first),
            names(&second)
        );
        let at = T0 + 5;
        let big = |tenant: &str, id: &str| job_of(Some(tenant), id, 6_000, 100, at);
        let out = published(
            &mut e,
            vec![big("flood", "f5"), big("flood", "f6"), big("steady", "s1")],
            at + 1,
        );
        out.iter()
            .filter_map(|o| match o {
                Outcome::Assign { job, decision, .. } => Some((
                    job.job.id.clone(),
                    decision.reason.clone().unwrap_or_default(),
                )),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(Some(1)), vec![], "two misses: it waits");
    let placed = run(None);
    assert_eq!(placed.len(), 1, "{placed:?}");
    assert_eq!(placed[0].0, "s1", "the default trades up to four");
    for why in [
        "placed where it does least harm",
        "under its fair share",
        "above their fair share (2.0 of the model's 6 running jobs): flood runs 4",
    ] {
        assert!(placed[0].1.contains(why), "{why:?} in {:?}", placed[0].1);
    }
}

/// Issue 10: a job that fits nowhere holds back only its own tenant's jobs. The worker runs
/// a long job of tenant a with a long context (about 46 tok/s for a job beside it); a's
/// next job, first in the fair order, asks for 48 tok/s, which it gets only on an idle
/// worker or beside a short job, while tenant b's job fits. It goes ahead; a's job keeps
/// its place and is placed once a's first job ends.
#[test]
fn a_job_that_fits_nowhere_holds_back_only_its_own_tenants_jobs() {
    let mut e = engine(|_| {});
    published(&mut e, vec![heartbeat("w", &[], 1, T0, |_| {})], T0);
    let first = published(&mut e, vec![job_of(Some("a"), "a0", 1_000, 29_000, T0)], T0);
    assert_eq!(assigned(&first), [("a0".to_string(), "w".to_string())]);
    let at = T0 + 5;
    let Event::Job(mut demanding) = job_of(Some("a"), "a1", 100, 10, at) else {
        unreachable!()
    };
    let mut j = (*demanding.job).clone();
    j.slo = Some(SloRequest {
        ttft_ms: None,
        min_tok_s: Some(48.0),
    });
    demanding.job = Arc::new(j);
    let out = published(
        &mut e,
        vec![
            Event::Job(demanding),
            job_of(Some("b"), "b1", 100, 10, at + 1),
        ],
        at + 1,
    );
    assert_eq!(assigned(&out), [("b1".to_string(), "w".to_string())]);
    let out = published(
        &mut e,
        vec![
            ended("a0", "w", 29_000, CompletionOutcome::Done),
            heartbeat("w", &["b1"], 2, at + 2, |_| {}),
        ],
        at + 2,
    );
    assert_eq!(assigned(&out), [("a1".to_string(), "w".to_string())]);
}

/// Issue 10: a new leader reads the backlog an earlier one left before it places anything,
/// so the fair queue sees every tenant's waiting jobs. The flood's three jobs come first in
/// stream order, the steady tenant's after them; the worker takes two. Placing on arrival
/// gives both places to the flood; reading first places the steady tenant's job. The hold
/// ends when the backlog is read or, at the latest, at its bound.
#[test]
fn a_new_leader_reads_the_backlog_before_placing_so_every_tenant_is_seen() {
    let run = |hold: Option<u64>, read_at: Option<u64>| {
        let mut e = engine(|_| {});
        let capped = heartbeat("w", &[], 1, T0, |s| s.max_concurrency = 2);
        published(&mut e, vec![capped], T0);
        if let Some(until) = hold {
            e.read_backlog_first(until);
        }
        let mut placed = Vec::new();
        let flood = (1..=3)
            .map(|i| tenant_job(Some("flood"), &format!("f{i}"), T0 + i))
            .collect();
        placed.extend(assigned(&published(&mut e, flood, T0 + 3)));
        placed.extend(assigned(&published(
            &mut e,
            vec![tenant_job(Some("steady"), "s1", T0 + 4)],
            T0 + 4,
        )));
        if hold.is_some() {
            assert_eq!(
                placed,
                vec![],
                "nothing is placed while the backlog is read"
            );
        }
        let mut at = T0 + 5;
        if let Some(read_at) = read_at {
            at = read_at;
            placed.extend(assigned(&published(&mut e, vec![Event::BacklogRead], at)));
        }
        // Ticks until the bound has passed.
        for _ in 0..3 {
            at += 100;
            e.tick(at);
            placed.extend(assigned(&published(&mut e, vec![], at)));
        }
        let mut jobs: Vec<String> = placed.into_iter().map(|(j, _)| j).collect();
        jobs.sort();
        jobs
    };
    assert_eq!(
        run(None, None),
        ["f1", "f2"],
        "placing on arrival: the flood takes both"
    );
    // Read first, the steady tenant's job is placed; the flood's next one may wait for
    // the room kept for the lighter tenant (work is still offered to the flood).
    let read_first = run(Some(T0 + 1_000), Some(T0 + 6));
    assert!(read_first.contains(&"s1".to_string()), "{read_first:?}");
    assert_eq!(
        run(Some(T0 + 200), None),
        read_first,
        "a backlog never read holds placements only until the bound"
    );
}

/// The steady tenant's job of `prompt` tokens runs on worker `w` and ends: the steady tenant
/// is active and runs nothing. Returns the time to go on from.
fn after_a_steady_job(e: &mut Engine, prompt: u32) -> u64 {
    let out = published(e, vec![job_of(Some("steady"), "s0", prompt, 10, T0)], T0);
    assert_eq!(assigned(&out).len(), 1, "{:?}", names(&out));
    published(
        e,
        vec![ended("s0", "w", 10, CompletionOutcome::Done)],
        T0 + 1,
    );
    T0 + 2
}

/// Issue 10: while a tenant running fewer jobs is active, another tenant's jobs queue in the
/// dispatcher, in fair order, rather than in a GPU's first-come prefill queue. The steady
/// tenant's job has run and ended; the flood sends two 400-token prompts to one worker that
/// prefills 10,000 tokens/s. The first goes (40 ms of prefill queued); the second would
/// queue 80 ms, over `light_tenant_prefill_ms` (50), and waits. With the limit off both go.
#[test]
fn a_heavier_tenant_does_not_fill_the_prefill_queue_while_a_lighter_one_is_active() {
    let run = |prefill_ms: u64| {
        let mut e = one_worker(|c| {
            c.fairness.light_tenant_prefill_ms = prefill_ms;
            c.fairness.light_tenant_ttft_ratio = 0.0;
        });
        let at = after_a_steady_job(&mut e, 100);
        let out = published(
            &mut e,
            vec![
                job_of(Some("flood"), "f1", 400, 10, at),
                job_of(Some("flood"), "f2", 400, 10, at),
            ],
            at,
        );
        assigned(&out)
            .into_iter()
            .map(|(j, _)| j)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(50), ["f1"], "the second prompt waits in the dispatcher");
    assert_eq!(run(0), ["f1", "f2"], "without the limit both are placed");
}

/// Issue 10: while a tenant running fewer jobs is active, another tenant fills a worker only
/// as far as the lighter tenant's next job would still see its first token within
/// `light_tenant_ttft_ratio` of its TTFT on an idle worker. The steady tenant sent a
/// 1,000-token prompt (idle TTFT 20 + 0.1 * 1,000 = 120 ms, so the bound is 150 ms at
/// 1.25) and it ended; the flood sends 40 jobs of 10-token prompts, whose prefill queue
/// stays under `light_tenant_prefill_ms`. Each flood job placed puts 1 ms of prefill ahead
/// of the steady tenant's next prompt and adds a stream (1 ms more), so after k of them its
/// TTFT is 120 + 2k ms: the flood's 15th job is placed, its 16th waits. With no bound, or a
/// loose one, only the SLO stops the flood.
#[test]
fn a_heavier_tenant_leaves_a_worker_where_a_lighter_ones_first_token_comes_soon() {
    let run = |ratio: f64| {
        let mut e = one_worker(|c| c.fairness.light_tenant_ttft_ratio = ratio);
        let at = after_a_steady_job(&mut e, 1_000);
        let flood = (0..40)
            .map(|i| job_of(Some("flood"), &format!("f{i}"), 10, 20, at))
            .collect();
        assigned(&published(&mut e, flood, at)).len()
    };
    let bounded = run(1.25);
    let unbounded = run(0.0);
    assert_eq!(
        unbounded, 40,
        "without the bound the SLO admits the whole flood"
    );
    assert_eq!(
        bounded, 15,
        "the flood stops where the lighter tenant's TTFT would pass its bound"
    );
    assert_eq!(run(3.0), 40, "a loose bound does not bind");
}

/// Issue 10: a new leader keeps room for a lighter tenant from its first decision, knowing
/// from the counters its predecessor persisted who submitted lately and how long their
/// prompts were. The steady tenant's 1,000-token job ran and ended under the first leader;
/// the second reads only the flood's 40 jobs. With the arrivals carried over it stops the
/// flood where the steady tenant's next first token would pass its bound (15 jobs, as in
/// `a_heavier_tenant_leaves_a_worker_where_a_lighter_ones_first_token_comes_soon`);
/// with the counters alone it sees one tenant and places all 40.
#[test]
fn a_new_leader_keeps_room_for_a_tenant_that_submitted_under_the_last_one() {
    let ratio = |c: &mut Config| c.fairness.light_tenant_ttft_ratio = 1.25;
    let mut first = one_worker(ratio);
    first.fairness(None);
    let at = after_a_steady_job(&mut first, 1_000);
    first.tick(at);
    let saved: FairnessSnapshot = first
        .take_effects()
        .into_iter()
        .filter_map(|f| match f {
            Effect::PersistFairness(snapshot) => Some(snapshot),
            _ => None,
        })
        .last()
        .expect("the counters were handed out to be persisted");
    assert!(saved.arrivals.contains_key("m"), "{saved:?}");
    let run = |saved: FairnessSnapshot| {
        let mut second = one_worker(ratio);
        second.fairness(Some(saved));
        let flood = (0..40)
            .map(|i| job_of(Some("flood"), &format!("f{i}"), 10, 20, at + 1))
            .collect();
        assigned(&published(&mut second, flood, at + 1)).len()
    };
    assert_eq!(run(saved.clone()), 15, "room kept for the steady tenant");
    let counters_only = FairnessSnapshot {
        arrivals: Default::default(),
        ..saved
    };
    assert_eq!(
        run(counters_only),
        40,
        "one tenant seen: the flood fills the GPU"
    );
}

/// Issue 10: a job of a tenant under its fair share that some worker admits, but only where
/// its first token comes late, goes where it starts `light_tenant_ttft_ratio` times sooner
/// at the price of a predicted miss on a running job (the flood's). Worker `w` runs the
/// flood's short job, which the steady tenant's 2,000-token prefill (a 200 ms stall) would
/// take below its floor, so `w` refuses it; `late` admits it, behind 8,000 tokens of
/// prefill (a first token at ~1,020 ms against ~230 ms on `w`). The flood has two jobs
/// waiting, so the steady tenant is under its share and not the most backlogged. With the
/// ratio off, it goes to `late`.
#[test]
fn a_lighter_tenants_job_trades_a_predicted_miss_for_a_much_sooner_first_token() {
    let run = |ratio: f64| {
        let mut e = one_worker(|c| c.fairness.light_tenant_ttft_ratio = ratio);
        let out = published(&mut e, vec![job_of(Some("flood"), "f1", 100, 10, T0)], T0);
        assert_eq!(assigned(&out), [("f1".to_string(), "w".to_string())]);
        let late = heartbeat("late", &[], 1, T0 + 1, |s| s.prefill_pending_tokens = 8_000);
        published(&mut e, vec![late], T0 + 1);
        // The flood has a backlog when the steady tenant's job comes: read as a new
        // leader reads the stream, all three are queued before anything is placed.
        e.read_backlog_first(T0 + 10_000);
        let at = T0 + 2;
        let jobs = vec![
            job_of(Some("flood"), "f2", 100, 10, at),
            job_of(Some("flood"), "f3", 100, 10, at),
            job_of(Some("steady"), "s1", 2_000, 10, at),
        ];
        assert!(assigned(&published(&mut e, jobs, at)).is_empty());
        let out = published(&mut e, vec![Event::BacklogRead], at + 1);
        out.iter()
            .find_map(|o| match o {
                Outcome::Assign {
                    job,
                    worker_id,
                    decision,
                    ..
                } if job.job.id == "s1" => Some((
                    worker_id.clone(),
                    decision.reason.clone().unwrap_or_default(),
                )),
                _ => None,
            })
            .expect("s1 is placed")
    };
    let (worker, reason) = run(1.5);
    assert_eq!(worker, "w", "{reason}");
    assert!(reason.contains("first token comes sooner"), "{reason}");
    let (worker, reason) = run(0.0);
    assert_eq!(worker, "late", "{reason}");
    assert!(!reason.contains("first token comes sooner"), "{reason}");
}

/// A worker at its cap holds the queue without an evaluation (the cheap look): the jobs
/// wait in order, each look counts the worker's refusal as a full evaluation would, and
/// the next completion places the oldest.
#[test]
fn a_model_at_its_cap_holds_its_queue_in_order_and_counts_each_look() {
    let metrics = Metrics::new();
    let mut e = Engine::new(
        EngineSettings::from_config(&Config::default(), 7, "test".into()),
        metrics.clone(),
        None,
    );
    let capped = heartbeat("w", &[], 1, T0, |s| s.max_concurrency = 1);
    published(&mut e, vec![capped], T0);
    let out = published(&mut e, vec![job("a", 100, 50, T0)], T0);
    assert_eq!(assigned(&out), vec![("a".to_string(), "w".to_string())]);
    let out = published(
        &mut e,
        vec![job("b", 100, 50, T0 + 1), job("c", 100, 50, T0 + 1)],
        T0 + 1,
    );
    assert!(assigned(&out).is_empty());
    // One look per arrival, one refusal per worker.
    assert_eq!(metrics.holds("m", "at_concurrency_cap"), 2);
    let out = published(
        &mut e,
        vec![ended("a", "w", 50, CompletionOutcome::Done)],
        T0 + 2,
    );
    assert_eq!(assigned(&out), vec![("b".to_string(), "w".to_string())]);
    // The look after placing b found the worker at its cap again.
    assert_eq!(metrics.holds("m", "at_concurrency_cap"), 3);
}
