//! One test per transition of the job lifecycle, the no-double-run cases first.

use std::collections::HashSet;
use std::time::Duration;

use super::*;

const AFTER: Duration = Duration::from_millis(2_000);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn machine(t0: Instant) -> JobMachine {
    JobMachine::new(
        Settings {
            worker_id: "w1".into(),
            max_concurrency: 2,
            fence_after: AFTER,
            reported_before_restart: HashSet::from(["reported".to_string()]),
        },
        t0,
    )
}

fn assignment(job_id: &str, epoch: u64) -> Assigned {
    Assigned {
        job_id: job_id.into(),
        attempt: 1,
        epoch,
        worker_id: "w1".into(),
        tenant: Some("acme".into()),
        prompt_tokens: 100,
        cached_tokens: 0,
        delivered: 1,
    }
}

fn lease(m: &JobMachine, epoch: u64) -> Lease {
    if m.needs_lease(epoch) {
        Lease::Vouches
    } else {
        Lease::NotRead
    }
}

/// Take `job_id` and have a heartbeat report it, so it runs.
fn running(m: &mut JobMachine, job_id: &str, now: Instant) {
    let a = assignment(job_id, 1);
    let l = lease(m, 1);
    m.assigned(&a, l, now);
    let hb = m.heartbeat(None, 0);
    let effects = m.reported(hb.generation, now);
    assert!(effects.contains(&Effect::Start {
        job_id: job_id.into()
    }));
}

fn refusal(effects: &[Effect]) -> Option<(Refusal, bool)> {
    effects.iter().find_map(|e| match e {
        Effect::Refuse { why, carry_job, .. } => Some((*why, *carry_job)),
        _ => None,
    })
}

fn revoke(epoch: u64, job_id: &str, attempt: Option<u32>) -> Revoke {
    Revoke {
        v: metronome_protocol::PROTOCOL_VERSION,
        epoch,
        jobs: vec![RevokedJob {
            job_id: job_id.into(),
            attempt,
        }],
        reason: "test".into(),
    }
}

#[test]
fn a_first_delivery_is_held_listed_and_a_heartbeat_asked_for() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let effects = m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    assert_eq!(
        effects,
        vec![
            Effect::Hold {
                job_id: "j1".into()
            },
            Effect::Heartbeat
        ]
    );
    let hb = m.heartbeat(None, 0);
    assert_eq!(hb.in_flight, vec!["j1".to_string()]);
    assert_eq!(hb.generation, 1);
    assert_eq!(
        hb.prefill_pending_tokens, 100,
        "held, not started: still to prefill"
    );
    assert_eq!(hb.max_epoch, 1);
}

#[test]
fn a_job_starts_only_once_a_stored_heartbeat_lists_it() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    let before = m.heartbeat(None, 0).generation;
    m.assigned(&assignment("j2", 1), Lease::NotRead, t0);
    // The heartbeat built before j2 was taken does not start j2.
    let effects = m.reported(before, t0 + ms(1));
    assert_eq!(
        effects,
        vec![Effect::Start {
            job_id: "j1".into()
        }]
    );
    let effects = m.reported(m.heartbeat(None, 0).generation, t0 + ms(2));
    assert_eq!(
        effects,
        vec![Effect::Start {
            job_id: "j2".into()
        }]
    );
    assert!(m.reported(2, t0 + ms(3)).is_empty(), "started once");
}

#[test]
fn a_job_taken_before_a_fenced_gap_is_refused_when_reported_not_started() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    let g = m.heartbeat(None, 0).generation;
    // The heartbeat that lists it is stored only after a gap longer than the fence.
    let effects = m.reported(g, t0 + AFTER + ms(1));
    assert_eq!(refusal(&effects), Some((Refusal::Fenced, false)));
    assert!(!effects.iter().any(|e| matches!(e, Effect::Start { .. })));
    assert_eq!(m.held(), 1, "held until its refusal is published");
}

