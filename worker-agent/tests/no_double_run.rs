//! No job runs twice because of the agent, against a real nats-server and redis-server:
//! a redelivered assignment it does not hold is refused, a revoked job stops without a
//! result, an agent whose heartbeats are not stored takes and starts nothing (and refuses
//! what it took before it was fenced), and the forwarded request never asks for more
//! tokens than the job declared.

use crate::common;

use std::sync::atomic::Ordering;

use async_nats::jetstream::{consumer, AckKind};
use common::*;
use futures::StreamExt;
use metronome_protocol::names::{
    control_subject, event_done_subject, results_subject_all, work_consumer, work_subject,
    BUCKET_WORKERS, CONTROL_REVOKE, STREAM_WORK,
};
use metronome_protocol::setup::{ensure_all, StreamSettings};
use metronome_protocol::{
    CompletionEvent, CompletionOutcome, Endpoint, FinalResult, Revoke, RevokedJob, PROTOCOL_VERSION,
};
use metronome_testkit::wait_for;

type Collected = std::sync::Arc<std::sync::Mutex<Vec<async_nats::Message>>>;

fn events_of(list: &Collected, job_id: &str) -> Vec<CompletionEvent> {
    list.lock()
        .unwrap()
        .iter()
        .filter_map(|m| serde_json::from_slice::<CompletionEvent>(&m.payload).ok())
        .filter(|e| e.job_id == job_id)
        .collect()
}

fn final_of(list: &Collected) -> Option<FinalResult> {
    list.lock()
        .unwrap()
        .iter()
        .find(|m| m.subject.ends_with(".final"))
        .map(|m| serde_json::from_slice(&m.payload).unwrap())
}

