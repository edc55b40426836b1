//! The worker-agent end to end on a real nats-server and redis-server, with a stub model
//! server: results, events, EWMAs, stale epochs, heartbeats, drain, cancellation and
//! malformed messages.

use crate::common;

use std::sync::atomic::Ordering;

use common::*;
use metronome_protocol::names::{
    cancel_subject, event_done_subject, results_subject_all, work_consumer, work_subject,
    STREAM_WORK, SUBJECT_DEAD_LETTER,
};
use metronome_protocol::redis_keys::{ewma_key, output_len_key, DEFAULT_PREFIX};
use metronome_protocol::{
    CompletionEvent, CompletionOutcome, Endpoint, ErrorCode, FinalResult, ResultChunk, WorkerStatus,
};
use metronome_testkit::wait_for;
use redis::AsyncCommands;

fn events_of(list: &std::sync::Mutex<Vec<async_nats::Message>>) -> Vec<CompletionEvent> {
    list.lock()
        .unwrap()
        .iter()
        .map(|m| serde_json::from_slice(&m.payload).expect("event parses"))
        .collect()
}

/// Chunks and final result of one job, from its `results.<job>.>` subscription.
fn results_of(
    list: &std::sync::Mutex<Vec<async_nats::Message>>,
) -> (Vec<ResultChunk>, Option<FinalResult>) {
    let mut chunks = Vec::new();
    let mut fin = None;
    for m in list.lock().unwrap().iter() {
        if m.subject.ends_with(".chunk") {
            chunks.push(serde_json::from_slice(&m.payload).expect("chunk parses"));
        } else {
            fin = Some(serde_json::from_slice(&m.payload).expect("final parses"));
        }
    }
    (chunks, fin)
}

async fn final_of(
    list: &std::sync::Mutex<Vec<async_nats::Message>>,
    what: &str,
) -> (Vec<ResultChunk>, FinalResult) {
    wait_for(what, WAIT, || async {
        let (c, f) = results_of(list);
        f.map(|f| (c, f))
    })
    .await
}

