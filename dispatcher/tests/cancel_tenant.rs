//! Issue 10: cancellation is scoped by tenant. A client may publish only on its own
//! tenant's `cancel.<tenant>.*` (the servers' permissions) but may name any job id there,
//! so the dispatcher acts on `cancel.<tenant>.<job>` only when the job is that tenant's: a
//! cancel naming another tenant is ignored (and counted) whether the job waits in a queue,
//! runs on a worker, or has not reached the leader yet. Against a real nats-server; the
//! worker is a heartbeat from the test.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use metronome_protocol::names;
use metronome_protocol::{CompletionOutcome, ErrorCode, Outcome};
use metronome_testkit::wait_for;
use tokio_util::sync::CancellationToken;

const ACME: Option<&str> = Some("acme");

async fn cancel(env: &Env, tenant: Option<&str>, job_id: &str) {
    env.client
        .publish(names::cancel_subject(tenant, job_id), bytes::Bytes::new())
        .await
        .unwrap();
    env.client.flush().await.unwrap();
}

async fn submit_for(env: &Env, tenant: Option<&str>, id: &str, model: &str) {
    let body = serde_json::to_vec(&job_json(id, model, 10, 10)).unwrap();
    env.submit_on(&names::submit_subject(tenant), id, body)
        .await;
}

/// A queued job of tenant acme: cancels naming another tenant, or none, leave it queued,
/// and it is assigned when capacity frees up; acme's own cancel then removes the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_naming_another_tenant_leaves_a_queued_job_alone() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("cancel-tenant-queued")).await;
    env.workers("cq", 1, "model-cq", 1).await;
    wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    submit_for(&env, ACME, "cq-busy", "model-cq").await;
    env.decisions_for(&["cq-busy".to_string()]).await;
    submit_for(&env, ACME, "cq-1", "model-cq").await;
    submit_for(&env, ACME, "cq-2", "model-cq").await;
    wait_for("cq-1 and cq-2 queued", WAIT, || async {
        let depth = running
            .metrics
            .queue_depth
            .lock()
            .unwrap()
            .get("model-cq")
            .copied();
        (depth == Some(2)).then_some(())
    })
    .await;

    cancel(&env, Some("globex"), "cq-1").await;
    cancel(&env, None, "cq-1").await;
    wait_for("both forged cancels ignored", WAIT, || async {
        (running
            .metrics
            .cancels_of_another_tenant_total
            .load(Relaxed)
            == 2)
            .then_some(())
    })
    .await;
    // acme's own cancel of the job behind it.
    cancel(&env, ACME, "cq-2").await;
    let d = env.decisions_for(&["cq-2".to_string()]).await;
    assert_eq!(d["cq-2"].outcome, Outcome::Rejected, "{:?}", d["cq-2"]);
    assert_eq!(d["cq-2"].reason_code.as_deref(), Some("cancelled"));

    // Capacity frees up: cq-1, still queued, is assigned.
    let busy = wait_for("the busy job's assignment", WAIT, || async {
        env.take_work("cq-0").await.into_iter().next()
    })
    .await;
    env.complete(&busy.0, CompletionOutcome::Done).await;
    let d = env.decisions_for(&["cq-1".to_string()]).await;
    assert_eq!(d["cq-1"].outcome, Outcome::Assigned, "{:?}", d["cq-1"]);
    token.cancel();
    running.join().await.unwrap();
}

