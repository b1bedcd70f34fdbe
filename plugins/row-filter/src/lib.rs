//! row-filter: a predicate on column values, with row movement (the logic
//! is `filter_kit::row`).

filter_kit::export_filter!(filter_kit::row::RowFilter);
