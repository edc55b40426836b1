//! The open-loop runner: sends each planned request at its planned time, whatever is still
//! outstanding, and collects the records.
//!
//! Open loop is what makes latency numbers honest: a closed loop (next request after the
//! previous one finishes) slows down with the server and hides its queueing. Invariants:
//! - a request is never delayed because others are outstanding; if `max_in_flight` are
//!   outstanding at its arrival it is *dropped* and recorded as an error of kind `dropped`;
//! - every planned request yields exactly one record (sent, dropped, cut off or cancelled),
//!   so counts always add up;
//! - the run is bounded: after the last arrival, outstanding requests get
//!   `drain_timeout_s`, then are cut off and recorded as `timeout`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

use crate::client::{Client, Stops};
use crate::error::LoadError;
use crate::plan::plan_requests;
use crate::record::{ErrorKind, RequestRecord};
use crate::request::PlannedRequest;
use crate::spec::LoadSpec;
use crate::stats;
use crate::summary::{summarize, Summary};

/// Everything a run produced.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    pub spec: LoadSpec,
    /// Wall-clock start, milliseconds since the Unix epoch.
    pub started_unix_ms: u64,
    /// One record per planned request, in id order.
    pub records: Vec<RequestRecord>,
    pub summary: Summary,
    /// True when the run was cancelled before its end.
    pub cancelled: bool,
}

/// Plans and runs a spec to its end.
pub async fn run_load(spec: LoadSpec, progress: bool) -> Result<RunResult, LoadError> {
    run_load_until(spec, progress, CancellationToken::new()).await
}

/// The entry point shared by every Metronome component: run `config` until its end or
/// until `shutdown` is cancelled, without progress lines.
pub async fn run(
    config: crate::Config,
    shutdown: CancellationToken,
) -> Result<RunResult, LoadError> {
    run_load_until(config, false, shutdown).await
}

/// Plans and runs a spec; `cancel` stops it early (outstanding requests are recorded as
/// `cancelled` and the partial result is returned).
pub async fn run_load_until(
    spec: LoadSpec,
    progress: bool,
    cancel: CancellationToken,
) -> Result<RunResult, LoadError> {
    let plan = plan_requests(&spec)?;
    run_plan(spec, plan, progress, cancel).await
}

/// Live counters shared with the request tasks and the progress printer.
#[derive(Default)]
struct Counters {
    sent: AtomicUsize,
    done: AtomicUsize,
    errors: AtomicUsize,
    in_flight: AtomicUsize,
    /// TTFTs (ms) completed since the last progress line; only collected when progress
    /// lines are printed (the printer drains it).
    recent_ttft: Mutex<Vec<f64>>,
    track_ttft: bool,
}

