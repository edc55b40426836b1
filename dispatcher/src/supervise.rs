//! Supervision of a leadership term's internal tasks.
//!
//! A term runs several tasks besides the deciding loop (publisher, JOBS intake, completion
//! and cancellation readers, workers watch, EWMA refresher). If one of them dies (a panic, or
//! an end nobody asked for) the leader would limp on: it keeps renewing its lease, so no
//! standby takes over, while its outcomes are dropped or its inputs stop. Each task is
//! watched here instead: the first one that ends before its term is cancelled ends the term
//! with the reason, and the leader steps down (see `lead_loop`), so a fresh term (here or on
//! a standby) rebuilds everything from NATS and Redis.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// The watched tasks of one term.
pub struct TermTasks {
    term: CancellationToken,
    failure: Arc<Mutex<Option<String>>>,
    metrics: Arc<Metrics>,
}

impl TermTasks {
    pub fn new(term: CancellationToken, metrics: Arc<Metrics>) -> TermTasks {
        TermTasks {
            term,
            failure: Arc::new(Mutex::new(None)),
            metrics,
        }
    }

    /// Watch `handle`: if the task ends while the term still runs, end the term.
    pub fn watch(&self, name: &'static str, handle: JoinHandle<()>) {
        let term = self.term.clone();
        let failure = self.failure.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let result = handle.await;
            if result.is_ok() && term.is_cancelled() {
                return;
            }
            let why = match result {
                Ok(()) => format!("{name} task ended while its term was running"),
                Err(e) if e.is_panic() => {
                    format!("{name} task panicked: {}", panic_message(e.into_panic()))
                }
                Err(e) => format!("{name} task was cancelled: {e}"),
            };
            metrics.term_task_failures_total.fetch_add(1, Relaxed);
            tracing::error!(task = name, reason = %why, "internal task died: ending the term");
            if let Ok(mut f) = failure.lock() {
                f.get_or_insert(why);
            }
            term.cancel();
        });
    }

    /// Why the term ended early, when a watched task ended it.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().ok().and_then(|f| f.clone())
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_task_ends_the_term_with_its_message() {
        let term = CancellationToken::new();
        let tasks = TermTasks::new(term.clone(), Metrics::new());
        tasks.watch("quiet", tokio::spawn(std::future::pending::<()>()));
        tasks.watch(
            "publisher",
            tokio::spawn(async { panic!("invalid header value") }),
        );
        term.cancelled().await;
        let failure = tasks.failure().expect("a failure is recorded");
        assert!(failure.contains("publisher"), "{failure}");
        assert!(failure.contains("invalid header value"), "{failure}");
        assert_eq!(tasks.metrics.term_task_failures_total.load(Relaxed), 1);
    }
}