async fn metric(agent: &metronome_worker_agent::RunningAgent, name: &str) -> f64 {
    metric_value(&Env::agent_metrics(agent).await, name, &[]).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_assignment_the_agent_does_not_hold_is_refused_not_run() {
    let env = Env::start().await;
    let worker = "nd-gpu0";
    let config = env.config(worker);
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    // A previous run of this agent took the assignment and died before acknowledging it
    // (and before reporting it: the bucket has no heartbeat of it).
    delivered_once_before(&env, &config, "job-redelivered").await;

    let (agent, shutdown) = env.start_agent(config).await;
    let refused = wait_for("the refusal of the redelivered job", WAIT, || async {
        events_of(&events, "job-redelivered").into_iter().next()
    })
    .await;
    assert_eq!(refused.outcome, CompletionOutcome::Refused);
    assert!(
        refused
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("redelivered"),
        "{refused:?}"
    );
    // The refusal hands the job back: a leader that took over from the one that assigned
    // it holds no body and assigns it again from this copy.
    // A redelivery may have been started by an earlier run: its refusal carries no copy
    // of the job, which a leader that does not hold the body would assign again.
    assert!(refused.job.is_none(), "{refused:?}");
    assert_eq!(
        env.stub.stats.requests.load(Ordering::SeqCst),
        0,
        "the model server never saw the job"
    );
    assert_eq!(
        metric(&agent, "metronome_worker_redelivery_refusals_total").await,
        1.0
    );
    // A fresh assignment still runs: the refusal is about redeliveries only.
    env.assign(worker, &job("job-fresh", Endpoint::Chat, 2, 0), 1)
        .await;
    let done = wait_for("the fresh job's event", WAIT, || async {
        events_of(&events, "job-fresh").into_iter().next()
    })
    .await;
    assert_eq!(done.outcome, CompletionOutcome::Done);
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// Create the agent's durable consumer, publish `job_id`'s assignment and have it delivered
/// once without an acknowledgement, as a previous run of the agent that died would have.
async fn delivered_once_before(env: &Env, config: &metronome_worker_agent::Config, job_id: &str) {
    delivered_once_before_by(env, config, job_id, 1, None).await;
}

/// [`delivered_once_before`] of an Assignment of `epoch`, redelivered after `delay`.
async fn delivered_once_before_by(
    env: &Env,
    config: &metronome_worker_agent::Config,
    job_id: &str,
    epoch: u64,
    delay: Option<std::time::Duration>,
) {
    let worker = config.worker_id.as_str();
    let stream = env.js.get_stream(STREAM_WORK).await.unwrap();
    let name = work_consumer(worker);
    let durable = stream
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                filter_subject: work_subject(worker),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait(),
                description: Some(format!("worker-agent {worker}")),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    env.assign(worker, &job(job_id, Endpoint::Chat, 4, 0), epoch)
        .await;
    let mut first = durable.fetch().max_messages(1).messages().await.unwrap();
    let taken = first.next().await.expect("delivered once").unwrap();
    assert_eq!(taken.info().unwrap().delivered, 1);
    taken.ack_with(AckKind::Nak(delay)).await.unwrap();
}

/// Store the last heartbeat of a previous run of `worker` that listed `job_id` (so that
/// run may have started it and streamed).
async fn previous_run_reported(env: &Env, worker: &str, job_id: &str) {
    let previous = serde_json::json!({
        "v": PROTOCOL_VERSION, "worker_id": worker, "model": MODEL, "healthy": true,
        "draining": false, "max_concurrency": 4, "active": 1, "queued": 0,
        "in_flight": [job_id], "seq": 41, "sent_ms": 1,
    });
    env.buckets
        .workers
        .put(worker, serde_json::to_vec(&previous).unwrap().into())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_job_the_previous_run_had_reported_fails_as_lost_and_never_runs_again() {
    let env = Env::start().await;
    let worker = "nd-gpu4";
    let config = env.config(worker);
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-was-running"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    delivered_once_before(&env, &config, "job-was-running").await;
    // The previous run's last stored heartbeat listed the job: it may have streamed.
    previous_run_reported(&env, worker, "job-was-running").await;

    let (agent, shutdown) = env.start_agent(config).await;
    let failed = wait_for("the lost job's event", WAIT, || async {
        events_of(&events, "job-was-running").into_iter().next()
    })
    .await;
    assert_eq!(failed.outcome, CompletionOutcome::Failed, "{failed:?}");
    assert!(failed.streamed, "the dispatcher must not run it again");
    let fin = wait_for("the lost job's final result", WAIT, || async {
        final_of(&results)
    })
    .await;
    assert_eq!(
        fin.error.map(|e| e.code),
        Some(metronome_protocol::ErrorCode::WorkerLost)
    );
    assert_eq!(env.stub.stats.requests.load(Ordering::SeqCst), 0);
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// The drill `kill-leader-amid-faults` found it: the leader and an agent are killed
/// together, the agent restarts and hears the new leader's epoch before the old leader's
/// Assignment of a job its killed run had started comes back. That redelivery used to be
/// refused as a deposed leader's ("stale epoch"), and a refusal may be assigned again: it
/// fails as lost instead, whatever its epoch, and never runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leaders_redelivery_of_a_job_the_previous_run_reported_fails_as_lost() {
    let env = Env::start().await;
    let worker = "nd-gpu5";
    let config = env.config(worker);
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    // Redelivered late, after the new leader's first Assignment has been read.
    delivered_once_before_by(
        &env,
        &config,
        "job-old-term",
        1,
        Some(std::time::Duration::from_secs(8)),
    )
    .await;
    previous_run_reported(&env, worker, "job-old-term").await;
    env.assign(worker, &job("job-new-term", Endpoint::Chat, 2, 0), 5)
        .await;

    let (agent, shutdown) = env.start_agent(config).await;
    let old = wait_for("the old term's job's event", WAIT, || async {
        events_of(&events, "job-old-term").into_iter().next()
    })
    .await;
    assert!(
        !events_of(&events, "job-new-term").is_empty(),
        "the new term's job was read first, so its epoch was known"
    );
    assert_eq!(old.outcome, CompletionOutcome::Failed, "{old:?}");
    assert!(old.streamed, "the dispatcher must not run it again");
    assert!(old.job.is_none());
    assert_eq!(
        env.stub.stats.requests.load(Ordering::SeqCst),
        1,
        "only the new term's job ran"
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_revoked_by_the_leader_stops_without_a_result_or_an_event() {
    let env = Env::start().await;
    let worker = "nd-gpu1";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-revoked"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    env.assign(worker, &job("job-revoked", Endpoint::Chat, 10_000, 20), 1)
        .await;
    wait_for("the job to stream", WAIT, || async {
        (results.lock().unwrap().len() >= 2).then_some(())
    })
    .await;

    // The leader declared the worker dead and gave the job away: a later attempt of the
    // same job is not covered, so this one is revoked while attempt 2 would not be.
    let revoke = Revoke {
        v: PROTOCOL_VERSION,
        epoch: 1,
        jobs: vec![
            RevokedJob {
                job_id: "job-revoked".into(),
                attempt: Some(1),
            },
            // Delivered before the revocation but read after it (a stopped agent waking).
            RevokedJob {
                job_id: "job-read-late".into(),
                attempt: Some(1),
            },
        ],
        reason: "test: worker declared dead".into(),
    };
    env.client
        .publish(
            control_subject(worker, CONTROL_REVOKE),
            serde_json::to_vec(&revoke).unwrap().into(),
        )
        .await
        .unwrap();
    wait_for("the revoked job to stop", WAIT, || async {
        (metric(&agent, "metronome_worker_revoked_jobs_total").await == 1.0
            && env.stub.stats.aborted.load(Ordering::SeqCst) == 1)
            .then_some(())
    })
    .await;
    wait_for("the slot to be free", WAIT, || async {
        (metric(&agent, "metronome_worker_running_jobs").await == 0.0).then_some(())
    })
    .await;
    env.assign(worker, &job("job-read-late", Endpoint::Chat, 2, 0), 1)
        .await;
    wait_for("the late assignment to be dropped", WAIT, || async {
        (metric(&agent, "metronome_worker_revoked_jobs_total").await == 2.0).then_some(())
    })
    .await;
    assert_eq!(
        env.stub.stats.requests.load(Ordering::SeqCst),
        1,
        "a revoked attempt read after its revocation never starts"
    );
    assert!(events_of(&events, "job-read-late").is_empty());
    // The runner returns before publishing anything once it counts the revocation, so
    // nothing can still be on its way.
    env.client.flush().await.unwrap();
    assert!(
        final_of(&results).is_none(),
        "no final result of a revoked run"
    );
    assert!(
        events_of(&events, "job-revoked").is_empty(),
        "no event of a revoked run"
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_heartbeats_are_not_stored_takes_and_starts_nothing() {
    let env = Env::start().await;
    let worker = "nd-gpu2";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.fence_after_ms = 600;
    let (agent, shutdown) = env.start_agent(config).await;

    // Heartbeats can no longer be stored: the bucket is gone.
    env.js.delete_key_value(BUCKET_WORKERS).await.unwrap();
    // Taken before the fence rises, but never reported.
    env.assign(worker, &job("job-before", Endpoint::Chat, 2, 0), 1)
        .await;
    wait_for("the agent to fence itself", WAIT, || async {
        (metric(&agent, "metronome_worker_fenced").await == 1.0).then_some(())
    })
    .await;
    // A pull request open when the fence rose expires within 500 ms; one second of failed
    // heartbeats later none is open.
    let errors = metric(&agent, "metronome_worker_heartbeat_errors_total").await;
    wait_for("10 more failed heartbeats", WAIT, || async {
        (metric(&agent, "metronome_worker_heartbeat_errors_total").await >= errors + 10.0)
            .then_some(())
    })
    .await;
    env.assign(worker, &job("job-during", Endpoint::Chat, 2, 0), 1)
        .await;
    // Past the old 2 s "start unreported" wait: heartbeats keep failing every 100 ms.
    let errors = metric(&agent, "metronome_worker_heartbeat_errors_total").await;
    wait_for("30 more failed heartbeats", WAIT, || async {
        (metric(&agent, "metronome_worker_heartbeat_errors_total").await >= errors + 30.0)
            .then_some(())
    })
    .await;
    assert_eq!(
        env.stub.stats.requests.load(Ordering::SeqCst),
        0,
        "no job started while heartbeats were not stored"
    );
    let stream = env.js.get_stream(STREAM_WORK).await.unwrap();
    let mut durable: consumer::PullConsumer =
        stream.get_consumer(&work_consumer(worker)).await.unwrap();
    let info = durable.info().await.unwrap();
    assert_eq!(
        info.num_pending, 1,
        "the fenced agent did not pull: {info:?}"
    );

    // Heartbeats are stored again: the fence lowers.
    ensure_all(&env.js, &StreamSettings::default())
        .await
        .unwrap();
    let before = wait_for("the job taken before the fence", WAIT, || async {
        events_of(&events, "job-before").into_iter().next()
    })
    .await;
    assert_eq!(
        before.outcome,
        CompletionOutcome::Refused,
        "it may have been given away while the agent was fenced: {before:?}"
    );
    let during = wait_for("the job assigned during the fence", WAIT, || async {
        events_of(&events, "job-during").into_iter().next()
    })
    .await;
    assert_eq!(during.outcome, CompletionOutcome::Done);
    assert_eq!(env.stub.stats.requests.load(Ordering::SeqCst), 1);
    assert_eq!(
        metric(&agent, "metronome_worker_fence_episodes_total").await,
        1.0
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jobs_max_tokens_bounds_the_forwarded_request() {
    let env = Env::start().await;
    let worker = "nd-gpu3";
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-oversized"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    // Declared as 3 tokens (what the dispatcher reserved), the body asks for 40.
    let mut j = job("job-oversized", Endpoint::Chat, 3, 0);
    j.request["max_tokens"] = 40.into();
    env.assign(worker, &j, 1).await;
    let fin = wait_for("the final result", WAIT, || async { final_of(&results) }).await;
    assert_eq!(fin.error, None);
    assert_eq!(fin.usage.completion_tokens, 3, "{fin:?}");
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_delivery_of_an_attempt_that_already_ran_is_acknowledged_not_run_or_refused() {
    let env = Env::start().await;
    let worker = "nd-gpu5";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    let j = job("job-acked-late", Endpoint::Chat, 2, 0);
    env.assign(worker, &j, 1).await;
    wait_for("the job to finish", WAIT, || async {
        events_of(&events, "job-acked-late").into_iter().next()
    })
    .await;
    // The same attempt again, as after a WORK ack lost in a NATS restart (another msg id,
    // so JetStream's de-duplication lets it through).
    let a = metronome_protocol::Assignment {
        v: PROTOCOL_VERSION,
        job: j.clone(),
        worker_id: worker.into(),
        epoch: 1,
        attempt: 1,
        assigned_ms: 0,
        cached_prefix: None,
    };
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        metronome_protocol::names::HEADER_MSG_ID,
        "job-acked-late:1:again",
    );
    env.js
        .publish_with_headers(
            work_subject(worker),
            headers,
            serde_json::to_vec(&a).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let stream = env.js.get_stream(STREAM_WORK).await.unwrap();
    let durable: consumer::PullConsumer =
        stream.get_consumer(&work_consumer(worker)).await.unwrap();
    wait_for("the second delivery to be acknowledged", WAIT, || async {
        let info = durable.clone().info().await.unwrap().clone();
        (info.num_pending == 0 && info.num_ack_pending == 0 && info.delivered.stream_sequence >= 2)
            .then_some(())
    })
    .await;
    env.client.flush().await.unwrap();
    assert_eq!(
        env.stub.stats.requests.load(Ordering::SeqCst),
        1,
        "ran once"
    );
    assert_eq!(
        events_of(&events, "job-acked-late").len(),
        1,
        "no refusal that would make the dispatcher run it again"
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_key_the_leader_deleted_stops_its_jobs_as_lost_and_registers_again() {
    let env = Env::start().await;
    let worker = "nd-gpu4";
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-given-away"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    env.assign(
        worker,
        &job("job-given-away", Endpoint::Chat, 10_000, 20),
        1,
    )
    .await;
    wait_for("the job to stream", WAIT, || async {
        (results.lock().unwrap().len() >= 2).then_some(())
    })
    .await;

    // The leader declares the worker dead the way it does: a delete of the key at the
    // revision of the last heartbeat it saw (retried at a newer one if a heartbeat landed
    // in between: the very race the condition settles). The agent's next conditional put
    // is then refused.
    let bucket = env.js.get_key_value(BUCKET_WORKERS).await.unwrap();
    wait_for("the key deleted at the latest revision", WAIT, || async {
        let e = bucket.entry(worker).await.unwrap()?;
        bucket
            .delete_expect_revision(worker, Some(e.revision))
            .await
            .ok()
    })
    .await;

    let fin = wait_for("the job's final result", WAIT, || async {
        final_of(&results)
    })
    .await;
    let err = fin.error.expect("the job did not finish: it was lost");
    assert_eq!(
        err.code,
        metronome_protocol::ErrorCode::WorkerLost,
        "{err:?}"
    );
    assert!(
        env.stub.stats.aborted.load(Ordering::SeqCst) >= 1,
        "the model request was stopped"
    );

    // It registers again with a plain put that no longer lists the job.
    let back = wait_for("the worker to register again", WAIT, || async {
        let e = bucket.entry(worker).await.unwrap()?;
        (e.operation == async_nats::jetstream::kv::Operation::Put)
            .then(|| serde_json::from_slice::<metronome_protocol::WorkerStatus>(&e.value).unwrap())
    })
    .await;
    assert!(back.in_flight.is_empty(), "{:?}", back.in_flight);
    assert_eq!(
        metric(&agent, "metronome_worker_fence_episodes_total").await,
        1.0
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}
