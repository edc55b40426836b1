//! The worker's performance model end to end, on a real nats-server and redis-server: an
//! agent in front of the bundled GPU simulator fits it from its jobs, heartbeats its
//! coefficients and persists it in Redis; a restarted agent resumes it; a garbage value
//! under its key does not stop an agent; a streaming job shows in the heartbeat with its
//! decode rate. No assertion depends on timings.

use crate::common;

use common::{collect, Env, WAIT};
use metronome_gpu_sim::{spawn_gpu, SimGpuConfig};
use metronome_protocol::names::{event_done_subject, heartbeat_subject};
use metronome_protocol::redis_keys::{perf_key, DEFAULT_PREFIX};
use metronome_protocol::{CompletionEvent, CompletionOutcome, Endpoint, WorkerStatus};
use metronome_scheduler::perf::{PerfModel, PerfPrior};
use metronome_testkit::wait_for;
use metronome_worker_agent::{Config, ServerKind};
use redis::AsyncCommands;
use tokio_util::sync::CancellationToken;

const SIM_MODEL: &str = "sim/llama-3.1-8b";

/// A simulated GPU taking `base_step_ms` a decode step, never ending a reply early.
async fn start_sim(stop: &CancellationToken, base_step_ms: f64) -> std::net::SocketAddr {
    spawn_gpu(
        SimGpuConfig {
            base_step_ms,
            eos_probability: 0.0,
            ..SimGpuConfig::new(SIM_MODEL)
        },
        stop.clone(),
    )
    .await
    .expect("simulated GPU")
}

fn sim_config(env: &Env, worker: &str, sim: std::net::SocketAddr) -> Config {
    let mut config = env.config(worker);
    config.model = SIM_MODEL.into();
    config.model_server_url = format!("http://{sim}");
    config.model_server_kind = ServerKind::Simulator;
    config
}

fn sim_job(id: &str, max_tokens: u32) -> metronome_protocol::Job {
    let mut job = common::job(id, Endpoint::Chat, max_tokens, 0);
    job.model = SIM_MODEL.into();
    job.request["model"] = SIM_MODEL.into();
    job
}

async fn stored_model(
    redis: &mut redis::aio::MultiplexedConnection,
    worker: &str,
) -> Option<PerfModel> {
    let raw: Option<String> = redis.get(perf_key(DEFAULT_PREFIX, worker)).await.ok()?;
    serde_json::from_str(&raw?).ok()
}

