//! Burst: N idle, equal workers and N jobs published at once land on N distinct workers
//! (the read→commit of each decision is serialised), for N from 2 to 16, over more than
//! 100 rounds; and the same when half the jobs arrive while the first half's assignments
//! are still unacknowledged by the workers.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_dispatcher::Running;
use metronome_protocol::{CompletionOutcome, Decision, Outcome};
use metronome_testkit::wait_for;

async fn publish_all(env: &Env, ids: &[String], model: &str) {
    futures::future::join_all(ids.iter().map(|id| env.submit(id, model, 100, 100))).await;
}

fn winners(decisions: &HashMap<String, Decision>, ids: &[String], round: usize) -> HashSet<String> {
    ids.iter()
        .map(|id| {
            let d = &decisions[id];
            assert_eq!(d.outcome, Outcome::Assigned, "round {round}: {d:?}");
            d.worker_id.clone().expect("assigned has a worker")
        })
        .collect()
}

/// One group of N workers per N, each serving its own model, all registered up front.
async fn register_groups(env: &Env, running: &Running) {
    let mut total = 0;
    for n in 2..=16usize {
        env.workers(&format!("g{n}"), n, &format!("model-{n}"), 4)
            .await;
        total += n;
    }
    let metrics = running.metrics.clone();
    wait_for("every worker registered", WAIT, || {
        let m = metrics.clone();
        async move { (m.workers_known.load(Relaxed) as usize == total).then_some(()) }
    })
    .await;
}

/// Complete every assignment of group `n` and wait until the ledger is empty again.
async fn finish_group(env: &Env, running: &Running, n: usize) {
    for i in 0..n {
        for (a, _) in env.take_work(&format!("g{n}-{i}")).await {
            env.complete(&a, CompletionOutcome::Done).await;
        }
    }
    let metrics = running.metrics.clone();
    wait_for("reservations released", WAIT, || {
        let m = metrics.clone();
        async move { (m.ledger_reservations.load(Relaxed) == 0).then_some(()) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_simultaneous_jobs_land_on_n_distinct_idle_workers() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("burst")).await;
    register_groups(&env, &running).await;
    let mut round = 0;
    for _pass in 0..7 {
        for n in 2..=16usize {
            round += 1;
            let ids: Vec<String> = (0..n).map(|i| format!("r{round}-j{i}")).collect();
            publish_all(&env, &ids, &format!("model-{n}")).await;
            let decisions = env.decisions_for(&ids).await;
            let w = winners(&decisions, &ids, round);
            assert_eq!(
                w.len(),
                n,
                "round {round}: {n} jobs on {} workers: {w:?}",
                w.len()
            );
            finish_group(&env, &running, n).await;
        }
    }
    assert!(round >= 100, "{round} rounds");
    token.cancel();
    running.join().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_arriving_while_earlier_assignments_are_unacked_still_spread() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("burst-unacked")).await;
    register_groups(&env, &running).await;
    let mut round = 0;
    for n in 2..=16usize {
        round += 1;
        let ids: Vec<String> = (0..n).map(|i| format!("u{round}-j{i}")).collect();
        let (first, second) = ids.split_at(n / 2);
        publish_all(&env, first, &format!("model-{n}")).await;
        // The first half is decided and its Assignments sit on WORK, unacknowledged:
        // no worker has pulled them or reported them in a heartbeat.
        env.decisions_for(first).await;
        publish_all(&env, second, &format!("model-{n}")).await;
        let decisions = env.decisions_for(&ids).await;
        let w = winners(&decisions, &ids, round);
        assert_eq!(
            w.len(),
            n,
            "round {round}: {n} jobs on {} workers: {w:?}",
            w.len()
        );
        finish_group(&env, &running, n).await;
    }
    token.cancel();
    running.join().await.unwrap();
}
