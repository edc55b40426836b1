//! The tenant of a job is the one its subject names (`jobs.submit.<tenant>`, which the
//! server's permissions give only to that tenant's clients), never a claim in its body:
//! a body naming another tenant is refused (`tenant_mismatch`), and the refusal goes to the
//! subject's tenant only. A job on the version-1 `jobs.submit`, or of schema version 1 or
//! 2, is refused with `unsupported_version` and a reason naming this version's subjects.
//! Against a real nats-server.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;

use common::*;
use metronome_protocol::{names, Decision, ErrorCode, FinalResult, Outcome};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subject_names_the_tenant_and_the_body_cannot_claim_another() {
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("tenant-subject")).await;
    env.workers("t", 1, "model-t", 8).await;
    metronome_testkit::wait_for("worker registered", WAIT, || async {
        (running.metrics.workers_known.load(Relaxed) == 1).then_some(())
    })
    .await;
    let acme = names::submit_subject(Some("acme"));
    let body = |id: &str| job_json(id, "model-t", 10, 10);

    // No tenant in the body: the subject's.
    env.submit_on(
        &acme,
        "t-plain",
        serde_json::to_vec(&body("t-plain")).unwrap(),
    )
    .await;
    // The same tenant in both: fine.
    let mut same = body("t-same");
    same["tenant"] = json!("acme");
    env.submit_on(&acme, "t-same", serde_json::to_vec(&same).unwrap())
        .await;
    // Another tenant in the body: refused.
    let mut forged = body("t-forged");
    forged["tenant"] = json!("other");
    env.submit_on(&acme, "t-forged", serde_json::to_vec(&forged).unwrap())
        .await;
    // The version-1 subject, and a version-1 job on the right subject.
    env.submit_on(
        names::SUBJECT_JOBS_SUBMIT_V1,
        "t-v1-subject",
        serde_json::to_vec(&body("t-v1-subject")).unwrap(),
    )
    .await;
    let mut old = body("t-v1-body");
    old["v"] = json!(1);
    env.submit_on(&acme, "t-v1-body", serde_json::to_vec(&old).unwrap())
        .await;
    // A version-2 job: its client would read results without their publisher and cancel on
    // `cancel.<job_id>`, so it is told what changed rather than served.
    let mut v2 = body("t-v2-body");
    v2["v"] = json!(2);
    env.submit_on(&acme, "t-v2-body", serde_json::to_vec(&v2).unwrap())
        .await;

    for id in ["t-plain", "t-same"] {
        let d: Decision = env
            .stored(
                names::STREAM_DECISIONS,
                names::decision_subject(Some("acme"), id),
            )
            .await;
        assert_eq!(d.outcome, Outcome::Assigned, "{id}: {d:?}");
        assert_eq!(d.tenant.as_deref(), Some("acme"), "{id}");
    }

    let d: Decision = env
        .stored(
            names::STREAM_DECISIONS,
            names::decision_subject(Some("acme"), "t-forged"),
        )
        .await;
    assert_eq!(d.outcome, Outcome::Rejected);
    assert_eq!(d.reason_code.as_deref(), Some("tenant_mismatch"), "{d:?}");
    assert_eq!(d.tenant.as_deref(), Some("acme"));
    let f: FinalResult = env
        .stored(
            names::STREAM_RESULTS,
            names::dispatcher_final_subject(Some("acme"), "t-forged"),
        )
        .await;
    assert_eq!(f.error.expect("an error").code, ErrorCode::InvalidJob);
    // Nothing was told to, or charged to, the tenant the body named.
    let others = env.all_decisions().await;
    assert!(
        others.iter().all(|d| d.tenant.as_deref() != Some("other")),
        "{others:?}"
    );

    let d: Decision = env
        .stored(
            names::STREAM_DECISIONS,
            names::decision_subject(None, "t-v1-subject"),
        )
        .await;
    assert_eq!(d.outcome, Outcome::Rejected);
    assert_eq!(d.reason_code.as_deref(), Some("unsupported_version"));
    assert!(
        d.reason
            .as_deref()
            .unwrap_or("")
            .contains("jobs.submit.<tenant>"),
        "{d:?}"
    );
    let d: Decision = env
        .stored(
            names::STREAM_DECISIONS,
            names::decision_subject(Some("acme"), "t-v1-body"),
        )
        .await;
    assert_eq!(d.reason_code.as_deref(), Some("unsupported_version"));
    let d: Decision = env
        .stored(
            names::STREAM_DECISIONS,
            names::decision_subject(Some("acme"), "t-v2-body"),
        )
        .await;
    assert_eq!(d.reason_code.as_deref(), Some("unsupported_version"));
    let reason = d.reason.unwrap_or_default();
    for named in [
        "results.<tenant>.<job_id>.<worker_id>.chunk|final",
        "cancel.<tenant>.<job_id>",
    ] {
        assert!(reason.contains(named), "{named} in {reason}");
    }
    let f: FinalResult = env
        .stored(
            names::STREAM_RESULTS,
            names::dispatcher_final_subject(Some("acme"), "t-v2-body"),
        )
        .await;
    assert_eq!(f.error.expect("an error").code, ErrorCode::InvalidJob);
    token.cancel();
}
