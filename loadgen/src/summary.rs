//! The run summary: distribution figures of every measure, error counts, and goodput.
//!
//! `summarize` is pure. Figures over successful requests only (a failed request has no
//! meaningful latency); counts include every planned request, dropped ones too.
//! Percentiles are nearest-rank (see [`crate::stats`]); CV is population stddev / mean.
//!
//! **Goodput** is the share of *all* requests (failed and dropped ones count as misses)
//! that succeeded with TTFT <= `slo.ttft_ms` and tokens/s >= `slo.tok_s`; a request without
//! a tokens/s figure (a single output token) meets the rate part when `slo.tok_s` is 0 only.
//! `goodput_rps` is the number of such requests divided by the run's duration.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::record::RequestRecord;
use crate::spec::Slo;
use crate::stats;

/// A p99 send lag above this is flagged in the table.
const SEND_LAG_WARN_MS: f64 = 50.0;

/// Distribution of one measure.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct Dist {
    /// Number of samples.
    pub n: usize,
    pub mean: Option<f64>,
    pub min: Option<f64>,
    pub p1: Option<f64>,
    pub p5: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub p99_9: Option<f64>,
    pub max: Option<f64>,
    /// Coefficient of variation (population stddev / mean).
    pub cv: Option<f64>,
}

impl Dist {
    pub fn of(samples: &[f64]) -> Dist {
        let s = stats::sorted_finite(samples);
        let p = |q| stats::percentile_sorted(&s, q);
        Dist {
            n: s.len(),
            mean: stats::mean(&s),
            min: s.first().copied(),
            p1: p(1.0),
            p5: p(5.0),
            p50: p(50.0),
            p90: p(90.0),
            p99: p(99.0),
            p99_9: p(99.9),
            max: s.last().copied(),
            cv: stats::coefficient_of_variation(&s),
        }
    }
}

/// Everything `summary.json` holds about a run's requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Summary {
    /// Requests planned (sent, dropped, or cancelled before being sent).
    pub count: usize,
    pub ok: usize,
    pub errors: usize,
    /// Errors by kind (`http`, `connect`, `timeout`, `stream`, `dropped`, `cancelled`).
    pub errors_by_kind: BTreeMap<String, usize>,
    /// Errors by HTTP status, for `http` errors.
    pub errors_by_status: BTreeMap<String, usize>,
    /// From the first send to the last completion, seconds.
    pub duration_s: f64,
    /// Requests sent per second over the send window (first to last send).
    pub offered_rate_rps: f64,
    /// Successful requests per second over `duration_s`.
    pub achieved_rate_rps: f64,
    /// Output tokens of successful requests per second over `duration_s`.
    pub output_tokens_per_s: f64,
    pub ttft_ms: Dist,
    pub tpot_ms: Dist,
    pub e2e_ms: Dist,
    /// Per-request tokens/s (see [`crate::record`] for the definition).
    pub tokens_per_s: Dist,
    /// Scheduler lateness `sent_s - scheduled_s` in ms: large values mean the load
    /// generator itself could not keep up and the offered load was lower than planned.
    pub send_lag_ms: Dist,
    pub slo: Slo,
    /// Requests meeting the SLO.
    pub good: usize,
    /// `good / count`.
    pub goodput_share: f64,
    /// `good / duration_s`.
    pub goodput_rps: f64,
    /// Per serving worker (the `x-metronome-worker` response header), when servers send it:
    /// shows which GPU a slow tail came from.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_worker: BTreeMap<String, WorkerSummary>,
    /// Per tenant of the spec (`[[tenants]]`), each summarised as a run of its own: one
    /// tenant's tail is not hidden in the mix.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_tenant: BTreeMap<String, Summary>,
}

/// The figures of the requests one worker served.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct WorkerSummary {
    pub count: usize,
    pub ok: usize,
    pub good: usize,
    pub ttft_ms: Dist,
    pub e2e_ms: Dist,
    pub tokens_per_s: Dist,
}

/// True when a request meets the SLO.
pub fn meets_slo(r: &RequestRecord, slo: &Slo) -> bool {
    if !r.ok {
        return false;
    }
    let ttft_ok = r.ttft_ms.is_some_and(|t| t <= slo.ttft_ms);
    let rate_ok = match r.tokens_per_s {
        Some(t) => t >= slo.tok_s,
        None => slo.tok_s <= 0.0,
    };
    ttft_ok && rate_ok
}

