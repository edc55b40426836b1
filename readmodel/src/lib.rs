//! The system as operators read it, over the documented NATS contract (docs/PROTOCOL.md)
//! and Redis for the EWMAs: who leads, which workers are up and how loaded, what was
//! decided, and the story of any one job. The `metronome` CLI prints it and the gateway's
//! console serves it, from this one crate, so the two can never disagree.
//!
//! Layout: [`source`] does every read; [`explain`], [`decisions`], [`workers`] and
//! [`status`] are pure views with tests on fixed inputs (each with its table or text
//! rendering, [`fmt`]); [`story`], [`status_report`] and [`worker_views`] read what a view
//! needs and build it.

pub mod decisions;
pub mod error;
pub mod explain;
pub mod fmt;
pub mod source;
pub mod status;
pub mod workers;

use metronome_protocol::{names, time::unix_ms, Outcome};

pub use error::ReadError;
use source::Nats;

/// Every record of one job (its decisions, the completion events of its last attempt, its
/// final result), read for `explain` and the gateway's console; [`ReadError::NotFound`] for
/// an unknown id.
pub async fn story(nats: &Nats, job_id: &str, scan: usize) -> Result<explain::Story, ReadError> {
    if !names::is_subject_token(job_id) {
        return Err(ReadError::Usage(format!(
            "{job_id:?} is not a job id (letters, digits, '-' and '_' only)"
        )));
    }
    let decisions = nats.decisions_of(job_id).await?;
    if decisions.is_empty() {
        return Err(ReadError::NotFound(format!(
            "no decision recorded for job {job_id}: unknown id, not decided yet, or older than the DECISIONS stream keeps (24 h)"
        )));
    }
    let last = decisions.last().cloned().expect("not empty");
    let completions = if last.outcome == Outcome::Assigned {
        // Every worker this job was assigned to, across attempts.
        let mut winners: Vec<&str> = decisions
            .iter()
            .filter_map(|d| d.worker_id.as_deref())
            .collect();
        winners.dedup();
        let worker = if winners.len() == 1 {
            Some(winners[0])
        } else {
            None
        };
        let since = decisions[0].decided_ms.saturating_sub(5_000);
        nats.completions_of(job_id, worker, since, scan, |e| {
            e.attempt == last.attempt && e.outcome != metronome_protocol::CompletionOutcome::Refused
        })
        .await?
    } else {
        Vec::new()
    };
    // The stored final result readers accept: the leader's, or that of the worker the
    // latest assigned decision names, whichever was stored first (forgeries never count).
    let assigned = decisions
        .iter()
        .rev()
        .find(|d| d.outcome == Outcome::Assigned && d.worker_id.is_some())
        .and_then(|d| d.worker_id.as_deref());
    let result = nats.final_result(job_id, assigned).await?;
    Ok(explain::Story {
        job_id: job_id.to_string(),
        decisions,
        completions,
        result,
    })
}

/// What `status` shows, as data (also the gateway console's header and model table).
pub async fn status_report(
    nats: &Nats,
    window_s: u64,
    stale_after_ms: u64,
    now: u64,
) -> Result<status::Report, ReadError> {
    let leader = nats.leader().await?;
    let jobs_waiting = nats.jobs_waiting().await?;
    let recent: Vec<status::Brief> = nats
        .decisions_since(now.saturating_sub(window_s * 1000), 200_000)
        .await?;
    let (views, _) = worker_views(nats, stale_after_ms, None, &Default::default(), "").await?;
    let (queues, _unreadable) = nats.queues().await?;
    Ok(status::Report::from_parts(
        leader,
        jobs_waiting,
        &recent,
        window_s,
        now,
        workers::counts(&views),
        queues,
    ))
}

/// The workers with their state, and their EWMAs when `redis_url` is given. A Redis
/// failure is not fatal: the table still shows, with a warning returned beside it.
pub async fn worker_views(
    nats: &Nats,
    stale_after_ms: u64,
    redis_url: Option<&str>,
    redis_tls: &metronome_runtime::redis::RedisTls,
    redis_prefix: &str,
) -> Result<(Vec<workers::WorkerView>, Option<String>), ReadError> {
    let (raw, unreadable) = nats.workers(unix_ms()).await?;
    let mut views: Vec<workers::WorkerView> = raw
        .into_iter()
        .map(|(s, age)| workers::WorkerView::new(s, age, stale_after_ms))
        .collect();
    let mut warning = (unreadable > 0)
        .then(|| format!("{unreadable} entries of the workers bucket could not be read"));
    if let Some(url) = redis_url {
        let ids: Vec<String> = views.iter().map(|v| v.status.worker_id.clone()).collect();
        match source::ewmas(url, redis_tls, redis_prefix, &ids).await {
            Ok(map) => {
                for v in &mut views {
                    v.ewma = map.get(&v.status.worker_id).copied();
                }
            }
            Err(e) => warning = Some(format!("{e}; EWMA columns left n/a")),
        }
    }
    Ok((views, warning))
}
