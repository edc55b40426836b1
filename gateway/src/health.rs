//! Liveness, readiness and the metrics endpoint.
//!
//! `/healthz` answers while the process serves HTTP. `/readyz` answers 200 only when a
//! job submitted now could be dispatched: NATS is connected, every stream of the contract
//! exists, and a dispatcher holds the leader lease; otherwise 503 with every failed check
//! named. Each check is bounded by a short timeout so a hung NATS cannot hang the probe.

use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use metronome_protocol::names::{
    LEADER_KEY, STREAM_DECISIONS, STREAM_EVENTS, STREAM_JOBS, STREAM_RESULTS, STREAM_WORK,
};
use serde_json::{json, Value};

use crate::AppState;

const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /healthz`.
pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// `GET /metrics`.
pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        state.metrics.render(),
    )
        .into_response()
}

fn check(ok: bool, detail: impl Into<String>) -> Value {
    json!({ "ok": ok, "detail": detail.into() })
}

/// `GET /readyz`.
pub async fn readyz(State(state): State<AppState>) -> Response {
    let connected = state.client.connection_state() == async_nats::connection::State::Connected;
    let nats = check(
        connected,
        if connected {
            "connected".to_string()
        } else {
            format!("{:?}", state.client.connection_state())
        },
    );
    let (streams, leader) = if connected {
        (streams_check(&state).await, leader_check(&state).await)
    } else {
        let skipped = || check(false, "skipped: NATS is not connected");
        (skipped(), skipped())
    };
    let ready = [&nats, &streams, &leader]
        .iter()
        .all(|c| c["ok"] == Value::Bool(true));
    let failed: Vec<&str> = [("nats", &nats), ("streams", &streams), ("leader", &leader)]
        .iter()
        .filter(|(_, c)| c["ok"] != Value::Bool(true))
        .map(|(name, _)| *name)
        .collect();
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "failed": failed,
        "checks": { "nats": nats, "streams": streams, "leader": leader },
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn streams_check(state: &AppState) -> Value {
    let mut missing = Vec::new();
    for name in [
        STREAM_JOBS,
        STREAM_WORK,
        STREAM_DECISIONS,
        STREAM_RESULTS,
        STREAM_EVENTS,
    ] {
        match tokio::time::timeout(CHECK_TIMEOUT, state.js.get_stream(name)).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => missing.push(format!("{name}: {error}")),
            Err(_) => missing.push(format!("{name}: no answer within {CHECK_TIMEOUT:?}")),
        }
    }
    if missing.is_empty() {
        check(true, "all streams present")
    } else {
        check(false, missing.join("; "))
    }
}

async fn leader_check(state: &AppState) -> Value {
    match tokio::time::timeout(CHECK_TIMEOUT, state.buckets.leader.get(LEADER_KEY)).await {
        Ok(Ok(Some(value))) if !value.is_empty() => check(true, "a dispatcher holds the lease"),
        Ok(Ok(_)) => check(false, "no dispatcher holds the leader lease"),
        Ok(Err(error)) => check(false, format!("cannot read the leader lease: {error}")),
        Err(_) => check(false, format!("no answer within {CHECK_TIMEOUT:?}")),
    }
}
