//! Metronome's OpenAI-compatible HTTP gateway: HTTP requests in, jobs on NATS JetStream
//! out, results (whole or streamed) back.
//!
//! The gateway holds no scheduling state: it validates a request, refuses models no live
//! worker serves, publishes the job to `jobs.submit.<tenant>` and relays what the
//! dispatcher (`decisions.<tenant>.<id>`) and the worker (`results.<tenant>.<id>.>`) publish
//! back, a worker's results only once a decision gave it the job ([`submit`]). The OpenAI
//! endpoints
//! need an API key (`Authorization: Bearer`) mapped to a tenant, whose allowed models and
//! limits are checked before anything is published ([`auth`], [`limits`]). Tests and the binary
//! share [`bind`] / [`Gateway::serve`] (or [`run`]); [`app`] builds the router alone.

pub mod api_key;
pub mod auth;
pub mod config;
pub mod console;
pub mod cors;
pub mod error;
pub mod extract;
pub mod headers;
pub mod health;
pub mod in_flight;
pub mod key_store;
pub mod limits;
pub mod metrics;
pub mod openai;
pub mod queue_view;
pub mod registry;
pub mod relay;
pub mod routes;
pub mod submit;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use metronome_protocol::setup::{ensure_all, Buckets, StreamSettings};
use tokio_util::sync::CancellationToken;

pub use config::{Config, ConfigError, FieldError, KeyConfig, ModelList, TenantConfig};
pub use error::{ApiError, GatewayError};
pub use headers::{HEADER_DEADLINE_MS, HEADER_JOB_ID, HEADER_PRIORITY, HEADER_WORKER};
pub use metrics::Metrics;
pub use registry::Registry;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<Config>,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub buckets: Buckets,
    pub registry: Registry,
    pub metrics: Arc<Metrics>,
    /// API keys, tenants and their limiters.
    pub auth: Arc<auth::Auth>,
    /// Requests and bodies held, against the configured bounds.
    pub in_flight: Arc<in_flight::InFlight>,
    /// The leader's admission queues as last read: a model's full queue sheds at once.
    pub queues: queue_view::QueueView,
    /// Cancelled when the gateway shuts down: ends the console's event streams, which
    /// would otherwise hold up the graceful stop forever.
    pub console_stop: CancellationToken,
}

impl AppState {
    /// State over an open NATS connection and the contract's buckets.
    pub fn new(config: Config, client: async_nats::Client, buckets: Buckets) -> AppState {
        let js = jetstream::new(client.clone());
        let registry = Registry::new(Duration::from_millis(config.worker_stale_after_ms));
        let auth = Arc::new(auth::Auth::new(&config));
        let in_flight = in_flight::InFlight::new(in_flight::Bounds {
            requests: config.max_in_flight,
            per_tenant: config.max_in_flight_per_tenant,
            body_bytes: config.max_in_flight_body_bytes,
        });
        AppState {
            auth,
            in_flight,
            config: Arc::new(config),
            client,
            js,
            buckets,
            registry,
            queues: queue_view::QueueView::default(),
            metrics: Arc::default(),
            console_stop: CancellationToken::new(),
        }
    }
}

/// The HTTP router.
pub fn app(state: AppState) -> Router {
    let body_limit = state.config.body_limit_bytes;
    let cors = cors::layer(&state.config.cors_allowed_origins);
    // With CORS on, each endpoint also routes OPTIONS, so a preflight reaches the CORS
    // layer (which answers it) instead of the router's 405.
    let route = |method: MethodRouter<AppState>| match cors {
        Some(_) => method.options(|| async { axum::http::StatusCode::NO_CONTENT }),
        None => method,
    };
    // Admitted against the in-flight bounds before the body is read.
    let completions = Router::new()
        .route(
            "/v1/chat/completions",
            route(post(routes::chat_completions)),
        )
        .route("/v1/completions", route(post(routes::completions)))
        .route("/v1/embeddings", route(post(routes::embeddings)))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            in_flight::bound,
        ));
    let mut openai = Router::new()
        .merge(completions)
        .route("/v1/models", route(get(routes::list_models)))
        .route("/v1/models/{*model}", route(get(routes::get_model)));
    if let Some(cors) = cors {
        openai = openai.layer(cors);
    }
    Router::new()
        .merge(openai)
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .merge(console::router(state.clone()))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            metrics::track,
        ))
        .fallback(|uri: axum::http::Uri| async move { ApiError::no_route(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(DefaultBodyLimit::max(body_limit))
        // Failures are logged where they are understood (with the job id); the HTTP trace
        // stays at debug so readiness probes answering 503 do not flood the log.
        .layer(
            tower_http::trace::TraceLayer::new_for_http().on_failure(
                tower_http::trace::DefaultOnFailure::new().level(tracing::Level::DEBUG),
            ),
        )
        .with_state(state)
}

/// A gateway connected to NATS and bound to its address, not yet serving.
pub struct Gateway {
    listener: tokio::net::TcpListener,
    local_addr: SocketAddr,
    /// Set with `tls_cert` and `tls_key`: HTTPS only on the listen address.
    tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    state: AppState,
}

/// Connect to NATS, make sure the streams and buckets exist, and bind the listen address.
pub async fn bind(config: Config) -> Result<Gateway, GatewayError> {
    config.validate().map_err(GatewayError::Config)?;
    let tls = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some(tls::server_config(cert, key)?),
        _ => None,
    };
    let options = config
        .nats_auth
        .connect_options()
        .map_err(GatewayError::NatsAuth)?;
    let client = options
        .name("metronome-gateway")
        .connection_timeout(Duration::from_secs(5))
        // Reconnect quickly after an outage: clients are waiting on 503s meanwhile.
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((attempts as u64).saturating_mul(100).min(1_000))
        })
        .connect(metronome_runtime::nats::server_urls(&config.nats_url))
        .await
        .map_err(|source| GatewayError::Connect {
            url: config.nats_url.clone(),
            source,
        })?;
    let max_payload = client.server_info().max_payload;
    if config.body_limit_bytes > max_payload {
        tracing::warn!(
            body_limit_bytes = config.body_limit_bytes,
            nats_max_payload_bytes = max_payload,
            "body_limit_bytes is above the NATS server's max_payload: bodies in between get 413 after the publish is refused"
        );
    }
    let settings = StreamSettings {
        storage: match config.stream_storage {
            config::StreamStorage::File => jetstream::stream::StorageType::File,
            config::StreamStorage::Memory => jetstream::stream::StorageType::Memory,
        },
        replicas: config.stream_replicas,
        ..StreamSettings::default()
    };
    let buckets = ensure_all(&jetstream::new(client.clone()), &settings).await?;
    let addr = config.listen.clone();
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| GatewayError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local_addr = listener
        .local_addr()
        .map_err(|source| GatewayError::Bind { addr, source })?;
    Ok(Gateway {
        listener,
        local_addr,
        tls,
        state: AppState::new(config, client, buckets),
    })
}

