//! Datasets in verl's schema: JSONL and Parquet (written by pyarrow) load to the same rows,
//! every malformed-row kind is an error naming file, row and field, and the epoch cursor
//! visits every row once per epoch and resumes from its position.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use r3_tasks::dataset::jsonl::{parse_jsonl, to_jsonl};
use r3_tasks::dataset::load_file;
use r3_tasks::{ChatMessage, DatasetCursor, DatasetPosition, Prompt, TaskError};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn jsonl_rows_follow_the_schema() {
    let rows = load_file(&fixture("verl_rows.jsonl"), "prompt").expect("load");
    assert_eq!(rows.len(), 3);
    assert_eq!(
        rows[0].prompt,
        Prompt::Messages(vec![
            ChatMessage {
                role: "system".into(),
                content: "Solve step by step.".into()
            },
            ChatMessage {
                role: "user".into(),
                content: "Tom has 3 apples and buys 4 more. How many?".into()
            },
        ])
    );
    assert_eq!(rows[0].ground_truth, "7");
    assert_eq!(rows[0].data_source, "openai/gsm8k");
    assert_eq!(
        rows[0].extra_info,
        serde_json::json!({"split": "train", "index": 0})
    );
    assert_eq!(rows[1].ground_truth, "2,400");
    assert_eq!(rows[2].prompt.messages().len(), 3);
}

#[test]
fn parquet_written_by_pyarrow_loads_to_the_jsonl_rows() {
    let jsonl = load_file(&fixture("verl_rows.jsonl"), "prompt").expect("jsonl");
    for codec in ["snappy", "zstd"] {
        let name = format!("verl_rows.{codec}.parquet");
        let parquet = load_file(&fixture(&name), "prompt").expect(&name);
        assert_eq!(parquet, jsonl, "{name}");
        let raw_j = load_file(&fixture("verl_rows.jsonl"), "raw_prompt").expect("jsonl raw");
        let raw_p = load_file(&fixture(&name), "raw_prompt").expect("parquet raw");
        assert_eq!(raw_p, raw_j, "{name} with prompt_key = raw_prompt");
        assert!(matches!(raw_p[1].prompt, Prompt::Text(ref t) if t.contains("café")));
    }
}

#[test]
fn numbers_as_ground_truth_and_plain_prompts() {
    let text = r#"{"prompt": "2+2=", "reward_model": {"ground_truth": 4}}
{"prompt": "half of 3", "reward_model": {"ground_truth": 1.5}, "data_source": "x"}

"#;
    let rows = parse_jsonl(text, Path::new("mem.jsonl"), "prompt").expect("rows");
    assert_eq!(rows.len(), 2, "blank lines are not rows");
    assert_eq!(rows[0].prompt, Prompt::Text("2+2=".into()));
    // Held as the JSON numbers they are; the built-in rewards read them as JSON writes them.
    assert_eq!(rows[0].ground_truth, serde_json::json!(4));
    assert_eq!(rows[0].data_source, "");
    assert_eq!(rows[0].extra_info, serde_json::Value::Null);
    assert_eq!(rows[1].ground_truth, serde_json::json!(1.5));
    let texts: Vec<_> = rows.iter().map(truth_text).collect();
    assert_eq!(texts, ["4", "1.5"]);
}

fn truth_text(row: &r3_tasks::DatasetRow) -> String {
    r3_tasks::ground_truth_text(&row.ground_truth)
        .expect("a string or number")
        .into_owned()
}

