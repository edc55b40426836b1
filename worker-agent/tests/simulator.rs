//! The agent in front of the bundled GPU simulator (in-process), on real NATS and Redis:
//! the simulator's SSE stream, usage and vLLM-named metrics are read as from vLLM.

use crate::common;

use common::{collect, Env, WAIT};
use metronome_gpu_sim::{spawn_gpu, SimGpuConfig};
use metronome_protocol::names::{event_done_subject, results_subject_all};
use metronome_protocol::{CompletionEvent, CompletionOutcome, Endpoint, FinalResult, WorkerStatus};
use metronome_testkit::wait_for;
use metronome_worker_agent::ServerKind;
use tokio_util::sync::CancellationToken;

const SIM_MODEL: &str = "sim/llama-3.1-8b";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_on_the_simulator_and_heartbeats_carry_its_kv_metrics() {
    let env = Env::start().await;
    let sim_stop = CancellationToken::new();
    let sim = spawn_gpu(
        SimGpuConfig {
            base_step_ms: 1.0,
            ..SimGpuConfig::new(SIM_MODEL)
        },
        sim_stop.clone(),
    )
    .await
    .expect("simulated GPU");
    let worker = "sim-gpu0";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "job-sim"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.model = SIM_MODEL.into();
    config.model_server_url = format!("http://{sim}");
    config.model_server_kind = ServerKind::Simulator;
    let (agent, shutdown) = env.start_agent(config).await;

    let mut job = common::job("job-sim", Endpoint::Chat, 12, 0);
    job.model = SIM_MODEL.into();
    job.request["model"] = SIM_MODEL.into();
    env.assign(worker, &job, 1).await;

    let fin: FinalResult = wait_for("final result from the simulator", WAIT, || async {
        results
            .lock()
            .unwrap()
            .iter()
            .find(|m| m.subject.ends_with(".final"))
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
    })
    .await;
    assert_eq!(fin.error, None, "{fin:?}");
    assert_eq!(
        fin.usage.completion_tokens, 12,
        "the simulator honours max_tokens"
    );
    let resp = fin.response.unwrap();
    assert_eq!(resp["object"], "chat.completion");
    assert!(!resp["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    let ev: CompletionEvent = wait_for("completion event", WAIT, || async {
        events
            .lock()
            .unwrap()
            .first()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
    })
    .await;
    assert_eq!(ev.outcome, CompletionOutcome::Done);
    assert_eq!(ev.output_tokens, 12);

    let bucket = env.buckets.workers.clone();
    let status: WorkerStatus =
        wait_for("a heartbeat with the simulator's KV capacity", WAIT, || {
            let bucket = bucket.clone();
            async move {
                let s: WorkerStatus =
                    serde_json::from_slice(&bucket.get(worker).await.ok()??).ok()?;
                s.kv.and_then(|kv| kv.capacity_tokens).map(|_| s)
            }
        })
        .await;
    assert!(status.healthy);
    let kv = status.kv.unwrap();
    assert!((0.0..=1.0).contains(&kv.used_frac));
    assert!(kv.capacity_tokens.unwrap() > 0);

    shutdown.cancel();
    agent.wait().await.unwrap();
    sim_stop.cancel();
}

/// A job that asks for log-probabilities and does not stream gets, from the response the
/// agent assembles out of the stream, exactly what the server answers a non-streamed
/// request: the same tokens, numbers and alternatives, for chat and for completions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_assembled_response_keeps_the_logprobs_the_server_streamed() {
    let env = Env::start().await;
    let sim_stop = CancellationToken::new();
    let sim = spawn_gpu(
        SimGpuConfig {
            base_step_ms: 1.0,
            ..SimGpuConfig::new(SIM_MODEL)
        },
        sim_stop.clone(),
    )
    .await
    .expect("simulated GPU");
    let worker = "sim-gpu1";
    let results = collect(
        env.client
            .subscribe(results_subject_all(None, "*"))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let mut config = env.config(worker);
    config.model = SIM_MODEL.into();
    config.model_server_url = format!("http://{sim}");
    config.model_server_kind = ServerKind::Simulator;
    let (agent, shutdown) = env.start_agent(config).await;
    let http = reqwest::Client::new();

    for (id, endpoint, request) in [
        (
            "job-lp-chat",
            Endpoint::Chat,
            serde_json::json!({"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 7, "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "job-lp-completion",
            Endpoint::Completion,
            serde_json::json!({"model": SIM_MODEL, "prompt": "once upon a time",
                "max_tokens": 7, "logprobs": 3}),
        ),
    ] {
        let mut job = common::job(id, endpoint, 7, 0);
        job.model = SIM_MODEL.into();
        job.request = request.clone();
        env.assign(worker, &job, 1).await;
        let fin: FinalResult = wait_for("the final result", WAIT, || async {
            results
                .lock()
                .unwrap()
                .iter()
                .find(|m| m.subject.contains(id) && m.subject.ends_with(".final"))
                .map(|m| serde_json::from_slice(&m.payload).unwrap())
        })
        .await;
        assert_eq!(fin.error, None, "{fin:?}");
        let assembled = fin.response.unwrap();
        let direct: serde_json::Value = http
            .post(format!("http://{sim}{}", endpoint.path()))
            .json(&request)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let (a, d) = (&assembled["choices"][0], &direct["choices"][0]);
        assert!(!d["logprobs"].is_null(), "{direct}");
        assert_eq!(a["logprobs"], d["logprobs"], "{endpoint:?}");
        assert_eq!(a["message"], d["message"]);
        assert_eq!(a["text"], d["text"]);
        assert_eq!(a["finish_reason"], d["finish_reason"]);
    }

    shutdown.cancel();
    agent.wait().await.unwrap();
    sim_stop.cancel();
}
