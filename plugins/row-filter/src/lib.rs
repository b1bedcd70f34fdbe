//! row-filter: a predicate on column values, with row movement (the logic
//! is `filter_kit::row`).

sluice_plugin_sdk::export_filter!(filter_kit::row::RowFilter);