impl Gateway {
    /// The bound address (the real port when configured with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serve until `shutdown`, then let in-flight requests finish.
    pub async fn serve(self, shutdown: CancellationToken) -> Result<(), GatewayError> {
        let watcher_stop = shutdown.child_token();
        let watcher = self.state.registry.spawn_watcher(
            self.state.buckets.workers.clone(),
            self.state.metrics.clone(),
            watcher_stop.clone(),
        );
        let key_watcher = key_store::spawn_watcher(
            self.state.js.clone(),
            self.state.auth.clone(),
            self.state.metrics.clone(),
            watcher_stop.clone(),
        );
        let queue_watcher = self.state.queues.spawn_watcher(
            self.state.buckets.queues.clone(),
            self.state.metrics.clone(),
            watcher_stop.clone(),
        );
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        tracing::info!(addr = %self.local_addr, scheme, nats = %self.state.config.nats_url, "gateway listening");
        if self.tls.is_none() && !self.local_addr.ip().is_loopback() {
            tracing::warn!(addr = %self.local_addr, "serving plain HTTP beyond loopback: API keys and console credentials cross the network readable; set tls_cert and tls_key, or keep a TLS proxy in front");
        }
        if self.state.config.allow_anonymous {
            tracing::warn!(
                "anonymous access is on: requests without an API key are served as tenant `anonymous`"
            );
        } else if !self.state.auth.admits_anyone() {
            tracing::warn!("no API key is configured and anonymous access is off: every OpenAI request will get 401 until a key is created (`metronome keys create --tenant NAME`, or `metronome-gateway keys create --tenant NAME` for the configuration file)");
        }
        let client = self.state.client.clone();
        let mut state = self.state;
        state.console_stop = shutdown.child_token();
        // One router for every connection: served as a `Router` itself, axum finalises a
        // fresh copy of every route's service stack for each accepted connection (about
        // 650 KB per connection in a debug build), so memory grew with the number of
        // clients; `into_make_service` shares the finalised router and clones only the
        // one route a request takes.
        let service = app(state).into_make_service();
        let stop = shutdown.cancelled_owned();
        let result = match self.tls {
            Some(config) => {
                let listener = tls::TlsListener::new(self.listener, config);
                axum::serve(listener, service)
                    .with_graceful_shutdown(stop)
                    .await
            }
            None => {
                // Without TCP_NODELAY small SSE writes wait for the client's delayed ACK
                // (~40 ms).
                let listener = axum::serve::ListenerExt::tap_io(self.listener, |tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                axum::serve(listener, service)
                    .with_graceful_shutdown(stop)
                    .await
            }
        }
        .map_err(GatewayError::Serve);
        watcher_stop.cancel();
        let _ = watcher.await;
        let _ = key_watcher.await;
        let _ = queue_watcher.await;
        // Sends what is still buffered (e.g. cancellations of dropped streams).
        if let Err(error) = client.drain().await {
            tracing::debug!(%error, "draining the NATS connection");
        }
        tracing::info!("gateway stopped");
        result
    }
}

/// [`bind`] then [`Gateway::serve`].
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), GatewayError> {
    bind(config).await?.serve(shutdown).await
}
