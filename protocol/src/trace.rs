//! W3C trace context (`traceparent`, <https://www.w3.org/TR/trace-context/>) carried with a
//! job, so one request can be followed from the client through the gateway, the queue, the
//! leader and the worker to the model server, and the model server's own traces (vLLM's
//! OpenTelemetry spans read the header) join the same trace id.
//!
//! Only version `00` is written. A header that does not parse is ignored and a new trace is
//! started, as the specification asks of a receiver; on a job (where a direct NATS client
//! may have put anything) it is a malformed job instead, so the sender hears why.

use std::fmt;

/// A parsed `traceparent`: `00-<trace id, 32 hex>-<parent span id, 16 hex>-<flags, 2 hex>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

/// The header's name (lower case, as HTTP/2 sends it).
pub const TRACEPARENT_HEADER: &str = "traceparent";

impl TraceParent {
    /// Parse a `traceparent` header value; `None` when it is not a valid version-00 value
    /// (wrong shape, upper-case hex, or an all-zero trace or span id).
    pub fn parse(value: &str) -> Option<TraceParent> {
        let value = value.trim();
        let mut parts = value.split('-');
        let (version, trace, parent, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || version != "00" {
            return None;
        }
        let trace_id: [u8; 16] = hex(trace)?;
        let parent_id: [u8; 8] = hex(parent)?;
        let [flags] = hex::<1>(flags)?;
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// A new trace, sampled, its parent a new span id: for a request that arrives without
    /// one.
    pub fn start() -> TraceParent {
        let trace_id = *uuid::Uuid::new_v4().as_bytes();
        let mut parent_id = [0u8; 8];
        parent_id.copy_from_slice(&uuid::Uuid::new_v4().as_bytes()[..8]);
        // A v4 UUID has fixed version bits, never all zero; the span id half may be (2^-64).
        if parent_id == [0; 8] {
            parent_id[7] = 1;
        }
        TraceParent {
            trace_id,
            parent_id,
            flags: 0x01,
        }
    }

    /// The client's header when it parses, else a new trace.
    pub fn continue_or_start(header: Option<&str>) -> TraceParent {
        header
            .and_then(TraceParent::parse)
            .unwrap_or_else(TraceParent::start)
    }

    /// A trace context from its parts (an exporter's span context, to hand on); `None` when
    /// either id is all zero, which the specification makes invalid.
    pub fn from_parts(trace_id: [u8; 16], parent_id: [u8; 8], flags: u8) -> Option<TraceParent> {
        (trace_id != [0; 16] && parent_id != [0; 8]).then_some(TraceParent {
            trace_id,
            parent_id,
            flags,
        })
    }

    /// The trace id as 32 lower-case hex digits (what log lines and trace viewers show).
    pub fn trace_id(&self) -> String {
        to_hex(&self.trace_id)
    }

    /// The trace id's 16 bytes.
    pub fn trace_id_bytes(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The id of the span this context names as the parent of the next one.
    pub fn parent_id_bytes(&self) -> [u8; 8] {
        self.parent_id
    }

    /// The parent span id as 16 lower-case hex digits.
    pub fn parent_id(&self) -> String {
        to_hex(&self.parent_id)
    }

    /// The trace flags (bit 0: sampled).
    pub fn flags(&self) -> u8 {
        self.flags
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            to_hex(&self.trace_id),
            to_hex(&self.parent_id),
            self.flags
        )
    }
}

fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N
        || !s
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_writes_the_specification_example() {
        let t = TraceParent::parse(SPEC_EXAMPLE).expect("valid");
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.to_string(), SPEC_EXAMPLE);
    }

    #[test]
    fn refuses_what_the_specification_refuses() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn parts_round_trip_and_zero_ids_are_refused() {
        let t = TraceParent::parse(SPEC_EXAMPLE).expect("valid");
        let again = TraceParent::from_parts(t.trace_id_bytes(), t.parent_id_bytes(), t.flags());
        assert_eq!(again, Some(t));
        assert_eq!(t.parent_id(), "00f067aa0ba902b7");
        assert_eq!(
            TraceParent::from_parts([0; 16], t.parent_id_bytes(), 1),
            None
        );
        assert_eq!(TraceParent::from_parts(t.trace_id_bytes(), [0; 8], 1), None);
    }

    #[test]
    fn a_client_trace_is_continued_and_a_missing_or_broken_one_is_started() {
        let kept = TraceParent::continue_or_start(Some(SPEC_EXAMPLE));
        assert_eq!(kept.to_string(), SPEC_EXAMPLE);
        for header in [None, Some("not a trace")] {
            let started = TraceParent::continue_or_start(header);
            let again = TraceParent::parse(&started.to_string()).expect("a started trace parses");
            assert_eq!(again, started);
            assert_ne!(started.trace_id(), kept.trace_id());
        }
        assert_ne!(
            TraceParent::start().trace_id(),
            TraceParent::start().trace_id()
        );
    }
}
