//! Source plugins: implement [`Source`], export it with
//! [`export_source!`](crate::export_source).
//!
//! ```ignore
//! use sluice_plugin_sdk::types::{Message, PluginError};
//! use sluice_plugin_sdk::{Resume, Source};
//!
//! struct Counter { next: u64 }
//!
//! impl Source for Counter {
//!     fn open(config: &str, resume: Option<Resume>) -> Result<Self, PluginError> { ... }
//!     fn replica_version(&self) -> String { "00".into() }
//!     fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, PluginError> { ... }
//!     fn ack(&mut self, _watermark: &str) -> Result<(), PluginError> { Ok(()) }
//!     // Optional: `fn progress(&mut self) -> Progress` for /status and /metrics.
//! }
//!
//! sluice_plugin_sdk::export_source!(Counter);
//! ```

use std::cell::RefCell;

use crate::source_world::exports::sluice::plugin::source::{ChangeStream, GuestChangeStream, ResumePoint};
pub use crate::source_world::exports::sluice::plugin::source_progress::ProgressReport as Progress;
use crate::types::{Message, PluginError};

/// Where the host's change log stands when a stream is to continue it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// The last durable commit watermark: continue with what follows it.
    pub watermark: String,
    /// The lineage the change log holds.
    pub replica_version: String,
}

/// A change source: one open stream of the upstream's transactions.
///
/// The host calls [`Source::next_batch`] in a loop and [`Source::ack`] once
/// transactions are durable in its change log. Every call runs under a
/// deadline and a memory cap; return [`PluginError::Transient`] for what a
/// reopen may cure (the host backs off and reopens after the last durable
/// watermark) and [`PluginError::Fatal`] or [`PluginError::InvalidConfig`]
/// for what it cannot.
pub trait Source: Sized + 'static {
    /// Opens a stream from the plugin's configuration (JSON text).
    ///
    /// With `resume`, continue after `resume.watermark`. Without it, start a
    /// new lineage: its first transaction is the initial snapshot. The resume
    /// rule is applied already: a change log holding nothing past its
    /// replica version (its snapshot was never stored) comes as `None`.
    fn open(config: &str, resume: Option<Resume>) -> Result<Self, PluginError>;

    /// The lineage this stream's watermarks belong to.
    fn replica_version(&self) -> String;

    /// Up to `max` messages; an empty batch means nothing right now (wait a
    /// little first rather than return at once: the host calls again).
    fn next_batch(&mut self, max: u32) -> Result<Vec<Message>, PluginError>;

    /// Everything through `watermark` is durable in the change log.
    fn ack(&mut self, watermark: &str) -> Result<(), PluginError>;

    /// How far the stream is from its upstream, for `/status` and
    /// `/metrics`: the bytes of upstream log not read yet, and while the
    /// initial snapshot runs, about how many rows it holds. Asked about once
    /// a second under the call deadline; the default knows neither.
    fn progress(&mut self) -> Progress {
        Progress { behind_bytes: None, snapshot_rows_estimate: None }
    }
}

/// The `change-stream` resource around a [`Source`].
#[doc(hidden)]
pub struct Stream<S>(RefCell<S>);

impl<S: Source> GuestChangeStream for Stream<S> {
    fn replica_version(&self) -> String {
        self.0.borrow().replica_version()
    }

    fn next_batch(&self, max: u32) -> Result<Vec<Message>, PluginError> {
        self.0.borrow_mut().next_batch(max)
    }

    fn ack(&self, watermark: String) -> Result<(), PluginError> {
        self.0.borrow_mut().ack(&watermark)
    }
}

impl<S: Source> Stream<S> {
    /// The WIT `source-progress.progress`, for [`export_source!`](crate::export_source).
    #[doc(hidden)]
    pub fn progress(&self) -> Progress {
        self.0.borrow_mut().progress()
    }
}

/// The WIT `open`, for [`export_source!`](crate::export_source).
#[doc(hidden)]
pub fn open<S: Source>(config: String, resume: Option<ResumePoint>) -> Result<ChangeStream, PluginError> {
    let resume = resume
        .filter(|r| crate::watermark::resumes(&r.watermark, &r.replica_version))
        .map(|r| Resume { watermark: r.watermark, replica_version: r.replica_version });
    Ok(ChangeStream::new(Stream(RefCell::new(S::open(&config, resume)?))))
}

/// Exports a [`Source`] as the `source-plugin` component. Invoke it once,
/// at the root of a `cdylib` crate built for `wasm32-wasip2`.
#[macro_export]
macro_rules! export_source {
    ($source:ty) => {
        #[doc(hidden)]
        struct SluiceSourcePlugin;

        impl $crate::source_world::exports::sluice::plugin::source::Guest for SluiceSourcePlugin {
            type ChangeStream = $crate::source::Stream<$source>;

            fn open(
                config: String,
                resume: Option<$crate::source_world::exports::sluice::plugin::source::ResumePoint>,
            ) -> Result<$crate::source_world::exports::sluice::plugin::source::ChangeStream, $crate::types::PluginError>
            {
                $crate::source::open::<$source>(config, resume)
            }
        }

        impl $crate::source_world::exports::sluice::plugin::source_progress::Guest for SluiceSourcePlugin {
            fn progress(
                of: $crate::source_world::exports::sluice::plugin::source::ChangeStreamBorrow<'_>,
            ) -> $crate::source::Progress {
                of.get::<$crate::source::Stream<$source>>().progress()
            }
        }

        $crate::source_world::export_source_world!(SluiceSourcePlugin with_types_in $crate::source_world);
    };
}
