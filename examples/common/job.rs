//! Job files: every command-line flag of a binary is also a key of a TOML file, grouped in
//! sections (torchtitan's `[model]`, `[optimizer]`, `[training]`, ... layout), so a job can
//! be saved, shared and diffed instead of retyped.
//!
//! - `--config job.toml` reads the file; flags on the command line override it (the file's
//!   keys become flags placed *before* the command line's, and a later occurrence of a flag
//!   wins).
//! - Keys are the flags' long names (`seq-len`, `no-fsdp`); a switch takes `true` or `false`,
//!   a flag with a value takes a string or a number, a repeatable flag an array.
//! - [`resolved`] prints the resolved job (every flag with its value, defaults included) as a
//!   job file, so `--print-config` output fed back with `--config` gives the same run.
//! - Unknown keys, keys in the wrong section, and values of the wrong kind are errors naming
//!   the file, the key and (for a misspelling) the closest known key; a value clap cannot
//!   parse is reported with the key it came from.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::{ArgAction, ArgMatches, Command, FromArgMatches};

/// Flags that are not job settings (they act on the job file itself, or are clap's own).
const NOT_KEYS: [&str; 4] = ["help", "version", "config", "print-config"];

/// The sections of a job file: `(section, flags)` with flags by long name.
pub type Sections = &'static [(&'static str, &'static [&'static str])];

/// A job file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// Reading the file failed.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not TOML.
    #[error("{path}: not a valid TOML file: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A key no flag has.
    #[error("{path}: unknown key `{key}`{}", suggestion(.closest))]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// `section.key` as written.
        key: String,
        /// The closest known `section.key`.
        closest: Option<String>,
    },
    /// A section no job file has, or a top-level value outside any section.
    #[error("{path}: unknown section `[{section}]` (sections: {known})")]
    UnknownSection {
        /// The file.
        path: PathBuf,
        /// The section as written.
        section: String,
        /// The known sections.
        known: String,
    },
    /// A value of the wrong kind for its key.
    #[error("{path}: key `{key}`: {problem}")]
    Value {
        /// The file.
        path: PathBuf,
        /// `section.key`.
        key: String,
        /// What is wrong.
        problem: String,
    },
    /// clap refused the resolved arguments (a value it cannot parse, a bad combination).
    #[error("{origin}{message}")]
    Args {
        /// `"<file>: key `x`: "` when the value came from the job file, else empty.
        origin: String,
        /// clap's message.
        message: String,
    },
}

fn suggestion(closest: &Option<String>) -> String {
    match closest {
        Some(c) => format!(" (did you mean `{c}`?)"),
        None => String::new(),
    }
}

/// Every flag of `cmd` that is a job setting, by long name.
fn keys(cmd: &Command) -> Vec<String> {
    cmd.get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .filter(|l| !NOT_KEYS.contains(&l.as_str()))
        .collect()
}

/// The section of flag `long` (`None`: the flag is not in any section).
fn section_of(sections: Sections, long: &str) -> Option<&'static str> {
    sections
        .iter()
        .find(|(_, flags)| flags.contains(&long))
        .map(|(s, _)| *s)
}

/// Flags of `cmd` that no section lists, and listed names that are not flags of `cmd` (both
/// must be empty: the binaries' tests check it, so a new flag cannot miss its key).
pub fn coverage(cmd: &Command, sections: Sections) -> (Vec<String>, Vec<String>) {
    let ks = keys(cmd);
    let missing = ks
        .iter()
        .filter(|k| section_of(sections, k).is_none())
        .cloned()
        .collect();
    let stray = sections
        .iter()
        .flat_map(|(s, flags)| flags.iter().map(move |f| (s, f)))
        .filter(|(_, f)| !ks.iter().any(|k| k == **f))
        .map(|(s, f)| format!("{s}.{f}"))
        .collect();
    (missing, stray)
}

fn is_switch(cmd: &Command, long: &str) -> bool {
    cmd.get_arguments()
        .find(|a| a.get_long() == Some(long))
        .is_some_and(|a| matches!(a.get_action(), ArgAction::SetTrue | ArgAction::SetFalse))
}

fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        _ => None,
    }
}

/// The flags a job file stands for, as `(key, argument)` pairs in file order (a key gives one
/// argument per value: `--name=value`, or `--name` for a switch set to true).
pub fn file_args(
    cmd: &Command,
    sections: Sections,
    path: &Path,
) -> Result<Vec<(String, OsString)>, JobError> {
    let text = std::fs::read_to_string(path).map_err(|source| JobError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    args_of_text(cmd, sections, path, &text)
}

fn args_of_text(
    cmd: &Command,
    sections: Sections,
    path: &Path,
    text: &str,
) -> Result<Vec<(String, OsString)>, JobError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| JobError::Syntax {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    let known_sections = || {
        sections
            .iter()
            .map(|(s, _)| *s)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let all_keys: Vec<String> = sections
        .iter()
        .flat_map(|(s, flags)| flags.iter().map(move |f| format!("{s}.{f}")))
        .collect();
    let mut out = Vec::new();
    for (section, body) in &table {
        let toml::Value::Table(body) = body else {
            // A top-level `key = value`: say where it belongs.
            let home = section_of(sections, section);
            return Err(match home {
                Some(s) => JobError::Value {
                    path: path.to_path_buf(),
                    key: section.clone(),
                    problem: format!("belongs in section [{s}]"),
                },
                None => JobError::UnknownKey {
                    path: path.to_path_buf(),
                    key: section.clone(),
                    closest: closest(section, &all_keys),
                },
            });
        };
        if !sections.iter().any(|(s, _)| s == section) {
            return Err(JobError::UnknownSection {
                path: path.to_path_buf(),
                section: section.clone(),
                known: known_sections(),
            });
        }
        for (key, value) in body {
            let full = format!("{section}.{key}");
            match section_of(sections, key) {
                None => {
                    return Err(JobError::UnknownKey {
                        path: path.to_path_buf(),
                        closest: closest(&full, &all_keys),
                        key: full,
                    })
                }
                Some(home) if home != section => {
                    return Err(JobError::Value {
                        path: path.to_path_buf(),
                        key: full,
                        problem: format!("belongs in section [{home}], not [{section}]"),
                    })
                }
                Some(_) => {}
            }
            let bad = |problem: String| JobError::Value {
                path: path.to_path_buf(),
                key: full.clone(),
                problem,
            };
            if is_switch(cmd, key) {
                match value {
                    toml::Value::Boolean(true) => {
                        out.push((full.clone(), format!("--{key}").into()))
                    }
                    toml::Value::Boolean(false) => {}
                    other => {
                        return Err(bad(format!(
                            "a switch takes true or false, not {}",
                            other.type_str()
                        )))
                    }
                }
                continue;
            }
            let values: Vec<&toml::Value> = match value {
                toml::Value::Array(items) => items.iter().collect(),
                v => vec![v],
            };
            for v in values {
                let s = scalar(v).ok_or_else(|| {
                    bad(format!(
                        "takes a string or a number, not {}{}",
                        v.type_str(),
                        if matches!(v, toml::Value::Boolean(_)) {
                            " (only switches take true/false)"
                        } else {
                            ""
                        }
                    ))
                })?;
                out.push((full.clone(), format!("--{key}={s}").into()));
            }
        }
    }
    Ok(out)
}

/// The known key closest to `key` (Jaro-Winkler similarity of at least 0.8), for "did you mean".
fn closest(key: &str, known: &[String]) -> Option<String> {
    let bare = key.rsplit('.').next().unwrap_or(key);
    known
        .iter()
        .map(|k| {
            let kb = k.rsplit('.').next().unwrap_or(k);
            (
                strsim::jaro_winkler(bare, kb).max(strsim::jaro_winkler(key, k)),
                k,
            )
        })
        .filter(|(s, _)| *s >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.clone())
}

/// The value of `--config` in `argv` (`--config PATH` or `--config=PATH`), if any.
fn config_path(argv: &[OsString]) -> Option<PathBuf> {
    let mut it = argv.iter().skip(1);
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "--" {
            break;
        }
        if s == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(p) = s.strip_prefix("--config=") {
            return Some(PathBuf::from(p));
        }
    }
    None
}

/// Parses `argv` (the program name first) into `A`, with the job file named by `--config`
/// (if any) read first and the command line overriding it. Returns the arguments and clap's
/// matches (for [`resolved`]).
pub fn parse<A: clap::CommandFactory + FromArgMatches>(
    sections: Sections,
    argv: Vec<OsString>,
) -> Result<(A, ArgMatches), JobError> {
    let cmd = A::command().args_override_self(true);
    let mut full = Vec::with_capacity(argv.len());
    full.extend(argv.first().cloned());
    if let Some(path) = config_path(&argv) {
        let from_file = file_args(&cmd, sections, &path)?;
        // The file's values alone first, so a value clap refuses is reported with its key.
        let mut probe = vec![argv.first().cloned().unwrap_or_default()];
        probe.extend(from_file.iter().map(|(_, a)| a.clone()));
        if let Err(e) = cmd.clone().try_get_matches_from(&probe) {
            if !matches!(
                e.kind(),
                clap::error::ErrorKind::MissingRequiredArgument
                    | clap::error::ErrorKind::DisplayHelp
                    | clap::error::ErrorKind::DisplayVersion
            ) {
                let key = from_file
                    .iter()
                    .find(|(_, a)| e.to_string().contains(&flag_name(a)))
                    .map(|(k, _)| k.clone())
                    .unwrap_or_else(|| "?".into());
                return Err(JobError::Args {
                    origin: format!("{}: key `{key}`: ", path.display()),
                    message: e.to_string().trim_end().to_string(),
                });
            }
        }
        full.extend(from_file.iter().map(|(_, a)| a.clone()));
    }
    full.extend(argv.into_iter().skip(1));
    let matches = match cmd.try_get_matches_from(&full) {
        Ok(m) => m,
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            e.exit()
        }
        Err(e) => {
            return Err(JobError::Args {
                origin: String::new(),
                message: e.to_string().trim_end().to_string(),
            })
        }
    };
    let args = A::from_arg_matches(&matches).map_err(|e| JobError::Args {
        origin: String::new(),
        message: e.to_string(),
    })?;
    Ok((args, matches))
}

