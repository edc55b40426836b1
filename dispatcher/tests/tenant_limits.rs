//! A tenant's limits hold for jobs submitted straight over NATS: the leader charges every
//! first attempt its input (the body's, whatever `prompt_tokens` it declares) and its
//! `max_tokens`, and rejects what is over with a decision and a 429-class final. Other
//! tenants are not charged. Against a real nats-server.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_protocol::{names, Decision, ErrorCode, FinalResult, Outcome};
use metronome_scheduler::rate_limit::RateLimits;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_nats_client_is_held_to_its_tenants_token_limit() {
    let env = Env::start().await;
    let mut config = env.config("tenant-limits");
    config.tenant_limits = [(
        "frugal".to_string(),
        RateLimits {
            tokens_per_minute: Some(200),
            ..RateLimits::default()
        },
    )]
    .into();
    let (running, _token) = env.dispatcher(config).await;
    env.workers("t", 1, "model-t", 8).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    let submit = |tenant: &'static str, id: &'static str, text_chars: usize| {
        let mut body = job_json(id, "model-t", 1, 10);
        // Declares one input token; the body holds text_chars / 4.
        body["request"]["messages"][0]["content"] = json!("x".repeat(text_chars));
        let env = &env;
        async move {
            env.submit_on(
                &names::submit_subject(Some(tenant)),
                id,
                serde_json::to_vec(&body).unwrap(),
            )
            .await
        }
    };
    // 1,000 characters: 257 tokens of input, over 200 a minute whatever was declared.
    submit("frugal", "l-big", 1_000).await;
    submit("frugal", "l-small", 40).await;
    submit("acme", "l-other", 1_000).await;

    let d: Decision = env
        .stored(
            names::STREAM_DECISIONS,
            names::decision_subject(Some("frugal"), "l-big"),
        )
        .await;
    assert_eq!(d.outcome, Outcome::Rejected, "{d:?}");
    assert_eq!(d.reason_code.as_deref(), Some("request_too_large"), "{d:?}");
    let f: FinalResult = env
        .stored(
            names::STREAM_RESULTS,
            names::dispatcher_final_subject(Some("frugal"), "l-big"),
        )
        .await;
    assert_eq!(f.error.expect("an error").code, ErrorCode::QueueFull);
    for (tenant, id) in [("frugal", "l-small"), ("acme", "l-other")] {
        let d: Decision = env
            .stored(
                names::STREAM_DECISIONS,
                names::decision_subject(Some(tenant), id),
            )
            .await;
        assert_eq!(d.outcome, Outcome::Assigned, "{id}: {d:?}");
    }
    assert_eq!(running.metrics.tenant_limited_jobs_total.load(Relaxed), 1);
}
