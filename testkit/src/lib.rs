//! Real servers for tests: a `nats-server` with JetStream and a `redis-server`, each on a
//! free port with its own temporary storage (and a JetStream cluster of several
//! `nats-server`s, [`NatsCluster`]), stoppable and restartable (same port, same
//! data) for fault tests, and removed on drop; either can serve TLS with certificates of a
//! throwaway private CA ([`TestCa`]), or run in operator mode for users with `.creds` files
//! ([`TestOperator`]). Also a guard for Metronome's own binaries and the
//! environment check every binary's `--check-config` passes.
//!
//! Nothing here is a mock: a missing binary is an error with an install hint, never a
//! silent skip.

mod cluster;
mod config_env;
mod error;
mod operator;
mod process;
mod servers;
mod tls;

pub use cluster::NatsCluster;
pub use config_env::assert_nats_and_redis_settings_from_env;
pub use error::TestkitError;
pub use operator::TestOperator;
pub use process::{bin_path, ChildGuard};
pub use servers::{free_port, free_ports, NatsServer, RedisServer};
pub use tls::TestCa;

/// Poll `check` until it returns `Some`, or panic after `timeout` with `what`.
/// Tests wait for conditions this way instead of sleeping.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: std::time::Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if std::time::Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
