//! A JetStream cluster of real `nats-server`s on loopback: each node on free ports (client,
//! route, monitoring) with its own store, routes to every other node authenticated with a
//! route user, as `./dev up --nats-cluster 3` and the Ansible roles render it. A node can
//! be killed (SIGKILL, as a crash) and started again with its store, to test what a
//! client sees when the node leading a stream goes away.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::error::TestkitError;
use crate::process::find_binary;
use crate::servers::{free_ports, http_get_body, kill_child, read_log};

const ROUTE_USER: &str = "route";
const ROUTE_PASSWORD: &str = "route-secret";
// Electing the meta leader takes a few seconds, more on a loaded 2-core machine running
// several clusters at once.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

struct Node {
    port: u16,
    route_port: u16,
    monitor_port: u16,
    child: Option<Child>,
}

/// `nodes` clustered `nats-server`s with JetStream, removed on drop.
pub struct NatsCluster {
    nodes: Vec<Node>,
    dir: TempDir,
    binary: PathBuf,
    extra_config: String,
}

impl NatsCluster {
    /// Start `nodes` servers and wait until their JetStream cluster has a meta leader
    /// (streams can be created from then on).
    pub fn start(nodes: usize) -> Result<Self, TestkitError> {
        Self::start_with_config(nodes, "")
    }

    /// As [`NatsCluster::start`], every node's config also holding `extra_config`
    /// (an `authorization { users = [...] }` block).
    pub fn start_with_config(nodes: usize, extra_config: &str) -> Result<Self, TestkitError> {
        let binary = find_binary("nats-server", "nats-server")?;
        let dir = tempfile::Builder::new()
            .prefix("metronome-nats-cluster-")
            .tempdir()
            .map_err(|source| TestkitError::Io {
                what: "temporary folder".into(),
                source,
            })?;
        let ports = free_ports(3 * nodes);
        let nodes = ports
            .chunks(3)
            .map(|p| Node {
                port: p[0],
                route_port: p[1],
                monitor_port: p[2],
                child: None,
            })
            .collect();
        let mut cluster = NatsCluster {
            nodes,
            dir,
            binary,
            extra_config: extra_config.to_string(),
        };
        for i in 0..cluster.nodes.len() {
            cluster.spawn(i)?;
        }
        cluster.wait_meta_leader()?;
        Ok(cluster)
    }

    /// The server name of node `i` (`n0`, `n1`, ...), as JetStream reports a stream's
    /// leader and replicas.
    pub fn name(&self, i: usize) -> String {
        format!("n{i}")
    }

    /// The node named `name`, if it is one of this cluster's.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        (0..self.nodes.len()).find(|i| self.name(*i) == name)
    }

    /// `nats://127.0.0.1:<port>` of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// Every node's URL, comma-separated: a `nats_url` setting naming the whole cluster.
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Kill node `i` without warning (SIGKILL), as a crash would; its store stays.
    pub fn kill(&mut self, i: usize) {
        kill_child(&mut self.nodes[i].child, 9);
    }

    /// Start node `i` again on its ports with its store.
    pub fn restart(&mut self, i: usize) -> Result<(), TestkitError> {
        kill_child(&mut self.nodes[i].child, 15);
        self.spawn(i)
    }

    /// The last lines of node `i`'s log, for failure messages.
    pub fn log_tail(&self, i: usize) -> String {
        read_log(&self.dir.path().join(format!("n{i}.log")))
    }

    fn spawn(&mut self, i: usize) -> Result<(), TestkitError> {
        let name = self.name(i);
        let routes: Vec<String> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, n)| {
                format!(
                    "\"nats-route://{ROUTE_USER}:{ROUTE_PASSWORD}@127.0.0.1:{}\"",
                    n.route_port
                )
            })
            .collect();
        let node = &self.nodes[i];
        let store = self.dir.path().join(format!("{name}-js"));
        let log = self.dir.path().join(format!("{name}.log"));
        let conf = self.dir.path().join(format!("{name}.conf"));
        let text = format!(
            "server_name: \"{name}\"\nlisten: \"127.0.0.1:{}\"\nhttp: \"127.0.0.1:{}\"\n\
             max_payload: 8MB\njetstream {{ store_dir: \"{}\" }}\n\
             cluster {{\n  name: \"metronome-test\"\n  listen: \"127.0.0.1:{}\"\n  \
             authorization {{ user: \"{ROUTE_USER}\", password: \"{ROUTE_PASSWORD}\", timeout: 2 }}\n  \
             routes: [{}]\n}}\n{}\n",
            node.port,
            node.monitor_port,
            store.display(),
            node.route_port,
            routes.join(", "),
            self.extra_config
        );
        std::fs::write(&conf, text).map_err(|source| TestkitError::Io {
            what: format!("{name}.conf"),
            source,
        })?;
        let mut child = Command::new(&self.binary)
            .arg("-c")
            .arg(&conf)
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| TestkitError::Io {
                what: format!("nats-server {name}"),
                source,
            })?;
        let monitor = node.monitor_port;
        // Answering on the monitoring port: the node runs (it may not have found its
        // peers yet, which a restarted node does in the background).
        let result = crate::servers::wait_ready(&name, &log, &mut child, || {
            http_get_body(monitor, "/varz").is_some()
        });
        self.nodes[i].child = Some(child);
        result
    }

    /// Until some node reports a JetStream meta leader and a cluster of every node.
    fn wait_meta_leader(&self) -> Result<(), TestkitError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let size = format!("\"cluster_size\": {}", self.nodes.len());
        while Instant::now() < deadline {
            let ready = self.nodes.iter().any(|n| {
                http_get_body(n.monitor_port, "/jsz")
                    .is_some_and(|body| body.contains("\"leader\": \"n") && body.contains(&size))
            });
            if ready {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(TestkitError::NotReady {
            what: "the JetStream cluster's meta leader".into(),
            timeout: READY_TIMEOUT,
            log: self.log_tail(0),
        })
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            kill_child(&mut node.child, 9);
        }
    }
}
