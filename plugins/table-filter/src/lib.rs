//! table-filter: include or exclude tables by `schema.table` glob patterns
//! (the logic is `filter_kit::table`).

sluice_plugin_sdk::export_filter!(filter_kit::table::TableFilter);
