//! Watermarks: Zero's LexiVersion encoding and the resume rule, from the
//! `sluice-watermark` crate the source plugins share.

pub use sluice_watermark::{distance, from_lexi, resumes, to_lexi};
