//! Properties of the text-format readers: arbitrary input never panics, SSE events do not
//! depend on how the bytes were split into network reads, and a rendered Prometheus sample
//! is read back exactly.

use metronome_protocol::{prometheus, sse};
use proptest::prelude::*;

/// Decodes `bytes` fed in the pieces that `cuts` (positions, taken modulo the length) make.
fn decode_in_pieces(bytes: &[u8], cuts: &[usize]) -> Vec<sse::SseEvent> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.push(0);
    points.push(bytes.len());
    points.sort_unstable();
    points.dedup();
    let mut decoder = sse::SseDecoder::new();
    let mut events = Vec::new();
    for w in points.windows(2) {
        events.extend(decoder.push(&bytes[w[0]..w[1]]));
    }
    events.extend(decoder.finish());
    events
}

/// One line of an event stream, with a chosen line ending.
fn line() -> impl Strategy<Value = String> {
    let body = prop_oneof![
        "data: [a-zé😀 :{}\"]{0,10}",
        "data:[a-z ]{0,5}",
        Just("data".to_string()),
        "event: [a-z]{1,6}",
        ": [a-z ]{0,8}",
        "id: [0-9]{1,3}",
        Just(String::new()),
        Just("data: [DONE]".to_string()),
    ];
    let ending = prop_oneof![Just("\n"), Just("\r\n"), Just("\r")];
    (body, ending).prop_map(|(b, e)| format!("{b}{e}"))
}

proptest! {
    #[test]
    fn sse_events_do_not_depend_on_how_the_stream_was_split(
        lines in proptest::collection::vec(line(), 0..30),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let bytes = lines.concat().into_bytes();
        let whole = sse::parse(&bytes);
        prop_assert_eq!(decode_in_pieces(&bytes, &cuts), whole.clone());
        // Byte by byte, the finest split there is.
        let mut decoder = sse::SseDecoder::new();
        let mut one_by_one: Vec<_> = bytes.iter().flat_map(|b| decoder.push(&[*b])).collect();
        one_by_one.extend(decoder.finish());
        prop_assert_eq!(one_by_one, whole);
    }

    #[test]
    fn openai_payloads_survive_any_split(
        texts in proptest::collection::vec("[a-zé😀 \n]{0,12}", 1..8),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let mut body = String::new();
        for t in &texts {
            body.push_str(&format!("data: {}\n\n", serde_json::json!({"content": t})));
        }
        body.push_str("data: [DONE]\n\n");
        let events = decode_in_pieces(body.as_bytes(), &cuts);
        prop_assert!(events.last().unwrap().is_done());
        let contents: Vec<String> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<serde_json::Value>(&e.data).unwrap()["content"].as_str().unwrap().to_string())
            .collect();
        prop_assert_eq!(contents, texts);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = sse::parse(&bytes);
    }

    #[test]
    fn arbitrary_prometheus_text_never_panics(text in "\\PC*") {
        let _ = prometheus::parse(&text);
    }

    #[test]
    fn a_rendered_sample_is_read_back(
        name in "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}",
        labels in proptest::collection::vec(("[a-zA-Z_][a-zA-Z0-9_]{0,8}", "[ -~\n]{0,12}"), 0..4),
        value in any::<f64>(),
        timestamp in proptest::option::of(any::<i64>()),
    ) {
        let rendered_labels: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")))
            .collect();
        let value_text = if value.is_nan() { "NaN".to_string() }
            else if value == f64::INFINITY { "+Inf".to_string() }
            else if value == f64::NEG_INFINITY { "-Inf".to_string() }
            else { format!("{value:e}") };
        let mut line = format!("{name}{{{}}} {value_text}", rendered_labels.join(","));
        if let Some(t) = timestamp {
            line.push_str(&format!(" {t}"));
        }
        let sample = prometheus::parse_line(&line).expect("a valid sample line");
        prop_assert_eq!(&sample.name, &name);
        prop_assert_eq!(sample.labels, labels);
        prop_assert!(sample.value == value || (value.is_nan() && sample.value.is_nan()));
        prop_assert_eq!(sample.timestamp_ms, timestamp);
    }
}
