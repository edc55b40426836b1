//! A hostile message's bytes never become log lines of their own. Parse errors echo the
//! input (serde quotes an unknown variant, CR/LF included); logged with `Display` they
//! forged whole lines in the dispatcher's log (found by the hostile drill: its
//! `chat\r\n` endpoints split "rejected a malformed job" lines in two). Its own test
//! binary: the subscriber that captures the log is process-wide.

use crate::common;

use std::io;
use std::sync::{Arc, Mutex};

use common::*;
use metronome_protocol::{names, Outcome};
use serde_json::json;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

const FORGED: &str = "2026-01-01T00:00:00.000000Z  INFO metronome_dispatcher::leader: FORGED acquired the leader lease";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_jobs_and_events_cannot_forge_log_lines() {
    let logs = Captured::default();
    tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .init();
    let env = Env::start().await;
    let (running, token) = env.dispatcher(env.config("logs")).await;

    let mut j = job_json("forge-job", "model-x", 10, 10);
    j["endpoint"] = json!(format!("chat\r\n{FORGED}\u{0}"));
    env.submit_raw("forge-job", j).await;
    let event = json!({
        "v": 1, "job_id": "j", "worker_id": "w1", "model": "m", "epoch": 1, "attempt": 1,
        "outcome": format!("done\n{FORGED}"), "streamed": false, "prompt_tokens": 1,
        "output_tokens": 1, "e2e_ms": 1.0, "finished_ms": 1,
    });
    env.store_json(names::event_done_subject("w1"), &event)
        .await;

    let d = env.decisions_for(&["forge-job".to_string()]).await;
    assert_eq!(d["forge-job"].outcome, Outcome::Rejected);
    metronome_testkit::wait_for("both rejections logged", WAIT, || async {
        let text = logs.text();
        (text.contains("rejected a malformed job")
            && text.contains("malformed completion event ignored"))
        .then_some(())
    })
    .await;
    let text = logs.text();
    for line in text.lines() {
        assert!(
            !line.starts_with("2026-01-01") && !line.contains('\0'),
            "a client's bytes became a log line: {line:?}\n{text}"
        );
    }
    assert!(text.contains("FORGED"), "the echo is kept, escaped: {text}");
    token.cancel();
    running.join().await.unwrap();
}
