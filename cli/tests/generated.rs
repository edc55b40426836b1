//! Shell completions and the man page, generated from the command line's definition: every
//! command is in them, bash accepts the script, and neither needs a running system.

use std::process::Command;

/// Run the binary with NATS pointed at a port nothing listens on: these commands must not
/// connect.
fn metronome(args: &[&str]) -> String {
    let closed = format!("nats://127.0.0.1:{}", metronome_testkit::free_port());
    let out = Command::new(env!("CARGO_BIN_EXE_metronome"))
        .args(args)
        .env("NATS_URL", closed)
        .output()
        .expect("run metronome");
    assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
    String::from_utf8(out.stdout).expect("utf-8")
}

const COMMANDS: [&str; 10] = [
    "status",
    "workers",
    "decisions",
    "explain",
    "drain",
    "undrain",
    "replay",
    "completions",
    "keys",
    "context",
];

#[test]
fn bash_completion_names_every_command_and_parses() {
    let script = metronome(&["completions", "bash"]);
    for c in COMMANDS {
        assert!(script.contains(c), "{c} missing from the bash completion");
    }
    let file = std::env::temp_dir().join(format!("metronome-completion-{}", std::process::id()));
    std::fs::write(&file, &script).unwrap();
    let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    std::fs::remove_file(&file).ok();
    assert!(check.status.success(), "bash -n: {check:?}");
    for shell in ["zsh", "fish"] {
        assert!(
            metronome(&["completions", shell]).contains("drain"),
            "{shell}"
        );
    }
}

#[test]
fn the_man_page_documents_every_command() {
    let page = metronome(&["man"]);
    assert!(page.contains(".TH metronome 1"), "{page}");
    for c in COMMANDS {
        assert!(page.contains(c), "{c} missing from the man page");
    }
    assert!(
        page.contains("Exit codes"),
        "the man page carries the exit codes"
    );
}
