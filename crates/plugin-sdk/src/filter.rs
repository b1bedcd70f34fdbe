//! Filter plugins: implement [`Filter`], export it with
//! [`export_filter!`](crate::export_filter). The bundled filters
//! (`plugins/filter-kit`) are written this way.

use crate::filter_world::exports::sluice::plugin::filter::{Batch, Decision, TablePolicy};

/// How a filter treats one table's row changes (the WIT `table-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Every row change of the table is kept, without being sent.
    KeepAll,
    /// Every row change of the table is dropped, without being sent.
    DropAll,
    /// Each row change is sent to [`Filter::decide`].
    Inspect,
}

/// What becomes of one change (the WIT `decision`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    Drop,
    /// The change object to send instead (JSON text).
    Replace(String),
}

/// A filter's logic, independent of the plugin boundary (so it can be
/// tested and benchmarked natively).
pub trait Filter: Sized + 'static {
    /// Builds the filter from the subscriber's configuration (JSON text).
    fn from_config(config: &str) -> Result<Self, String>;
    fn policy(&self, schema: &str, table: &str) -> Policy;
    /// Decides one change object (`tag` and its JSON text).
    fn decide(&self, tag: &str, json: &str) -> Verdict;
    /// The columns the filter judges rows by (the WIT `row-columns`), if it
    /// reads only a few: the host then finds their values for it.
    fn row_columns(&self) -> Option<Vec<String>> {
        None
    }
    /// Decides one change with the host's spans of [`Filter::row_columns`]
    /// in it ([`crate::scan::ColumnLocator`]'s layout: four numbers per
    /// column).
    fn decide_located(&self, tag: &str, json: &str, _spans: &[u32]) -> Verdict {
        self.decide(tag, json)
    }
}

/// The change texts of a batch (`texts` cut at `ends`); a bad offset ends
/// the iteration early, which the host reports as a wrong decision count.
pub fn split<'a>(texts: &'a str, ends: &'a [u32]) -> impl Iterator<Item = &'a str> + 'a {
    let mut start = 0usize;
    ends.iter().map_while(move |&end| {
        let piece = texts.get(start..end as usize)?;
        start = end as usize;
        Some(piece)
    })
}

/// The `change-filter` resource around a [`Filter`], with how many
/// `row-columns` it named.
#[doc(hidden)]
pub struct Instance<F> {
    filter: F,
    columns: usize,
}

impl<F: Filter> Instance<F> {
    #[doc(hidden)]
    pub fn create(config: &str) -> Result<Self, String> {
        let filter = F::from_config(config)?;
        let columns = filter.row_columns().map_or(0, |c| c.len());
        Ok(Instance { filter, columns })
    }

    #[doc(hidden)]
    pub fn table_policy(&self, schema: &str, name: &str) -> TablePolicy {
        match self.filter.policy(schema, name) {
            Policy::KeepAll => TablePolicy::KeepAll,
            Policy::DropAll => TablePolicy::DropAll,
            Policy::Inspect => TablePolicy::Inspect,
        }
    }

    #[doc(hidden)]
    pub fn row_columns(&self) -> Option<Vec<String>> {
        self.filter.row_columns()
    }

    #[doc(hidden)]
    pub fn apply(&self, batch: &Batch) -> Vec<Decision> {
        let per_change = 4 * self.columns;
        // Sized up front: a collected `map_while` would grow step by step.
        let mut decisions = Vec::with_capacity(batch.ends.len());
        decisions.extend(split(&batch.texts, &batch.ends).enumerate().map(|(i, json)| {
            let tag = crate::scan::tag_of(json);
            let verdict = if per_change == 0 {
                self.filter.decide(tag, json)
            } else {
                let spans = batch.spans.get(i * per_change..(i + 1) * per_change).unwrap_or(&[]);
                self.filter.decide_located(tag, json, spans)
            };
            match verdict {
                Verdict::Keep => Decision::Keep,
                Verdict::Drop => Decision::Drop,
                Verdict::Replace(text) => Decision::Replace(text),
            }
        }));
        decisions
    }
}