/// A cancel that reaches the leader before its job (the cancel is a core message, the job
/// waits in JOBS) is remembered with its tenant: one naming another tenant does not cancel
/// the job when it arrives, acme's own does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_that_overtakes_its_job_applies_only_to_a_job_of_its_tenant() {
    let env = Env::start().await;
    env.workers("co", 1, "model-co", 4).await;
    let (running, token) = env.dispatcher(env.config("cancel-tenant-early")).await;
    // The leader subscribes to cancels once it leads, before it reads jobs: once a job is
    // decided, the server has its subscription, and no cancel below is published too early.
    submit_for(&env, ACME, "co-ready", "model-co").await;
    env.decisions_for(&["co-ready".to_string()]).await;
    cancel(&env, Some("globex"), "co-forged").await;
    cancel(&env, ACME, "co-own").await;
    // Poll with a job that was not cancelled: once it is decided, so were the cancels read.
    submit_for(&env, ACME, "co-marker", "model-co").await;
    env.decisions_for(&["co-marker".to_string()]).await;
    submit_for(&env, ACME, "co-forged", "model-co").await;
    submit_for(&env, ACME, "co-own", "model-co").await;
    let d = env
        .decisions_for(&["co-forged".to_string(), "co-own".to_string()])
        .await;
    assert_eq!(
        d["co-forged"].outcome,
        Outcome::Assigned,
        "{:?}",
        d["co-forged"]
    );
    assert_eq!(d["co-own"].outcome, Outcome::Rejected, "{:?}", d["co-own"]);
    assert_eq!(d["co-own"].reason_code.as_deref(), Some("cancelled"));
    let fin = wait_for("final result", WAIT, || env.final_result("co-own")).await;
    assert_eq!(fin.error.expect("error").code, ErrorCode::Cancelled);
    token.cancel();
    running.join().await.unwrap();
}

/// A job assigned and not yet reported by its worker: a cancel naming another tenant is
/// ignored (never relayed); acme's own is relayed to the job's worker on its own
/// `control.<worker>.cancel`, naming acme, at once and again once the worker's heartbeat
/// reports the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_cancel_of_the_jobs_tenant_is_relayed_to_its_worker() {
    let env = Env::start().await;
    let mut w = worker("cr-0", "model-cr", 4);
    env.work_consumer("cr-0").await;
    env.heartbeat(&w).await;
    let (running, token) = env.dispatcher(env.config("cancel-tenant-relay")).await;
    submit_for(&env, ACME, "cr-1", "model-cr").await;
    wait_for("the assignment", WAIT, || async {
        let w = env.take_work("cr-0").await;
        (!w.is_empty()).then_some(())
    })
    .await;
    let mut cancels = env
        .client
        .subscribe(names::SUBJECT_CANCEL_ALL)
        .await
        .unwrap();
    let mut relays = env
        .client
        .subscribe(names::control_subject("cr-0", names::CONTROL_CANCEL))
        .await
        .unwrap();
    env.client.flush().await.unwrap();
    cancel(&env, Some("globex"), "cr-1").await;
    wait_for("the forged cancel ignored", WAIT, || async {
        (running
            .metrics
            .cancels_of_another_tenant_total
            .load(Relaxed)
            == 1)
            .then_some(())
    })
    .await;
    cancel(&env, ACME, "cr-1").await;
    let mut heard = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(WAIT, cancels.next())
            .await
            .expect("the clients' cancels")
            .unwrap();
        heard.push(m.subject.to_string());
    }
    assert_eq!(heard, ["cancel.globex.cr-1", "cancel.acme.cr-1"]);
    // Relayed at once to the worker holding the job, on its own control subject, naming
    // acme (globex's was never relayed: this is the first relay).
    let relay = |m: async_nats::Message| -> (String, String) {
        let r: metronome_protocol::RelayedCancel = serde_json::from_slice(&m.payload).unwrap();
        (r.tenant, r.job_id)
    };
    let first = tokio::time::timeout(WAIT, relays.next())
        .await
        .expect("the leader relays acme's cancel")
        .unwrap();
    assert_eq!(relay(first), ("acme".to_string(), "cr-1".to_string()));

    // The worker now reports the job, heartbeat after heartbeat, until the relay comes.
    let beating = CancellationToken::new();
    let beater = {
        let (workers, stop) = (env.workers.clone(), beating.clone());
        w.in_flight = vec!["cr-1".into()];
        w.active = 1;
        tokio::spawn(async move {
            loop {
                w.seq += 1;
                let body = serde_json::to_vec(&w).unwrap();
                workers.put("cr-0", body.into()).await.unwrap();
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        })
    };
    let relayed = tokio::time::timeout(WAIT, relays.next())
        .await
        .expect("the leader relays the cancel again once the worker reports the job")
        .unwrap();
    assert_eq!(relay(relayed), ("acme".to_string(), "cr-1".to_string()));
    beating.cancel();
    beater.await.unwrap();
    token.cancel();
    running.join().await.unwrap();
}