/// Summarises records (pure).
pub fn summarize(records: &[RequestRecord], slo: Slo) -> Summary {
    let mut by_tenant: BTreeMap<String, Vec<RequestRecord>> = BTreeMap::new();
    for r in records {
        if let Some(t) = &r.tenant {
            by_tenant.entry(t.clone()).or_default().push(r.clone());
        }
    }
    let mut summary = summarize_all(records, slo);
    summary.per_tenant = by_tenant
        .into_iter()
        .map(|(t, rs)| (t, summarize_all(&rs, slo)))
        .collect();
    summary
}

/// The summary of `records` taken together (no per-tenant split).
fn summarize_all(records: &[RequestRecord], slo: Slo) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
    let mut errors_by_kind = BTreeMap::new();
    let mut errors_by_status = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ok) {
        let kind = r.error_kind.map(|k| k.as_str()).unwrap_or("unknown");
        *errors_by_kind.entry(kind.to_string()).or_insert(0) += 1;
        if let Some(s) = r.status.filter(|s| !(200..300).contains(s)) {
            *errors_by_status.entry(s.to_string()).or_insert(0) += 1;
        }
    }
    // Requests actually sent have an e2e time (failed ones too); dropped requests and
    // those cancelled before their arrival time have none.
    let sent: Vec<&RequestRecord> = records.iter().filter(|r| r.e2e_ms.is_some()).collect();
    let first_send = sent.iter().map(|r| r.sent_s).fold(f64::INFINITY, f64::min);
    let last_send = sent
        .iter()
        .map(|r| r.sent_s)
        .fold(f64::NEG_INFINITY, f64::max);
    let last_end = sent
        .iter()
        .map(|r| r.sent_s + r.e2e_ms.unwrap_or(0.0) / 1000.0)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if sent.is_empty() {
        0.0
    } else {
        (last_end - first_send).max(0.0)
    };
    let per_s = |n: f64, d: f64| if d > 0.0 { n / d } else { 0.0 };
    let offered_rate_rps = if sent.len() > 1 {
        per_s((sent.len() - 1) as f64, last_send - first_send)
    } else {
        0.0
    };
    let col = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
        ok.iter().filter_map(|r| f(r)).collect()
    };
    let good = records.iter().filter(|r| meets_slo(r, &slo)).count();
    let mut by_worker: BTreeMap<String, Vec<&RequestRecord>> = BTreeMap::new();
    for r in records {
        if let Some(w) = &r.worker {
            by_worker.entry(w.clone()).or_default().push(r);
        }
    }
    let per_worker = by_worker
        .into_iter()
        .map(|(w, rs)| {
            let okc = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
                rs.iter().filter(|r| r.ok).filter_map(|r| f(r)).collect()
            };
            let summary = WorkerSummary {
                count: rs.len(),
                ok: rs.iter().filter(|r| r.ok).count(),
                good: rs.iter().filter(|r| meets_slo(r, &slo)).count(),
                ttft_ms: Dist::of(&okc(|r| r.ttft_ms)),
                e2e_ms: Dist::of(&okc(|r| r.e2e_ms)),
                tokens_per_s: Dist::of(&okc(|r| r.tokens_per_s)),
            };
            (w, summary)
        })
        .collect();
    let out_tokens: f64 = ok.iter().map(|r| f64::from(r.output_tokens)).sum();
    Summary {
        count: records.len(),
        ok: ok.len(),
        errors: records.len() - ok.len(),
        errors_by_kind,
        errors_by_status,
        duration_s,
        offered_rate_rps,
        achieved_rate_rps: per_s(ok.len() as f64, duration_s),
        output_tokens_per_s: per_s(out_tokens, duration_s),
        ttft_ms: Dist::of(&col(|r| r.ttft_ms)),
        tpot_ms: Dist::of(&col(|r| r.tpot_ms)),
        e2e_ms: Dist::of(&col(|r| r.e2e_ms)),
        tokens_per_s: Dist::of(&col(|r| r.tokens_per_s)),
        send_lag_ms: Dist::of(
            &sent
                .iter()
                .map(|r| (r.sent_s - r.scheduled_s) * 1000.0)
                .collect::<Vec<_>>(),
        ),
        slo,
        good,
        goodput_share: if records.is_empty() {
            0.0
        } else {
            good as f64 / records.len() as f64
        },
        goodput_rps: per_s(good as f64, duration_s),
        per_worker,
        per_tenant: BTreeMap::new(),
    }
}

