//! One layering for every setting, through clap's own value sources.
//! Highest first:
//!
//! 1. the command line (a global flag such as `--log-format` before or
//!    after the subcommand);
//! 2. `SLUICE_*` variables;
//! 3. the TOML file named by `--config FILE` (anywhere on the line) or
//!    `SLUICE_CONFIG`, whose keys are the flags' long names (`listen`,
//!    `log-format`, `allow-filter = ["redact"]`; `_` may stand for `-`);
//! 4. the built-in defaults.
//!
//! The file's values become the flags' defaults before clap parses, so
//! clap validates them as it does a flag, and a flag or variable that is
//! given still wins. The file serves `run` and the global flags; an admin
//! command that shares a flag with `run` (`--change-db`, `--token`) reads
//! it from the same file. `source-config` may be a TOML table; it reaches
//! the source as JSON.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::error::ErrorKind;

/// The subcommand whose flags a file may set (besides the global ones).
const FILE_COMMAND: &str = "run";
/// Flags whose value is JSON, which the file may also give as a table.
const JSON_FLAGS: &[&str] = &["source-config"];
/// Flags a file must not set: another file, or consent to delete.
const NOT_IN_FILE: &[&str] = &["config", "yes", "force", "help", "version"];

/// Parses `argv` (program name first) as `C`, with the file layer.
pub fn parse<C: clap::Parser>(argv: impl IntoIterator<Item = impl Into<OsString>>) -> Result<C, clap::Error> {
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let mut command = C::command();
    if let Some(file) = config_file(&argv) {
        command = with_file(command, &file).map_err(|e| clap::Error::raw(ErrorKind::InvalidValue, format!("{e}\n")))?;
    }
    let matches = command.try_get_matches_from_mut(argv)?;
    <C as clap::FromArgMatches>::from_arg_matches(&matches)
}

/// `--config FILE` or `--config=FILE` anywhere before `--`, else `SLUICE_CONFIG`.
fn config_file(argv: &[OsString]) -> Option<PathBuf> {
    let mut args = argv.iter().skip(1).map(|a| a.to_string_lossy());
    while let Some(arg) = args.next() {
        if arg == "--" {
            break;
        }
        if let Some(file) = arg.strip_prefix("--config=") {
            return Some(PathBuf::from(file));
        }
        if arg == "--config" {
            return args.next().map(|f| PathBuf::from(f.as_ref()));
        }
    }
    std::env::var_os("SLUICE_CONFIG").map(PathBuf::from)
}

/// `command` with the settings in `file` as its flags' defaults.
fn with_file(mut command: clap::Command, file: &Path) -> Result<clap::Command, String> {
    let at = |what: String| format!("--config {}: {what}", file.display());
    let text = std::fs::read_to_string(file).map_err(|e| at(format!("cannot read it: {e}")))?;
    let table: toml::Table = text.parse().map_err(|e| at(format!("not valid TOML: {e}")))?;
    for (key, value) in table {
        let name = key.replace('_', "-");
        let settable = |c: &clap::Command| c.get_arguments().any(|a| a.get_long() == Some(name.as_str()));
        let known = settable(&command) || command.find_subcommand(FILE_COMMAND).is_some_and(settable);
        if NOT_IN_FILE.contains(&name.as_str()) || !known {
            return Err(at(format!(
                "unknown setting {key:?} (settings are named as the flags of `sluice {FILE_COMMAND}` and the global flags)"
            )));
        }
        let values = file_values(&name, value).map_err(|e| at(format!("{key}: {e}")))?;
        command = set_defaults(command, &name, &values);
    }
    Ok(command)
}

/// A TOML value as the flag's values (text, as on a command line).
fn file_values(name: &str, value: toml::Value) -> Result<Vec<String>, String> {
    let items = match value {
        toml::Value::Array(items) => items,
        one => vec![one],
    };
    items
        .into_iter()
        .map(|v| match v {
            toml::Value::String(s) => Ok(s),
            toml::Value::Boolean(b) => Ok(b.to_string()),
            toml::Value::Integer(n) => Ok(n.to_string()),
            toml::Value::Float(n) => Ok(n.to_string()),
            toml::Value::Table(t) if JSON_FLAGS.contains(&name) => {
                serde_json::to_string(&t).map_err(|e| format!("cannot be written as JSON: {e}"))
            }
            other => Err(format!("{other}: expected a string, number, boolean or a list of them")),
        })
        .collect()
}

