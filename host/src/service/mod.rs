//! The service, assembled in one place: a source and a change log in, a
//! running change streamer out (the subscriber endpoint, the replication
//! loop, cleanup), with its address, its status and a clean stop.
//!
//! The start-up order lives only here:
//! 1. status and hub over the log's reader;
//! 2. the endpoint is bound (so the address to advertise is known) but does
//!    not serve yet;
//! 3. cleanup and progress logging start;
//! 4. the streamer seeds the hub with the existing log's lineage, so a
//!    subscriber that comes at once finds it (and, on a shared change DB,
//!    waits for this host to own it) instead of being turned away;
//! 5. the endpoint serves and the loop runs.
//!
//! The replication loop can be stopped and started again on another source
//! or log handle while the endpoint keeps serving ([`Service::stop_replication`],
//! [`Service::start_replication`]): subscribers stay connected across it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cleanup::CleanupOptions;
use crate::filter::FilterHost;
use crate::hub::Hub;
use crate::server::AppState;
use crate::source::ChangeSource;
use crate::status::Status;
use crate::storage::{ChangeLog, LogReader};
use crate::streamer::{Streamer, StreamerOptions};

mod build;

/// Everything a service is made of.
pub struct ServiceConfig {
    pub source: Box<dyn ChangeSource>,
    pub log: Box<dyn ChangeLog>,
    pub reader: Arc<dyn LogReader>,
    /// Where the endpoint listens (`127.0.0.1:0` picks a free port).
    pub listen: String,
    /// The address recorded as the log's owner address; `None`: the bound one.
    pub advertise: Option<String>,
    pub streamer: StreamerOptions,
    /// `None` runs no purge and no laggard check (tests that inspect the log).
    pub cleanup: Option<CleanupOptions>,
    pub subscriber_limits: crate::subscriber::Limits,
    pub ping_interval: Duration,
    pub filters: Arc<FilterHost>,
    /// The permissions row Sluice serves to a zero-cache whose upstream
    /// lacks Zero's tables (`None`: NULL permissions).
    pub zero_permissions: Option<crate::server::zero_tables::Permissions>,
    /// How long a disconnected consumer's or subscriber's position is held
    /// (see `crate::reservations`).
    pub retention: crate::reservations::Retention,
    /// How catch-ups share reading the log.
    pub catchup: crate::catchup::CatchupOptions,
    /// One line of progress every 10 s while transactions are stored.
    pub log_progress: bool,
    /// The endpoint's token and connection caps.
    pub access: Arc<crate::server::access::Access>,
    /// TLS on the endpoint (`None`: plain).
    pub endpoint_tls: Option<Arc<crate::server::tls::EndpointTls>>,
    /// How long the source may back off before `/readyz` says not ready.
    pub ready_backoff: Duration,
    /// The plugin directory, listed at `/plugins` and rescanned by
    /// `POST /plugins/reload`.
    pub plugins: Option<Arc<crate::plugin::Registry>>,
}

impl ServiceConfig {
    /// A service on a free loopback port, with the defaults of `sluice run`
    /// and no filters.
    pub fn new(source: Box<dyn ChangeSource>, log: Box<dyn ChangeLog>, reader: Arc<dyn LogReader>) -> Self {
        ServiceConfig {
            source,
            log,
            reader,
            listen: "127.0.0.1:0".into(),
            advertise: None,
            streamer: StreamerOptions::default(),
            cleanup: Some(CleanupOptions::default()),
            subscriber_limits: crate::subscriber::Limits::default(),
            ping_interval: Duration::from_secs(10),
            filters: FilterHost::none(),
            zero_permissions: None,
            access: crate::server::access::Access::open(),
            endpoint_tls: None,
            ready_backoff: Duration::from_secs(30),
            plugins: None,
            retention: crate::reservations::Retention::default(),
            catchup: crate::catchup::CatchupOptions::default(),
            log_progress: false,
        }
    }
}

/// A running service.
pub struct Service {
    addr: SocketAddr,
    status: Arc<Status>,
    hub: Arc<Hub>,
    /// Stops everything: the endpoint, cleanup, progress logging.
    stop: watch::Sender<bool>,
    /// The options each replication loop starts with.
    options: StreamerOptions,
    /// The replication loop, until it has ended or was stopped.
    replication: Option<Replication>,
    server: JoinHandle<std::io::Result<()>>,
    /// The stream connections, which a stop waits to see closed.
    access: Arc<crate::server::access::Access>,
    /// What [`Service::reload`] reads again.
    reloadable: Reloadable,
    /// Tasks that run beside the loop for its source (see
    /// `crate::source::assemble`), stopped with the service.
    beside: Vec<JoinHandle<()>>,
    /// One writer per SQLite log: held for the service's life.
    writer_lock: Option<crate::storage::writer_lock::WriterLock>,
}

