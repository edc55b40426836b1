//! The gateway flood: many more chat requests than the system can serve, sent at once
//! through the gateway over HTTP, while the drill's normal load runs. What must hold:
//! every request is answered, 200 (served) or 429 (shed, by the gateway's in-flight bounds,
//! a tenant limit or the dispatcher's admission), and the gateway's peak resident memory
//! (`VmHWM`, the kernel's high-water mark over the process's life, so no sample can miss
//! the peak) stays under the documented ceiling.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::json;

/// The gateway's documented memory ceiling under a flood (docs/RUNBOOK.md).
pub const RSS_CEILING_KIB: u64 = 256 * 1024;

/// What the flood saw.
#[derive(Debug, Clone, Default)]
pub struct FloodAccount {
    pub requests: usize,
    /// Answers by HTTP status.
    pub statuses: BTreeMap<u16, usize>,
    /// Requests that got no HTTP answer, by error (connection refused, reset, timeout).
    pub unanswered: BTreeMap<String, usize>,
    /// The 429s by their error code (`in_flight`, `deadline_unmeetable`, …).
    pub shed_codes: BTreeMap<String, usize>,
    /// Gateway RSS before the flood and its peak (VmHWM) after, KiB.
    pub rss_before_kib: u64,
    pub peak_rss_kib: u64,
    /// Gateway RSS once every request was answered, KiB.
    pub rss_after_kib: u64,
    pub elapsed: Duration,
}

impl FloodAccount {
    /// Why the flood failed its checks (empty: it passed).
    pub fn failures(&self) -> Vec<String> {
        let mut out = Vec::new();
        let answered: usize = self.statuses.values().sum();
        let other: BTreeMap<&u16, &usize> = self
            .statuses
            .iter()
            .filter(|(s, _)| **s != 200 && **s != 429)
            .collect();
        if !other.is_empty() {
            out.push(format!("answers other than 200 and 429: {other:?}"));
        }
        if answered != self.requests {
            out.push(format!(
                "{} of {} requests got no HTTP answer: {:?}",
                self.requests - answered,
                self.requests,
                self.unanswered
            ));
        }
        if self.peak_rss_kib >= RSS_CEILING_KIB {
            out.push(format!(
                "the gateway's peak RSS was {} MiB, over the ceiling of {} MiB",
                self.peak_rss_kib / 1024,
                RSS_CEILING_KIB / 1024
            ));
        }
        out
    }

    /// One line for the report.
    pub fn describe(&self) -> String {
        format!(
            "{} chat requests through the gateway at once (in {:.1} s): {} answered 200, {} answered 429 ({}), {} other; gateway RSS {} MiB before, peak {} MiB (ceiling {} MiB), {} MiB after",
            self.requests,
            self.elapsed.as_secs_f64(),
            self.statuses.get(&200).unwrap_or(&0),
            self.statuses.get(&429).unwrap_or(&0),
            self.shed_codes
                .iter()
                .map(|(c, n)| format!("{c} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            self.requests
                - self.statuses.get(&200).unwrap_or(&0)
                - self.statuses.get(&429).unwrap_or(&0),
            self.rss_before_kib / 1024,
            self.peak_rss_kib / 1024,
            RSS_CEILING_KIB / 1024,
            self.rss_after_kib / 1024,
        )
    }
}

/// The kernel's high-water mark of a process's resident memory, KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// Send `requests` non-streaming chat completions for `model` to `gateway`, `concurrency`
/// at a time, and account for their answers and the gateway's (`pid`) memory.
pub async fn flood(
    gateway: &str,
    model: &str,
    requests: usize,
    concurrency: usize,
    pid: u32,
) -> anyhow::Result<FloodAccount> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(concurrency)
        .timeout(Duration::from_secs(300))
        .build()?;
    let url = Arc::new(format!(
        "{}/v1/chat/completions",
        gateway.trim_end_matches('/')
    ));
    let rss_before_kib = metronome_loadgen::system::rss_kib(pid).unwrap_or(0);
    let started = Instant::now();
    let answers: Vec<Result<(u16, Option<String>), String>> = futures::stream::iter(0..requests)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            let body = json!({"model": model, "max_tokens": 8,
                    "messages": [{"role": "user", "content": format!("flood request {i}")}]});
            async move {
                let response = http
                    .post(url.as_str())
                    .json(&body)
                    .send()
                    .await
                    .map_err(|e| error_kind(&e))?;
                let status = response.status().as_u16();
                let text = response.text().await.map_err(|e| error_kind(&e))?;
                let code = (status == 429).then(|| {
                    serde_json::from_str::<serde_json::Value>(&text)
                        .ok()
                        .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
                        .unwrap_or_else(|| "unreadable".into())
                });
                Ok((status, code))
            }
        })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let mut account = FloodAccount {
        requests,
        rss_before_kib,
        elapsed: started.elapsed(),
        ..FloodAccount::default()
    };
    for answer in answers {
        match answer {
            Ok((status, code)) => {
                *account.statuses.entry(status).or_default() += 1;
                if let Some(code) = code {
                    *account.shed_codes.entry(code).or_default() += 1;
                }
            }
            Err(kind) => *account.unanswered.entry(kind).or_default() += 1,
        }
    }
    account.peak_rss_kib = peak_rss_kib(pid).unwrap_or(u64::MAX);
    account.rss_after_kib = metronome_loadgen::system::rss_kib(pid).unwrap_or(0);
    Ok(account)
}

fn error_kind(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connect".into()
    } else if e.is_body() || e.is_decode() {
        "body".into()
    } else {
        "request".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_200_and_429_for_every_request_under_the_ceiling_passes() {
        let mut a = FloodAccount {
            requests: 3,
            statuses: [(200, 1), (429, 2)].into(),
            peak_rss_kib: 100 * 1024,
            ..FloodAccount::default()
        };
        assert!(a.failures().is_empty(), "{:?}", a.failures());
        a.statuses = [(200, 1), (503, 1)].into();
        a.unanswered = [("connect".to_string(), 1)].into();
        let f = a.failures();
        assert_eq!(f.len(), 2, "{f:?}");
        a.statuses = [(429, 3)].into();
        a.peak_rss_kib = RSS_CEILING_KIB;
        assert_eq!(a.failures().len(), 1);
        assert!(peak_rss_kib(std::process::id()).is_some_and(|k| k > 0));
    }
}