#[test]
fn a_fenced_agent_pulls_nothing_until_a_heartbeat_is_stored() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    assert_eq!(m.pull(t0).0, Pull::Free(2));
    let (pull, effects) = m.pull(t0 + AFTER + ms(1));
    assert_eq!(pull, Pull::Fenced);
    assert_eq!(effects, vec![Effect::Fence(FenceMove::RaisedOverdue)]);
    let effects = m.heartbeat_failed(t0 + AFTER * 2);
    assert!(effects.is_empty(), "one outage, one raise");
    m.reported(0, t0 + AFTER * 2);
    assert_eq!(m.pull(t0 + AFTER * 2).0, Pull::Free(2));
}

#[test]
fn a_job_taken_while_fenced_counts_as_taken_before_the_episode() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    // Read from a pull made before the fence rose.
    let effects = m.assigned(&assignment("j1", 1), Lease::Vouches, t0 + AFTER + ms(1));
    assert!(effects.contains(&Effect::Fence(FenceMove::RaisedOverdue)));
    let effects = m.reported(1, t0 + AFTER + ms(2));
    assert_eq!(refusal(&effects), Some((Refusal::Fenced, false)));
}

#[test]
fn a_full_agent_pulls_nothing() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    assert_eq!(m.pull(t0).0, Pull::Free(1));
    m.assigned(&assignment("j2", 1), Lease::NotRead, t0);
    assert_eq!(m.pull(t0).0, Pull::Full);
    m.release("j1", t0);
    assert_eq!(m.pull(t0).0, Pull::Free(1));
}

#[test]
fn a_deposed_leaders_assignment_is_refused_with_its_job() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 5), Lease::Vouches, t0);
    let effects = m.assigned(&assignment("j2", 4), Lease::NotRead, t0);
    assert_eq!(refusal(&effects), Some((Refusal::StaleEpoch, true)));
    let Some(Effect::Refuse { reason, .. }) = effects.first() else {
        panic!("{effects:?}")
    };
    assert!(
        reason.contains("stale epoch 4 (highest seen 5)"),
        "{reason}"
    );
    assert!(!m.holds("j2"));
}

#[test]
fn a_new_epoch_the_lease_does_not_vouch_for_is_refused_and_does_not_raise_the_bar() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 2), Lease::Vouches, t0);
    assert!(m.needs_lease(9));
    let effects = m.assigned(&assignment("j2", 9), Lease::Refuses("forged".into()), t0);
    assert_eq!(refusal(&effects), Some((Refusal::Unvouched, true)));
    assert_eq!(m.max_epoch(), 2, "the real leader's epoch still passes");
    let effects = m.assigned(&assignment("j3", 2), Lease::NotRead, t0);
    assert!(effects.contains(&Effect::Hold {
        job_id: "j3".into()
    }));
    let effects = m.assigned(&assignment("j4", 10), Lease::NotRead, t0);
    assert_eq!(
        refusal(&effects),
        Some((Refusal::Unvouched, true)),
        "unread lease"
    );
}

#[test]
fn an_assignment_naming_another_worker_is_refused() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let mut a = assignment("j1", 1);
    a.worker_id = "w2".into();
    assert_eq!(
        refusal(&m.assigned(&a, Lease::Vouches, t0)),
        Some((Refusal::OtherWorker, true))
    );
}

#[test]
fn a_draining_agent_refuses_new_work() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    assert!(!m.set_draining(true));
    assert_eq!(
        refusal(&m.assigned(&assignment("j1", 1), Lease::Vouches, t0)),
        Some((Refusal::Draining, true))
    );
    assert!(m.heartbeat(None, 0).draining);
}

#[test]
fn a_duplicate_delivery_of_a_held_job_is_ignored() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    let mut again = assignment("j1", 1);
    again.delivered = 2;
    let effects = m.assigned(&again, Lease::NotRead, t0);
    assert_eq!(
        effects,
        vec![Effect::Notice {
            job_id: "j1".into(),
            notice: Notice::DuplicateIgnored
        }]
    );
    assert_eq!(m.held(), 1);
}

#[test]
fn a_duplicate_first_delivery_of_a_held_job_is_not_taken_twice() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    let effects = m.assigned(&assignment("j1", 1), Lease::NotRead, t0);
    assert!(!effects.iter().any(|e| matches!(e, Effect::Hold { .. })));
    assert_eq!(m.heartbeat(None, 0).in_flight.len(), 1);
}

