//! The report page: one self-contained HTML file (inline CSS, PNGs as base64 data URIs) with
//! the crash rule, a summary table per run and the figures.

use base64::Engine;

use super::run::RunData;
use super::summary::{CrashRule, RunSummary, StepValue};

/// A figure as the page embeds it.
#[derive(Debug, Clone)]
pub struct PageFigure<'a> {
    /// Caption.
    pub title: &'a str,
    /// PNG bytes, or why there is no plot.
    pub png: Result<Vec<u8>, String>,
}

/// Escapes text for HTML element content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}\
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #bbb;padding:4px 8px;\
text-align:left}th{background:#eee}td.num{text-align:right}img{max-width:100%;height:auto;\
border:1px solid #ddd}.nodata{color:#888;font-style:italic}code{background:#f4f4f4}";

fn step_value(v: Option<StepValue>, digits: usize) -> String {
    v.map_or("—".to_string(), |v| {
        format!("{:.digits$} (step {})", v.value, v.step)
    })
}

fn summary_row(s: &RunSummary) -> String {
    let cells = [
        escape(&s.name),
        escape(&s.setting),
        s.steps_logged.to_string(),
        step_value(s.best_eval, 4),
        step_value(s.final_reward, 4),
        s.mean_k3_kl.map_or("—".to_string(), |k| format!("{k:.3e}")),
        s.crash.map_or("—".to_string(), |c| {
            format!("{} <small>({})</small>", c.step, escape(&c.describe()))
        }),
    ];
    let tds: String = cells
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let class = if (2..6).contains(&i) {
                " class=\"num\""
            } else {
                ""
            };
            format!("<td{class}>{c}</td>")
        })
        .collect();
    format!("<tr>{tds}</tr>\n")
}

/// What the page says besides tables and figures.
#[derive(Debug, Clone, Default)]
pub struct PageNotes {
    /// EMA weight of the per-step curves (0: raw only).
    pub smoothing: f64,
    /// Paired comparisons, one sentence each.
    pub paired: Vec<String>,
}

/// The whole page.
pub fn render_page(
    runs: &[RunData],
    summaries: &[RunSummary],
    rule: &CrashRule,
    figures: &[PageFigure<'_>],
    notes: &PageNotes,
) -> String {
    let mut page = format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>r3 report</title>\n<style>{STYLE}</style>\n</head>\n<body>\n\
         <h1>r3 report</h1>\n<p>Runs:</p>\n<ul>\n"
    );
    for run in runs {
        page.push_str(&format!(
            "<li><code>{}</code> — {}</li>\n",
            escape(&run.dir.display().to_string()),
            escape(&run.label())
        ));
    }
    page.push_str("</ul>\n<h2>Summary</h2>\n");
    page.push_str(&format!(
        "<p><b>Crash rule.</b> {}</p>\n",
        escape(&rule.describe())
    ));
    page.push_str(
        "<table>\n<tr><th>run</th><th>setting</th><th>steps logged</th>\
         <th>best eval accuracy</th><th>final reward</th><th>mean k3 KL</th>\
         <th>crash step</th></tr>\n",
    );
    for s in summaries {
        page.push_str(&summary_row(s));
    }
    page.push_str("</table>\n");
    if !notes.paired.is_empty() {
        page.push_str(
            "<h2>Paired comparisons</h2>\n<p>Final held-out evaluations, the same prompts \
             paired, against the first run; 95% intervals (Student's t over prompts; with \
             several seeds a side, t whose variance adds each side's run-to-run spread, \
             Welch–Satterthwaite degrees of freedom).</p>\n<ul>\n",
        );
        for line in &notes.paired {
            page.push_str(&format!("<li>{}</li>\n", escape(line)));
        }
        page.push_str("</ul>\n");
    }
    page.push_str("<h2>Over training steps</h2>\n");
    if notes.smoothing > 0.0 {
        page.push_str(&format!(
            "<p>Per-step curves: raw values faint, the line an exponential moving average \
             with weight {} (debiased, as TensorBoard / wandb draw it). Eval accuracy: \
             bars ±1 standard error over prompts where the eval states one.</p>\n",
            notes.smoothing
        ));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    for fig in figures {
        page.push_str(&format!("<h3>{}</h3>\n", escape(fig.title)));
        match &fig.png {
            Ok(bytes) => page.push_str(&format!(
                "<img alt=\"{}\" src=\"data:image/png;base64,{}\">\n",
                escape(fig.title),
                b64.encode(bytes)
            )),
            Err(why) => page.push_str(&format!("<p class=\"nodata\">{}</p>\n", escape(why))),
        }
    }
    page.push_str("</body>\n</html>\n");
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            escape("<a href=\"x\">R&D's</a>"),
            "&lt;a href=&quot;x&quot;&gt;R&amp;D&#39;s&lt;/a&gt;"
        );
    }

    #[test]
    fn page_embeds_images_and_states_the_rule() {
        let rule = CrashRule { kl_threshold: 0.05 };
        let figures = [
            PageFigure {
                title: "A <plot>",
                png: Ok(vec![0x89, b'P', b'N', b'G']),
            },
            PageFigure {
                title: "B",
                png: Err("no run logged x".into()),
            },
        ];
        let notes = PageNotes {
            smoothing: 0.9,
            paired: vec!["R3 − no replay: +1.0 <x>".into()],
        };
        let page = render_page(&[], &[], &rule, &figures, &notes);
        assert!(
            page.contains("<li>R3 − no replay: +1.0 &lt;x&gt;</li>"),
            "{page}"
        );
        assert!(page.contains("weight 0.9"));
        // base64 of 89 50 4E 47 is "iVBORw==".
        assert!(
            page.contains("src=\"data:image/png;base64,iVBORw==\""),
            "{page}"
        );
        assert!(page.contains("<h3>A &lt;plot&gt;</h3>"));
        assert!(page.contains("<p class=\"nodata\">no run logged x</p>"));
        assert!(page.contains(&escape(&rule.describe())));
        assert!(!page.contains("http"), "the page must not load anything");
    }
}
