//! Admin commands of the `sluice` binary: talking to a running Sluice
//! (`sluice reload`), and working on what Sluice keeps (the change log) or
//! created upstream (the Postgres slot and publication).

pub mod http;
pub mod log;
pub mod postgres;
