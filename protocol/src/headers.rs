//! Building NATS headers without panicking.
//!
//! async-nats's `HeaderMap::insert(&str, &str)` and `PublishMessage::header` assert that a
//! value holds no CR/LF and that a name is a valid token: a value taken from a message (a
//! model name, an id) that breaks the rule would panic the task that builds the header. Every
//! header Metronome writes goes through [`headers`], which reports the bad pair instead.

use std::str::FromStr;

use async_nats::header::{HeaderMap, HeaderName, HeaderValue};

/// A header that cannot be written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("header name {0:?} is not a valid NATS header name")]
    BadName(String),
    #[error("value of header {name} is not a valid NATS header value (CR or LF): {value:?}")]
    BadValue { name: String, value: String },
}

/// A header map from `(name, value)` pairs, or the first pair that cannot be a header.
pub fn headers<'a>(
    pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<HeaderMap, HeaderError> {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        let header_name =
            HeaderName::from_str(name).map_err(|_| HeaderError::BadName(name.to_string()))?;
        let header_value = HeaderValue::from_str(value).map_err(|_| HeaderError::BadValue {
            name: name.to_string(),
            value: value.chars().take(64).collect(),
        })?;
        map.insert(header_name, header_value);
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::names::{HEADER_MODEL, HEADER_MSG_ID};

    #[test]
    fn builds_valid_headers() {
        let map = headers([(HEADER_MSG_ID, "j1:1"), (HEADER_MODEL, "org/model-8b")]).unwrap();
        assert_eq!(map.get(HEADER_MODEL).unwrap().as_str(), "org/model-8b");
    }

    #[test]
    fn reports_instead_of_panicking() {
        for bad in ["a\r\nb", "a\nb", "a\rb"] {
            assert!(matches!(
                headers([(HEADER_MODEL, bad)]),
                Err(HeaderError::BadValue { .. })
            ));
        }
        assert!(matches!(
            headers([("Bad:Name", "x")]),
            Err(HeaderError::BadName(_))
        ));
    }
}
