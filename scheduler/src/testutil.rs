//! Builders shared by the unit tests of filters and terms.

use metronome_protocol::{KvUsage, WorkerStatus};

use crate::filter::{Filter, FilterContext};
use crate::{EwmaSnapshot, JobRequest, Ledger, SchedulerConfig, WorkerLoad, WorkerView};

pub const NOW: u64 = 1_000_000;

pub fn job(model: &str) -> JobRequest {
    JobRequest {
        job_id: "job-1".into(),
        model: model.into(),
        prompt_tokens: 100,
        max_tokens: 100,
        predicted_output_tokens: 50.0,
        slo: metronome_protocol::Slo {
            ttft_ms: 2_000,
            min_tok_s: 30.0,
        },
        ttft_remaining_ms: Some(2_000.0),
        prefix: None,
    }
}

/// An idle, healthy worker serving model `m`, heard from just now, cap 4, 10 000 KV tokens
/// all free, no EWMA and no GPU figures.
pub fn worker(id: &str) -> WorkerView {
    WorkerView {
        status: WorkerStatus {
            v: 1,
            worker_id: id.into(),
            model: "m".into(),
            node: None,
            gpu_index: None,
            healthy: true,
            draining: false,
            max_concurrency: 4,
            active: 0,
            queued: 0,
            in_flight: Vec::new(),
            kv: Some(KvUsage {
                used_frac: 0.0,
                capacity_tokens: Some(10_000),
            }),
            gpu: None,
            prefill_pending_tokens: 0,
            perf: None,
            decoding: None,
            seq: 1,
            sent_ms: NOW,
            max_epoch: 0,
        },
        last_seen_ms: NOW,
        ewma: None,
        not_provisioned: None,
    }
}

pub fn ewma(ttft_ms: f64, tpot_ms: f64) -> EwmaSnapshot {
    EwmaSnapshot {
        ttft_ms,
        tpot_ms,
        tok_s: 1000.0 / tpot_ms,
        e2e_ms: ttft_ms + 100.0 * tpot_ms,
        samples: 10,
        updated_ms: NOW,
    }
}

/// Run one filter against a worker with the given ledger and config.
pub fn check(
    f: &dyn Filter,
    job: &JobRequest,
    view: &WorkerView,
    ledger: &Ledger,
    config: &SchedulerConfig,
) -> Result<(), String> {
    let load = WorkerLoad::of(view, ledger, config);
    f.check(&FilterContext {
        job,
        view,
        load: &load,
        ledger,
        forecast: &std::cell::OnceCell::new(),
        config,
        now_ms: NOW,
    })
}

/// `check` with an empty ledger and the default config.
pub fn check_default(f: &dyn Filter, job: &JobRequest, view: &WorkerView) -> Result<(), String> {
    check(f, job, view, &Ledger::new(), &SchedulerConfig::default())
}

/// Raw value of one term for a worker with the given ledger and default config.
pub fn raw(
    t: &dyn crate::term::Term,
    job: &JobRequest,
    view: &WorkerView,
    ledger: &Ledger,
) -> Option<f64> {
    let config = SchedulerConfig::default();
    let load = WorkerLoad::of(view, ledger, &config);
    let forecast = crate::forecast::Forecast::of(job, view, &load, ledger, &config);
    t.raw(&crate::term::TermContext {
        job,
        view,
        load: &load,
        forecast: &forecast,
        config: &config,
    })
}
