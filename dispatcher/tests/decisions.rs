//! Decisions you can read: exactly one decision per job; each candidate shows all seven
//! terms; each rejected worker shows its reason; the Assignment on `work.<id>` carries the
//! per-attempt msg-id and the epoch. Also the rescue paths: a refused job and a job on a
//! worker that died before reporting it are assigned again with the next attempt.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

use common::*;
use futures::StreamExt;
use metronome_protocol::{names, CompletionOutcome, Outcome, RejectionCode, TermName};
use metronome_testkit::wait_for;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_decision_per_job_with_every_term_and_every_reason() {
    let env = Env::start().await;
    env.workers("ok", 3, "model-d", 10).await;
    let mut sick = worker("sick", "model-d", 8);
    sick.healthy = false;
    let mut drain = worker("drain", "model-d", 8);
    drain.draining = true;
    let other = worker("other", "model-x", 8);
    let mut stale = worker("stale", "model-d", 8);
    stale.sent_ms = metronome_protocol::time::unix_ms() - 3_600_000;
    let mut tiny = worker("tiny", "model-d", 8);
    tiny.kv = Some(metronome_protocol::KvUsage {
        used_frac: 0.0,
        capacity_tokens: Some(50),
    });
    for w in [&sick, &drain, &other, &tiny, &stale] {
        env.heartbeat(w).await;
    }
    // Heartbeats are aged by when the leader received them (never by the worker's own
    // `sent_ms`), so "stale" goes stale by falling silent while the others keep beating.
    let mut config = env.config("decisions");
    config.scheduler.heartbeat_timeout_ms = 2_000;
    let (running, token) = env.dispatcher(config).await;
    wait_for("workers loaded", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 8).then_some(())
    })
    .await;
    let mut alive: Vec<metronome_protocol::WorkerStatus> = (0..3)
        .map(|i| worker(&format!("ok-{i}"), "model-d", 10))
        .collect();
    alive.extend([sick.clone(), drain.clone(), other.clone(), tiny.clone()]);
    let beating = tokio_util::sync::CancellationToken::new();
    let beater = {
        let (store, stop) = (env.workers.clone(), beating.clone());
        tokio::spawn(async move {
            loop {
                for w in &mut alive {
                    w.seq += 1;
                    w.sent_ms = metronome_protocol::time::unix_ms();
                    let body = serde_json::to_vec(&*w).unwrap();
                    store.put(w.worker_id.as_str(), body.into()).await.unwrap();
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
                }
            }
        })
    };
    wait_for("the silent worker declared dead", WAIT, || async {
        (running.metrics.workers_lost_total.load(Relaxed) >= 1).then_some(())
    })
    .await;
    // Declared through the bucket: its key deleted (conditionally on its last heartbeat),
    // so its agent, were it only paused, would find its next conditional put refused.
    let entry = env
        .workers
        .entry("stale")
        .await
        .unwrap()
        .expect("a delete marker");
    assert_eq!(
        entry.operation,
        async_nats::jetstream::kv::Operation::Delete,
        "{entry:?}"
    );

    let ids: Vec<String> = (0..30).map(|i| format!("d{i}")).collect();
    for id in &ids {
        env.submit(id, "model-d", 100, 100).await;
    }
    let decisions = env.decisions_for(&ids).await;
    for (id, d) in &decisions {
        assert_eq!(d.outcome, Outcome::Assigned, "{id}");
        assert!(d.epoch > 0);
        assert_eq!(d.dispatcher_id, "decisions");
        assert_eq!(d.policy, "metronome");
        assert!(d.cost.is_some());
        let winner = d.worker_id.as_deref().unwrap();
        assert!(winner.starts_with("ok-"), "{id} went to {winner}");
        assert!(!d.candidates.is_empty());
        assert_eq!(d.candidates[0].worker_id, winner, "winner first");
        let scoring = d.scoring.expect("an assignment records its weights");
        for c in &d.candidates {
            let terms = d.terms_of(c);
            let names: Vec<TermName> = terms.iter().map(|t| t.term).collect();
            assert_eq!(
                names,
                TermName::ALL.to_vec(),
                "{id}: all seven terms of {}",
                c.worker_id
            );
            for t in &terms {
                assert!(t.contribution.is_finite() && t.weight.is_finite());
                assert_eq!(t.available, t.raw.is_some(), "{id}: {t:?}");
                assert_eq!(t.weight, scoring.weight(t.term));
            }
        }
        let reasons: HashMap<&str, RejectionCode> = d
            .rejected
            .iter()
            .map(|r| (r.worker_id.as_str(), r.code))
            .collect();
        assert_eq!(
            reasons.get("sick"),
            Some(&RejectionCode::Unhealthy),
            "{id}: {reasons:?}"
        );
        assert_eq!(reasons.get("drain"), Some(&RejectionCode::Draining));
        assert_eq!(reasons.get("other"), Some(&RejectionCode::WrongModel));
        assert_eq!(reasons.get("tiny"), Some(&RejectionCode::InsufficientKv));
        assert_eq!(reasons.get("stale"), Some(&RejectionCode::StaleHeartbeat));
        assert!(d.rejected.iter().all(|r| !r.reason.is_empty()));
    }
    // Exactly one decision per job in the whole stream, and one Assignment each.
    let all = env.all_decisions().await;
    assert_eq!(all.len(), ids.len(), "one decision per job");
    let mut work = 0;
    for i in 0..3 {
        for (a, headers) in env.take_work(&format!("ok-{i}")).await {
            work += 1;
            assert_eq!(a.worker_id, format!("ok-{i}"));
            assert_eq!(a.attempt, 1);
            assert_eq!(
                headers.get(names::HEADER_MSG_ID),
                Some(&names::work_msg_id(&a.job.id, 1))
            );
            assert_eq!(headers.get(names::HEADER_EPOCH), Some(&a.epoch.to_string()));
            assert_eq!(
                headers.get(names::HEADER_MODEL).map(String::as_str),
                Some("model-d")
            );
            assert_eq!(
                decisions[&a.job.id].worker_id.as_deref(),
                Some(a.worker_id.as_str())
            );
        }
    }
    assert_eq!(work, ids.len());
    beating.cancel();
    beater.await.unwrap();
    token.cancel();
    running.join().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_and_orphaned_jobs_are_assigned_again_with_the_next_attempt() {
    let env = Env::start().await;
    let mut config = env.config("rescue");
    config.scheduler.heartbeat_timeout_ms = 1500;
    let (running, token) = env.dispatcher(config).await;
    let mut live = worker("live", "model-r", 1);
    let doomed = worker("doomed", "model-r", 1);
    env.work_consumer("live").await;
    env.work_consumer("doomed").await;
    env.heartbeat(&live).await;
    env.heartbeat(&doomed).await;
    wait_for("workers registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 2).then_some(())
    })
    .await;
    // Keep `live` fresh while `doomed` goes silent.
    let beat = tokio::spawn({
        let workers = env.workers.clone();
        async move {
            loop {
                live.seq += 1;
                live.sent_ms = metronome_protocol::time::unix_ms();
                let _ = workers
                    .put("live", serde_json::to_vec(&live).unwrap().into())
                    .await;
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    });

    let mut revokes = env
        .client
        .subscribe(names::control_subject("doomed", names::CONTROL_REVOKE))
        .await
        .unwrap();
    env.client.flush().await.unwrap();
    env.submit("j1", "model-r", 10, 10).await;
    env.submit("j2", "model-r", 10, 10).await;
    let first = env
        .decisions_for(&["j1".to_string(), "j2".to_string()])
        .await;
    let on_live = if first["j1"].worker_id.as_deref() == Some("live") {
        "j1"
    } else {
        "j2"
    };
    let on_doomed = if on_live == "j1" { "j2" } else { "j1" };
    assert_eq!(first[on_doomed].worker_id.as_deref(), Some("doomed"));

    // `live` refuses its job: it comes back as attempt 2 (on live again once free).
    let (a, _) = env.take_work("live").await.remove(0);
    env.complete(&a, CompletionOutcome::Refused).await;
    let again = wait_for("attempt 2 of the refused job", WAIT, || async {
        let w = env.take_work("live").await;
        w.into_iter()
            .map(|(a, _)| a)
            .find(|a| a.job.id == on_live && a.attempt == 2)
    })
    .await;
    env.complete(&again, CompletionOutcome::Done).await;

    // `doomed` never heartbeats again and never reported its job: it is rescued.
    let rescued = wait_for("the orphaned job on another worker", WAIT, || async {
        let w = env.take_work("live").await;
        w.into_iter()
            .map(|(a, _)| a)
            .find(|a| a.job.id == on_doomed)
    })
    .await;
    assert_eq!(rescued.attempt, 2);
    let d = wait_for("decision of attempt 2", WAIT, || async {
        env.decision(on_doomed).await.filter(|d| d.attempt == 2)
    })
    .await;
    assert_eq!(d.worker_id.as_deref(), Some("live"));
    assert!(running.metrics.rescued_jobs_total.load(Relaxed) >= 1);
    // A `doomed` that was only silent is told to stop its copy of the rescued attempt.
    let revoke = tokio::time::timeout(WAIT, revokes.next())
        .await
        .expect("a revocation for the dead worker")
        .unwrap();
    let revoke: metronome_protocol::Revoke = serde_json::from_slice(&revoke.payload).unwrap();
    assert_eq!(
        revoke.jobs,
        vec![metronome_protocol::RevokedJob {
            job_id: on_doomed.to_string(),
            attempt: Some(1)
        }]
    );
    // The dead worker's pending Assignment is gone: if it came back it would not run it.
    wait_for("the dead worker's assignments purged", WAIT, || async {
        let stream = env.js.get_stream(names::STREAM_WORK).await.unwrap();
        let r = stream
            .get_last_raw_message_by_subject(&names::work_subject("doomed"))
            .await;
        r.is_err().then_some(())
    })
    .await;
    beat.abort();
    token.cancel();
    running.join().await.unwrap();
}

/// Publish what a deposed leader left behind: the Assignment of attempt 1 (and maybe its
/// Decision), but not the JOBS acknowledgement.
async fn leftover_assignment(env: &Env, job_id: &str, worker_id: &str, with_decision: bool) {
    let job: metronome_protocol::Job =
        serde_json::from_value(job_json(job_id, "model-p", 10, 10)).unwrap();
    let a = metronome_protocol::Assignment {
        v: 1,
        job: job.clone(),
        worker_id: worker_id.into(),
        epoch: 1,
        attempt: 1,
        assigned_ms: metronome_protocol::time::unix_ms(),
        cached_prefix: None,
    };
    let mut h = async_nats::HeaderMap::new();
    h.insert(names::HEADER_MSG_ID, names::work_msg_id(job_id, 1).as_str());
    env.js
        .publish_with_headers(
            names::work_subject(worker_id),
            h,
            serde_json::to_vec(&a).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    if with_decision {
        let mut h = async_nats::HeaderMap::new();
        h.insert(
            names::HEADER_MSG_ID,
            names::decision_msg_id(job_id, 1).as_str(),
        );
        let d = serde_json::json!({
            "v": 1, "job_id": job_id, "model": "model-p", "outcome": "assigned", "attempt": 1,
            "worker_id": worker_id, "policy": "metronome", "queue_wait_ms": 0,
            "decision_latency_us": 1, "epoch": 1, "dispatcher_id": "old-leader", "decided_ms": 1
        });
        env.js
            .publish_with_headers(
                names::decision_subject(None, job_id),
                h,
                serde_json::to_vec(&d).unwrap().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    env.submit(job_id, "model-p", 10, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_an_earlier_leader_already_sent_is_not_sent_twice() {
    let env = Env::start().await;
    env.workers("p", 2, "model-p", 4).await;
    leftover_assignment(&env, "dup-1", "p-1", false).await;
    leftover_assignment(&env, "dup-2", "p-1", true).await;
    // The new leader reads both jobs (unacknowledged). dup-2's decision is stored: it is
    // acknowledged without deciding it again. dup-1 has none: it is decided again, and the
    // WORK stream's msg-id reports its Assignment as a duplicate.
    let (running, token) = env.dispatcher(env.config("new-leader")).await;
    let d = env
        .decisions_for(&["dup-1".to_string(), "dup-2".to_string()])
        .await;
    assert_eq!(d["dup-2"].dispatcher_id, "old-leader");
    assert_eq!(d["dup-1"].outcome, Outcome::Assigned);
    wait_for("the duplicate noticed", WAIT, || async {
        (running.metrics.duplicate_assignments_total.load(Relaxed) == 1).then_some(())
    })
    .await;
    assert_eq!(
        running
            .metrics
            .redelivered_already_decided_total
            .load(Relaxed),
        1
    );
    wait_for("reservations rolled back", WAIT, || async {
        (running.metrics.ledger_reservations.load(Relaxed) == 0).then_some(())
    })
    .await;
    let all = env.all_decisions().await;
    assert_eq!(all.len(), 2, "one decision per job: {all:?}");
    let mut work = Vec::new();
    for w in ["p-0", "p-1"] {
        work.extend(
            env.take_work(w)
                .await
                .into_iter()
                .map(|(a, _)| (a.job.id, a.worker_id)),
        );
    }
    work.sort();
    assert_eq!(
        work,
        [
            ("dup-1".to_string(), "p-1".to_string()),
            ("dup-2".to_string(), "p-1".to_string())
        ],
        "only the earlier leader's Assignments exist"
    );
    wait_for("JOBS acknowledged", WAIT, || async {
        let mut s = env.js.get_stream(names::STREAM_JOBS).await.unwrap();
        (s.info().await.unwrap().state.messages == 0).then_some(())
    })
    .await;
    token.cancel();
    running.join().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_cannot_renew_stops_deciding() {
    let mut env = Env::start().await;
    let (running, _token) = env.dispatcher(env.config("fenced")).await;
    env.nats.stop();
    wait_for("the leader to fence itself", WAIT, || async {
        (running.metrics.is_leader.load(Relaxed) == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_decisions_list_the_best_candidates_and_say_what_they_leave_out() {
    let env = Env::start().await;
    let mut config = env.config("compact");
    config.decision_max_candidates = 2;
    config.decision_list_wrong_model = false;
    env.workers("k", 4, "model-k", 8).await;
    env.workers("other", 3, "model-other", 8).await;
    let (running, token) = env.dispatcher(config).await;
    env.submit("k1", "model-k", 10, 10).await;
    let d = env
        .decisions_for(&["k1".to_string()])
        .await
        .remove("k1")
        .unwrap();
    assert_eq!(d.outcome, Outcome::Assigned);
    assert_eq!(d.candidates.len(), 2);
    assert_eq!(d.candidates[0].worker_id, d.worker_id.clone().unwrap());
    assert!(d
        .rejected
        .iter()
        .all(|r| r.code != RejectionCode::WrongModel));
    let note = d.reason.unwrap();
    assert!(
        note.contains("3 workers serving other models") && note.contains("2 more candidates"),
        "{note}"
    );
    token.cancel();
    running.join().await.unwrap();
}

/// The stored record is the compact form (version 3): the term names and weights once, each
/// candidate's raw and normalised values as arrays in that order, no per-term objects; and
/// `rescore` under the recorded weights reproduces every decision from its record alone,
/// totals and order, bit for bit (what `metronome replay` relies on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_decision_is_compact_and_replays_to_itself() {
    let env = Env::start().await;
    let mut config = env.config("compact-record");
    config.scheduler.weights.kv_pressure = 1.3;
    config.scheduler.weights.job_cost = 0.7;
    let weights = config.scheduler.weights.clone();
    env.workers("r", 4, "model-r", 8).await;
    let (running, token) = env.dispatcher(config).await;
    // Jobs of different sizes, none completed: the workers' loads differ from job to job.
    let ids: Vec<String> = (0..6).map(|i| format!("r{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        env.submit(id, "model-r", 50 + 100 * i as u32, 100).await;
    }
    let decisions = env.decisions_for(&ids).await;
    let names: Vec<&str> = TermName::ALL.iter().map(|t| t.as_str()).collect();
    for id in &ids {
        let json = env.decision_json(id).await.unwrap();
        assert_eq!(json["v"], metronome_protocol::DECISION_VERSION, "{json}");
        assert_eq!(json["scoring"]["terms"], serde_json::json!(names), "{json}");
        assert_eq!(
            json["scoring"]["weights"],
            serde_json::json!(weights.as_array()),
            "{json}"
        );
        let candidates = json["candidates"].as_array().unwrap();
        assert_eq!(candidates.len(), 4, "every eligible worker: {json}");
        for c in candidates {
            assert_eq!(c["raw"].as_array().map(Vec::len), Some(7), "{c}");
            assert_eq!(c["normalised"].as_array().map(Vec::len), Some(7), "{c}");
            assert!(c.get("terms").is_none(), "no per-term objects: {c}");
            assert!(c["prediction"]["ttft_ms"].is_f64(), "{c}");
        }
        let d = &decisions[id];
        assert_eq!(d.outcome, Outcome::Assigned);
        let replayed = metronome_scheduler::rescore(
            &d.candidates,
            &weights,
            d.affinity.as_ref().map_or(0.0, |a| a.max_share),
        );
        assert_eq!(replayed, d.candidates, "{id}: replayed from its record");
        assert_eq!(replayed[0].worker_id, d.worker_id.clone().unwrap());
    }
    token.cancel();
    running.join().await.unwrap();
}
