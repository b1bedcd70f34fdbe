//! Zero's upstream tables for one app and shard, created in the upstream the
//! way zero-cache's own Postgres set-up creates them, so that they are
//! replicated like any table:
//!
//! * `<app>.permissions`: one row (`lock` true) holding the app's compiled
//!   permissions (`npx zero-deploy-permissions` writes it), with the
//!   trigger that keeps its `hash`;
//! * `<app>_<shard>.clients`: each client's last mutation ID, which CRUD
//!   mutations bump in the upstream and view-syncers read back from the
//!   stream to confirm them;
//! * `<app>_<shard>.mutations`: custom mutators' results. It has
//!   zero-cache's `result` column and also the `mutation` column that
//!   zero-cache's custom-source initial sync requires, so one upstream
//!   serves both (`/changes/v0/stream` and view-syncers).
//!
//! Everything is created only if missing, and published in
//! `_<app>_metadata_<shard>`, which the slot streams beside the configured
//! publications.

use serde::Deserialize;

/// `"zero": {"app_id": "zero", "shard_num": 0}` in the source config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZeroShard {
    #[serde(default = "default_app_id")]
    pub app_id: String,
    #[serde(default)]
    pub shard_num: u32,
}

fn default_app_id() -> String {
    "zero".into()
}

impl ZeroShard {
    /// Zero's rule for app IDs: lower-case letters, digits and `_`.
    pub fn check(&self) -> Result<(), String> {
        let ok = !self.app_id.is_empty()
            && self.app_id.len() <= 40
            && self.app_id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if ok {
            Ok(())
        } else {
            Err(format!("postgres source config: zero.app_id {:?}: use lower-case letters, digits and _", self.app_id))
        }
    }

    /// The publication of the three tables.
    pub fn publication(&self) -> String {
        format!("_{}_metadata_{}", self.app_id, self.shard_num)
    }

    /// Idempotent set-up statements (names are checked by [`Self::check`]).
    pub fn setup_sql(&self) -> String {
        let app = &self.app_id;
        let shard = format!("{app}_{}", self.shard_num);
        let publication = self.publication();
        format!(
            r#"
CREATE SCHEMA IF NOT EXISTS "{app}";
CREATE TABLE IF NOT EXISTS "{app}".permissions (
  "permissions" JSONB,
  "hash"        TEXT,
  "lock"        BOOL PRIMARY KEY DEFAULT true CHECK (lock)
);
CREATE OR REPLACE FUNCTION "{app}".set_permissions_hash() RETURNS TRIGGER AS $$
BEGIN
  NEW.hash = md5(NEW.permissions::text);
  RETURN NEW;
END;
$$ LANGUAGE plpgsql;
CREATE OR REPLACE TRIGGER on_set_permissions BEFORE INSERT OR UPDATE ON "{app}".permissions
  FOR EACH ROW EXECUTE FUNCTION "{app}".set_permissions_hash();
INSERT INTO "{app}".permissions (permissions) VALUES (NULL) ON CONFLICT DO NOTHING;
CREATE SCHEMA IF NOT EXISTS "{shard}";
CREATE TABLE IF NOT EXISTS "{shard}".clients (
  "clientGroupID"  TEXT NOT NULL,
  "clientID"       TEXT NOT NULL,
  "lastMutationID" BIGINT NOT NULL,
  "userID"         TEXT,
  PRIMARY KEY ("clientGroupID", "clientID")
);
CREATE TABLE IF NOT EXISTS "{shard}".mutations (
  "clientGroupID" TEXT NOT NULL,
  "clientID"      TEXT NOT NULL,
  "mutationID"    BIGINT NOT NULL,
  "result"        JSON NOT NULL,
  "mutation"      JSON,
  PRIMARY KEY ("clientGroupID", "clientID", "mutationID")
);
DO $$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = '{publication}') THEN
    CREATE PUBLICATION "{publication}"
      FOR TABLE "{app}".permissions, "{shard}".clients, "{shard}".mutations;
  END IF;
END $$;
"#
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_zero() {
        let shard = ZeroShard { app_id: "my_app".into(), shard_num: 2 };
        assert!(shard.check().is_ok());
        assert_eq!(shard.publication(), "_my_app_metadata_2");
        let sql = shard.setup_sql();
        assert!(sql.contains(r#""my_app_2".clients"#) && sql.contains(r#""my_app".permissions"#));
        for bad in ["", "App", "a-b", "a\"b"] {
            assert!(ZeroShard { app_id: bad.into(), shard_num: 0 }.check().is_err(), "{bad:?}");
        }
    }
}