async fn latest_status(env: &Env, worker: &str) -> Option<WorkerStatus> {
    serde_json::from_slice(&env.buckets.workers.get(worker).await.ok()??).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_worker_fits_heartbeats_and_persists_its_model_and_a_restart_resumes_it() {
    const JOBS: u64 = 6;
    let env = Env::start().await;
    let sim_stop = CancellationToken::new();
    let sim = start_sim(&sim_stop, 1.0).await;
    let worker = "perf-gpu0";
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(sim_config(&env, worker, sim)).await;
    let first = wait_for("the first heartbeat", WAIT, || latest_status(&env, worker)).await;
    assert_eq!(
        first.perf,
        Some(PerfPrior::default().coefficients()),
        "a worker with no stored model starts from the prior"
    );

    // Jobs of different lengths, assigned together so they overlap on the simulator.
    for i in 0..JOBS {
        env.assign(worker, &sim_job(&format!("perf-{i}"), 4 + 6 * i as u32), 1)
            .await;
    }
    let done = wait_for("every completion event", WAIT, || async {
        let evs: Vec<CompletionEvent> = events
            .lock()
            .unwrap()
            .iter()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
            .collect();
        (evs.len() as u64 == JOBS).then_some(evs)
    })
    .await;
    assert!(
        done.iter().all(|e| e.outcome == CompletionOutcome::Done),
        "{done:?}"
    );

    let status = wait_for("a heartbeat with the fitted model", WAIT, || async {
        latest_status(&env, worker)
            .await
            .filter(|s| s.perf.is_some_and(|p| p.samples == JOBS))
    })
    .await;
    assert_eq!(
        status.prefill_pending_tokens, 0,
        "nothing waits for its prefill"
    );
    let coefficients = status.perf.unwrap();
    assert!(coefficients.step_base_ms > 0.0);

    let redis = redis::Client::open(env.redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let stored = wait_for("the model in Redis", WAIT, || async {
        stored_model(&mut redis.clone(), worker)
            .await
            .filter(|m| m.samples() == JOBS)
    })
    .await;
    assert_eq!(stored.coefficients().samples, JOBS);
    assert_eq!(
        (stored.decode.samples, stored.prefill.samples),
        (JOBS, JOBS),
        "every job streamed several tokens: both fits saw it"
    );
    assert_eq!(
        Env::agent_metrics(&agent)
            .await
            .lines()
            .find(|l| l.starts_with("metronome_worker_perf_samples_total"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok()),
        Some(JOBS)
    );
    shutdown.cancel();
    agent.wait().await.unwrap();

    // The same worker on the same Redis: its very first heartbeat carries the model.
    let beats = collect(
        env.client
            .subscribe(heartbeat_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(sim_config(&env, worker, sim)).await;
    let first: WorkerStatus = wait_for("the restarted agent's first heartbeat", WAIT, || async {
        beats
            .lock()
            .unwrap()
            .first()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
    })
    .await;
    let resumed = first.perf.expect("coefficients in the first heartbeat");
    assert_eq!(resumed.samples, JOBS, "{resumed:?}");
    assert_eq!(first.prefill_pending_tokens, 0);
    shutdown.cancel();
    agent.wait().await.unwrap();
    sim_stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_under_the_perf_key_does_not_stop_the_agent_it_starts_from_the_prior() {
    let env = Env::start().await;
    let worker = "perf-gpu1";
    let mut redis = redis::Client::open(env.redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis
        .set(perf_key(DEFAULT_PREFIX, worker), "{not a model")
        .await
        .unwrap();
    let prior = PerfPrior {
        step_base_ms: 33.0,
        ttft_base_ms: 70.0,
        ..PerfPrior::default()
    };
    let mut config = env.config(worker);
    config.perf_prior = Some(prior);
    let beats = collect(
        env.client
            .subscribe(heartbeat_subject(worker))
            .await
            .unwrap(),
    );
    let events = collect(
        env.client
            .subscribe(event_done_subject(worker))
            .await
            .unwrap(),
    );
    env.client.flush().await.unwrap();
    let (agent, shutdown) = env.start_agent(config).await;
    let first: WorkerStatus = wait_for("the first heartbeat", WAIT, || async {
        beats
            .lock()
            .unwrap()
            .first()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
    })
    .await;
    assert_eq!(
        first.perf,
        Some(prior.coefficients()),
        "the configured prior"
    );

    // It runs jobs, and its first update replaces the garbage with a model.
    env.assign(
        worker,
        &common::job("perf-after-garbage", Endpoint::Chat, 5, 0),
        1,
    )
    .await;
    let ev: CompletionEvent = wait_for("the completion event", WAIT, || async {
        events
            .lock()
            .unwrap()
            .first()
            .map(|m| serde_json::from_slice(&m.payload).unwrap())
    })
    .await;
    assert_eq!(ev.outcome, CompletionOutcome::Done);
    let stored = wait_for("a model in Redis", WAIT, || async {
        stored_model(&mut redis.clone(), worker).await
    })
    .await;
    assert_eq!(stored.samples(), 1);
    shutdown.cancel();
    agent.wait().await.unwrap();
}

/// While a job streams, the heartbeat shows it decoding and, once it has written 16 tokens
/// past its first, its rate: the live evidence a new worker's warm-up allowance counts
/// (docs/ADMISSION.md). When it has finished, the heartbeat shows nothing decoding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_job_shows_in_the_heartbeat_with_its_decode_rate() {
    let env = Env::start().await;
    let sim_stop = CancellationToken::new();
    // 10 ms a step: a 300-token reply streams for about 3 s, many heartbeats long.
    let sim = start_sim(&sim_stop, 10.0).await;
    let worker = "live-gpu0";
    let (agent, shutdown) = env.start_agent(sim_config(&env, worker, sim)).await;
    let idle = wait_for("the first heartbeat", WAIT, || latest_status(&env, worker)).await;
    assert_eq!(idle.decoding, None, "nothing decodes yet");
    env.assign(worker, &sim_job("live-0", 300), 1).await;
    let status = wait_for("a heartbeat measuring the stream", WAIT, || async {
        latest_status(&env, worker)
            .await
            .filter(|s| s.decoding.is_some_and(|d| d.measured == 1))
    })
    .await;
    let live = status.decoding.unwrap();
    assert_eq!(live.streams, 1);
    assert!(
        live.slowest_tok_s > 0.0 && live.slowest_tok_s.is_finite(),
        "{live:?}"
    );
    wait_for("a heartbeat with nothing decoding", WAIT, || async {
        latest_status(&env, worker)
            .await
            .filter(|s| s.perf.is_some_and(|p| p.samples == 1) && s.decoding.is_none())
    })
    .await;
    shutdown.cancel();
    agent.wait().await.unwrap();
    sim_stop.cancel();
}