/// verl search-R1's ground truth is an object (`{"target": [...]}`), hellaswag's an int: a
/// row holds any JSON value, loads when only `command` verifiers read it, and is an error
/// naming file, row and field when a built-in rule must compare it as text.
#[test]
fn a_non_text_ground_truth_loads_for_a_command_verifier_only() {
    use r3_tasks::{load_dataset_for, GroundTruthUse, RewardKind};
    let dir = r3_test_support::Scratch::new("r3-tasks-object-truth");
    let path = dir.join("search.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"prompt": "capital?", "reward_model": {"ground_truth": "Paris"}}"#,
            "\n",
            r#"{"prompt": "capital?", "reward_model": {"ground_truth": {"target": ["Paris", "paris"]}}}"#,
            "\n",
        ),
    )
    .expect("write");
    let files = [path.clone()];
    let rows = load_dataset_for(&files, "prompt", GroundTruthUse::Any).expect("any truth");
    assert_eq!(rows[0].ground_truth, serde_json::json!("Paris"));
    assert_eq!(
        rows[1].ground_truth,
        serde_json::json!({"target": ["Paris", "paris"]})
    );
    for kind in [RewardKind::Math, RewardKind::Exact, RewardKind::Arith] {
        let err = load_dataset_for(&files, "prompt", GroundTruthUse::Text(kind))
            .expect_err("an object for a built-in rule")
            .to_string();
        for want in [
            "search.jsonl",
            "row 1",
            "field `reward_model.ground_truth`",
            "is an object, expected a string or a number",
            &format!("`{kind}` reward"),
        ] {
            assert!(err.contains(want), "{want}: {err}");
        }
    }
    for (truth, kind) in [("true", "a boolean"), ("[1, 2]", "a list")] {
        std::fs::write(
            &path,
            format!(r#"{{"prompt": "p", "reward_model": {{"ground_truth": {truth}}}}}"#),
        )
        .expect("write");
        let err = load_dataset_for(&files, "prompt", GroundTruthUse::Text(RewardKind::Math))
            .expect_err(truth)
            .to_string();
        assert!(err.contains("row 0") && err.contains(kind), "{err}");
    }
}

#[test]
fn rows_round_trip_through_jsonl() {
    let rows = load_file(&fixture("verl_rows.jsonl"), "prompt").expect("load");
    let text = to_jsonl(&rows, "prompt");
    let back = parse_jsonl(&text, Path::new("mem.jsonl"), "prompt").expect("reparse");
    assert_eq!(back, rows);
}

