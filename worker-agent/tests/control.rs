//! Operator drain over `control.<worker_id>.drain` / `.undrain` on a real nats-server: the
//! heartbeat says `draining` at once, new assignments are refused back to the dispatcher,
//! running jobs finish, every request is answered with the agent's state, and `undrain`
//! makes the worker take work again.

use crate::common;

use std::time::Duration;

use common::*;
use metronome_protocol::names::{
    control_subject, event_done_subject, CONTROL_DRAIN, CONTROL_UNDRAIN,
};
use metronome_protocol::{
    CompletionEvent, CompletionOutcome, ControlReply, Endpoint, WorkerStatus,
};
use metronome_testkit::wait_for;

async fn request(env: &Env, worker: &str, action: &str) -> ControlReply {
    let reply = tokio::time::timeout(
        WAIT,
        env.client
            .request(control_subject(worker, action), Vec::new().into()),
    )
    .await
    .expect("answered in time")
    .expect("the agent answers");
    serde_json::from_slice(&reply.payload).expect("a ControlReply")
}

async fn heartbeat(env: &Env, worker: &str) -> Option<WorkerStatus> {
    let bytes = env.buckets.workers.get(worker).await.ok()??;
    serde_json::from_slice(&bytes).ok()
}

fn event(list: &std::sync::Mutex<Vec<async_nats::Message>>, job: &str) -> Option<CompletionEvent> {
    list.lock()
        .unwrap()
        .iter()
        .map(|m| serde_json::from_slice::<CompletionEvent>(&m.payload).expect("event parses"))
        .find(|e| e.job_id == job)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_refuses_new_work_lets_running_jobs_finish_and_undrain_reopens() {
    let env = Env::start().await;
    let worker = "n1-gpu5";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;

    // A job that runs for about a second.
    env.assign(worker, &job("job-running", Endpoint::Chat, 20, 50), 1)
        .await;
    wait_for("the job to run", WAIT, || async {
        heartbeat(&env, worker)
            .await
            .filter(|s| s.in_flight.contains(&"job-running".to_string()))
    })
    .await;

    let r = request(&env, worker, CONTROL_DRAIN).await;
    assert!(r.draining, "{r:?}");
    assert_eq!(r.worker_id, worker);
    assert_eq!(r.running, 1, "{r:?}");
    assert_eq!(r.in_flight, vec!["job-running".to_string()]);
    assert_eq!(r.error, None);
    wait_for("a draining heartbeat", WAIT, || async {
        heartbeat(&env, worker).await.filter(|s| s.draining)
    })
    .await;

    // New work is refused back to the dispatcher, never run.
    env.assign(worker, &job("job-while-draining", Endpoint::Chat, 2, 0), 1)
        .await;
    let refused = wait_for("the refusal", WAIT, || async {
        event(&events, "job-while-draining")
    })
    .await;
    assert_eq!(refused.outcome, CompletionOutcome::Refused);
    assert!(refused.error.unwrap_or_default().contains("draining"));

    // The running job finishes; polling shows nothing left.
    let done = wait_for("the running job to finish", WAIT, || async {
        event(&events, "job-running")
    })
    .await;
    assert_eq!(done.outcome, CompletionOutcome::Done);
    let r = wait_for("the drain to be complete", WAIT, || async {
        let r = request(&env, worker, CONTROL_DRAIN).await;
        (r.running == 0).then_some(r)
    })
    .await;
    assert!(r.draining && r.in_flight.is_empty(), "{r:?}");

    // Unknown actions are answered, not applied.
    let r = request(&env, worker, "reboot").await;
    assert!(r.error.unwrap().contains("unknown action"));
    assert!(r.draining);

    let r = request(&env, worker, CONTROL_UNDRAIN).await;
    assert!(!r.draining, "{r:?}");
    wait_for("a heartbeat that takes work again", WAIT, || async {
        heartbeat(&env, worker).await.filter(|s| !s.draining)
    })
    .await;
    env.assign(worker, &job("job-after", Endpoint::Chat, 2, 0), 1)
        .await;
    let after = wait_for("the job after undrain", WAIT, || async {
        event(&events, "job-after")
    })
    .await;
    assert_eq!(after.outcome, CompletionOutcome::Done);

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), agent.wait())
        .await
        .expect("agent stops")
        .unwrap();
}