/// Exports a [`Filter`] as the `filter-plugin` component. Invoke it once,
/// at the root of a `cdylib` crate built for `wasm32-wasip2`.
#[macro_export]
macro_rules! export_filter {
    ($filter:ty) => {
        #[doc(hidden)]
        struct SluiceFilterPlugin;

        #[doc(hidden)]
        struct SluiceFilterInstance($crate::filter::Instance<$filter>);

        impl $crate::filter_world::exports::sluice::plugin::filter::Guest for SluiceFilterPlugin {
            type ChangeFilter = SluiceFilterInstance;

            fn create(
                config: String,
            ) -> Result<$crate::filter_world::exports::sluice::plugin::filter::ChangeFilter, $crate::types::PluginError>
            {
                let instance = $crate::filter::Instance::<$filter>::create(&config)
                    .map_err($crate::types::PluginError::InvalidConfig)?;
                Ok($crate::filter_world::exports::sluice::plugin::filter::ChangeFilter::new(SluiceFilterInstance(
                    instance,
                )))
            }
        }

        impl $crate::filter_world::exports::sluice::plugin::filter::GuestChangeFilter for SluiceFilterInstance {
            fn table_policy(
                &self,
                schema: String,
                name: String,
            ) -> $crate::filter_world::exports::sluice::plugin::filter::TablePolicy {
                self.0.table_policy(&schema, &name)
            }

            fn row_columns(&self) -> Option<Vec<String>> {
                self.0.row_columns()
            }

            fn apply(
                &self,
                batch: $crate::filter_world::exports::sluice::plugin::filter::Batch,
            ) -> Vec<$crate::filter_world::exports::sluice::plugin::filter::Decision> {
                self.0.apply(&batch)
            }
        }

        $crate::filter_world::export_filter_world!(SluiceFilterPlugin with_types_in $crate::filter_world);
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keeps inserts, drops deletes, replaces updates with their tag.
    struct ByTag;

    impl Filter for ByTag {
        fn from_config(config: &str) -> Result<Self, String> {
            (config == "{}").then_some(ByTag).ok_or_else(|| format!("unexpected config {config}"))
        }
        fn policy(&self, _schema: &str, table: &str) -> Policy {
            if table == "hidden" {
                Policy::DropAll
            } else {
                Policy::Inspect
            }
        }
        fn decide(&self, tag: &str, _json: &str) -> Verdict {
            match tag {
                "insert" => Verdict::Keep,
                "delete" => Verdict::Drop,
                other => Verdict::Replace(format!("{{\"tag\":\"{other}\"}}")),
            }
        }
    }

    #[test]
    fn an_instance_answers_for_its_filter_change_by_change() {
        assert!(Instance::<ByTag>::create("[]").err().unwrap().contains("unexpected config"));
        let instance = Instance::<ByTag>::create("{}").unwrap();
        assert_eq!(instance.table_policy("public", "hidden"), TablePolicy::DropAll);
        let changes = [r#"{"tag":"insert"}"#, r#"{"tag":"delete"}"#, r#"{"tag":"update","x":1}"#];
        let mut texts = String::new();
        let mut ends = Vec::new();
        for c in changes {
            texts.push_str(c);
            ends.push(texts.len() as u32);
        }
        let decisions = instance.apply(&Batch { texts: texts.clone(), ends: ends.clone(), spans: Vec::new() });
        assert_eq!(decisions, [Decision::Keep, Decision::Drop, Decision::Replace(r#"{"tag":"update"}"#.into())]);
        // An offset past the texts ends the batch early: the host sees a
        // wrong count and names the filter.
        ends[1] = 10_000;
        assert_eq!(instance.apply(&Batch { texts, ends, spans: Vec::new() }).len(), 1);
    }
}
