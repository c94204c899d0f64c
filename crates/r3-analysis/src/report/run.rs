//! One RL run directory as the report sees it: its name, a label saying what was run (replay
//! mode, loss), its metrics rows and its eval points.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::metrics::{keys, read_metrics, series, MetricsRow};
use super::ReportError;

/// A loaded run directory.
#[derive(Debug, Clone)]
pub struct RunData {
    /// The directory.
    pub dir: PathBuf,
    /// Short name (the directory's own name).
    pub name: String,
    /// What was run, e.g. "R3 · gspo"; empty if neither config nor metrics say.
    pub setting: String,
    /// The run's seed (`seed` of its config.toml), when it has one.
    pub seed: Option<i64>,
    /// Per-step metrics, sorted by step.
    pub rows: Vec<MetricsRow>,
    /// `(step, eval accuracy)`, sorted by step: from metrics.jsonl, plus eval.jsonl for steps
    /// metrics.jsonl has no eval for.
    pub eval: Vec<(u64, f64)>,
    /// `(step, standard error of the eval accuracy over prompts)` from eval.jsonl, where it
    /// states one.
    pub eval_stderr: Vec<(u64, f64)>,
}

impl RunData {
    /// "name (setting)", or just the name when the setting is unknown.
    pub fn label(&self) -> String {
        if self.setting.is_empty() {
            self.name.clone()
        } else {
            format!("{} ({})", self.name, self.setting)
        }
    }
}

/// Loads `dir`: metrics.jsonl (required), eval.jsonl and config.toml (optional).
pub fn load_run(dir: &Path) -> Result<RunData, ReportError> {
    let rows = read_metrics(&dir.join("metrics.jsonl"))?;
    let eval_file = dir.join("eval.jsonl");
    let eval_rows = if eval_file.is_file() {
        read_metrics(&eval_file)?
    } else {
        Vec::new()
    };
    let extra_eval = series(&eval_rows, keys::EVAL_ACCURACY);
    let config_file = dir.join("config.toml");
    let config = if config_file.is_file() {
        let text = std::fs::read_to_string(&config_file).map_err(ReportError::io(&config_file))?;
        Some(
            text.parse::<toml::Table>()
                .map_err(|e| ReportError::Config {
                    file: config_file.clone(),
                    what: e.to_string(),
                })?,
        )
    } else {
        None
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string());
    Ok(RunData {
        dir: dir.to_path_buf(),
        name,
        setting: setting(config.as_ref(), &rows),
        seed: config
            .as_ref()
            .and_then(|c| c.get("seed"))
            .and_then(toml::Value::as_integer),
        eval: merge_eval(series(&rows, keys::EVAL_ACCURACY), extra_eval),
        eval_stderr: series(&eval_rows, keys::EVAL_ACCURACY_STDERR),
        rows,
    })
}

/// Eval points of metrics.jsonl, completed by those of eval.jsonl at other steps.
fn merge_eval(primary: Vec<(u64, f64)>, extra: Vec<(u64, f64)>) -> Vec<(u64, f64)> {
    let mut by_step: BTreeMap<u64, f64> = extra.into_iter().collect();
    by_step.extend(primary);
    by_step.into_iter().collect()
}

/// First value found under any of `names`, searching `table` and then its sub-tables.
fn find_value<'t>(table: &'t toml::Table, names: &[&str]) -> Option<&'t toml::Value> {
    if let Some(v) = names.iter().find_map(|n| table.get(*n)) {
        return Some(v);
    }
    table.values().find_map(|v| match v {
        toml::Value::Table(t) => find_value(t, names),
        _ => None,
    })
}

/// The text under `names`; a table there is read through its `kind`/`type`/`name` key
/// (e.g. `[loss] kind = "gspo"`).
fn find_text(table: &toml::Table, names: &[&str]) -> Option<String> {
    match find_value(table, names)? {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Table(t) => ["kind", "type", "name"]
            .iter()
            .find_map(|k| t.get(*k).and_then(toml::Value::as_str).map(str::to_string)),
        _ => None,
    }
}