/// Sets the defaults of every flag named `--name`, in `command` and in all
/// its subcommands.
fn set_defaults(command: clap::Command, name: &str, values: &[String]) -> clap::Command {
    command
        .mut_args(|arg| {
            if arg.get_long() != Some(name) {
                return arg;
            }
            // A flag the file sets is no longer required on the command line.
            arg.required(false).default_values(values.iter().map(|v| clap::builder::OsStr::from(v.clone())))
        })
        .mut_subcommands(|sub| set_defaults(sub, name, values))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use crate::settings::LogFormat;

    fn file(text: &str) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sluice.toml");
        std::fs::write(&path, text).unwrap();
        let path = path.display().to_string();
        (dir, path)
    }

    fn run_settings(cli: Cli) -> crate::settings::Settings {
        match cli.command {
            Command::Run(settings) => *settings,
            _ => panic!("not run"),
        }
    }

    #[test]
    fn a_global_flag_before_the_subcommand_does_not_hide_the_file() {
        let (_dir, path) = file("source = \"mock-source\"\nlisten = \"127.0.0.1:7\"\n");
        let cli: Cli = parse(["sluice", "--log-format", "json", "run", "--config", &path]).unwrap();
        assert_eq!(cli.log_format, LogFormat::Json);
        let settings = run_settings(cli);
        assert_eq!(settings.source, "mock-source");
        assert_eq!(settings.listen, "127.0.0.1:7");

        // `--config` itself may come first too.
        let cli: Cli = parse(["sluice", &format!("--config={path}"), "run"]).unwrap();
        assert_eq!(run_settings(cli).source, "mock-source");
    }

    #[test]
    fn a_global_flag_can_be_set_in_the_file_and_the_command_line_wins() {
        let (_dir, path) = file("log-format = \"json\"\nsource = \"mock-source\"\n");
        let cli: Cli = parse(["sluice", "run", "--config", &path]).unwrap();
        assert_eq!(cli.log_format, LogFormat::Json);
        let cli: Cli = parse(["sluice", "run", "--config", &path, "--log-format", "text"]).unwrap();
        assert_eq!(cli.log_format, LogFormat::Text);
        let cli: Cli = parse(["sluice", "--log-format=text", "run", "--config", &path]).unwrap();
        assert_eq!(cli.log_format, LogFormat::Text);

        let (_dir, path) = file("log-format = \"yaml\"\n");
        let e = parse::<Cli>(["sluice", "run", "--config", &path, "--source", "x"]).err().unwrap().to_string();
        assert!(e.contains("yaml"), "{e}");
    }

    #[test]
    fn the_source_config_may_be_a_toml_table() {
        let (_dir, path) = file(
            "source = \"mariadb-source\"\n[source-config]\nhost = \"db\"\nport = 3306\ntables = [\"shop.orders\"]\n",
        );
        let settings = run_settings(parse(["sluice", "run", "--config", &path]).unwrap());
        let config: serde_json::Value = serde_json::from_str(&settings.source_config).unwrap();
        assert_eq!(config, serde_json::json!({"host": "db", "port": 3306, "tables": ["shop.orders"]}));

        // As JSON text it still works, and the command line still wins.
        let (_dir, path) = file("source = \"mock-source\"\nsource-config = '{\"rows\": 3}'\n");
        let settings = run_settings(parse(["sluice", "run", "--config", &path]).unwrap());
        assert_eq!(settings.source_config, "{\"rows\": 3}");
        let settings =
            run_settings(parse(["sluice", "run", "--config", &path, "--source-config", "{\"rows\": 4}"]).unwrap());
        assert_eq!(settings.source_config, "{\"rows\": 4}");
    }

    #[test]
    fn every_kind_of_value_and_the_mistakes_are_named() {
        let (_dir, path) = file(
            "source = \"mock-source\"\ntask_id = \"from-file\"\nauto-reset = true\nallow-filter = [\"a\", \"b\"]\n\
             lag_grace_secs = 7\nsync = \"normal\"\nchange-db = \"sqlite:x/log.db\"\n",
        );
        let settings = run_settings(parse(["sluice", "run", "--config", &path, "--listen", "127.0.0.1:9"]).unwrap());
        assert_eq!(settings.listen, "127.0.0.1:9");
        assert_eq!(settings.task_id, "from-file");
        assert!(settings.auto_reset);
        assert_eq!(settings.allow_filter.as_deref(), Some(&["a".to_string(), "b".to_string()][..]));
        assert_eq!(settings.lag_grace_secs, 7);
        assert_eq!(settings.sync, crate::storage::sqlite::Durability::Normal);
        assert_eq!(settings.log_store().describe(), "SQLite x/log.db");

        // An admin command reads the flags it shares with `run`.
        let cli: Cli = parse(["sluice", "log", "inspect", "--config", &path]).unwrap();
        let Command::Log { command: crate::cli::LogCommand::Inspect { log, .. } } = cli.command else { panic!() };
        assert_eq!(log.store().describe(), "SQLite x/log.db");

        for (text, expected) in [
            ("lissten = \"x\"\n", "unknown setting \"lissten\""),
            ("config = \"other.toml\"\n", "unknown setting \"config\""),
            ("yes = true\n", "unknown setting \"yes\""),
            ("[listen]\nx = 1\n", "listen: "),
            ("listen = \n", "not valid TOML"),
            ("lag-grace-secs = \"soon\"\nsource = \"m\"\n", "soon"),
        ] {
            let (_dir, path) = file(text);
            let e = parse::<Cli>(["sluice", "run", "--config", &path]).err().unwrap().to_string();
            assert!(e.contains(expected), "{text}: {e}");
        }
        let e = parse::<Cli>(["sluice", "run", "--config", "/nonexistent/sluice.toml"]).err().unwrap().to_string();
        assert!(e.contains("cannot read it"), "{e}");
    }

    #[test]
    fn the_packaged_settings_file_parses() {
        let packaged = include_str!("../../../packaging/sluice.toml");
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("source.json");
        std::fs::write(&source, r#"{"url": "postgres://sluice@db/app"}"#).unwrap();
        let text = packaged.replace("@/etc/sluice/source.json", &format!("@{}", source.display()));
        let (_file_dir, path) = file(&text);
        let settings = run_settings(parse(["sluice", "run", "--config", &path]).unwrap());
        assert_eq!(settings.source, "postgres");
        assert_eq!(settings.source_config, r#"{"url": "postgres://sluice@db/app"}"#);
        assert_eq!(settings.listen, "0.0.0.0:4849");
        assert_eq!(settings.retain_secs, Some(3600));
        assert_eq!(settings.log_store().describe(), "SQLite /var/lib/sluice/changelog.db");
    }
}
