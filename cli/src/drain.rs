//! `metronome drain <worker>` / `undrain <worker>`: the worker-agent's control subject
//! `control.<worker_id>.<drain|undrain>` (core NATS request/reply, see
//! `metronome_protocol::control`), and the words for its answer.

use metronome_protocol::ControlReply;

/// One line for an agent's answer.
pub fn line(r: &ControlReply) -> String {
    let mut s = match (r.draining, r.running) {
        (true, 0) => format!("{}: drained, no job running", r.worker_id),
        (true, n) => format!(
            "{}: draining, {n} job(s) still running: {}",
            r.worker_id,
            r.in_flight.join(", ")
        ),
        (false, n) => format!("{}: taking work ({n} job(s) running)", r.worker_id),
    };
    if let Some(e) = &r.error {
        s.push_str(&format!("  [agent: {e}]"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(draining: bool, in_flight: &[&str]) -> ControlReply {
        ControlReply {
            v: 1,
            worker_id: "n1-gpu0".into(),
            draining,
            running: in_flight.len() as u32,
            in_flight: in_flight.iter().map(|s| s.to_string()).collect(),
            error: None,
        }
    }

    #[test]
    fn lines_say_what_is_left() {
        assert_eq!(
            line(&reply(true, &["a", "b"])),
            "n1-gpu0: draining, 2 job(s) still running: a, b"
        );
        assert_eq!(line(&reply(true, &[])), "n1-gpu0: drained, no job running");
        assert_eq!(
            line(&reply(false, &["a"])),
            "n1-gpu0: taking work (1 job(s) running)"
        );
    }
}