/// The W3C specification's example trace context.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assignment_streams_chunks_then_a_final_result_an_event_and_ewmas() {
    let env = Env::start().await;
    let worker = "n1-gpu0";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let chat = collect(
        env.client
            // A tenant's job: its results are published under the tenant's subjects.
            .subscribe(results_subject_all(Some("acme"), "job-chat"))
            .await
            .unwrap(),
    );
    let text = collect(
        env.client
            .subscribe(results_subject_all(None, "job-text"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;

    let mut chat_job = job("job-chat", Endpoint::Chat, 6, 0);
    chat_job.tenant = Some("acme".into());
    chat_job.traceparent = Some(TRACEPARENT.into());
    env.assign(worker, &chat_job, 1).await;
    env.assign(worker, &job("job-text", Endpoint::Completion, 4, 0), 1)
        .await;

    let (chunks, fin) = final_of(&chat, "final result of the chat job").await;
    // Role chunk + 6 tokens + finish chunk + usage chunk, in order, without gaps.
    assert_eq!(chunks.len(), 9, "{chunks:?}");
    assert!(chunks
        .iter()
        .enumerate()
        .all(|(i, c)| c.seq == i as u64 && c.worker_id == worker));
    assert_eq!(chunks[1].data["choices"][0]["delta"]["content"], "t0 ");
    assert_eq!(fin.error, None);
    assert_eq!(fin.chunks, 9);
    assert_eq!(
        (
            fin.usage.prompt_tokens,
            fin.usage.completion_tokens,
            fin.usage.total_tokens
        ),
        (7, 6, 13)
    );
    let resp = fin.response.expect("assembled response");
    assert_eq!(resp["object"], "chat.completion");
    assert_eq!(
        resp["choices"][0]["message"]["content"],
        "t0 t1 t2 t3 t4 t5 "
    );
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    assert_eq!(resp["usage"]["completion_tokens"], 6);
    assert!(fin.ttft_ms.is_some());

    let (chunks, fin) = final_of(&text, "final result of the completion job").await;
    assert_eq!(chunks.len(), 6);
    let resp = fin.response.expect("assembled response");
    assert_eq!(resp["object"], "text_completion");
    assert_eq!(resp["choices"][0]["text"], "t0 t1 t2 t3 ");
    assert_eq!(fin.usage.completion_tokens, 4);

    let evs = wait_for("two completion events", WAIT, || async {
        let e = events_of(&events);
        (e.len() == 2).then_some(e)
    })
    .await;
    for e in &evs {
        assert_eq!(e.outcome, CompletionOutcome::Done);
        assert!(e.streamed);
        assert!(e.ttft_ms.is_some() && e.e2e_ms >= e.ttft_ms.unwrap());
        assert_eq!(e.worker_id, worker);
        assert_eq!(e.model, MODEL);
    }
    let chat_ev = evs.iter().find(|e| e.job_id == "job-chat").unwrap();
    assert_eq!(chat_ev.output_tokens, 6);
    assert!(chat_ev.tpot_ms.is_some());

    // The agent forced streaming with usage on both requests.
    assert_eq!(env.stub.stats.forced_streaming.load(Ordering::SeqCst), 2);
    // Each request named its job to the model server, and the chat job's trace went along.
    let mut ids = env.stub.stats.ids.lock().unwrap().clone();
    ids.sort();
    assert_eq!(
        ids,
        vec![
            (Some("job-chat".to_string()), Some(TRACEPARENT.to_string())),
            (Some("job-text".to_string()), None),
        ]
    );

    // The EWMAs landed in Redis, within the range of what was measured.
    let mut redis = redis::Client::open(env.redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = ewma_key(DEFAULT_PREFIX, worker);
    let fields: std::collections::HashMap<String, String> =
        wait_for("EWMA hash with 2 samples", WAIT, || {
            let mut r = redis.clone();
            let key = key.clone();
            async move {
                let h: std::collections::HashMap<String, String> = r.hgetall(&key).await.ok()?;
                (h.get("samples").map(String::as_str) == Some("2")).then_some(h)
            }
        })
        .await;
    let f = |k: &str| fields[k].parse::<f64>().unwrap();
    let ttfts: Vec<f64> = evs.iter().map(|e| e.ttft_ms.unwrap()).collect();
    let (lo, hi) = (
        ttfts.iter().cloned().fold(f64::MAX, f64::min),
        ttfts.iter().cloned().fold(0.0, f64::max),
    );
    assert!(
        f("ttft_ms") >= lo - 1e-6 && f("ttft_ms") <= hi + 1e-6,
        "{fields:?} vs {ttfts:?}"
    );
    assert!(f("tok_s") > 0.0 && f("e2e_ms") > 0.0 && f("tpot_ms") >= 0.0);
    assert!(f("alpha") > 0.0 && f("alpha") <= 1.0);
    assert!(f("updated_ms") > 0.0);
    let outlen: f64 = redis
        .hget(output_len_key(DEFAULT_PREFIX, MODEL, worker), "tokens")
        .await
        .map(|s: String| s.parse().unwrap())
        .unwrap();
    assert!((4.0..=6.0).contains(&outlen), "{outlen}");

    let m = Env::agent_metrics(&agent).await;
    assert!(
        !m.contains("metronome_worker_gpu_"),
        "no GPU probe, no GPU figures: {m}"
    );
    assert_eq!(
        metric_value(
            &m,
            "metronome_worker_jobs_total",
            &[("worker_id", "n1-gpu0"), ("outcome", "done")]
        ),
        Some(2.0),
        "{m}"
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_epoch_is_refused_and_acknowledged() {
    let env = Env::start().await;
    let worker = "n1-gpu1";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let stale = collect(
        env.client
            .subscribe(results_subject_all(None, "job-stale"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;

    env.assign(worker, &job("job-new", Endpoint::Chat, 2, 0), 5)
        .await;
    wait_for("event of the epoch-5 job", WAIT, || async {
        events_of(&events)
            .iter()
            .any(|e| e.job_id == "job-new")
            .then_some(())
    })
    .await;
    env.assign(worker, &job("job-stale", Endpoint::Chat, 2, 0), 3)
        .await;
    let ev = wait_for("refusal of the epoch-3 job", WAIT, || async {
        events_of(&events)
            .into_iter()
            .find(|e| e.job_id == "job-stale")
    })
    .await;
    assert_eq!(ev.outcome, CompletionOutcome::Refused);
    assert!(!ev.streamed);
    assert_eq!(ev.epoch, 3);
    assert!(ev.error.as_deref().unwrap().contains("stale epoch"));
    // Its first delivery: no run of the agent started it, so the refusal carries it back
    // for a leader that does not hold its body.
    assert_eq!(ev.job.as_ref().map(|j| j.id.as_str()), Some("job-stale"));
    assert!(results_of(&stale).0.is_empty(), "a refused job never runs");
    assert_eq!(env.stub.stats.requests.load(Ordering::SeqCst), 1);

    // The refused message is acknowledged: nothing pending on the agent's consumer.
    let stream = env.js.get_stream(STREAM_WORK).await.unwrap();
    wait_for("WORK consumer to have nothing pending", WAIT, || {
        let stream = stream.clone();
        async move {
            let mut c: async_nats::jetstream::consumer::PullConsumer =
                stream.get_consumer(&work_consumer(worker)).await.ok()?;
            let info = c.info().await.ok()?;
            (info.num_ack_pending == 0 && info.num_pending == 0).then_some(())
        }
    })
    .await;
    let m = Env::agent_metrics(&agent).await;
    assert_eq!(
        metric_value(&m, "metronome_worker_stale_epoch_refusals_total", &[]),
        Some(1.0),
        "{m}"
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// One assignment with an impossible epoch (u64::MAX, from a buggy or hostile writer of
/// `work.<id>`; found by the hostile drill) used to raise the agent's highest epoch for
/// good: it then refused every assignment of the real leader as stale, and the leader kept
/// picking the idle-looking worker until the jobs ran out of attempts. Now a new, higher
/// epoch counts only when the leader lease vouches for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_the_lease_does_not_vouch_for_is_refused_and_the_leader_keeps_its_worker() {
    let env = Env::start().await;
    let worker = "n1-gpu5";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    env.lead(5).await;
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;

    // Straight to NATS, as any writer of the subject could.
    let poison = metronome_protocol::Assignment {
        v: metronome_protocol::PROTOCOL_VERSION,
        job: job("job-poison", Endpoint::Chat, 2, 0),
        worker_id: worker.into(),
        epoch: u64::MAX,
        attempt: 1,
        assigned_ms: 0,
        cached_prefix: None,
    };
    env.js
        .publish(
            work_subject(worker),
            serde_json::to_vec(&poison).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let ev = wait_for("refusal of the poison assignment", WAIT, || async {
        events_of(&events)
            .into_iter()
            .find(|e| e.job_id == "job-poison")
    })
    .await;
    assert_eq!(ev.outcome, CompletionOutcome::Refused);
    assert!(
        ev.error
            .as_deref()
            .is_some_and(|e| e.contains("not assigned by the leader")),
        "{:?}",
        ev.error
    );

    // The real leader (epoch 5) is still served.
    env.assign(worker, &job("job-real", Endpoint::Chat, 2, 0), 5)
        .await;
    let ev = wait_for("the leader's job to finish", WAIT, || async {
        events_of(&events)
            .into_iter()
            .find(|e| e.job_id == "job-real")
    })
    .await;
    assert_eq!(ev.outcome, CompletionOutcome::Done, "{:?}", ev.error);
    assert_eq!(
        env.stub.stats.requests.load(Ordering::SeqCst),
        1,
        "the poison never ran"
    );
    let m = Env::agent_metrics(&agent).await;
    assert_eq!(
        metric_value(&m, "metronome_worker_unvouched_epoch_refusals_total", &[]),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric_value(&m, "metronome_worker_stale_epoch_refusals_total", &[]),
        Some(0.0),
        "{m}"
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_list_running_jobs_and_shutdown_drains_then_leaves_the_registry() {
    let env = Env::start().await;
    let worker = "n1-gpu2";
    let beats = collect(
        env.client
            .subscribe("workers.n1-gpu2.heartbeat")
            .await
            .unwrap(),
    );
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-long"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    let bucket = env.buckets.workers.clone();

    // 30 tokens 40 ms apart: the job runs for about a second.
    env.assign(worker, &job("job-long", Endpoint::Chat, 30, 40), 1)
        .await;
    let status: WorkerStatus = wait_for("a heartbeat listing the running job", WAIT, || {
        let bucket = bucket.clone();
        async move {
            let bytes = bucket.get(worker).await.ok()??;
            let s: WorkerStatus = serde_json::from_slice(&bytes).ok()?;
            s.in_flight.contains(&"job-long".to_string()).then_some(s)
        }
    })
    .await;
    assert!(status.healthy);
    assert!(!status.draining);
    assert_eq!(status.model, MODEL);
    assert_eq!(status.max_concurrency, 256, "the default ceiling");
    assert!(status.perf.is_some(), "the agent fits a performance model");
    assert_eq!(status.gpu, None, "no GPU probe: unavailable, not zero");
    let kv = status
        .kv
        .expect("KV usage scraped from the stub's vLLM metrics");
    assert_eq!(kv.used_frac, 0.125);
    assert_eq!(kv.capacity_tokens, Some(16_000));

    // Shut down while the job runs: it completes, then the worker leaves the bucket.
    wait_for("first chunk", WAIT, || async {
        (!results_of(&results).0.is_empty()).then_some(())
    })
    .await;
    shutdown.cancel();
    agent.wait().await.unwrap();
    // Delivery to this test's subscriptions is asynchronous: wait for what was published.
    let (chunks, fin) = final_of(&results, "the running job's final result, from the drain").await;
    assert_eq!(fin.error, None);
    assert_eq!(fin.usage.completion_tokens, 30);
    assert_eq!(chunks.len() as u64, fin.chunks);
    assert_eq!(
        bucket.get(worker).await.unwrap(),
        None,
        "key removed after the drain"
    );
    let hb: Vec<WorkerStatus> = wait_for(
        "a last heartbeat: draining, nothing in flight",
        WAIT,
        || async {
            let hb: Vec<WorkerStatus> = beats
                .lock()
                .unwrap()
                .iter()
                .map(|m| serde_json::from_slice(&m.payload).unwrap())
                .collect();
            let last = hb.last()?;
            (last.draining && last.in_flight.is_empty()).then_some(hb)
        },
    )
    .await;
    assert!(hb.windows(2).all(|w| w[0].seq < w[1].seq), "seq increases");
    assert!(
        hb.iter().any(|s| s.draining && !s.in_flight.is_empty()),
        "draining announced while the job ran"
    );
}

/// A client's cancel reaches the agent only as the leader relays it, on the agent's own
/// `control.<worker_id>.cancel` (a client's `cancel.<tenant>.<job>` itself is not heard).
/// A relay naming the job's own tenant stops it; one naming another tenant (a client may
/// name any job id under its own tenant's subject) is ignored and counted, and the job
/// keeps streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_running_job_and_closes_the_model_server_stream() {
    let env = Env::start().await;
    let worker = "n1-gpu3";
    let acme = Some("acme");
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let results = collect(
        env.client
            .subscribe(results_subject_all(acme, "job-cancel"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;

    // Long enough that it cannot finish on its own during the test.
    let mut long = job("job-cancel", Endpoint::Chat, 1000, 50);
    long.tenant = acme.map(String::from);
    env.assign(worker, &long, 1).await;
    wait_for("a token chunk", WAIT, || async {
        (results_of(&results).0.len() >= 2).then_some(())
    })
    .await;
    // The client's own cancel, not relayed: no agent hears `cancel.*.*`.
    env.client
        .publish(cancel_subject(acme, "job-cancel"), "".into())
        .await
        .unwrap();
    // Another tenant's client, and the client of no tenant, name this job.
    for tenant in [Some("globex"), None] {
        relay_cancel(&env, worker, tenant, "job-cancel").await;
    }
    env.client.flush().await.unwrap();
    wait_for("both forged cancels ignored", WAIT, || async {
        let m = Env::agent_metrics(&agent).await;
        (metric_value(&m, "metronome_worker_cancels_of_another_tenant_total", &[]) == Some(2.0))
            .then_some(())
    })
    .await;
    let streamed = results_of(&results).0.len();
    wait_for("the job to keep streaming", WAIT, || async {
        (results_of(&results).0.len() >= streamed + 10).then_some(())
    })
    .await;
    assert!(
        results_of(&results).1.is_none(),
        "a forged cancel ended the job"
    );
    relay_cancel(&env, worker, acme, "job-cancel").await;

    let (_, fin) = final_of(&results, "final result of the cancelled job").await;
    assert_eq!(fin.error.expect("an error").code, ErrorCode::Cancelled);
    let ev = wait_for("cancelled event", WAIT, || async {
        events_of(&events).pop()
    })
    .await;
    assert_eq!(ev.outcome, CompletionOutcome::Cancelled);
    assert!(ev.streamed);
    wait_for(
        "the model server to see the stream closed",
        WAIT,
        || async { (env.stub.stats.aborted.load(Ordering::SeqCst) == 1).then_some(()) },
    )
    .await;
    shutdown.cancel();
    agent.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_terminated_and_the_agent_keeps_serving() {
    let env = Env::start().await;
    let worker = "n1-gpu4";
    let dead = collect(env.client.subscribe(SUBJECT_DEAD_LETTER).await.unwrap());
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let failing = collect(
        env.client
            .subscribe(results_subject_all(None, "job-fail"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;

    env.js
        .publish(work_subject(worker), "{this is not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    // A model server error before any token: WorkerFailed, and the event says so.
    let mut bad = job("job-fail", Endpoint::Chat, 3, 0);
    bad.request["stub_fail"] = "status".into();
    env.assign(worker, &bad, 1).await;
    env.assign(worker, &job("job-ok", Endpoint::Completion, 3, 0), 1)
        .await;

    let evs = wait_for("events of both jobs", WAIT, || async {
        let e = events_of(&events);
        (e.len() == 2).then_some(e)
    })
    .await;
    let ok = evs.iter().find(|e| e.job_id == "job-ok").unwrap();
    assert_eq!(ok.outcome, CompletionOutcome::Done);
    let failed = evs.iter().find(|e| e.job_id == "job-fail").unwrap();
    assert_eq!(failed.outcome, CompletionOutcome::Failed);
    assert!(!failed.streamed);
    assert!(
        failed.error.as_deref().unwrap().contains("500"),
        "{failed:?}"
    );
    let (_, fin) = final_of(&failing, "final result of the failed job").await;
    assert_eq!(fin.error.unwrap().code, ErrorCode::WorkerFailed);

    let letter = wait_for("dead letter", WAIT, || async {
        dead.lock().unwrap().first().cloned()
    })
    .await;
    let letter: serde_json::Value = serde_json::from_slice(&letter.payload).unwrap();
    assert_eq!(letter["source"], "work.n1-gpu4");
    assert!(
        letter["reason"]
            .as_str()
            .unwrap()
            .contains("key must be a string"),
        "{letter}"
    );

    // Terminated, not redelivered: nothing waits for an ack on the consumer.
    let stream = env.js.get_stream(STREAM_WORK).await.unwrap();
    let info = wait_for("WORK consumer settled", WAIT, || {
        let stream = stream.clone();
        async move {
            let mut c: async_nats::jetstream::consumer::PullConsumer =
                stream.get_consumer(&work_consumer(worker)).await.ok()?;
            let info = c.info().await.ok()?.clone();
            (info.num_ack_pending == 0 && info.num_pending == 0).then_some(info)
        }
    })
    .await;
    assert_eq!(info.num_redelivered, 0);
    let m = Env::agent_metrics(&agent).await;
    assert_eq!(
        metric_value(&m, "metronome_worker_malformed_assignments_total", &[]),
        Some(1.0),
        "{m}"
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// The dispatcher re-dispatches a dead worker's jobs that no heartbeat ever listed, so a job
/// must be listed in a stored heartbeat before its first token, or a crash right after the
/// first tokens would run it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_reported_in_a_heartbeat_before_its_first_token() {
    let env = Env::start().await;
    let worker = "n1-gpu0";
    // One subscription for both subjects keeps their relative order.
    let all = collect(env.client.subscribe(">").await.unwrap());
    env.client.flush().await.unwrap();
    let (_agent, _shutdown) = env.start_agent(env.config(worker)).await;
    for i in 0..5 {
        let id = format!("job-early-{i}");
        env.assign(worker, &job(&id, Endpoint::Chat, 3, 0), 1).await;
    }
    wait_for("every job's final result", WAIT, || async {
        let n = all
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.subject.ends_with(".final"))
            .count();
        (n == 5).then_some(())
    })
    .await;
    let messages = all.lock().unwrap().clone();
    for i in 0..5 {
        let id = format!("job-early-{i}");
        let first_chunk = messages
            .iter()
            .position(|m| {
                m.subject.as_str()
                    == metronome_protocol::names::result_chunk_subject(None, &id, worker)
            })
            .expect("a chunk");
        let reported = messages[..first_chunk].iter().any(|m| {
            m.subject.as_str() == metronome_protocol::names::heartbeat_subject(worker)
                && serde_json::from_slice::<metronome_protocol::WorkerStatus>(&m.payload)
                    .is_ok_and(|s| s.in_flight.contains(&id))
        });
        assert!(reported, "{id} streamed before any heartbeat listed it");
    }
}

#[tokio::test]
async fn over_tls_the_agent_serves_a_job_and_writes_its_ewmas() {
    let env = Env::start_tls().await;
    let worker = "n1-gpu0";
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-tls"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();

    // Without the CA the agent does not start: the handshake refuses the server.
    let mut untrusting = env.config(worker);
    untrusting.nats_auth.ca_file = None;
    let mut deps = metronome_worker_agent::Dependencies::from_config(&untrusting).expect("deps");
    deps.gpu = std::sync::Arc::new(metronome_worker_agent::NoGpu);
    let err =
        metronome_worker_agent::start(untrusting, deps, tokio_util::sync::CancellationToken::new())
            .await
            .map(|_| ())
            .expect_err("an agent that does not trust the CA");
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "{err}"
    );

    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    env.assign(worker, &job("job-tls", Endpoint::Chat, 3, 0), 1)
        .await;
    let (_, fin) = final_of(&results, "final result over TLS").await;
    assert_eq!(fin.error, None);

    // The agent wrote the EWMA through its rediss:// URL; read it back the same way.
    let (url, tls) = env.redis_settings();
    let redis = tls
        .client(&url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = ewma_key(DEFAULT_PREFIX, worker);
    wait_for("EWMA hash with 1 sample over TLS", WAIT, || {
        let mut r = redis.clone();
        let key = key.clone();
        async move {
            let samples: Option<String> = r.hget(&key, "samples").await.ok()?;
            (samples.as_deref() == Some("1")).then_some(())
        }
    })
    .await;
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// What the leader sends the worker holding `job_id` when its client cancels it naming
/// `tenant`.
async fn relay_cancel(env: &Env, worker: &str, tenant: Option<&str>, job_id: &str) {
    let body = metronome_protocol::RelayedCancel {
        v: metronome_protocol::PROTOCOL_VERSION,
        tenant: metronome_protocol::names::tenant_token(tenant).to_string(),
        job_id: job_id.to_string(),
    };
    env.client
        .publish(
            metronome_protocol::names::control_subject(
                worker,
                metronome_protocol::names::CONTROL_CANCEL,
            ),
            serde_json::to_vec(&body).unwrap().into(),
        )
        .await
        .unwrap();
}

/// A GPU probe with fixed figures (NVML's path itself needs a GPU).
struct FixedGpu(metronome_protocol::GpuStats);

impl metronome_worker_agent::GpuProbe for FixedGpu {
    fn sample(&self) -> Option<metronome_protocol::GpuStats> {
        Some(self.0)
    }
    fn describe(&self) -> String {
        "fixed".into()
    }
}

/// The GPU probe's figures reach the agent's /metrics (utilisation, memory used and in
/// all), as they reach its heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_probes_figures_are_on_the_agents_metrics() {
    let env = Env::start().await;
    let stats = metronome_protocol::GpuStats {
        util_frac: 0.75,
        mem_used_bytes: 10 << 30,
        mem_total_bytes: 80 << 30,
    };
    let (agent, shutdown) = env
        .start_agent_with_gpu(env.config("n1-gpu0"), std::sync::Arc::new(FixedGpu(stats)))
        .await;
    let labels = [("worker_id", "n1-gpu0")];
    let text = wait_for("the GPU figures on /metrics", WAIT, || async {
        let m = Env::agent_metrics(&agent).await;
        metric_value(&m, "metronome_worker_gpu_utilisation_ratio", &labels).map(|_| m)
    })
    .await;
    assert_eq!(
        metric_value(&text, "metronome_worker_gpu_utilisation_ratio", &labels),
        Some(0.75)
    );
    assert_eq!(
        metric_value(&text, "metronome_worker_gpu_memory_used_bytes", &labels),
        Some((10u64 << 30) as f64)
    );
    assert_eq!(
        metric_value(&text, "metronome_worker_gpu_memory_total_bytes", &labels),
        Some((80u64 << 30) as f64)
    );
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// The body a client sent is not what reaches the model server: fields outside OpenAI's
/// (and the configured extras) stay behind, and `model` is the job's whatever the body says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_server_gets_only_allowed_fields_and_the_jobs_model() {
    let env = Env::start().await;
    let worker = "n1-gpu7";
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-fields"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(env.config(worker)).await;
    let mut hostile = job("job-fields", Endpoint::Chat, 3, 0);
    let request = hostile.request.as_object_mut().unwrap();
    request.insert("model".into(), "another-tenants-model".into());
    request.insert("chat_template".into(), "{{ cycler.__init__ }}".into());
    request.insert("prompt_embeds".into(), "AAAA".into());
    request.insert("temperature".into(), 0.5.into());
    env.assign(worker, &hostile, 1).await;
    let (_, fin) = final_of(&results, "final result").await;
    assert!(fin.error.is_none(), "{fin:?}");
    let body = env.stub.stats.bodies.lock().unwrap()[0].clone();
    assert_eq!(body["model"], MODEL, "{body}");
    assert_eq!(body["temperature"], 0.5, "{body}");
    for field in ["chat_template", "prompt_embeds"] {
        assert!(
            body.get(field).is_none(),
            "{field} reached the server: {body}"
        );
    }
    shutdown.cancel();
    agent.wait().await.unwrap();
}
