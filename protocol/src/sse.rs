//! Server-sent events: the one decoder of `text/event-stream` in the workspace, used for
//! the OpenAI streams the gateway, the agents, the load generator and the tests read.
//!
//! Follows the WHATWG event-stream rules: lines end in `\n`, `\r\n` or a lone `\r`; a
//! blank line dispatches the event; `data:` lines accumulate (joined with `\n`); one
//! space after the colon is dropped; lines starting with `:` are comments; a line without
//! a colon is a field with an empty value; a leading byte-order mark is skipped. `id` and
//! `retry` are read and ignored: nothing here reconnects.
//!
//! Incremental: [`SseDecoder::push`] takes bytes exactly as the network delivered them, so
//! a line, a field name or a UTF-8 sequence may be split anywhere between reads.
//!
//! One departure from the standard, on purpose: an event left without its final blank
//! line when the stream ends is still returned by [`SseDecoder::finish`] (servers that
//! close right after their last `data:` line lose nothing). Callers that need to know the
//! stream ended properly look for the OpenAI `[DONE]` sentinel ([`DONE`]).

/// The OpenAI sentinel payload that ends a successful stream.
pub const DONE: &str = "[DONE]";

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, if the event had one (the standard's default type is `message`).
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
}

impl SseEvent {
    /// Whether this is the OpenAI end-of-stream sentinel `data: [DONE]`.
    pub fn is_done(&self) -> bool {
        self.data == DONE
    }
}

/// Incremental `text/event-stream` decoder: feed bytes with [`push`](Self::push), take the
/// events each call completes, call [`finish`](Self::finish) at the end of the stream.
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes of the line not yet ended.
    line: Vec<u8>,
    /// The last byte seen was `\r`: a `\n` right after it ends no further line.
    after_cr: bool,
    /// The first line was already seen (a byte-order mark is skipped only there).
    past_first_line: bool,
    /// The data buffer of the standard: each `data` value followed by `\n`.
    data: String,
    event: Option<String>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next bytes of the stream; returns every event they complete, in order.
    pub fn push(&mut self, mut bytes: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
        }
        while let Some(pos) = bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&bytes[..pos]);
            let ending = bytes[pos];
            bytes = &bytes[pos + 1..];
            if ending == b'\r' {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            let line = std::mem::take(&mut self.line);
            if let Some(event) = self.process_line(&line) {
                events.push(event);
            }
        }
        self.line.extend_from_slice(bytes);
        events
    }

    /// Ends the stream: returns the event still being built, if it has data (see the
    /// module documentation for why it is not discarded). The decoder is then empty.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let line = std::mem::take(&mut self.line);
        let mut dispatched = None;
        if !line.is_empty() {
            dispatched = self.process_line(&line);
        }
        if dispatched.is_none() {
            dispatched = self.dispatch();
        }
        *self = Self::default();
        dispatched
    }

    fn process_line(&mut self, line: &[u8]) -> Option<SseEvent> {
        let mut line = String::from_utf8_lossy(line);
        if !self.past_first_line {
            self.past_first_line = true;
            if let Some(rest) = line.strip_prefix('\u{feff}') {
                line = rest.to_string().into();
            }
        }
        if line.is_empty() {
            return self.dispatch();
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "data" => {
                self.data.push_str(value);
                self.data.push('\n');
            }
            "event" => self.event = Some(value.to_string()),
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let event = self.event.take();
        if self.data.is_empty() {
            return None;
        }
        let mut data = std::mem::take(&mut self.data);
        data.pop();
        Some(SseEvent { event, data })
    }
}

/// Decodes a whole `text/event-stream` body.
pub fn parse(body: &[u8]) -> Vec<SseEvent> {
    let mut decoder = SseDecoder::new();
    let mut events = decoder.push(body);
    events.extend(decoder.finish());
    events
}

/// The `data` payloads of a whole body, in order (what most readers of an OpenAI stream want).
pub fn data_payloads(body: &str) -> Vec<String> {
    parse(body.as_bytes()).into_iter().map(|e| e.data).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(body: &str) -> Vec<String> {
        data_payloads(body)
    }

    #[test]
    fn a_blank_line_dispatches_and_multi_line_data_is_joined() {
        assert_eq!(data("data: a\n\ndata: b\ndata:  c\n\n"), ["a", "b\n c"]);
    }

    #[test]
    fn every_line_ending_counts() {
        assert_eq!(
            data("data: a\r\n\r\ndata: b\r\rdata: c\n\n"),
            ["a", "b", "c"]
        );
    }

    #[test]
    fn comments_other_fields_and_empty_events_dispatch_no_data() {
        let events = parse(b": keep-alive\n\nid: 7\nretry: 10\n\nevent: error\ndata: x\n\n");
        assert_eq!(
            events,
            [SseEvent {
                event: Some("error".into()),
                data: "x".into()
            }]
        );
        // A `data` field with no value is an event with empty data.
        assert_eq!(data("data\n\ndata:\n\n"), ["", ""]);
    }

    #[test]
    fn only_one_space_after_the_colon_is_dropped_and_colons_in_values_stay() {
        assert_eq!(
            data("data:x\n\ndata:  y\n\ndata: {\"a\":1}\n\n"),
            ["x", " y", "{\"a\":1}"]
        );
    }

    #[test]
    fn a_byte_order_mark_is_skipped_at_the_start_only() {
        assert_eq!(
            data("\u{feff}data: a\n\n\u{feff}data: b\n\n"),
            ["a"],
            "a second mark makes the field name unknown"
        );
    }

    #[test]
    fn split_fields_and_crlf_across_reads_are_reassembled() {
        let mut d = SseDecoder::new();
        assert!(d.push(b"da").is_empty());
        assert!(d.push(b"ta: {\"a\":").is_empty());
        assert!(d.push(b"1}\r").is_empty());
        assert_eq!(d.push(b"\n\r")[0].data, "{\"a\":1}");
        assert!(d.push(b"\n").is_empty(), "the \\n after \\r ends no line");
        assert!(d.push(b"data: [DO").is_empty());
        let done = d.push(b"NE]\n\n");
        assert!(done[0].is_done());
    }

    #[test]
    fn an_unterminated_last_event_is_returned_by_finish() {
        let mut d = SseDecoder::new();
        assert!(d.push(b"data: a\n\ndata: tail").len() == 1);
        assert_eq!(d.finish().map(|e| e.data).as_deref(), Some("tail"));
        assert_eq!(d.finish(), None);
        let mut d = SseDecoder::new();
        assert!(d.push(b"data: a\ndata: b\n").is_empty());
        assert_eq!(d.finish().map(|e| e.data).as_deref(), Some("a\nb"));
    }

    #[test]
    fn invalid_utf8_is_replaced_not_fatal() {
        assert_eq!(parse(b"data: \xff\n\n")[0].data, "\u{fffd}");
    }
}