/// Runs an explicit plan (e.g. a burst: every `at_s` = 0) with the spec's endpoint and
/// limits. The spec's workload is not consulted.
pub async fn run_plan(
    spec: LoadSpec,
    plan: Vec<PlannedRequest>,
    progress: bool,
    cancel: CancellationToken,
) -> Result<RunResult, LoadError> {
    let client = Client::new(&spec)?;
    let stops = Stops {
        cancel: cancel.clone(),
        cutoff: CancellationToken::new(),
    };
    let counters = Arc::new(Counters {
        track_ttft: progress,
        ..Counters::default()
    });
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let start = Instant::now();
    let total = plan.len();
    let progress_done = CancellationToken::new();
    let printer = progress.then(|| {
        tokio::spawn(print_progress(
            counters.clone(),
            start,
            total,
            Duration::from_secs_f64(spec.progress_interval_s),
            progress_done.clone(),
        ))
    });

    let mut records: Vec<RequestRecord> = Vec::with_capacity(total);
    let mut tasks: JoinSet<RequestRecord> = JoinSet::new();
    let collect = |res: Result<RequestRecord, tokio::task::JoinError>,
                   records: &mut Vec<RequestRecord>| match res {
        Ok(r) => records.push(r),
        Err(e) => tracing::error!(error = %e, "request task failed"),
    };
    let mut cancelled = false;
    let mut plan_iter = plan.into_iter();
    'arrivals: for req in plan_iter.by_ref() {
        let at = start + Duration::from_secs_f64(req.at_s.max(0.0));
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    cancelled = true;
                    records.push(not_sent(&spec, &req, start, ErrorKind::Cancelled, "run cancelled before its arrival time"));
                    break 'arrivals;
                }
                () = sleep_until(at) => break,
                Some(res) = tasks.join_next(), if !tasks.is_empty() => collect(res, &mut records),
            }
        }
        if counters.in_flight.load(Ordering::SeqCst) >= spec.max_in_flight {
            counters.errors.fetch_add(1, Ordering::Relaxed);
            counters.done.fetch_add(1, Ordering::Relaxed);
            records.push(not_sent(
                &spec,
                &req,
                start,
                ErrorKind::Dropped,
                &format!(
                    "dropped: {} requests in flight (max_in_flight)",
                    spec.max_in_flight
                ),
            ));
            continue;
        }
        counters.in_flight.fetch_add(1, Ordering::SeqCst);
        counters.sent.fetch_add(1, Ordering::Relaxed);
        let (client, stops, counters) = (client.clone(), stops.clone(), counters.clone());
        tasks.spawn(async move {
            let rec = client.send(&req, start, &stops).await;
            counters.in_flight.fetch_sub(1, Ordering::SeqCst);
            counters.done.fetch_add(1, Ordering::Relaxed);
            if rec.ok {
                if let (Some(t), true) = (rec.ttft_ms, counters.track_ttft) {
                    counters.recent_ttft.lock().expect("ttft lock").push(t);
                }
            } else {
                counters.errors.fetch_add(1, Ordering::Relaxed);
            }
            rec
        });
    }
    for req in plan_iter {
        records.push(not_sent(
            &spec,
            &req,
            start,
            ErrorKind::Cancelled,
            "run cancelled before its arrival time",
        ));
    }

    // Drain: bounded by drain_timeout_s, then the cutoff ends every outstanding request
    // (each still yields its record).
    let drain_deadline = Instant::now() + Duration::from_secs_f64(spec.drain_timeout_s);
    while !tasks.is_empty() {
        tokio::select! {
            Some(res) = tasks.join_next() => collect(res, &mut records),
            () = sleep_until(drain_deadline), if !stops.cutoff.is_cancelled() => {
                tracing::warn!(outstanding = tasks.len(), "drain timeout reached, cutting off outstanding requests");
                stops.cutoff.cancel();
            }
        }
    }
    cancelled |= cancel.is_cancelled();
    progress_done.cancel();
    if let Some(p) = printer {
        let _ = p.await;
    }
    records.sort_by_key(|r| r.id);
    let summary = summarize(&records, spec.slo);
    Ok(RunResult {
        spec,
        started_unix_ms,
        records,
        summary,
        cancelled,
    })
}

fn not_sent(
    spec: &LoadSpec,
    req: &PlannedRequest,
    start: Instant,
    kind: ErrorKind,
    why: &str,
) -> RequestRecord {
    RequestRecord {
        id: req.id,
        tenant: req
            .tenant
            .and_then(|i| spec.tenants.get(i))
            .map(|t| t.name.clone()),
        scheduled_s: req.at_s,
        sent_s: (Instant::now() - start).as_secs_f64(),
        prompt_tokens: req.prompt_tokens,
        max_tokens: req.output_tokens,
        ok: false,
        error_kind: Some(kind),
        error: Some(why.to_string()),
        ..Default::default()
    }
}

async fn print_progress(
    c: Arc<Counters>,
    start: Instant,
    total: usize,
    every: Duration,
    done: CancellationToken,
) {
    let mut tick = tokio::time::interval_at(start + every, every);
    loop {
        tokio::select! {
            () = done.cancelled() => return,
            _ = tick.tick() => {}
        }
        let recent: Vec<f64> = std::mem::take(&mut *c.recent_ttft.lock().expect("ttft lock"));
        let p50 = stats::percentile(&recent, 50.0)
            .map(|v| format!("{v:.0} ms"))
            .unwrap_or_else(|| "-".into());
        eprintln!(
            "[{:>7.1}s] sent {}/{}  done {}  errors {}  in flight {}  p50 TTFT {} (last {:.0} s)",
            start.elapsed().as_secs_f64(),
            c.sent.load(Ordering::Relaxed),
            total,
            c.done.load(Ordering::Relaxed),
            c.errors.load(Ordering::Relaxed),
            c.in_flight.load(Ordering::Relaxed),
            p50,
            every.as_secs_f64(),
        );
    }
}