/// The parts of a running service that can be read again (SIGHUP).
struct Reloadable {
    tls: Option<Arc<crate::server::tls::EndpointTls>>,
    plugins: Option<Arc<crate::plugin::Registry>>,
}

/// How long a stop waits for subscribers to answer their close frames
/// (each connection bounds its own close too).
const CLOSE_HANDSHAKES: Duration = Duration::from_secs(5);

/// A running replication loop and its own stop signal.
struct Replication {
    stop: watch::Sender<bool>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Replication {
    fn start(streamer: Streamer) -> Replication {
        let (stop, stop_rx) = watch::channel(false);
        Replication { stop, task: tokio::spawn(streamer.run(stop_rx)) }
    }

    /// Asks the loop to stop (the storer drains what is queued) and waits.
    async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.task.await.context("the replication loop panicked")?
    }
}

impl Service {
    pub async fn start(config: ServiceConfig) -> anyhow::Result<Service> {
        let status = Arc::new(Status::default());
        let hub = Hub::with_options(
            config.reader,
            status.clone(),
            config.retention,
            config.catchup,
            config.subscriber_limits.budget.clone(),
        );
        let (stop, stop_rx) = watch::channel(false);
        let app = AppState {
            hub: hub.clone(),
            status: status.clone(),
            subscriber_limits: config.subscriber_limits,
            ping_interval: config.ping_interval,
            filters: config.filters,
            zero_permissions: config.zero_permissions.map(Arc::new),
            access: config.access.clone(),
            ready_backoff: config.ready_backoff,
            shutdown: stop_rx.clone(),
            plugins: config.plugins.clone(),
        };
        let reloadable = Reloadable { tls: config.endpoint_tls.clone(), plugins: config.plugins };
        // zero-cache dials a discovered address as ws:// unless it names a scheme.
        let scheme = if config.endpoint_tls.is_some() { "wss://" } else { "" };
        let (addr, serve) = crate::server::bind_with_tls(
            &config.listen,
            crate::server::router(app),
            stop_rx.clone(),
            config.endpoint_tls,
        )
        .await?;
        if let Some(cleanup) = config.cleanup {
            tokio::spawn(crate::cleanup::run(hub.clone(), status.clone(), cleanup, stop_rx.clone()));
        }
        if config.log_progress {
            tokio::spawn(log_progress(status.clone(), stop_rx.clone()));
        }
        tokio::spawn(log_stalls(status.clone(), stop_rx.clone()));
        let options = StreamerOptions {
            advertise: config.advertise.unwrap_or_else(|| format!("{scheme}{}", advertised(addr))),
            ..config.streamer
        };
        let mut streamer = Streamer::new(config.source, config.log, hub.clone(), options.clone(), status.clone());
        streamer.seed_hub();
        let server = tokio::spawn(serve);
        let replication = Some(Replication::start(streamer));
        Ok(Service {
            addr,
            status,
            hub,
            stop,
            options,
            replication,
            server,
            access: config.access,
            reloadable,
            beside: Vec::new(),
            writer_lock: None,
        })
    }

    /// Stops the replication loop alone (the storer drains what is queued)
    /// and returns how it ended. The endpoint keeps serving: subscribers
    /// stay connected and follow the next loop.
    pub async fn stop_replication(&mut self) -> anyhow::Result<()> {
        match self.replication.take() {
            Some(replication) => replication.stop().await,
            None => Ok(()),
        }
    }

    /// The options the next replication loop starts with (those the service
    /// started with, until changed here).
    pub fn streamer_options(&mut self) -> &mut StreamerOptions {
        &mut self.options
    }

    /// Starts a replication loop on `source` and `log` after
    /// [`Service::stop_replication`].
    pub fn start_replication(&mut self, source: Box<dyn ChangeSource>, log: Box<dyn ChangeLog>) -> anyhow::Result<()> {
        anyhow::ensure!(self.replication.is_none(), "a replication loop is running already");
        let streamer = Streamer::new(source, log, self.hub.clone(), self.options.clone(), self.status.clone());
        self.replication = Some(Replication::start(streamer));
        Ok(())
    }

    /// Reads the endpoint's certificate and key again, and rescans the
    /// plugin directory (SIGHUP). A failure leaves the old ones in place
    /// and is logged.
    pub async fn reload(&self) {
        if let Some(tls) = &self.reloadable.tls {
            match tls.reload() {
                Ok(()) => tracing::info!("reloaded the endpoint's TLS certificate"),
                Err(e) => {
                    tracing::error!("the endpoint's TLS certificate was not reloaded ({e:#}); the old one stays")
                }
            }
        }
        if let Some(plugins) = &self.reloadable.plugins {
            match plugins.rescan().await {
                Ok(report) if !report.changed() && report.refused.is_empty() => {
                    tracing::info!("the plugin directory is unchanged")
                }
                Ok(_) => {}
                Err(e) => tracing::error!("plugin directory: {e:#}"),
            }
        }
    }