/// One malformed line after a good one: the error names the file, row 1 and the field.
fn error_of(line: &str) -> String {
    let good = r#"{"prompt": "ok", "reward_model": {"ground_truth": "1"}}"#;
    let text = format!("{good}\n{line}\n");
    match parse_jsonl(&text, Path::new("bad/train.jsonl"), "prompt") {
        Ok(rows) => panic!("{line} was accepted as {rows:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn every_malformed_row_kind_names_file_row_and_field() {
    let gt = r#""reward_model": {"ground_truth": "1"}"#;
    let cases: Vec<(String, &str, &str)> = vec![
        ("[1, 2]".into(), "(row)", "not an object"),
        (format!("{{{gt}}}"), "prompt", "missing"),
        (format!(r#"{{"prompt": null, {gt}}}"#), "prompt", "missing"),
        (format!(r#"{{"prompt": 5, {gt}}}"#), "prompt", "a number"),
        (format!(r#"{{"prompt": [], {gt}}}"#), "prompt", "empty list"),
        (
            format!(r#"{{"prompt": ["hi"], {gt}}}"#),
            "prompt[0]",
            "a string",
        ),
        (
            format!(r#"{{"prompt": [{{"content": "hi"}}], {gt}}}"#),
            "prompt[0].role",
            "missing",
        ),
        (
            format!(
                r#"{{"prompt": [{{"role": "user", "content": "a"}}, {{"role": "user", "content": 3}}], {gt}}}"#
            ),
            "prompt[1].content",
            "a number",
        ),
        (r#"{"prompt": "p"}"#.into(), "reward_model", "missing"),
        (
            r#"{"prompt": "p", "reward_model": "7"}"#.into(),
            "reward_model",
            "expected an object",
        ),
        (
            r#"{"prompt": "p", "reward_model": {"style": "rule"}}"#.into(),
            "reward_model.ground_truth",
            "missing",
        ),
        (
            format!(r#"{{"prompt": "p", {gt}, "data_source": 3}}"#),
            "data_source",
            "a number",
        ),
    ];
    for (line, field, reason) in cases {
        let msg = error_of(&line);
        assert!(msg.contains("bad/train.jsonl"), "{msg}");
        assert!(msg.contains("row 1"), "{msg}");
        assert!(msg.contains(&format!("field `{field}`")), "{field}: {msg}");
        assert!(msg.contains(reason), "{reason}: {msg}");
    }
    let msg = error_of("{not json");
    assert!(
        msg.contains("bad/train.jsonl") && msg.contains("row 1 (line 2)"),
        "{msg}"
    );
}

#[test]
fn prompt_key_selects_the_column() {
    let text = r#"{"question": "q?", "reward_model": {"ground_truth": "a"}}"#;
    let rows = parse_jsonl(text, Path::new("m.jsonl"), "question").expect("question key");
    assert_eq!(rows[0].prompt, Prompt::Text("q?".into()));
    let err = parse_jsonl(text, Path::new("m.jsonl"), "prompt").expect_err("no prompt column");
    assert!(err.to_string().contains("field `prompt`: missing"), "{err}");
}

#[test]
fn unknown_extensions_and_broken_parquet_are_errors() {
    let dir = std::env::temp_dir().join(format!("r3-dataset-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let csv = dir.join("rows.csv");
    std::fs::write(&csv, "a,b\n").expect("write");
    let err = load_file(&csv, "prompt").expect_err("csv");
    assert!(matches!(err, TaskError::DatasetRead { .. }), "{err}");
    let fake = dir.join("rows.parquet");
    std::fs::write(&fake, b"PAR1 this is not parquet").expect("write");
    let err = load_file(&fake, "prompt").expect_err("bad parquet");
    assert!(err.to_string().contains("rows.parquet"), "{err}");
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn each_epoch_visits_every_row_once_in_a_seeded_order() {
    let n = 10;
    let mut c = DatasetCursor::new(n, true, 7, DatasetPosition::default());
    let first: Vec<usize> = c.take(n);
    let second: Vec<usize> = c.take(n);
    for epoch in [&first, &second] {
        let set: HashSet<usize> = epoch.iter().copied().collect();
        assert_eq!(set.len(), n, "a permutation: {epoch:?}");
    }
    assert_ne!(first, second, "each epoch has its own order");
    assert_ne!(first, (0..n).collect::<Vec<_>>(), "shuffled");
    let again = DatasetCursor::new(n, true, 7, DatasetPosition::default()).take(2 * n);
    assert_eq!(again, [first.clone(), second.clone()].concat(), "seeded");
    let plain = DatasetCursor::new(n, false, 7, DatasetPosition::default()).take(n + 3);
    assert_eq!(plain, [(0..n).collect::<Vec<_>>(), vec![0, 1, 2]].concat());
}

#[test]
fn a_cursor_resumes_from_its_position() {
    let mut whole = DatasetCursor::new(7, true, 3, DatasetPosition::default());
    let all = whole.take(20);
    let mut head = DatasetCursor::new(7, true, 3, DatasetPosition::default());
    let first = head.take(9);
    let pos = head.position();
    assert_eq!(pos, DatasetPosition { epoch: 1, index: 2 });
    let rest = DatasetCursor::new(7, true, 3, pos).take(11);
    assert_eq!([first, rest].concat(), all);
}

#[test]
fn float32_parquet_values_read_as_f32_prints_them() {
    use parquet::data_type::{ByteArray, ByteArrayType, FloatType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use std::sync::Arc;

    let dir = std::env::temp_dir().join(format!("r3-dataset-f32-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("f32.parquet");
    let schema = "message m {
      required binary prompt (UTF8);
      required group reward_model { required float ground_truth; }
      required group extra_info { required float weight; }
    }";
    let truths = [0.1f32, 2.5, 1e20, 16_777_216.0, -0.3];
    let schema = Arc::new(parse_message_type(schema).expect("schema"));
    let file = std::fs::File::create(&path).expect("create");
    let props = Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(file, schema, props).expect("writer");
    let mut group = writer.next_row_group().expect("row group");
    let mut col = group.next_column().expect("column").expect("prompt");
    let prompts: Vec<ByteArray> = truths.iter().map(|_| ByteArray::from("q")).collect();
    col.typed::<ByteArrayType>()
        .write_batch(&prompts, None, None)
        .expect("prompts");
    col.close().expect("close");
    for _ in 0..2 {
        let mut col = group.next_column().expect("column").expect("float");
        col.typed::<FloatType>()
            .write_batch(&truths, None, None)
            .expect("floats");
        col.close().expect("close");
    }
    group.close().expect("close group");
    writer.close().expect("close file");

    let rows = load_file(&path, "prompt").expect("load");
    let got: Vec<String> = rows.iter().map(truth_text).collect();
    // What the f32s print as (widened to f64 first, 0.1f32 would read 0.10000000149011612).
    assert_eq!(got, ["0.1", "2.5", "1e+20", "16777216.0", "-0.3"]);
    assert_eq!(rows[0].extra_info, serde_json::json!({"weight": 0.1}));
    assert!(r3_tasks::math_equal("0.1", &got[0]));
    assert!(r3_tasks::math_equal("100000000000000000000", &got[2]));
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

/// A `.json` file holding one JSON array of rows (what HF `datasets`' json loader, verl's
/// reader of `.json`, accepts besides JSON lines) loads to the rows of the equivalent JSONL
/// file; a `.json` file of lines still reads as JSONL; a bad element is an error naming its
/// array index (and line).
#[test]
fn a_json_file_may_hold_an_array_of_rows() {
    let dir = r3_test_support::Scratch::new("r3-tasks-json-array");
    let jsonl = load_file(&fixture("verl_rows.jsonl"), "prompt").expect("jsonl");
    let lines = std::fs::read_to_string(fixture("verl_rows.jsonl")).expect("read");
    let objects: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).expect("line"))
        .collect();
    // Pretty-printed, as `json.dump(rows, f, indent=2)` writes it: rows span many lines.
    let array = dir.join("rows.json");
    let pretty = serde_json::to_string_pretty(&objects).expect("pretty");
    std::fs::write(&array, format!("\n  {pretty}\n")).expect("write");
    assert_eq!(load_file(&array, "prompt").expect("array"), jsonl);
    let as_lines = dir.join("lines.json");
    std::fs::write(&as_lines, &lines).expect("write");
    assert_eq!(load_file(&as_lines, "prompt").expect("lines"), jsonl);
    let empty = dir.join("empty.json");
    std::fs::write(&empty, "[ ]").expect("write");
    assert_eq!(load_file(&empty, "prompt").expect("empty").len(), 0);

    let good = r#"{"prompt": "ok", "reward_model": {"ground_truth": "1"}}"#;
    let cases = [
        (
            format!("[{good},\n{good},\n{{\"prompt\": 5, \"reward_model\": {{\"ground_truth\": \"1\"}}}}]"),
            "row 2: field `prompt`",
        ),
        (format!("[{good},\n{good},\n{{not json}}]"), "row 2 (line 3)"),
        (format!("[{good},\n{good}"), "row 1 (line 2)"),
        (format!("[{good} {good}]"), "row 0 (line 1): expected `,` or `]`"),
        (format!("[{good}]\n[{good}]"), "after the array's closing `]` (line 2)"),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let path = dir.join(format!("bad{i}.json"));
        std::fs::write(&path, text).expect("write");
        let err = load_file(&path, "prompt").expect_err(text).to_string();
        assert!(
            err.contains(&format!("bad{i}.json")) && err.contains(want),
            "{want}: {err}"
        );
    }
}