#[test]
fn a_redelivery_the_agent_does_not_hold_is_refused_without_its_job() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let mut a = assignment("j1", 1);
    a.delivered = 2;
    let effects = m.assigned(&a, Lease::Vouches, t0);
    assert_eq!(refusal(&effects), Some((Refusal::NotHeldRedelivery, false)));
}

#[test]
fn a_redelivery_of_a_job_the_previous_run_reported_fails_as_lost_whatever_its_epoch() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j0", 7), Lease::Vouches, t0);
    let mut a = assignment("reported", 3);
    a.delivered = 2;
    let effects = m.assigned(&a, Lease::NotRead, t0);
    assert!(
        matches!(effects.as_slice(), [Effect::FailLost { job_id, .. }] if job_id == "reported"),
        "{effects:?}"
    );
    let mut first = assignment("reported", 7);
    first.delivered = 1;
    let effects = m.assigned(&first, Lease::NotRead, t0);
    assert!(
        effects.contains(&Effect::Hold {
            job_id: "reported".into()
        }),
        "a first delivery is new work"
    );
}

#[test]
fn a_second_delivery_of_an_attempt_that_ended_here_is_acknowledged() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    m.finish("j1", Ending::Done, 100, 0, t0 + ms(5));
    m.release("j1", t0 + ms(6));
    let mut again = assignment("j1", 1);
    again.delivered = 2;
    let effects = m.assigned(&again, Lease::NotRead, t0);
    assert!(
        effects.contains(&Effect::Ack {
            job_id: "j1".into(),
            ack: Ack::Done
        }),
        "{effects:?}"
    );
    let mut next_attempt = assignment("j1", 1);
    next_attempt.attempt = 2;
    let effects = m.assigned(&next_attempt, Lease::NotRead, t0);
    assert!(effects.contains(&Effect::Hold {
        job_id: "j1".into()
    }));
}

#[test]
fn a_running_job_revoked_by_the_leader_stops_without_a_result_or_an_event() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    m.chunk("j1", true, t0 + ms(1));
    let effects = m.revoke(&revoke(1, "j1", Some(1)));
    assert_eq!(
        effects,
        vec![Effect::Stop {
            job_id: "j1".into(),
            why: Stop::Revoked
        }]
    );
    assert!(
        m.heartbeat(None, 0).in_flight.is_empty(),
        "no longer the leader's"
    );
    let effects = m.finish("j1", Ending::Stopped, 100, 1, t0 + ms(2));
    assert_eq!(
        effects,
        vec![
            Effect::Notice {
                job_id: "j1".into(),
                notice: Notice::Revoked
            },
            Effect::Ack {
                job_id: "j1".into(),
                ack: Ack::Term
            }
        ]
    );
}

#[test]
fn a_waiting_job_revoked_is_terminated_and_never_starts() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    let effects = m.revoke(&revoke(1, "j1", None));
    assert!(effects.contains(&Effect::Ack {
        job_id: "j1".into(),
        ack: Ack::Term
    }));
    assert_eq!(m.prefill_pending_tokens(), 0, "it will not start");
    assert!(m.reported(1, t0 + ms(1)).is_empty());
}

#[test]
fn an_assignment_read_after_its_revocation_is_not_started() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.revoke(&revoke(1, "j1", Some(1)));
    let effects = m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    assert_eq!(
        effects,
        vec![
            Effect::Notice {
                job_id: "j1".into(),
                notice: Notice::Revoked
            },
            Effect::Ack {
                job_id: "j1".into(),
                ack: Ack::Term
            }
        ]
    );
    let mut later = assignment("j1", 1);
    later.attempt = 2;
    assert!(m
        .assigned(&later, Lease::NotRead, t0)
        .contains(&Effect::Hold {
            job_id: "j1".into()
        }));
}

#[test]
fn a_deposed_leaders_revocation_is_ignored() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 3), Lease::Vouches, t0);
    let effects = m.revoke(&revoke(2, "j1", None));
    assert!(matches!(
        effects.as_slice(),
        [Effect::Notice {
            notice: Notice::StaleRevocation,
            ..
        }]
    ));
    assert_eq!(m.heartbeat(None, 0).in_flight, vec!["j1".to_string()]);
}