/// Config keys naming the replay mode (r3-train calls it `algo.router_replay`).
const REPLAY_NAMES: [&str; 3] = [keys::REPLAY_MODE, "router_replay", "replay"];
/// Config key of the importance-sampling correction (`none`, `tis`, `mis`).
const IS_MODE_NAME: &str = "is_mode";
/// Config key of the number of optimiser steps per RL step.
const MINI_STEPS_NAME: &str = "mini_batches";

/// "replay · loss · IS correction · mini-steps" from config.toml (replay and loss fall back
/// to the first metrics row that names them). The config's layout belongs to r3-train, so
/// keys are searched by name at any depth.
fn setting(config: Option<&toml::Table>, rows: &[MetricsRow]) -> String {
    let from_config = |names: &[&str]| config.and_then(|c| find_text(c, names));
    let from_rows = |key: &str| rows.iter().find_map(|r| r.text(key).map(str::to_string));
    let replay = from_config(&REPLAY_NAMES)
        .or_else(|| from_rows(keys::REPLAY_MODE))
        .map(|r| {
            if r.eq_ignore_ascii_case("disabled") || r.eq_ignore_ascii_case("none") {
                "no replay".to_string()
            } else {
                r
            }
        });
    let loss = from_config(&[keys::LOSS]).or_else(|| from_rows(keys::LOSS));
    let is_mode = from_config(&[IS_MODE_NAME])
        .filter(|m| !m.eq_ignore_ascii_case("none"))
        .map(|m| m.to_uppercase());
    let mini_steps = config
        .and_then(|c| find_value(c, &[MINI_STEPS_NAME]))
        .and_then(toml::Value::as_integer)
        .map(|n| format!("{n} mini-step{}", if n == 1 { "" } else { "s" }));
    [replay, loss, is_mode, mini_steps]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(" · ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::metrics::parse_metrics;

    fn rows(text: &str) -> Vec<MetricsRow> {
        parse_metrics(text, Path::new("m.jsonl")).unwrap()
    }

    #[test]
    fn setting_prefers_config_and_falls_back_to_metrics() {
        let cfg: toml::Table =
            "seed = 1\n[train]\nreplay_mode = \"R3\"\n[train.loss]\nkind = \"gspo\"\n"
                .parse()
                .unwrap();
        let metrics = rows("{\"step\":0,\"replay_mode\":\"R2\",\"loss\":\"ppo\"}\n");
        assert_eq!(setting(Some(&cfg), &metrics), "R3 · gspo");
        // r3-train's layout: [algo] router_replay, loss, is_mode, mini_batches.
        let train: toml::Table = "[algo]\nrouter_replay = \"disabled\"\nloss = \"ppo\"\n\
                                  is_mode = \"tis\"\nmini_batches = 8\n"
            .parse()
            .unwrap();
        assert_eq!(
            setting(Some(&train), &[]),
            "no replay · ppo · TIS · 8 mini-steps"
        );
        let single: toml::Table =
            "[algo]\nrouter_replay = \"R3\"\nis_mode = \"none\"\nmini_batches = 1\n"
                .parse()
                .unwrap();
        assert_eq!(setting(Some(&single), &metrics), "R3 · ppo · 1 mini-step");
        assert_eq!(setting(None, &metrics), "R2 · ppo");
        let disabled = rows("{\"step\":0,\"replay_mode\":\"disabled\"}\n");
        assert_eq!(setting(None, &disabled), "no replay");
        assert_eq!(setting(None, &[]), "");
    }

    #[test]
    fn eval_jsonl_fills_steps_metrics_lack() {
        let merged = merge_eval(vec![(10, 0.5), (20, 0.6)], vec![(5, 0.1), (10, 0.9)]);
        assert_eq!(merged, vec![(5, 0.1), (10, 0.5), (20, 0.6)]);
    }
}
