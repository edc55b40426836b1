//! A job's measurements from its token arrivals: TTFT from the moment the agent took the
//! assignment to the first chunk carrying text; TPOT the mean gap between text arrivals
//! after the first, per output token; tokens/s the output tokens over the time from the
//! take to the last token; e2e from the take to the end.

use std::time::{Duration, Instant};

use crate::ewma_store::JobSample;

/// Timing of the token arrivals of one job.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub start: Instant,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
}

/// The measurements of a job from its timing and output token count.
pub fn measure(t: &Timing, output_tokens: u32, end: Instant) -> JobSample {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ttft_ms = t.first_token.map(|f| ms(f - t.start));
    let tpot_ms = match (t.first_token, t.last_token) {
        (Some(f), Some(l)) if output_tokens > 1 => Some(ms(l - f) / f64::from(output_tokens - 1)),
        _ => None,
    };
    let tok_s = t.last_token.and_then(|l| {
        let secs = (l - t.start).as_secs_f64();
        (secs > 0.0 && output_tokens > 0).then(|| f64::from(output_tokens) / secs)
    });
    JobSample {
        ttft_ms,
        tpot_ms,
        tok_s,
        e2e_ms: Some(ms(end - t.start)),
        output_tokens: Some(output_tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measurements_from_token_arrivals() {
        let start = Instant::now();
        let t = Timing {
            start,
            first_token: Some(start + Duration::from_millis(100)),
            last_token: Some(start + Duration::from_millis(500)),
        };
        let s = measure(&t, 5, start + Duration::from_millis(600));
        assert!((s.ttft_ms.unwrap() - 100.0).abs() < 1e-6);
        assert!(
            (s.tpot_ms.unwrap() - 100.0).abs() < 1e-6,
            "400 ms over 4 gaps"
        );
        assert!((s.tok_s.unwrap() - 10.0).abs() < 1e-6, "5 tokens in 0.5 s");
        assert!((s.e2e_ms.unwrap() - 600.0).abs() < 1e-6);
    }

    #[test]
    fn no_token_means_no_latency_sample() {
        let start = Instant::now();
        let t = Timing {
            start,
            first_token: None,
            last_token: None,
        };
        let s = measure(&t, 0, start + Duration::from_millis(10));
        assert_eq!((s.ttft_ms, s.tpot_ms, s.tok_s), (None, None, None));
        let t1 = Timing {
            start,
            first_token: Some(start),
            last_token: Some(start),
        };
        assert_eq!(measure(&t1, 1, start).tpot_ms, None, "one token has no gap");
    }
}
