//! redact: drop columns, or replace their values with a mask or a keyed hash
//! (the logic is `filter_kit::redact`).

sluice_plugin_sdk::export_filter!(filter_kit::redact::Redact);
