//! What every binary reports about its own build as `metronome_build_info` on `/metrics`
//! (value 1, the facts in labels), so a dashboard or an alert can tell which release each
//! process runs while a rolling upgrade is under way.
//!
//! The version is the workspace's. The git commit is the `METRONOME_GIT_COMMIT` variable
//! of the build's environment (the container image and release builds set it; cargo
//! rebuilds when it changes), `unknown` when unset: a build script reading git would
//! rebuild every crate at each commit.

/// The metric's name in the text exposition.
pub const METRIC: &str = "metronome_build_info";

/// The name to register an OpenMetrics info metric under (`prometheus-client` appends
/// `_info`, making it [`METRIC`]).
pub const INFO_NAME: &str = "metronome_build";

/// Its help text.
pub const HELP: &str = "Build of this binary: version and git commit in labels, value 1";

/// The workspace version this binary was built from.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The git commit this binary was built from, or `unknown`.
pub fn git_commit() -> &'static str {
    match option_env!("METRONOME_GIT_COMMIT") {
        Some(c) if !c.trim().is_empty() => c.trim(),
        _ => "unknown",
    }
}

/// The labels of `metronome_build_info`: `version` and `commit`.
pub fn labels() -> Vec<(&'static str, String)> {
    vec![
        ("version", VERSION.to_string()),
        ("commit", git_commit().to_string()),
    ]
}

/// The metric in the Prometheus text format, for a hand-written exposition. Neither value
/// needs escaping: a version and a commit hash hold no quote or backslash, and a commit
/// variable that does is replaced by `unknown`.
pub fn exposition() -> String {
    let commit = match git_commit() {
        c if c.contains(['"', '\\', '\n']) => "unknown",
        c => c,
    };
    format!(
        "# HELP {METRIC} {HELP}.\n# TYPE {METRIC} gauge\n{METRIC}{{version=\"{VERSION}\",commit=\"{commit}\"}} 1\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_is_one_gauge_sample_with_version_and_commit() {
        let text = exposition();
        let sample = text.lines().last().unwrap();
        assert_eq!(
            sample,
            format!(
                "metronome_build_info{{version=\"{VERSION}\",commit=\"{}\"}} 1",
                git_commit()
            )
        );
        assert!(text.contains("# TYPE metronome_build_info gauge"));
        assert!(!VERSION.is_empty());
    }
}