/// `--name` of an argument `--name=value` or `--name`.
fn flag_name(arg: &OsString) -> String {
    let s = arg.to_string_lossy();
    s.split('=').next().unwrap_or(&s).to_string()
}

fn toml_scalar(s: &str) -> String {
    if s.parse::<i64>().is_ok() {
        return s.to_string();
    }
    if let Ok(f) = s.parse::<f64>() {
        if f.is_finite() && !s.starts_with('+') && s.contains(['.', 'e', 'E']) {
            return s.to_string();
        }
    }
    toml::Value::String(s.to_string()).to_string()
}

/// The resolved job as a job file: every setting of `cmd` with its value (command line, job
/// file or default), by section; settings with no value are listed as comments.
pub fn resolved(cmd: &Command, sections: Sections, matches: &ArgMatches) -> String {
    let mut out = String::new();
    for (section, flags) in sections {
        let _ = writeln!(out, "[{section}]");
        for long in *flags {
            let Some(arg) = cmd.get_arguments().find(|a| a.get_long() == Some(long)) else {
                continue;
            };
            let id = arg.get_id().as_str();
            if is_switch(cmd, long) {
                let on = matches.get_flag(id);
                let _ = writeln!(out, "{long} = {on}");
                continue;
            }
            let raw: Vec<String> = matches
                .get_raw(id)
                .map(|vals| vals.map(|v| v.to_string_lossy().into_owned()).collect())
                .unwrap_or_default();
            match raw.as_slice() {
                [] => {
                    let _ = writeln!(out, "# {long} = (not set)");
                }
                [one] if !matches!(arg.get_action(), ArgAction::Append) => {
                    let _ = writeln!(out, "{long} = {}", toml_scalar(one));
                }
                many => {
                    let items: Vec<String> = many.iter().map(|v| toml_scalar(v)).collect();
                    let _ = writeln!(out, "{long} = [{}]", items.join(", "));
                }
            }
        }
        out.push('\n');
    }
    out
}