#[test]
fn given_away_stops_running_jobs_as_lost_and_refuses_waiting_ones_when_reported() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "run", t0);
    m.assigned(&assignment("wait", 1), Lease::NotRead, t0);
    let effects = m.given_away();
    assert_eq!(
        effects,
        vec![
            Effect::Fence(FenceMove::RaisedGivenAway),
            Effect::Stop {
                job_id: "run".into(),
                why: Stop::Lost
            }
        ]
    );
    assert_eq!(m.heartbeat(None, 0).in_flight, vec!["wait".to_string()]);
    let effects = m.reported(m.heartbeat(None, 0).generation, t0 + ms(1));
    assert_eq!(refusal(&effects), Some((Refusal::Fenced, false)));
    let effects = m.finish("run", Ending::Stopped, 100, 0, t0 + ms(2));
    let Some(Effect::PublishFinal { error: Some(e), .. }) = effects.first() else {
        panic!("{effects:?}")
    };
    assert_eq!(e.code, ErrorCode::WorkerLost);
}

#[test]
fn a_cancel_stops_the_job_only_for_its_own_tenant() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    let effects = m.cancel("globex", "j1");
    assert!(matches!(
        effects.as_slice(),
        [Effect::Notice {
            notice: Notice::CancelOfAnotherTenant,
            ..
        }]
    ));
    assert_eq!(
        m.cancel("acme", "j1"),
        vec![Effect::Stop {
            job_id: "j1".into(),
            why: Stop::Cancelled
        }]
    );
    let effects = m.finish("j1", Ending::Stopped, 100, 0, t0 + ms(2));
    assert!(matches!(
        &effects[2],
        Effect::PublishCompletion { event, .. } if event.outcome == CompletionOutcome::Cancelled
    ));
    assert!(matches!(
        m.cancel("acme", "nope").as_slice(),
        [Effect::Notice {
            notice: Notice::CancelNotHeld,
            ..
        }]
    ));
}

#[test]
fn a_job_cancelled_while_waiting_stops_as_it_starts() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    assert!(m.cancel("acme", "j1").is_empty());
    assert_eq!(
        m.reported(1, t0),
        vec![
            Effect::Start {
                job_id: "j1".into()
            },
            Effect::Stop {
                job_id: "j1".into(),
                why: Stop::Cancelled
            }
        ]
    );
}

#[test]
fn a_revocation_outranks_a_cancel() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    m.cancel("acme", "j1");
    m.revoke(&revoke(1, "j1", None));
    let effects = m.finish("j1", Ending::Stopped, 100, 0, t0);
    assert!(effects.contains(&Effect::Ack {
        job_id: "j1".into(),
        ack: Ack::Term
    }));
}

#[test]
fn abort_refuses_waiting_jobs_and_stops_running_ones() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "run", t0);
    m.assigned(&assignment("wait", 1), Lease::NotRead, t0);
    let effects = m.abort();
    assert_eq!(effects.len(), 2);
    assert_eq!(
        effects[0],
        Effect::Stop {
            job_id: "run".into(),
            why: Stop::Aborted
        }
    );
    assert_eq!(refusal(&effects), Some((Refusal::ShuttingDown, false)));
    let effects = m.finish("run", Ending::Stopped, 100, 0, t0);
    let Some(Effect::PublishFinal { error: Some(e), .. }) = effects.first() else {
        panic!("{effects:?}")
    };
    assert_eq!(e.code, ErrorCode::WorkerFailed);
}

