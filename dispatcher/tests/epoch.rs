//! A leader's epoch is above every epoch on record (the latest decision's), even when the
//! `leader` bucket was rebuilt and its revisions (the usual epoch) start again: an agent
//! refuses work of an epoch below one it has seen, so a lower epoch would stop all work.
//! A worker's own claim (`max_epoch` in its heartbeat) never moves it. Against a real
//! nats-server; the worker is a heartbeat from the test.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_starts_above_the_epoch_workers_have_seen() {
    let env = Env::start().await;
    // The agent accepted work from epoch 1000, of a leader bucket since rebuilt: this
    // leader's lease revision is 1. That term's decisions are on record.
    let mut status = worker("e-0", "model-e", 8);
    status.max_epoch = 1_000;
    env.store_json(
        metronome_protocol::names::decision_subject(None, "before-rebuild"),
        &serde_json::json!({ "job_id": "before-rebuild", "epoch": 1_000 }),
    )
    .await;
    env.work_consumer(&status.worker_id).await;
    env.heartbeat(&status).await;
    let (running, token) = env.dispatcher(env.config("epoch")).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    env.submit("after-rebuild", "model-e", 10, 10).await;
    let d = env.decisions_for(&["after-rebuild".to_string()]).await;
    let epoch = d["after-rebuild"].epoch;
    assert!(
        epoch > 1_000,
        "decided in epoch {epoch}, below the worker's 1000"
    );
    let work = env.take_work("e-0").await;
    assert_eq!(work.len(), 1);
    assert_eq!(
        work[0].0.epoch, epoch,
        "the assignment carries the same epoch"
    );
    assert_eq!(running.metrics.epoch.load(Relaxed), epoch);
    // The lease records the lifted epoch, so agents believe it (`protocol::lease`).
    let lease = env
        .js
        .get_key_value(metronome_protocol::names::BUCKET_LEADER)
        .await
        .unwrap();
    let recorded = metronome_testkit::wait_for("the lease to record the epoch", WAIT, || async {
        let v = lease
            .get(metronome_protocol::names::LEADER_KEY)
            .await
            .ok()??;
        serde_json::from_slice::<metronome_protocol::LeaseValue>(&v)
            .ok()?
            .epoch
    })
    .await;
    assert_eq!(recorded, epoch);
    token.cancel();
}

/// Issue 40's probe: one heartbeat with `max_epoch` = 2^64-1 made the next leader's epoch
/// 18446744073709551615, after which no agent could tell a deposed leader from the current
/// one. The claim is not on record (no decision carries it): the epoch stays the lease's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_epoch_claim_does_not_move_the_leaders_epoch() {
    let env = Env::start().await;
    let mut status = worker("liar", "model-e", 8);
    status.max_epoch = u64::MAX;
    env.work_consumer(&status.worker_id).await;
    env.heartbeat(&status).await;
    let (running, token) = env.dispatcher(env.config("epoch-claim")).await;
    env.submit("after-claim", "model-e", 10, 10).await;
    let d = env.decisions_for(&["after-claim".to_string()]).await;
    let epoch = d["after-claim"].epoch;
    assert!(
        epoch < 1_000,
        "decided in epoch {epoch}: a worker's claim moved the epoch"
    );
    assert_eq!(running.metrics.epoch.load(Relaxed), epoch);
    token.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_bucket_gets_the_lease_ttl_the_dispatcher_is_configured_with() {
    let env = Env::start().await;
    let mut config = env.config("ttl");
    config.lease_ttl_ms = 4_321;
    let (_running, token) = env.dispatcher(config).await;
    let max_age = env.stream_config("KV_leader").await.max_age;
    assert_eq!(max_age, std::time::Duration::from_millis(4_321));
    token.cancel();
}

/// A bucket created with a longer TTL than the dispatcher's (another component created
/// it with the default, or an older version did) is shortened, its duplicate window with
/// it: the server refuses a window longer than the max age, and the dispatcher used to fail
/// to start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_bucket_with_a_longer_ttl_is_shortened_with_its_duplicate_window() {
    let env = Env::start_with(&metronome_protocol::setup::StreamSettings {
        storage: async_nats::jetstream::stream::StorageType::Memory,
        leader_ttl: std::time::Duration::from_secs(3),
        ..Default::default()
    })
    .await;
    assert_eq!(
        env.stream_config("KV_leader").await.duplicate_window,
        std::time::Duration::from_secs(3)
    );
    let mut config = env.config("shorter");
    config.lease_ttl_ms = 1_200;
    config.fence_after_ms = 900;
    let (_running, token) = env.dispatcher(config).await;
    let leader = env.stream_config("KV_leader").await;
    assert_eq!(leader.max_age, std::time::Duration::from_millis(1_200));
    assert_eq!(
        leader.duplicate_window,
        std::time::Duration::from_millis(1_200)
    );
    token.cancel();
}

/// Under the hostile drill's flood a renewal's answer timed out although the server had
/// stored it; the next renewal, at the revision before it, was refused, and the leader
/// stepped down ("the lease changed hands") although nobody else held the lease: the
/// standby took over, a new term for nothing. Here the leader's own value is stored
/// behind its back, as that renewal was: it must go on leading in the same term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_stored_after_its_answer_timed_out_does_not_depose_the_leader() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("slow-ack")).await;
    let epoch = running.metrics.epoch.load(Relaxed);
    let lease = env
        .js
        .get_key_value(metronome_protocol::names::BUCKET_LEADER)
        .await
        .unwrap();
    let key = metronome_protocol::names::LEADER_KEY;
    let entry = lease.entry(key).await.unwrap().expect("the lease");
    let stored = lease.put(key, entry.value.clone()).await.unwrap();
    assert!(stored > entry.revision);
    // Renewals come every 250 ms here: wait for several of them past the stored one.
    metronome_testkit::wait_for("renewals past the unseen one", WAIT, || async {
        let now = lease.entry(key).await.ok()??;
        (now.revision >= stored + 3).then_some(())
    })
    .await;
    assert_eq!(running.metrics.is_leader.load(Relaxed), 1);
    assert_eq!(
        running.metrics.epoch.load(Relaxed),
        epoch,
        "the same term leads"
    );
    let now = lease.entry(key).await.unwrap().expect("the lease");
    let value: metronome_protocol::LeaseValue = serde_json::from_slice(&now.value).unwrap();
    assert_eq!(value.dispatcher_id, "slow-ack");
    token.cancel();
    running.join().await.unwrap();
}
