//! `metronome decisions`: one readable line per decision, and the filters that pick them.
//!
//! Pure: a [`Filter`] decides which decisions to show, [`line`] renders one. Reading the
//! DECISIONS stream (the last N, or live with `--follow`) lives in `source.rs`.

use metronome_protocol::{Decision, Outcome};

use crate::fmt;

/// Which decisions to show; every set field must match.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    pub model: Option<String>,
    /// The winner (assigned decisions only name one).
    pub worker: Option<String>,
    pub outcome: Option<Outcome>,
}

impl Filter {
    pub fn matches(&self, d: &Decision) -> bool {
        self.model
            .as_ref()
            .is_none_or(|m| d.model.as_deref() == Some(m.as_str()))
            && self
                .worker
                .as_ref()
                .is_none_or(|w| d.worker_id.as_deref() == Some(w.as_str()))
            && self.outcome.is_none_or(|o| d.outcome == o)
    }
}

/// `12:34:56.789  job-1  assigned  n1-gpu1  ttft 120 ms  45.0 tok/s  wait 15 ms  llama-3.1-8b`
/// plus the reason when there is one.
pub fn line(d: &Decision) -> String {
    let outcome = match d.outcome {
        Outcome::Assigned => "assigned",
        Outcome::Rejected => "rejected",
        Outcome::Expired => "expired",
    };
    let winner = d
        .worker_id
        .as_ref()
        .and_then(|w| d.candidates.iter().find(|c| &c.worker_id == w));
    let prediction = winner.and_then(|w| w.prediction);
    let mut s = format!(
        "{}  {}  {:<8}  {:<12}  ttft {:>7}  {:>11}  wait {:>7}  {}",
        fmt::utc_time(d.decided_ms),
        d.job_id,
        outcome,
        d.worker_id.as_deref().unwrap_or("-"),
        prediction
            .map(|p| fmt::ms(p.ttft_ms))
            .unwrap_or_else(|| "n/a".into()),
        fmt::tok_s(prediction.map(|p| p.decode_tok_s)),
        fmt::ms(d.queue_wait_ms as f64),
        d.model.as_deref().unwrap_or("-"),
    );
    if d.attempt > 1 {
        s.push_str(&format!("  attempt {}", d.attempt));
    }
    if let Some(r) = &d.reason {
        s.push_str(&format!(
            "  {}: {r}",
            d.reason_code.as_deref().unwrap_or("reason")
        ));
    }
    s
}

/// Keep the last `n` of `items` that match (the input is in stream order).
pub fn last_n(
    items: impl IntoIterator<Item = Decision>,
    filter: &Filter,
    n: usize,
) -> Vec<Decision> {
    let mut kept: std::collections::VecDeque<Decision> = std::collections::VecDeque::new();
    for d in items {
        if filter.matches(&d) {
            if kept.len() == n {
                kept.pop_front();
            }
            if n > 0 {
                kept.push_back(d);
            }
        }
    }
    kept.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::explain::fixtures::assigned;

    #[test]
    fn line_shows_winner_prediction_and_wait() {
        assert_eq!(
            line(&assigned()),
            "12:34:56.789  job-1  assigned  n1-gpu1       ttft  120 ms   45.0 tok/s  wait   15 ms  llama-3.1-8b"
        );
    }

    #[test]
    fn a_rejection_shows_its_reason() {
        let mut d = assigned();
        d.outcome = Outcome::Rejected;
        d.worker_id = None;
        d.reason = Some("queue full".into());
        d.reason_code = Some("queue_full".into());
        let l = line(&d);
        assert!(l.contains("rejected  -  "), "{l}");
        assert!(
            l.contains("ttft     n/a") && l.ends_with("queue_full: queue full"),
            "{l}"
        );
    }

    #[test]
    fn filters_combine_and_last_n_keeps_the_newest() {
        let mut a = assigned();
        a.job_id = "a".into();
        let mut b = assigned();
        b.job_id = "b".into();
        b.worker_id = Some("n1-gpu0".into());
        let mut c = assigned();
        c.job_id = "c".into();
        c.outcome = Outcome::Expired;
        c.model = Some("other".into());
        let all = vec![a, b, c];
        let ids = |v: Vec<Decision>| v.into_iter().map(|d| d.job_id).collect::<Vec<_>>();
        assert_eq!(ids(last_n(all.clone(), &Filter::default(), 2)), ["b", "c"]);
        let f = Filter {
            worker: Some("n1-gpu1".into()),
            ..Filter::default()
        };
        assert_eq!(ids(last_n(all.clone(), &f, 10)), ["a", "c"]);
        let f = Filter {
            model: Some("llama-3.1-8b".into()),
            outcome: Some(Outcome::Assigned),
            ..Filter::default()
        };
        assert_eq!(ids(last_n(all.clone(), &f, 10)), ["a", "b"]);
        assert!(last_n(all, &Filter::default(), 0).is_empty());
    }
}
