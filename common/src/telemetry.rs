//! Logs (tracing) and metrics (Prometheus) set up the same way in every binary.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

/// Buckets for every `*_seconds` histogram: 1 ms to 5 min.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

/// Logs to stderr, as text or JSON lines, filtered by `RUST_LOG` (default `info`).
pub fn init_tracing(json: bool) {
    init_tracing_at(json, "info");
}

/// [`init_tracing`] with another default filter (the command line keeps to `warn`, so its
/// output is what it prints).
pub fn init_tracing_at(json: bool, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colours only for a terminal: a log file or a collector gets plain `key=value` text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // A second init (tests starting several services in one process) keeps the first.
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

/// The installed recorder's handle, so an HTTP API can serve `/metrics` too.
static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Serves Prometheus metrics at `http://<addr>/metrics` and installs the global recorder.
/// Call inside the Tokio runtime.
///
/// # Errors
/// The address cannot be bound, or a recorder is already installed.
pub fn install_metrics(addr: SocketAddr) -> Result<(), BuildError> {
    // Histograms keep their samples until the upkeep drains them: every second, so a busy
    // process holds a second of them (the crate's default is five).
    let (recorder, exporter) = PrometheusBuilder::new()
        .with_http_listener(addr)
        .upkeep_timeout(std::time::Duration::from_secs(1))
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .build()?;
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)?;
    tokio::spawn(exporter);
    let _ = HANDLE.set(handle);
    Ok(())
}

/// The metrics in the Prometheus text format, if [`install_metrics`] ran in this process.
pub fn render_metrics() -> Option<String> {
    HANDLE.get().map(PrometheusHandle::render)
}

/// Runs this program again, in place (same process id, arguments and environment), with
/// `MALLOC_ARENA_MAX=2` and fixed trim and mmap thresholds of 128 KiB — unless
/// `MALLOC_ARENA_MAX` is set already, which it then is. For the processors and the relay,
/// which use glibc's allocator:
/// - glibc gives each thread that allocates an arena of its own (up to eight a core) and
///   keeps what is freed in each, so a burst whose messages are allocated on one thread and
///   freed on others held 74-82 MiB at its peak; in two arenas it peaked at 59 MiB, at the
///   same CPU per job (`jobfold bench`, 50,000 jobs);
/// - glibc raises its thresholds each time a large block is freed (librdkafka's decompressed
///   message sets), after which it keeps up to twice that free in each arena: the processor
///   that ran the 50,000-job bursts peaked at 64-76 MiB, and at 58.5 MiB with the thresholds
///   fixed, at the same throughput.
///
/// The variables are read by glibc only as a program starts, hence the second start. If it
/// cannot start again, it goes on as it is, and says so.
pub fn at_most_two_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        const VAR: &str = "MALLOC_ARENA_MAX";
        const THRESHOLDS: [(&str, &str); 2] =
            [("MALLOC_TRIM_THRESHOLD_", "131072"), ("MALLOC_MMAP_THRESHOLD_", "131072")];
        if std::env::var_os(VAR).is_some() {
            return;
        }
        let Ok(program) = std::env::current_exe() else { return };
        let mut args = std::env::args_os();
        let mut again = std::process::Command::new(program);
        if let Some(name) = args.next() {
            again.arg0(name);
        }
        for (name, value) in THRESHOLDS {
            if std::env::var_os(name).is_none() {
                again.env(name, value);
            }
        }
        // Returns only if it failed.
        let e = again.args(args).env(VAR, "2").exec();
        eprintln!("running with glibc's default malloc arenas ({VAR} unset): {e}");
    }
}

/// Turns transparent huge pages off for this process (`prctl(PR_SET_THP_DISABLE)`), before
/// it allocates much. Where they apply to the heap (the kernel's THP mode `always`, or an
/// allocator that asks for them, as mimalloc, the command line's, does with
/// `madvise(MADV_HUGEPAGE)`), `khugepaged` collapses heap regions into 2 MiB pages long after
/// start, whether the memory in them is in use or not: in the soak, under mimalloc, the
/// processor's resident set stepped up by 15-20 MiB about 22 minutes in, with the heap in
/// use unchanged. Without them the resident set is what the process uses. Nothing to do (and
/// no error) where the kernel has no THP.
pub fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        eprintln!("transparent huge pages stay on for this process: {e}");
    }
}
