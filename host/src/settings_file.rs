//! `sluice run --config FILE`: settings from a TOML file, named as the flags
//! are. Precedence, highest first: the command line, then `SLUICE_*`
//! variables, then the file, then the defaults. The file's settings become
//! flags appended to the command line unless the flag or its variable is
//! already given, so clap validates them all alike.

use std::path::Path;

use anyhow::{bail, Context};

/// The flags `file` adds to `argv` (the arguments after `run`). `command` is
/// `run`'s definition, for the names and variables of its flags.
pub fn flags_from_file(file: &Path, command: &clap::Command, argv: &[String]) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading --config {}", file.display()))?;
    let table: toml::Table = text.parse().with_context(|| format!("--config {}: not valid TOML", file.display()))?;
    let mut flags = Vec::new();
    for (key, value) in table {
        let name = key.replace('_', "-");
        let Some(arg) = command.get_arguments().find(|a| a.get_long() == Some(name.as_str())) else {
            bail!("--config {}: unknown setting {key:?} (settings are named as `sluice run` flags)", file.display());
        };
        if name == "config" {
            bail!("--config {}: a config file cannot name another", file.display());
        }
        let given = argv.iter().any(|a| a == &format!("--{name}") || a.starts_with(&format!("--{name}=")));
        let from_env = arg.get_env().is_some_and(|v| std::env::var_os(v).is_some());
        if given || from_env {
            continue;
        }
        let values = match value {
            toml::Value::Array(items) => items,
            one => vec![one],
        };
        for v in values {
            match v {
                toml::Value::Boolean(true) => flags.push(format!("--{name}")),
                toml::Value::Boolean(false) => {}
                toml::Value::String(s) => flags.push(format!("--{name}={s}")),
                toml::Value::Integer(n) => flags.push(format!("--{name}={n}")),
                toml::Value::Float(n) => flags.push(format!("--{name}={n}")),
                other => {
                    bail!("--config {}: {key} = {other}: expected a string, number, boolean or a list", file.display())
                }
            }
        }
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Args {
        #[arg(long, default_value = "127.0.0.1:4849")]
        listen: String,
        #[arg(long, env = "SLUICE_SETTINGS_TEST_TASK_ID")]
        task_id: Option<String>,
        #[arg(long)]
        auto_reset: bool,
        #[arg(long = "allow-filter")]
        allow_filter: Vec<String>,
        #[arg(long, default_value_t = 1)]
        lag_grace_secs: u64,
    }

    #[test]
    fn the_command_line_wins_over_the_file() {
        use clap::{CommandFactory, Parser};
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sluice.toml");
        std::fs::write(
            &file,
            "listen = \"0.0.0.0:1\"\ntask_id = \"from-file\"\nauto-reset = true\nallow-filter = [\"a\", \"b\"]\nlag_grace_secs = 7\n",
        )
        .unwrap();
        let argv = vec!["--listen".to_string(), "127.0.0.1:9".to_string()];
        let flags = flags_from_file(&file, &Args::command(), &argv).unwrap();
        let args = Args::parse_from(std::iter::once("x".to_string()).chain(argv).chain(flags));
        assert_eq!(args.listen, "127.0.0.1:9");
        assert_eq!(args.task_id.as_deref(), Some("from-file"));
        assert!(args.auto_reset);
        assert_eq!(args.allow_filter, ["a", "b"]);
        assert_eq!(args.lag_grace_secs, 7);

        std::fs::write(&file, "lissten = \"x\"\n").unwrap();
        let e = flags_from_file(&file, &Args::command(), &[]).unwrap_err().to_string();
        assert!(e.contains("unknown setting \"lissten\""), "{e}");
    }
}
