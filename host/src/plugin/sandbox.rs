//! The sandbox every plugin instance runs in: one wasmtime `Store` each, with
//! a wall-clock deadline per call, a memory cap, only the WASI capabilities
//! granted to that plugin, and its stderr sent to the host log.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use wasmtime::component::ResourceTable;
use wasmtime::{Config, Engine, Store, UpdateDeadline};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::sockets::SocketAddrUse;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

/// How often the epoch ticks; the deadline check runs at each tick.
const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Resource limits for one plugin instance.
#[derive(Debug, Clone, Copy)]
pub struct SandboxLimits {
    /// Longest a single call into the plugin may run (wall clock).
    pub call_deadline: Duration,
    /// Most linear memory the instance may grow to.
    pub memory_bytes: usize,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits { call_deadline: Duration::from_secs(5), memory_bytes: 256 << 20 }
    }
}

/// Network addresses a plugin may connect to. Empty: no network at all.
#[derive(Debug, Clone, Default)]
pub struct NetGrant {
    pub connect: Vec<SocketAddr>,
    /// The trust anchors (PEM) for the plugin's TLS tunnels (`tls_ca` in
    /// its config; `None`: the system's CAs).
    pub tls_ca: Option<std::path::PathBuf>,
}

/// Builds the engine shared by every plugin: epoch interruption for deadlines,
/// and no component-model concurrency (the pull contract does not need it and
/// it costs about a microsecond per call).
pub fn engine() -> anyhow::Result<Engine> {
    let mut config = Config::new();
    config.epoch_interruption(true);
    config.concurrency_support(false);
    // For profiling plugins: perf names their functions from /tmp/perf-PID.map.
    if std::env::var_os("SLUICE_WASM_PERFMAP").is_some() {
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    let engine = Engine::new(&config).map_err(|e| anyhow::anyhow!("creating the wasm engine: {e}"))?;
    start_ticker(&engine);
    Ok(engine)
}

fn start_ticker(engine: &Engine) {
    // The ticker ends by itself once the engine is dropped.
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("wasm-epoch".into())
        .spawn(move || loop {
            std::thread::sleep(EPOCH_TICK);
            match weak.upgrade() {
                Some(engine) => engine.increment_epoch(),
                None => return,
            }
        })
        .expect("spawning the epoch ticker thread");
}

/// Per-Store data.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    memory: MemoryCap,
    /// When the current call must have returned.
    deadline: Instant,
    /// For calls bounded by their running time instead: the epoch ticks the
    /// call may still run for.
    ticks_left: Option<u32>,
    /// The plugin's TLS tunnels (the contract's `tls` interface).
    pub(super) tunnels: super::tls_tunnel::Tunnels,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl HostState {
    /// Starts the clock for one call (wall clock: sources, which wait on I/O).
    pub fn arm_deadline(&mut self, limit: Duration) {
        self.deadline = Instant::now() + limit;
        self.ticks_left = None;
    }

    /// Bounds one call by the time it actually runs, not counting time its
    /// task waits to be scheduled (filters, which never wait on I/O: on a
    /// busy host a well-behaved filter must not be cut off for the time
    /// other tasks ran).
    pub fn arm_running_time(&mut self, limit: Duration) {
        let ticks = (limit.as_millis() / EPOCH_TICK.as_millis()).max(1);
        self.ticks_left = Some(ticks.min(u32::MAX as u128) as u32);
    }

    /// Whether the last failure was the memory cap (for a clearer message).
    pub fn hit_memory_cap(&self) -> bool {
        self.memory.hit
    }
}

struct MemoryCap {
    max: usize,
    hit: bool,
}

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.max {
            self.hit = true;
            wasmtime::bail!("memory limit of {} MiB reached", self.max >> 20);
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
}

/// A fresh Store for one instance of `plugin`.
pub fn new_store(engine: &Engine, plugin: &str, limits: SandboxLimits, net: &NetGrant) -> Store<HostState> {
    let mut wasi = WasiCtxBuilder::new();
    wasi.stderr(LogPipe { plugin: plugin.into() });
    // The grant, and the loopback addresses of the plugin's TLS tunnels
    // while they wait to be dialled.
    let dialable = Arc::new(std::sync::RwLock::new(net.connect.clone()));
    if !net.connect.is_empty() {
        let allowed = dialable.clone();
        wasi.allow_tcp(true).allow_ip_name_lookup(true).socket_addr_check(move |addr, use_| {
            // A connect first binds to the wildcard address implicitly, so
            // binds are allowed; only the destination is checked.
            let ok = match use_ {
                SocketAddrUse::TcpBind => true,
                SocketAddrUse::TcpConnect => allowed.read().unwrap_or_else(|e| e.into_inner()).contains(&addr),
                _ => false,
            };
            Box::pin(async move { ok })
        });
    }
    let state = HostState {
        wasi: wasi.build(),
        table: ResourceTable::new(),
        memory: MemoryCap { max: limits.memory_bytes, hit: false },
        deadline: Instant::now() + limits.call_deadline,
        ticks_left: None,
        tunnels: super::tls_tunnel::Tunnels::new(net.connect.clone(), dialable, net.tls_ca.clone()),
    };
    let mut store = Store::new(engine, state);
    store.limiter(|s| &mut s.memory);
    store.set_epoch_deadline(1);
    // Called once per epoch tick while the guest runs (not while its task
    // is suspended), so counting calls measures running time.
    store.epoch_deadline_callback(|mut ctx| {
        let state = ctx.data_mut();
        let expired = match state.ticks_left.as_mut() {
            Some(0) => true,
            Some(t) => {
                *t -= 1;
                false
            }
            None => Instant::now() >= state.deadline,
        };
        Ok(if expired { UpdateDeadline::Interrupt } else { UpdateDeadline::Yield(1) })
    });
    store
}

/// Guest stderr, line by line, into the host log tagged with the plugin name.
struct LogPipe {
    plugin: Arc<str>,
}

impl IsTerminal for LogPipe {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for LogPipe {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(LogWriter { plugin: self.plugin.clone(), line: Vec::new() })
    }
}

struct LogWriter {
    plugin: Arc<str>,
    line: Vec<u8>,
}

impl LogWriter {
    fn emit(&mut self) {
        let text = String::from_utf8_lossy(&self.line);
        let text = text.trim_end();
        if !text.is_empty() {
            tracing::warn!(plugin = %self.plugin, "plugin stderr: {text}");
        }
        self.line.clear();
    }
}

impl tokio::io::AsyncWrite for LogWriter {
    fn poll_write(mut self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        for &b in buf {
            if b == b'\n' {
                self.emit();
            } else if self.line.len() < 16 << 10 {
                self.line.push(b);
            }
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.emit();
        Poll::Ready(Ok(()))
    }
}

impl Drop for LogWriter {
    fn drop(&mut self) {
        self.emit();
    }
}

/// A readable cause for a failed plugin call.
/// Process-wide counts of calls into plugins of one kind, for `/metrics`.
#[derive(Default)]
pub struct PluginCalls {
    pub calls: std::sync::atomic::AtomicU64,
    pub nanos: std::sync::atomic::AtomicU64,
    pub traps: std::sync::atomic::AtomicU64,
    pub deadline_hits: std::sync::atomic::AtomicU64,
    pub memory_hits: std::sync::atomic::AtomicU64,
}

/// Calls into source plugins (`next-batch`, `ack`).
pub static SOURCE_CALLS: PluginCalls = PluginCalls::new();
/// Calls into filter plugins (`apply`, `table-policy`).
pub static FILTER_CALLS: PluginCalls = PluginCalls::new();

impl PluginCalls {
    const fn new() -> Self {
        use std::sync::atomic::AtomicU64;
        PluginCalls {
            calls: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            traps: AtomicU64::new(0),
            deadline_hits: AtomicU64::new(0),
            memory_hits: AtomicU64::new(0),
        }
    }

    /// One call that began at `started`; a failure is counted by its cause.
    pub fn record<T>(&self, started: std::time::Instant, result: &Result<T, wasmtime::Error>, state: &HostState) {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        self.nanos.fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
        let Err(err) = result else { return };
        if state.hit_memory_cap() {
            self.memory_hits.fetch_add(1, Relaxed);
        } else if let Some(trap) = err.downcast_ref::<wasmtime::Trap>() {
            match trap {
                wasmtime::Trap::Interrupt => self.deadline_hits.fetch_add(1, Relaxed),
                _ => self.traps.fetch_add(1, Relaxed),
            };
        }
    }
}

pub fn describe_failure(err: &wasmtime::Error, state: &HostState, limits: SandboxLimits) -> String {
    if state.hit_memory_cap() {
        return format!("exceeded its memory limit of {} MiB", limits.memory_bytes >> 20);
    }
    if let Some(trap) = err.downcast_ref::<wasmtime::Trap>() {
        return match trap {
            wasmtime::Trap::Interrupt => {
                format!("did not return within its call deadline of {} ms", limits.call_deadline.as_millis())
            }
            wasmtime::Trap::UnreachableCodeReached => "trapped (panicked; see its stderr above)".to_string(),
            other => format!("trapped: {other}"),
        };
    }
    let chain: Vec<String> = err.chain().map(|e| e.to_string()).collect();
    format!("failed: {}", chain.join(": "))
}