#[test]
fn chunks_are_numbered_and_a_completed_job_is_measured_from_its_take() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    m.assigned(&assignment("j1", 1), Lease::Vouches, t0);
    m.reported(1, t0 + ms(10));
    assert_eq!(
        m.prefill_pending_tokens(),
        100,
        "on the server now, not yet prefilled"
    );
    assert_eq!(
        m.chunk("j1", false, t0 + ms(15)),
        vec![Effect::PublishChunk {
            job_id: "j1".into(),
            seq: 0
        }]
    );
    m.chunk("j1", true, t0 + ms(50));
    assert_eq!(m.prefill_pending_tokens(), 0);
    m.chunk("j1", true, t0 + ms(70));
    let effects = m.chunk("j1", true, t0 + ms(90));
    assert_eq!(
        effects,
        vec![Effect::PublishChunk {
            job_id: "j1".into(),
            seq: 3
        }]
    );
    let effects = m.finish("j1", Ending::Done, 100, 3, t0 + ms(100));
    let [Effect::PublishFinal {
        error: None,
        chunks: 4,
        ttft_ms,
        e2e_ms,
        ..
    }, Effect::Ack { ack: Ack::Done, .. }, Effect::PublishCompletion { event, .. }, Effect::Learn {
        done: true,
        perf: Some(_),
        sample,
        ..
    }] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert_eq!(
        *ttft_ms,
        Some(50.0),
        "from the take, the report wait included"
    );
    assert_eq!(*e2e_ms, Some(100.0));
    assert_eq!(sample.tpot_ms, Some(20.0));
    assert!(event.streamed && event.outcome == CompletionOutcome::Done);
}

/// The decision counted 80 of the job's 100 prompt tokens as cached on this worker: its
/// server prefills only 20, and the job's sample says so (the prefill law fits on the rest).
#[test]
fn a_job_with_a_cached_prefix_counts_only_the_rest_as_prefill() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    let a = Assigned {
        cached_tokens: 80,
        ..assignment("j1", 1)
    };
    m.assigned(&a, Lease::Vouches, t0);
    assert_eq!(m.prefill_pending_tokens(), 20, "held, not started");
    m.reported(1, t0 + ms(10));
    assert_eq!(m.prefill_pending_tokens(), 20, "on the server now");
    m.chunk("j1", true, t0 + ms(30));
    m.chunk("j1", true, t0 + ms(50));
    let effects = m.finish("j1", Ending::Done, 100, 2, t0 + ms(50));
    let Some(Effect::Learn {
        perf: Some(perf), ..
    }) = effects.last()
    else {
        panic!("{effects:?}")
    };
    assert_eq!((perf.prompt_tokens, perf.cached_tokens), (100, 80));
}

#[test]
fn a_failed_job_says_whether_it_streamed_and_teaches_the_averages_nothing() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    let effects = m.finish(
        "j1",
        Ending::Failed(ErrorCode::WorkerFailed, "500".into()),
        100,
        0,
        t0 + ms(3),
    );
    let [_, _, Effect::PublishCompletion { event, .. }, Effect::Learn {
        done: false,
        perf: None,
        ..
    }] = effects.as_slice()
    else {
        panic!("{effects:?}")
    };
    assert!(!event.streamed);
    assert_eq!(event.error.as_deref(), Some("500"));
}

#[test]
fn release_frees_the_slot_and_counts_jobs_that_ended_on_the_server() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "ran", t0);
    m.assigned(&assignment("never", 1), Lease::NotRead, t0);
    m.revoke(&revoke(1, "never", None));
    m.finish("ran", Ending::Done, 100, 0, t0);
    assert!(m.release("ran", t0) && m.release("never", t0));
    assert!(!m.release("ran", t0), "released once");
    assert_eq!(m.ended_on_server(), 1);
    assert_eq!(m.held(), 0);
}

#[test]
fn a_job_whose_task_ended_without_finishing_leaves_the_tracker() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    assert_eq!(m.prefill_pending_tokens(), 100);
    m.release("j1", t0 + ms(1));
    assert_eq!(m.prefill_pending_tokens(), 0);
}

#[test]
fn the_heartbeats_running_count_leaves_out_jobs_ended_since_the_scrape() {
    let t0 = Instant::now();
    let mut m = machine(t0);
    running(&mut m, "j1", t0);
    let at_scrape = m.ended_on_server();
    m.finish("j1", Ending::Done, 100, 0, t0);
    m.release("j1", t0);
    assert_eq!(m.heartbeat(Some(3), at_scrape).active, 2);
    assert_eq!(m.heartbeat(Some(0), at_scrape).active, 0);
    assert_eq!(
        m.heartbeat(None, at_scrape).active,
        0,
        "no scrape: the jobs held"
    );
}