    /// Runs `task` beside the service until it stops.
    pub fn spawn_beside(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.beside.push(tokio::spawn(task));
    }

    /// Where subscribers and `/status` reach the service.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn status(&self) -> &Arc<Status> {
        &self.status
    }

    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// The replication loop has ended by itself.
    pub fn is_finished(&self) -> bool {
        self.replication.as_ref().is_none_or(|r| r.task.is_finished())
    }

    /// Resolves when the replication loop ends by itself: `Err` with the
    /// reason after a fatal error, `Ok` after a clean stop (another host
    /// took the log over). The endpoint stops with it.
    pub async fn finished(&mut self) -> anyhow::Result<()> {
        let Some(replication) = self.replication.as_mut() else { return Ok(()) };
        let result = (&mut replication.task).await;
        self.replication = None;
        self.server.abort();
        result.context("the replication loop panicked")?
    }

    /// Stops the loop (the storer drains what is queued) and the endpoint.
    /// Stops: every subscriber gets a close frame 1001 and a clean close
    /// (waited for, within a bound), the storer drains, and the endpoint
    /// closes.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        let result = self.stop_replication().await;
        if tokio::time::timeout(CLOSE_HANDSHAKES, self.access.all_closed()).await.is_err() {
            tracing::warn!(
                "{} subscriber connection(s) did not finish closing within {} s",
                self.access.connections(),
                CLOSE_HANDSHAKES.as_secs()
            );
        }
        self.server.abort();
        result
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        for task in &self.beside {
            task.abort();
        }
        let _ = self.stop.send(true);
        if let Some(replication) = &self.replication {
            let _ = replication.stop.send(true);
        }
        self.server.abort();
    }
}

/// The address recorded for discovery (`ownerAddress`) when none is given:
/// the bound one, unless it is a wildcard (`0.0.0.0`, `::`), which nobody
/// can dial; then this host's outward address, found from the route a UDP
/// socket would take (nothing is sent), or loopback with a warning.
fn advertised(bound: SocketAddr) -> String {
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let outward = || -> Option<std::net::IpAddr> {
        let (local, probe) = if bound.is_ipv4() { ("0.0.0.0:0", "192.0.2.1:9") } else { ("[::]:0", "[2001:db8::1]:9") };
        let socket = std::net::UdpSocket::bind(local).ok()?;
        socket.connect(probe).ok()?;
        let ip = socket.local_addr().ok()?.ip();
        (!ip.is_unspecified()).then_some(ip)
    };
    let ip = outward().unwrap_or_else(|| {
        let loopback = if bound.is_ipv4() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
        };
        tracing::warn!(%bound, "no outward address found to advertise; advertising {loopback} (set --advertise)");
        loopback
    });
    SocketAddr::new(ip, bound.port()).to_string()
}

/// One line when a network path stalls (see [`crate::status::STALL_AFTER`])
/// and one when it recovers, with how long it lasted.
async fn log_stalls(status: Arc<Status>, mut stop: watch::Receiver<bool>) {
    use crate::status::NetPath;
    let mut stalled: [Option<Duration>; 2] = [None; 2];
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        for (i, path) in NetPath::ALL.into_iter().enumerate() {
            let now = status.stalls().into_iter().find(|s| s.path == path);
            match (&stalled[i], now) {
                (None, Some(report)) => {
                    tracing::warn!(
                        "{} stalled: {}; /readyz answers 503 until it recovers",
                        path.label(),
                        report.reason
                    );
                    stalled[i] = Some(Duration::from_millis(report.for_ms));
                }
                (Some(_), Some(report)) => stalled[i] = Some(Duration::from_millis(report.for_ms)),
                (Some(lasted), None) => {
                    tracing::info!("{} recovered from a stall of at least {:.1} s", path.label(), lasted.as_secs_f64());
                    stalled[i] = None;
                }
                (None, None) => {}
            }
        }
    }
}

/// Every 10 s while transactions are being stored, one line of progress.
async fn log_progress(status: Arc<Status>, mut stop: watch::Receiver<bool>) {
    let mut last = 0u64;
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let s = status.snapshot();
        if s.transactions > last {
            tracing::info!(
                "stored {} transactions ({:.0}/s), {} changes; last watermark {}; {} subscribers",
                s.transactions,
                (s.transactions - last) as f64 / 10.0,
                s.changes,
                s.last_watermark.as_deref().unwrap_or("-"),
                s.subscribers
            );
            last = s.transactions;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listen_address_is_never_advertised() {
        assert_eq!(advertised("127.0.0.1:4849".parse().unwrap()), "127.0.0.1:4849");
        for wildcard in ["0.0.0.0:4849", "[::]:4849"] {
            let a = advertised(wildcard.parse().unwrap());
            let ip: SocketAddr = a.parse().unwrap();
            assert!(!ip.ip().is_unspecified() && ip.port() == 4849, "{wildcard} advertised as {a}");
        }
    }
}
