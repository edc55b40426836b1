//! Reading the Prometheus text exposition format: the one parser in the workspace, used by
//! the agents (model servers' load), the load generator (the cluster's counters) and the
//! tests.
//!
//! A sample line is `name{label="value",...} value [timestamp]`: label values may hold
//! the escapes `\\`, `\"` and `\n`; the value is a float or `NaN`, `+Inf`, `-Inf`; the
//! timestamp (milliseconds) is optional. `# HELP`, `# TYPE` and other comments are skipped.
//! Scrapers are tolerant: a line that cannot be read is skipped, never fatal, so one odd
//! metric of a model server cannot hide the others.

use std::collections::BTreeMap;

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
    /// Milliseconds since the Unix epoch, when the exposition gave one.
    pub timestamp_ms: Option<i64>,
}

impl Sample {
    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the sample carries every `key="value"` pair given (and maybe others).
    pub fn has_labels(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(k, v)| self.label(k) == Some(v))
    }
}

/// Every sample of `text`, in order, skipping comments and lines that cannot be read.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

/// The sum of every sample of `name`, whatever its labels; 0 when there is none.
pub fn sum(text: &str, name: &str) -> f64 {
    sum_where(text, name, &[])
}

/// The sum of the samples of `name` carrying every `key="value"` pair given.
pub fn sum_where(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    parse(text)
        .iter()
        .filter(|s| s.name == name && s.has_labels(labels))
        .map(|s| s.value)
        .sum()
}

/// The samples of `name`, summed per value of their label `key` (samples without it are
/// left out).
pub fn sum_by_label(text: &str, name: &str, key: &str) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for s in parse(text).iter().filter(|s| s.name == name) {
        if let Some(v) = s.label(key) {
            *sums.entry(v.to_string()).or_insert(0.0) += s.value;
        }
    }
    sums
}

/// The value of the first sample of `name` carrying every `key="value"` pair given.
pub fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter_map(parse_line)
        .find(|s| s.name == name && s.has_labels(labels))
        .map(|s| s.value)
}

/// One line: `None` for blank lines, comments and lines that are not a valid sample.
pub fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
    let name = &line[..name_end];
    if !is_valid_name(name) {
        return None;
    }
    let mut rest = line[name_end..].trim_start();
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(after_brace)?;
        labels = parsed;
        rest = after;
    }
    let mut fields = rest.split_whitespace();
    let value = parse_value(fields.next()?)?;
    let timestamp_ms = match fields.next() {
        Some(t) => Some(t.parse::<i64>().ok()?),
        None => None,
    };
    if fields.next().is_some() {
        return None;
    }
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
        timestamp_ms,
    })
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn is_valid_name(name: &str) -> bool {
    name.chars().next().is_some_and(|c| !c.is_ascii_digit()) && name.chars().all(is_name_char)
}

/// `NaN`, `+Inf`, `-Inf` or a Go-style float.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        // Only digits, signs, dots and exponents: Rust would also accept `inf`, `nan`, `infinity`.
        v if v
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '+' | '-' | '.' | 'e' | 'E')) =>
        {
            v.parse().ok()
        }
        _ => None,
    }
}

/// `k="v",k2="v2"}` (the opening brace already read; a trailing comma is allowed);
/// returns the labels and the text after `}`.
fn parse_labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        if !is_valid_name(key) || key.contains(':') {
            return None;
        }
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        s = s[end + 1..].trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_names_labels_values_and_timestamps() {
        let text = "# HELP vllm:num_requests_running Running.\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3\n\
                    up 1 1700000000000\n\
                    \n\
                    bare_total  2.5e1\n";
        let s = parse(text);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "vllm:num_requests_running");
        assert_eq!(s[0].label("model_name"), Some("m"));
        assert_eq!(s[0].label("engine"), Some("0"));
        assert_eq!(s[0].value, 3.0);
        assert_eq!(s[0].timestamp_ms, None);
        assert_eq!(s[1].timestamp_ms, Some(1_700_000_000_000));
        assert_eq!(s[2].value, 25.0);
    }

    #[test]
    fn label_values_keep_their_escapes_and_special_characters() {
        let s = parse_line(r#"m{a="x\"y",b="l1\nl2",c="back\\slash",d="{},= #"} 1"#).unwrap();
        assert_eq!(s.label("a"), Some("x\"y"));
        assert_eq!(s.label("b"), Some("l1\nl2"));
        assert_eq!(s.label("c"), Some("back\\slash"));
        assert_eq!(s.label("d"), Some("{},= #"));
        assert_eq!(parse_line("m{a=\"1\",} 2").unwrap().label("a"), Some("1"));
        assert_eq!(parse_line("m{} 2").unwrap().labels, []);
    }

    #[test]
    fn special_values() {
        assert!(parse_line("m NaN").unwrap().value.is_nan());
        assert_eq!(parse_line("m +Inf").unwrap().value, f64::INFINITY);
        assert_eq!(parse_line("m -Inf").unwrap().value, f64::NEG_INFINITY);
        assert_eq!(parse_line("m -0.5").unwrap().value, -0.5);
    }

    #[test]
    fn unreadable_lines_are_skipped() {
        for line in [
            "m",
            "m x",
            "m nan",
            "m 1 notatime",
            "m 1 2 3",
            "m{a=\"1\" 2",
            "m{a=1} 2",
            "m{a=\"1\"b=\"2\"} 3",
            "9m 1",
            "{a=\"1\"} 1",
            "# TYPE m gauge",
        ] {
            assert_eq!(parse_line(line), None, "{line}");
        }
        assert_eq!(parse("m x\nn 1\n").len(), 1);
    }

    #[test]
    fn sums_and_lookups_match_the_whole_name_only() {
        let text = "# HELP vllm:num_preemptions_total x\n\
                    vllm:num_preemptions_total{model_name=\"m\"} 3\n\
                    vllm:num_preemptions_total_other 100\n\
                    vllm:num_preemptions_total{model_name=\"n\"} 4.5 1700000000000\n";
        assert_eq!(sum(text, "vllm:num_preemptions_total"), 7.5);
        assert_eq!(sum(text, "absent"), 0.0);
        assert_eq!(
            sum_where(text, "vllm:num_preemptions_total", &[("model_name", "n")]),
            4.5
        );
        assert_eq!(
            value(text, "vllm:num_preemptions_total", &[("model_name", "m")]),
            Some(3.0)
        );
        assert_eq!(
            value(text, "vllm:num_preemptions_total", &[("x", "y")]),
            None
        );
        let per_model = sum_by_label(text, "vllm:num_preemptions_total", "model_name");
        assert_eq!(
            per_model.into_iter().collect::<Vec<_>>(),
            [("m".to_string(), 3.0), ("n".to_string(), 4.5)]
        );
    }
}
