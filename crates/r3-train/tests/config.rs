//! The train config: defaults, TOML round trip, file layering, `--set` overrides and the
//! errors that name a bad key or value.

use r3_train::config::{RouterReplay, TrainConfig};
use r3_train::{IsMode, LossAgg, PolicyLossKind, TrainError};

/// A scratch directory of one test, removed when the test ends (pass or fail).
struct Scratch(std::path::PathBuf);

impl Scratch {
    /// A fresh directory named after the test, so tests running in parallel do not share it.
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("r3-train-cfg-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }

    fn file(&self, name: &str) -> std::path::PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn set(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn defaults_round_trip_through_toml() {
    let cfg = TrainConfig::resolve(None, &[]).expect("defaults");
    assert_eq!(cfg, TrainConfig::default());
    assert_eq!(cfg.algo.router_replay, RouterReplay::R3);
    let text = cfg.to_toml_string().expect("toml");
    assert!(text.contains("router_replay = \"R3\""), "{text}");
    assert!(text.contains("loss_agg = \"token-mean\""), "{text}");
    assert_eq!(TrainConfig::from_toml_str(&text).expect("parse"), cfg);
    // An empty document is all defaults.
    assert_eq!(TrainConfig::from_toml_str("").expect("parse"), cfg);
}

#[test]
fn overrides_set_typed_values() {
    let cfg = TrainConfig::resolve(
        None,
        &set(&[
            "algo.eps_high=0.28",
            "optim.lr=1",
            "algo.router_replay=R2",
            "algo.loss = gspo",
            "algo.is_mode=\"tis\"",
            "algo.loss_agg=seq-mean-token-mean",
            "algo.dynamic_sampling=false",
            "rollout.group_size=4",
            "model_dir=models/other",
            "run_dir=123",
            "seed=7",
        ]),
    )
    .expect("resolve");
    assert_eq!(cfg.algo.eps_high, 0.28);
    assert_eq!(cfg.optim.lr, 1.0, "integer accepted for a float");
    assert_eq!(cfg.algo.router_replay, RouterReplay::R2);
    assert_eq!(cfg.algo.loss, PolicyLossKind::Gspo);
    assert_eq!(cfg.algo.is_mode, IsMode::Tis);
    assert_eq!(cfg.algo.loss_agg, LossAgg::SeqMeanTokenMean);
    assert!(!cfg.algo.dynamic_sampling);
    assert_eq!(cfg.rollout.group_size, 4);
    assert_eq!(cfg.model_dir, std::path::PathBuf::from("models/other"));
    assert_eq!(
        cfg.run_dir,
        std::path::PathBuf::from("123"),
        "strings take any text"
    );
    assert_eq!(cfg.seed, 7);
    // GSPO picks its own clip range.
    assert_eq!(cfg.clip_range().low, 3e-4);
    // Later overrides win.
    let cfg = TrainConfig::resolve(None, &set(&["seed=1", "seed=2"])).expect("resolve");
    assert_eq!(cfg.seed, 2);
    let lower = TrainConfig::resolve(None, &set(&["algo.router_replay=disabled"])).expect("r");
    assert_eq!(lower.algo.router_replay, RouterReplay::Disabled);
}

#[test]
fn override_errors_name_the_problem() {
    match TrainConfig::resolve(None, &set(&["algo.epsilon=0.1"])) {
        Err(TrainError::UnknownConfigKey { key, known }) => {
            assert_eq!(key, "algo.epsilon");
            assert!(known.contains("eps_high"), "{known}");
        }
        other => panic!("expected UnknownConfigKey, got {other:?}"),
    }
    match TrainConfig::resolve(None, &set(&["nope.lr=1"])) {
        Err(TrainError::UnknownConfigKey { key, .. }) => assert_eq!(key, "nope"),
        other => panic!("expected UnknownConfigKey, got {other:?}"),
    }
    for (text, needle) in [
        ("steps=abc", "expected integer, got string"),
        ("optim.lr=fast", "expected float"),
        ("algo.dynamic_sampling=1", "expected boolean, got integer"),
        ("algo=3", "section"),
        ("seed.x=3", "not a section"),
        ("no_equals_sign", "key=value"),
        ("=3", "empty key"),
        ("algo..lr=3", "empty key"),
    ] {
        match TrainConfig::resolve(None, &set(&[text])) {
            Err(TrainError::BadOverride { text: t, reason }) => {
                assert_eq!(t, text);
                assert!(reason.contains(needle), "{text}: {reason}");
            }
            other => panic!("{text}: expected BadOverride, got {other:?}"),
        }
    }
    match TrainConfig::resolve(None, &set(&["algo.router_replay=R4"])) {
        Err(e @ TrainError::ConfigParse { .. }) => assert!(e.to_string().contains("R4"), "{e}"),
        other => panic!("expected ConfigParse, got {other:?}"),
    }
    match TrainConfig::resolve(None, &set(&["rollout.group_size=0"])) {
        Err(TrainError::InvalidConfig { field, reason }) => {
            assert_eq!(field, "rollout");
            assert!(reason.contains("group_size"), "{reason}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    match TrainConfig::resolve(None, &set(&["rollout.device=gpu"])) {
        Err(TrainError::InvalidConfig { field, reason }) => {
            assert_eq!(field, "rollout.device");
            assert!(reason.contains("cpu-candle"), "{reason}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    // The KV cache dtype: a known one for the CPU engine; `auto` or `f32` for the device
    // engine.
    TrainConfig::resolve(None, &set(&["rollout.kv_cache_dtype=f32"])).expect("f32 cache");
    TrainConfig::resolve(
        None,
        &set(&["rollout.kv_cache_dtype=f32", "rollout.device=cpu-candle"]),
    )
    .expect("an f32 cache on the device engine");
    for (sets, needle) in [
        (vec!["rollout.kv_cache_dtype=fp8"], "fp8"),
        (
            vec!["rollout.kv_cache_dtype=bf16", "rollout.device=cpu-candle"],
            "compute dtype",
        ),
    ] {
        match TrainConfig::resolve(None, &set(&sets)) {
            Err(TrainError::InvalidConfig { field, reason }) => {
                assert_eq!(field, "rollout.kv_cache_dtype");
                assert!(reason.contains(needle), "{sets:?}: {reason}");
            }
            other => panic!("{sets:?}: expected InvalidConfig, got {other:?}"),
        }
    }
    match TrainConfig::resolve(None, &set(&["algo.eps_low=1.5"])) {
        Err(TrainError::InvalidConfig { field, .. }) => assert_eq!(field, "algo.eps_low"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
    for bad in ["1", "0.5", "-3", "nan", "inf"] {
        match TrainConfig::resolve(None, &set(&[&format!("algo.clip_ratio_c={bad}")])) {
            Err(TrainError::InvalidConfig { field, reason }) => {
                assert_eq!(field, "algo.clip_ratio_c");
                assert!(reason.contains("> 1"), "{bad}: {reason}");
            }
            other => panic!("clip_ratio_c = {bad}: expected InvalidConfig, got {other:?}"),
        }
    }
    // Off by default; set, PPO gets it. GSPO has no dual-clip (as verl's): set with it, the
    // value is refused naming both keys rather than silently dropped.
    assert_eq!(TrainConfig::default().clip_range().dual_clip, None);
    let dual = TrainConfig::resolve(None, &set(&["algo.clip_ratio_c=3"])).expect("dual-clip");
    assert_eq!(dual.clip_range().dual_clip, Some(3.0));
    match TrainConfig::resolve(None, &set(&["algo.clip_ratio_c=3", "algo.loss=gspo"])) {
        Err(TrainError::InvalidConfig { field, reason }) => {
            assert_eq!(field, "algo.clip_ratio_c");
            assert!(reason.contains("algo.loss = gspo"), "{reason}");
        }
        other => panic!("clip_ratio_c with gspo: expected InvalidConfig, got {other:?}"),
    }
    let gspo =
        TrainConfig::resolve(None, &set(&["algo.clip_ratio_c=0", "algo.loss=gspo"])).expect("gspo");
    assert_eq!(gspo.clip_range().dual_clip, None);
    let fleet = "rollout.urls=[\"http://127.0.0.1:30000\"]";
    for (sets, want) in [
        (vec!["rollout.async=true"], "rollout.async"),
        (
            vec!["rollout.async=true", "rollout.backend=sglang", fleet],
            "rollout.max_staleness",
        ),
    ] {
        match TrainConfig::resolve(None, &set(&sets)) {
            Err(TrainError::InvalidConfig { field, .. }) => assert_eq!(field, want, "{sets:?}"),
            other => panic!("{sets:?}: expected InvalidConfig, got {other:?}"),
        }
    }
    let ok = TrainConfig::resolve(
        None,
        &set(&[
            "rollout.async=true",
            "rollout.backend=sglang",
            fleet,
            "rollout.max_staleness=1",
        ]),
    )
    .expect("a valid async config");
    assert!(ok.rollout.async_rollout);
}

#[test]
fn file_layers_between_defaults_and_overrides() {
    let scratch = Scratch::new("layers");
    let path = scratch.file("layer.toml");
    std::fs::write(
        &path,
        "steps = 5\n[algo]\nmini_batches = 4\nis_mode = \"mis\"\n[optim]\nlr = 3e-6\n",
    )
    .expect("write");
    let cfg = TrainConfig::resolve(Some(&path), &set(&["optim.lr=1e-6"])).expect("resolve");
    assert_eq!(cfg.steps, 5);
    assert_eq!(cfg.algo.mini_batches, 4);
    assert_eq!(cfg.algo.is_mode, IsMode::Mis);
    assert_eq!(cfg.optim.lr, 1e-6, "override beats file");
    assert_eq!(cfg.rollout.group_size, 8, "untouched default");
    assert_eq!(
        cfg.lr_schedule(cfg.steps).total_steps,
        20,
        "steps × mini_batches"
    );
    assert_eq!(
        cfg.lr_position(3, 2),
        10,
        "two steps of 4, then the third update"
    );
    // A prompt leaves r3's engine one position of a 128-position context; an SGLang
    // fleet, which refuses prompt + max_new_tokens past the context, all 64 of its tokens.
    let mut fleet = cfg.clone();
    fleet.rollout.backend = r3_train::config::RolloutBackend::Sglang;
    assert_eq!((cfg.prompt_room(128), fleet.prompt_room(128)), (127, 63));
    assert_eq!(
        fleet.prompt_room(60),
        0,
        "no room at all: every prompt is refused"
    );

    std::fs::write(&path, "[algo]\nclip = 0.2\n").expect("write");
    match TrainConfig::resolve(Some(&path), &[]) {
        Err(TrainError::UnknownConfigKey { key, .. }) => assert_eq!(key, "algo.clip"),
        other => panic!("expected UnknownConfigKey, got {other:?}"),
    }
    std::fs::write(&path, "steps = [").expect("write");
    assert!(matches!(
        TrainConfig::resolve(Some(&path), &[]),
        Err(TrainError::ConfigParse { .. })
    ));
    assert!(matches!(
        TrainConfig::resolve(Some(&scratch.file("missing.toml")), &[]),
        Err(TrainError::Io { .. })
    ));
}

#[test]
fn saved_config_reloads_identically() {
    let cfg = TrainConfig::resolve(None, &set(&["seed=99", "algo.loss=gspo", "optim.lr=3e-6"]))
        .expect("resolve");
    let scratch = Scratch::new("saved");
    let path = scratch.file("resolved.toml");
    cfg.save(&path).expect("save");
    let back = TrainConfig::resolve(Some(&path), &[]).expect("reload");
    assert_eq!(back, cfg);
}

#[test]
fn router_replay_names_round_trip_and_accept_the_aliases() {
    for mode in [RouterReplay::Disabled, RouterReplay::R2, RouterReplay::R3] {
        let name = mode.to_string();
        assert_eq!(name.parse::<RouterReplay>().expect("parse"), mode);
        let cfg = TrainConfig::resolve(None, &set(&[&format!("algo.router_replay={name}")]))
            .expect("resolve");
        assert_eq!(cfg.algo.router_replay, mode);
        let text = cfg.to_toml_string().expect("toml");
        assert!(
            text.contains(&format!("router_replay = \"{name}\"")),
            "{text}"
        );
    }
    for (alias, mode) in [
        ("none", RouterReplay::Disabled),
        ("r2", RouterReplay::R2),
        ("r3", RouterReplay::R3),
    ] {
        assert_eq!(alias.parse::<RouterReplay>().expect("alias"), mode);
    }
    assert!(matches!(
        "R4".parse::<RouterReplay>(),
        Err(TrainError::UnknownReplayMode(name)) if name == "R4"
    ));
}

/// The rollout engine's budgets are keys of their own: 0 rows, KV or activations, and a
/// budget past 1 PiB, are config errors naming the key; a prefix cache of 0 MiB is allowed
/// (it turns the cache off).
#[test]
fn rollout_engine_budgets_are_checked_by_key() {
    for (key, value) in [
        ("rollout.max_running", "0"),
        ("rollout.kv_cache_mib", "0"),
        ("rollout.activation_mib", "0"),
        ("rollout.kv_cache_mib", "1073741825"),
        ("rollout.activation_mib", "1073741825"),
        ("rollout.prefix_cache_mib", "1073741825"),
    ] {
        let err = TrainConfig::resolve(None, &set(&[&format!("{key}={value}")]))
            .and_then(|c| c.validate())
            .expect_err(key)
            .to_string();
        assert!(err.contains(key), "{key}={value}: {err}");
    }
    let cfg = TrainConfig::resolve(
        None,
        &set(&[
            "rollout.prefix_cache_mib=0",
            "rollout.max_running=3",
            "rollout.kv_cache_mib=512",
            "rollout.chunked_prefill_size=2048",
        ]),
    )
    .expect("budgets");
    cfg.validate()
        .expect("a prefix cache of 0 MiB is off, not invalid");
    assert_eq!(
        (
            cfg.rollout.max_running,
            cfg.rollout.kv_cache_mib,
            cfg.rollout.prefix_cache_mib,
            cfg.rollout.chunked_prefill_size
        ),
        (3, 512, 0, 2048)
    );
    let unset = TrainConfig::resolve(None, &[]).expect("defaults");
    assert_eq!(unset.rollout.chunked_prefill_size, 0, "no cap unless set");
}

/// `algo.attention_tile_mib` bounds an attention product's f32 scores: 1 GiB by default
/// (2²⁸ values), what is set, or nothing at 0.
#[test]
fn the_attention_tile_key_bounds_a_products_scores() {
    use r3_model::layers::attention::ScoreTiles;
    let defaults = TrainConfig::resolve(None, &[]).expect("defaults");
    assert_eq!(defaults.algo.attention_tile_mib, 1024);
    assert_eq!(
        defaults.algo.attention_tiles(),
        ScoreTiles::at_most(1 << 28)
    );
    assert_eq!(
        defaults.algo.attention_tiles(),
        ScoreTiles::DEFAULT,
        "what a model's layers hold unless told"
    );
    let set = |value: &str| {
        TrainConfig::resolve(None, &[format!("algo.attention_tile_mib={value}")])
            .expect("resolved")
            .algo
            .attention_tiles()
    };
    assert_eq!(set("3").max_scores(), 3 << 18);
    assert_eq!(set("0"), ScoreTiles::WHOLE);
}

/// The engines sample greedily below `GREEDY_TEMPERATURE` = 1e-6 (SGLang's `_SAMPLING_EPS`)
/// and report raw log-probs there, while the trainer scores at `1 / T`: a rollout or eval
/// temperature in (0, 1e-6) is refused naming its key; 1e-6 and above (and eval's 0,
/// greedy) are accepted.
#[test]
fn temperatures_the_engines_sample_greedily_are_refused() {
    for (key, t) in [
        ("rollout.temperature", "1e-7"),
        ("rollout.temperature", "5e-7"),
        ("rollout.temperature", "9.9e-7"),
        ("eval.temperature", "1e-7"),
    ] {
        match TrainConfig::resolve(None, &set(&[&format!("{key}={t}")])) {
            Err(TrainError::InvalidConfig { field, reason }) => {
                assert_eq!(field, key, "{t}: {reason}");
                assert!(reason.contains("greedily"), "{key}={t}: {reason}");
            }
            other => panic!("{key}={t}: expected InvalidConfig, got {other:?}"),
        }
    }
    // k identical greedy answers at eval.temperature = 1e-7 are refused too.
    assert!(TrainConfig::resolve(
        None,
        &set(&["eval.temperature=1e-7", "eval.samples_per_prompt=4"])
    )
    .is_err());
    for (key, t) in [
        ("rollout.temperature", 1e-6),
        ("rollout.temperature", 2e-6),
        ("rollout.temperature", 0.7),
        ("eval.temperature", 0.0),
        ("eval.temperature", 1e-6),
    ] {
        let cfg = TrainConfig::resolve(None, &set(&[&format!("{key}={t:e}")]))
            .unwrap_or_else(|e| panic!("{key}={t}: {e}"));
        let got = match key {
            "rollout.temperature" => cfg.rollout.temperature,
            _ => cfg.eval.temperature,
        };
        assert_eq!(got, t);
    }
}
