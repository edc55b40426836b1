//! A heartbeat's `in_flight` is the worker's own claim: the leader adopts a listed job only
//! when it booked the job there itself or a decision on record assigns it to that worker.
//! A worker that learned a job's id before the leader read the job cannot claim it by
//! listing it. Against a real nats-server; the workers are heartbeats from the test.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_protocol::Outcome;
use metronome_testkit::wait_for;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_cannot_claim_a_job_no_decision_gave_it() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("adoption-claim")).await;
    let honest = env.workers("adopt-honest", 1, "model-adopt", 1).await;
    // The intruder serves another model and claims a job it has only learned the id of.
    let mut intruder = worker("adopt-intruder", "model-other", 4);
    intruder.in_flight = vec!["adopt-1".into()];
    intruder.active = 1;
    env.work_consumer(&intruder.worker_id).await;
    env.heartbeat(&intruder).await;
    wait_for("both heartbeats read", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 2).then_some(())
    })
    .await;
    env.submit("adopt-1", "model-adopt", 10, 10).await;
    let decided = env.decisions_for(&["adopt-1".to_string()]).await;
    let d = &decided["adopt-1"];
    assert_eq!(d.outcome, Outcome::Assigned, "{d:?}");
    assert_ne!(d.reason_code.as_deref(), Some("already_assigned"), "{d:?}");
    assert_eq!(d.worker_id.as_deref(), Some(honest[0].worker_id.as_str()));
    let work = env.take_work(&honest[0].worker_id).await;
    assert_eq!(work.len(), 1, "the honest worker got the Assignment");
    assert_eq!(work[0].0.job.id, "adopt-1");
    assert!(running.metrics.unvouched_claims_total.load(Relaxed) >= 1);
    token.cancel();
}

/// At a takeover the new leader adopts what an earlier leader assigned (its decision on
/// record names the worker that lists the job) and nothing a worker merely claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_adopts_what_an_earlier_one_assigned_and_only_that() {
    let env = Env::start().await;
    let (first, first_token) = env.dispatcher(env.config("adoption-first")).await;
    let mut honest = env
        .workers("adopt-held", 1, "model-held", 1)
        .await
        .remove(0);
    wait_for("the worker registered", WAIT, || async {
        (first.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    env.submit("held-1", "model-held", 10, 10).await;
    let decided = env.decisions_for(&["held-1".to_string()]).await;
    assert_eq!(
        decided["held-1"].worker_id.as_deref(),
        Some(honest.worker_id.as_str())
    );
    first_token.cancel();
    first.join().await.unwrap();

    // While no leader runs: the worker reports the job it was given, an intruder one it
    // was not given (its id learned elsewhere) and one that does not exist yet.
    honest.in_flight = vec!["held-1".into()];
    honest.active = 1;
    honest.seq += 1;
    env.heartbeat(&honest).await;
    let mut intruder = worker("adopt-thief", "model-held", 4);
    intruder.in_flight = vec!["held-1".into(), "held-2".into()];
    intruder.active = 2;
    env.work_consumer(&intruder.worker_id).await;
    env.heartbeat(&intruder).await;

    let (second, second_token) = env.dispatcher(env.config("adoption-second")).await;
    wait_for("the earlier leader's job adopted", WAIT, || async {
        (second.metrics.ledger_reservations.load(Relaxed) == 1).then_some(())
    })
    .await;
    assert_eq!(second.metrics.unvouched_claims_total.load(Relaxed), 2);
    // The job the intruder claimed first is not its: submitted now, it is assigned to a
    // worker with room (the intruder's heartbeat counts nothing it does not hold).
    env.submit("held-2", "model-held", 10, 10).await;
    let decided = env.decisions_for(&["held-2".to_string()]).await;
    let d = &decided["held-2"];
    assert_ne!(d.reason_code.as_deref(), Some("already_assigned"), "{d:?}");
    second_token.cancel();
    second.join().await.unwrap();
}

/// Issue 10: the decision that vouches for an adopted job also names its tenant, which
/// the heartbeat's update carries, so a new leader counts each tenant's running jobs from
/// the start of its term (fair sharing); a job no decision vouches for carries none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vouched_jobs_tenant_comes_from_its_decision() {
    let env = Env::start().await;
    let (leader, token) = env.dispatcher(env.config("adoption-tenant")).await;
    let mut held = env
        .workers("adopt-tenant", 1, "model-tenant", 4)
        .await
        .remove(0);
    wait_for("the worker registered", WAIT, || async {
        (leader.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    for (id, tenant) in [("tenant-a-1", Some("tenant-a")), ("no-tenant-1", None)] {
        let mut body = job_json(id, "model-tenant", 10, 10);
        if let Some(t) = tenant {
            body["tenant"] = t.into();
        }
        env.submit_raw(id, body).await;
    }
    let ids = ["tenant-a-1".to_string(), "no-tenant-1".to_string()];
    let decided = env.decisions_for(&ids).await;
    assert_eq!(decided["tenant-a-1"].tenant.as_deref(), Some("tenant-a"));
    token.cancel();
    leader.join().await.unwrap();

    // The worker lists both, and a job it was never given (a claim only).
    held.in_flight = vec![ids[0].clone(), ids[1].clone(), "claimed-1".into()];
    let decisions = env
        .js
        .get_stream_no_info(metronome_protocol::names::STREAM_DECISIONS)
        .await
        .unwrap();
    let mut vouching = metronome_dispatcher::registry::Vouching::new(decisions);
    let mut update = metronome_dispatcher::engine::WorkerUpdate::Put {
        status: Box::new(held),
        seen_ms: 0,
        revision: 1,
        unvouched: Vec::new(),
        tenants: Default::default(),
    };
    vouching.check(&mut update).await;
    let metronome_dispatcher::engine::WorkerUpdate::Put {
        unvouched, tenants, ..
    } = update
    else {
        unreachable!()
    };
    assert_eq!(unvouched, ["claimed-1"]);
    assert_eq!(
        tenants.into_iter().collect::<Vec<_>>(),
        [("tenant-a-1".to_string(), "tenant-a".to_string())],
        "the tenant on record, for the vouched job that has one"
    );
}