impl Summary {
    /// A fixed-width table for terminals.
    pub fn table(&self) -> String {
        let f = |x: Option<f64>| x.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
        let mut s = String::new();
        let _ = writeln!(
            s,
            "requests {}  ok {}  errors {}{}",
            self.count,
            self.ok,
            self.errors,
            if self.errors_by_kind.is_empty() {
                String::new()
            } else {
                format!(
                    " ({})",
                    self.errors_by_kind
                        .iter()
                        .map(|(k, v)| format!("{k}: {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        let _ = writeln!(
            s,
            "duration {:.1} s  offered {:.2} req/s  achieved {:.2} req/s  output {:.0} tok/s",
            self.duration_s,
            self.offered_rate_rps,
            self.achieved_rate_rps,
            self.output_tokens_per_s
        );
        let _ = writeln!(
            s,
            "{:<16}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>8}",
            "", "p1", "p5", "p50", "p90", "p99", "p99.9", "mean", "cv"
        );
        for (name, d) in [
            ("ttft ms", &self.ttft_ms),
            ("tpot ms", &self.tpot_ms),
            ("e2e ms", &self.e2e_ms),
            ("tokens/s", &self.tokens_per_s),
        ] {
            let _ = writeln!(
                s,
                "{:<16}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>8}",
                name,
                f(d.p1),
                f(d.p5),
                f(d.p50),
                f(d.p90),
                f(d.p99),
                f(d.p99_9),
                f(d.mean),
                d.cv.map(|v| format!("{v:.3}"))
                    .unwrap_or_else(|| "-".into())
            );
        }
        if let (Some(p50), Some(p99)) = (self.send_lag_ms.p50, self.send_lag_ms.p99) {
            let _ = writeln!(
                s,
                "send lag (actual - planned send time): p50 {p50:.1} ms, p99 {p99:.1} ms{}",
                if p99 > SEND_LAG_WARN_MS {
                    "  <- the generator fell behind its plan; offered load was lower than planned"
                } else {
                    ""
                }
            );
        }
        for (w, ws) in &self.per_worker {
            let _ = writeln!(
                s,
                "worker {w}: {} requests, {} ok, {} good, tokens/s p50 {} p1 {}, e2e p99 {} ms",
                ws.count,
                ws.ok,
                ws.good,
                f(ws.tokens_per_s.p50),
                f(ws.tokens_per_s.p1),
                f(ws.e2e_ms.p99)
            );
        }
        for (t, ts) in &self.per_tenant {
            let _ = writeln!(
                s,
                "tenant {t}: {} requests, {} ok, {} good, offered {:.2} req/s, TTFT p50 {} p99 {} ms, {:.0} output tok/s",
                ts.count,
                ts.ok,
                ts.good,
                ts.offered_rate_rps,
                f(ts.ttft_ms.p50),
                f(ts.ttft_ms.p99),
                ts.output_tokens_per_s
            );
        }
        let _ = writeln!(
            s,
            "goodput (TTFT <= {} ms and >= {} tok/s): {:.1}% = {:.2} req/s",
            self.slo.ttft_ms,
            self.slo.tok_s,
            self.goodput_share * 100.0,
            self.goodput_rps
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn ok(id: u64, sent_s: f64, ttft: f64, e2e: f64, tokens: u32) -> RequestRecord {
        let mut r = RequestRecord {
            id,
            scheduled_s: sent_s,
            sent_s,
            ok: true,
            status: Some(200),
            ttft_ms: Some(ttft),
            e2e_ms: Some(e2e),
            output_tokens: tokens,
            ..Default::default()
        };
        r.derive_rates();
        r
    }

    #[test]
    fn each_tenant_is_summarised_on_its_own() {
        let tagged = |mut r: RequestRecord, t: &str| {
            r.tenant = Some(t.into());
            r
        };
        let recs = vec![
            tagged(ok(0, 0.0, 100.0, 300.0, 11), "steady"),
            tagged(ok(1, 0.5, 2000.0, 2500.0, 11), "flood"),
            tagged(ok(2, 1.0, 120.0, 320.0, 11), "steady"),
            tagged(ok(3, 1.5, 3000.0, 3500.0, 11), "flood"),
            ok(4, 2.0, 50.0, 250.0, 11),
        ];
        let s = summarize(&recs, Slo::default());
        assert_eq!(s.count, 5);
        assert_eq!(
            s.per_tenant.len(),
            2,
            "untagged requests belong to no tenant"
        );
        let steady = &s.per_tenant["steady"];
        assert_eq!((steady.count, steady.ok), (2, 2));
        assert_eq!(steady.ttft_ms.max, Some(120.0));
        assert_eq!(s.per_tenant["flood"].ttft_ms.min, Some(2000.0));
        assert!(steady.per_tenant.is_empty());
        assert!(
            s.table().contains("tenant steady: 2 requests"),
            "{}",
            s.table()
        );
    }

    #[test]
    fn counts_rates_and_goodput() {
        let recs = vec![
            // 11 tokens over 200 ms after TTFT: 55 tok/s, TTFT 100: good.
            ok(0, 0.0, 100.0, 300.0, 11),
            // 11 tokens over 1000 ms: 11 tok/s: misses the rate floor.
            ok(1, 1.0, 100.0, 1100.0, 11),
            // TTFT 3 s: misses the TTFT bound.
            ok(2, 2.0, 3000.0, 3200.0, 11),
            RequestRecord {
                id: 3,
                sent_s: 3.0,
                scheduled_s: 3.0,
                status: Some(503),
                error_kind: Some(ErrorKind::Http),
                e2e_ms: Some(5.0),
                ..Default::default()
            },
            RequestRecord {
                id: 4,
                sent_s: 3.5,
                scheduled_s: 3.5,
                error_kind: Some(ErrorKind::Dropped),
                ..Default::default()
            },
        ];
        let s = summarize(&recs, Slo::default());
        assert_eq!((s.count, s.ok, s.errors, s.good), (5, 3, 2, 1));
        assert_eq!(s.errors_by_kind.get("http"), Some(&1));
        assert_eq!(s.errors_by_kind.get("dropped"), Some(&1));
        assert_eq!(s.errors_by_status.get("503"), Some(&1));
        assert_eq!(s.goodput_share, 0.2);
        // First send 0 s, last completion 2 s + 3.2 s.
        assert!((s.duration_s - 5.2).abs() < 1e-9);
        assert!((s.goodput_rps - 1.0 / 5.2).abs() < 1e-9);
        assert!((s.offered_rate_rps - 1.0).abs() < 1e-9);
        assert_eq!(s.ttft_ms.n, 3);
        assert_eq!(s.ttft_ms.p50, Some(100.0));
        assert_eq!(s.ttft_ms.max, Some(3000.0));
        assert_eq!(s.tokens_per_s.p1, Some(11.0));
        assert_eq!(s.tpot_ms.p50, Some(20.0));
        assert!(s.tokens_per_s.cv.unwrap() > 0.0);
        assert!(s.table().contains("goodput"));
        assert!(s.per_worker.is_empty());
    }

    #[test]
    fn per_worker_breakdown() {
        let mut a = ok(0, 0.0, 100.0, 300.0, 11);
        a.worker = Some("gpu0".into());
        let mut b = ok(1, 0.0, 100.0, 1100.0, 11);
        b.worker = Some("gpu1".into());
        let mut c = ok(2, 0.0, 100.0, 300.0, 11);
        c.worker = Some("gpu0".into());
        let s = summarize(&[a, b, c], Slo::default());
        assert_eq!(s.per_worker.len(), 2);
        assert_eq!(s.per_worker["gpu0"].good, 2);
        assert_eq!(s.per_worker["gpu1"].good, 0);
        assert_eq!(s.per_worker["gpu1"].tokens_per_s.p50, Some(11.0));
        assert!(s.table().contains("worker gpu1"));
    }

    #[test]
    fn empty_run_is_all_zero() {
        let s = summarize(&[], Slo::default());
        assert_eq!(s.count, 0);
        assert_eq!(s.duration_s, 0.0);
        assert_eq!(s.goodput_share, 0.0);
        assert_eq!(s.ttft_ms.p50, None);
        let _ = s.table();
    }

    #[test]
    fn slo_edges_are_inclusive() {
        let slo = Slo {
            ttft_ms: 100.0,
            tok_s: 55.0,
        };
        assert!(meets_slo(&ok(0, 0.0, 100.0, 300.0, 11), &slo));
        assert!(!meets_slo(&ok(0, 0.0, 100.1, 300.0, 11), &slo));
        let single = ok(0, 0.0, 10.0, 10.0, 1);
        assert!(!meets_slo(&single, &slo));
        assert!(meets_slo(
            &single,
            &Slo {
                ttft_ms: 100.0,
                tok_s: 0.0
            }
        ));
    }
}
