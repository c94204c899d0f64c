//! Behaviours transformers 5 (the version of the HF oracle fixtures) defines and r3 must
//! reproduce, each against HF's rule written out by hand: which RoPE dict wins when a config
//! carries both `rope_scaling` and `rope_parameters`; the config defaults of
//! `Qwen2MoeConfig` / `DeepseekV3Config`; OLMoE's `clip_qkv` applied after the q/k norms;
//! renormalised gates of a replayed choice far below the router's best; and checkpoint
//! tensors of a layer that the config would silently drop.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var, D};
use common::{tiny_json, tiny_weights};
use r3_model::layers::attention::rope::Rope;
use r3_model::layers::attention::{AttentionMask, GqaAttention};
use r3_model::{
    AttentionConfig, Config, ModelError, RopeScaling, Router, RouterKind, SharedExpert, Weights,
};
use r3_test_support::Scratch;
use serde_json::{json, Value};

fn parse(value: Value) -> Config {
    match Config::from_value(value) {
        Ok(c) => c,
        Err(e) => panic!("config failed to parse: {e}"),
    }
}

/// The Qwen3-MoE oracle fixture's config.json, as transformers 5 wrote it (its
/// `rope_parameters` a default rope of theta 1e4, no top-level `rope_theta`).
fn fixture_config() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/qwen3_moe_tiny/config.json"
    );
    let text = std::fs::read_to_string(path).expect("fixture config");
    serde_json::from_str(&text).expect("fixture json")
}

/// HF `convert_rope_params_to_dict`: `rope_parameters = rope_scaling or rope_parameters`.
/// The v5 fixture plus a legacy YaRN `rope_scaling` runs YaRN in HF, theta from the top-level
/// key or the class default (the replaced dict's theta is gone with it).
#[test]
fn a_legacy_rope_scaling_wins_over_rope_parameters_as_in_transformers() {
    let mut doc = fixture_config();
    assert_eq!(
        doc["rope_parameters"],
        json!({"rope_theta": 10000.0, "rope_type": "default"})
    );
    doc["rope_scaling"] =
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
    let c = parse(doc.clone());
    match c.rope.scaling {
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            ..
        } => {
            assert_eq!(factor, 4.0);
            assert_eq!(original_max_position_embeddings, 32768);
        }
        other => panic!("HF runs YaRN here, r3 parsed {other:?}"),
    }
    assert_eq!(c.rope.theta, 1e4);

    // Both dicts scaling, differently: rope_scaling still decides (and a warning names both).
    doc["rope_parameters"] = json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4});
    assert!(
        matches!(parse(doc.clone()).rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0)
    );

    // The replaced dict's theta is dropped: the top-level key, else the class default.
    doc["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 5e5});
    assert_eq!(parse(doc.clone()).rope.theta, 1e4);
    doc["rope_theta"] = json!(2e5);
    assert_eq!(parse(doc.clone()).rope.theta, 2e5);
    // A theta inside rope_scaling is the dict's own, ahead of the top-level key.
    doc["rope_scaling"]["rope_theta"] = json!(3e5);
    assert_eq!(parse(doc.clone()).rope.theta, 3e5);

    // Python's `or`: a null or empty rope_scaling leaves rope_parameters in charge.
    for empty in [Value::Null, json!({})] {
        let mut doc = fixture_config();
        doc["rope_scaling"] = empty;
        doc["rope_parameters"] = json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5});
        let c = parse(doc);
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(c.rope.theta, 5e5);
    }
}

/// HF: `rope_parameters.setdefault("rope_theta", <top-level rope_theta>)`: the dict's theta
/// first, the top-level key only where the dict has none.
#[test]
fn the_rope_dicts_theta_comes_before_the_top_level_key() {
    let mut doc = fixture_config();
    doc["rope_theta"] = json!(1e6);
    doc["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 5e5});
    assert_eq!(parse(doc.clone()).rope.theta, 5e5);
    doc["rope_parameters"] = json!({"rope_type": "default"});
    assert_eq!(parse(doc).rope.theta, 1e6);
}

/// `DeepseekV3Config(n_shared_experts=1)`, `Qwen2MoeConfig(shared_expert_intermediate_size=
/// 5632, qkv_bias=True)`: a config without the key gets HF's default, not "none".
#[test]
fn missing_keys_take_the_transformers_defaults() {
    let mut ds = tiny_json("deepseek_v3");
    ds.as_object_mut()
        .expect("object")
        .remove("n_shared_experts");
    let moe_width = ds["moe_intermediate_size"].as_u64().expect("width") as usize;
    assert_eq!(
        parse(ds).moe.expect("moe").shared,
        SharedExpert::Plain {
            intermediate_size: moe_width
        }
    );

    let mut qwen = tiny_json("qwen2_moe");
    qwen.as_object_mut()
        .expect("object")
        .remove("shared_expert_intermediate_size");
    let c = parse(qwen.clone());
    assert_eq!(
        c.moe.expect("moe").shared,
        SharedExpert::Gated {
            intermediate_size: 5632
        }
    );
    assert!(matches!(
        c.attention,
        AttentionConfig::Gqa { qkv_bias: true, .. }
    ));

    // transformers 5's `qkv_bias` key is read; an explicit 0 shared width is no shared expert.
    qwen["qkv_bias"] = json!(false);
    qwen["shared_expert_intermediate_size"] = json!(0);
    let c = parse(qwen);
    assert!(matches!(
        c.attention,
        AttentionConfig::Gqa {
            qkv_bias: false,
            ..
        }
    ));
    assert_eq!(c.moe.expect("moe").shared, SharedExpert::None);
}

/// `[rows, cols]` f32 values of a 2-D tensor.
fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.to_vec2::<f64>())
        .expect("2-D tensor")
}

/// `w x` for a `[out, in]` matrix.
fn matvec(w: &[Vec<f64>], x: &[f64]) -> Vec<f64> {
    w.iter()
        .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// HF `OlmoeRMSNorm` over the whole projection.
fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

/// HF `rotate_half` RoPE of one head at `pos`.
fn rotate(head: &mut [f64], pos: f64, theta: f64) {
    let half = head.len() / 2;
    for i in 0..half {
        let angle = pos * theta.powf(-(2.0 * i as f64) / head.len() as f64);
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * angle.cos() - b * angle.sin();
        head[i + half] = b * angle.cos() + a * angle.sin();
    }
}

/// HF `OlmoeAttention.forward` by hand: q = clamp(q_norm(q_proj x)), k = clamp(k_norm(k_proj
/// x)), v = clamp(v_proj x), RoPE, causal softmax attention, o_proj.
fn olmoe_attention_by_hand(cfg: &Config, w: &Weights, x: &[Vec<f64>], clip: f64) -> Vec<Vec<f64>> {
    let p = "model.layers.0.self_attn";
    let get = |n: &str| rows(w.get(&format!("{p}.{n}")).expect("tensor"));
    let vec = |n: &str| {
        w.get(&format!("{p}.{n}"))
            .and_then(|t| Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?))
            .expect("norm")
    };
    let (wq, wk, wv, wo) = (
        get("q_proj.weight"),
        get("k_proj.weight"),
        get("v_proj.weight"),
        get("o_proj.weight"),
    );
    let (qn, kn) = (vec("q_norm.weight"), vec("k_norm.weight"));
    let AttentionConfig::Gqa {
        num_kv_heads,
        head_dim: hd,
        ..
    } = cfg.attention
    else {
        panic!("GQA config");
    };
    let (nh, eps, theta) = (cfg.num_attention_heads, cfg.rms_norm_eps, cfg.rope.theta);
    let clamp = |v: Vec<f64>| {
        v.into_iter()
            .map(|x| x.clamp(-clip, clip))
            .collect::<Vec<_>>()
    };
    let mut q = Vec::new();
    let mut k = Vec::new();
    let mut v = Vec::new();
    for (t, xt) in x.iter().enumerate() {
        let mut qt = clamp(rms_norm(&matvec(&wq, xt), &qn, eps));
        let mut kt = clamp(rms_norm(&matvec(&wk, xt), &kn, eps));
        qt.chunks_mut(hd).for_each(|h| rotate(h, t as f64, theta));
        kt.chunks_mut(hd).for_each(|h| rotate(h, t as f64, theta));
        q.push(qt);
        k.push(kt);
        v.push(clamp(matvec(&wv, xt)));
    }
    let groups = nh / num_kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    (0..x.len())
        .map(|t| {
            let mut out = vec![0.0; nh * hd];
            for h in 0..nh {
                let kvh = h / groups;
                let qh = &q[t][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (0..=t)
                    .map(|j| {
                        let kj = &k[j][kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    let p = (s - m).exp() / z;
                    for d in 0..hd {
                        out[h * hd + d] += p * v[j][kvh * hd + d];
                    }
                }
            }
            matvec(&wo, &out)
        })
        .collect()
}

/// OLMoE's `clip_qkv` clamps the normed q and k (HF `OlmoeAttention.forward`): with a bound
/// that bites on most normed values, r3's attention layer equals the hand computation of
/// `clamp(rmsnorm(q_proj x))`, and differs from it by far more than rounding if the clamp
/// ran before the norm.
#[test]
fn olmoe_clips_q_and_k_after_their_norms() {
    let clip = 0.5;
    let mut doc = tiny_json("olmoe");
    doc["clip_qkv"] = json!(clip);
    let cfg = parse(doc);
    let weights = tiny_weights(&cfg, 7, DType::F32);
    let t = 5;
    let h = cfg.hidden_size;
    let x: Vec<Vec<f64>> = (0..t)
        .map(|i| {
            (0..h)
                .map(|j| (((i * 13 + j * 7) % 11) as f64 - 5.0) / 4.0)
                .collect()
        })
        .collect();
    let want = olmoe_attention_by_hand(&cfg, &weights, &x, clip);

    let layer = GqaAttention::new(&cfg, &weights, "model.layers.0.self_attn").expect("layer");
    let flat: Vec<f32> = x.iter().flatten().map(|&v| v as f32).collect();
    let xt = Tensor::from_vec(flat, (1, t, h), &Device::Cpu).expect("x");
    let rope = Rope::new(&cfg.rope)
        .tables(t, &Device::Cpu, DType::F32)
        .expect("rope");
    let mask = AttentionMask::new(&[t], t, None, &Device::Cpu).expect("mask");
    let got = layer
        .forward(&xt, &rope, &mask)
        .and_then(|o| Ok(o.squeeze(0)?.to_dtype(DType::F64)?.to_vec2::<f64>()?))
        .expect("forward");
    let scale = want.iter().flatten().fold(1f64, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        for (a, b) in g.iter().zip(w) {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "position {i}: r3 {a} vs HF by hand {b}"
            );
        }
    }
}

/// A renormalising softmax router (HF `norm_topk_prob`, Mixtral always).
fn renormalising(experts: usize, top_k: usize) -> Router {
    Router {
        kind: RouterKind::Softmax {
            norm_topk_prob: true,
        },
        num_experts: experts,
        top_k,
    }
}

/// A replayed choice need not hold this router's best expert: logits `[0, -200, -201, 0]`
/// with replayed ids `[1, 2]` weigh as softmax([-200, -201]) = [1/(1+e⁻¹), e⁻¹/(1+e⁻¹)]
/// ≈ [0.731, 0.269] in both halves, where softmax-then-renormalise gave 0 / 0.
#[test]
fn replayed_gates_far_below_the_best_are_finite() {
    let router = renormalising(4, 2);
    let logits = [0.0f32, -200.0, -201.0, 0.0];
    let ids = [1u32, 2];
    let e1 = (-1.0f64).exp();
    let want = [1.0 / (1.0 + e1), e1 / (1.0 + e1)];

    let mut row = [0f32; 2];
    router
        .weigh_row(&logits, &ids, &mut row)
        .expect("weigh_row");
    let lt = Tensor::from_slice(&logits, (1, 4), &Device::Cpu).expect("logits");
    let it = Tensor::from_slice(&ids, (1, 2), &Device::Cpu).expect("ids");
    let tensor = router
        .weigh(&lt, &it)
        .and_then(|g| Ok(g.flatten_all()?.to_vec1::<f32>()?))
        .expect("weigh");
    for (what, got) in [("weigh_row", row.to_vec()), ("weigh", tensor)] {
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() < 1e-6,
                "{what}: {got:?} vs {want:?}"
            );
        }
    }
}

/// HF's gate formula in f64: softmax over all logits, gather `ids`, renormalise.
fn hf_gates(logits: &[f64], ids: &[usize]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let z: f64 = logits.iter().map(|x| (x - m).exp()).sum();
    let p: Vec<f64> = ids.iter().map(|&i| (logits[i] - m).exp() / z).collect();
    let s: f64 = p.iter().sum();
    p.iter().map(|v| v / s).collect()
}

/// The gathered softmax has HF's gradient: autograd of `Σ probe · weigh(logits)` equals
/// central differences of HF's softmax-then-renormalise formula (in f64, where nothing
/// underflows) on an ordinary row, with a replayed id outside the router's top-k and a
/// repeated id; and on the far-below row the gradient is finite, that of softmax([-200, -201]).
#[test]
fn gathered_softmax_gradient_is_hfs() {
    let router = renormalising(5, 3);
    let probe = [0.7f64, -1.3, 0.4];
    for (logits, ids) in [
        (vec![0.3f64, -1.2, 0.8, 2.0, -0.4], vec![1usize, 2, 4]),
        (vec![1.5, 0.1, -2.0, 0.9, 0.0], vec![3, 3, 0]),
    ] {
        let var = Var::from_vec(
            logits.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            (1, 5),
            &Device::Cpu,
        )
        .expect("var");
        let ids_t = Tensor::from_vec(
            ids.iter().map(|&i| i as u32).collect::<Vec<_>>(),
            (1, 3),
            &Device::Cpu,
        )
        .expect("ids");
        let probe_t = Tensor::from_vec(
            probe.iter().map(|&v| v as f32).collect::<Vec<_>>(),
            (1, 3),
            &Device::Cpu,
        )
        .expect("probe");
        let loss = router
            .weigh(var.as_tensor(), &ids_t)
            .and_then(|g| Ok((g * &probe_t)?.sum_all()?))
            .expect("loss");
        let grads = loss.backward().expect("backward");
        let got = grads
            .get(var.as_tensor())
            .expect("gradient")
            .flatten_all()
            .and_then(|g| g.to_vec1::<f32>())
            .expect("values");
        let objective = |l: &[f64]| -> f64 {
            hf_gates(l, &ids)
                .iter()
                .zip(probe)
                .map(|(g, p)| g * p)
                .sum()
        };
        let h = 1e-6;
        for i in 0..5 {
            let (mut up, mut down) = (logits.clone(), logits.clone());
            up[i] += h;
            down[i] -= h;
            let fd = (objective(&up) - objective(&down)) / (2.0 * h);
            assert!(
                (f64::from(got[i]) - fd).abs() < 1e-5,
                "logit {i} of {logits:?}, ids {ids:?}: autograd {} vs HF finite difference {fd}",
                got[i]
            );
        }
    }

    let router = renormalising(4, 2);
    let var = Var::from_vec(vec![0.0f32, -200.0, -201.0, 0.0], (1, 4), &Device::Cpu).expect("var");
    let ids = Tensor::from_vec(vec![1u32, 2], (1, 2), &Device::Cpu).expect("ids");
    let gates = router.weigh(var.as_tensor(), &ids).expect("weigh");
    let first = gates
        .narrow(D::Minus1, 0, 1)
        .and_then(|g| g.sum_all())
        .expect("g0");
    let grad = first.backward().expect("backward");
    let got = grad
        .get(var.as_tensor())
        .expect("gradient")
        .flatten_all()
        .and_then(|g| g.to_vec1::<f32>())
        .expect("values");
    // d g0 / d l1 = g0 g1, d g0 / d l2 = −g0 g1, nothing through the unchosen logits.
    let e1 = (-1.0f64).exp();
    let g0g1 = e1 / ((1.0 + e1) * (1.0 + e1));
    let want = [0.0, g0g1, -g0g1, 0.0];
    for (g, w) in got.iter().zip(want) {
        assert!((f64::from(*g) - w).abs() < 1e-6, "{got:?} vs {want:?}");
    }
}

/// Writes `tensors` as `dir/model.safetensors`.
fn write_checkpoint(dir: &Scratch, tensors: &std::collections::BTreeMap<String, Tensor>) {
    let map: HashMap<String, Tensor> = tensors.clone().into_iter().collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).expect("write");
}

/// Loads `dir` under config `doc`.
fn load(dir: &Scratch, doc: Value) -> r3_model::Result<Weights> {
    Weights::load(dir, &parse(doc), &Device::Cpu)
}

/// The error of loading `dir` under `doc`, which must name `needle`.
fn refused(dir: &Scratch, doc: Value, needle: &str) {
    match load(dir, doc) {
        Err(e @ ModelError::Checkpoint { .. }) => {
            let text = e.to_string();
            assert!(text.contains(needle), "{text} does not name {needle}");
        }
        Err(other) => panic!("expected a checkpoint error naming {needle}, got {other}"),
        Ok(_) => panic!("a checkpoint with {needle} loaded under a config without it"),
    }
}

/// A checkpoint whose layers hold a shared expert or attention tensors the config leaves out
/// is refused, naming them (the model would run without them); tensors of layers past
/// `num_hidden_layers` (DeepSeek's MTP layers) and old checkpoints' rotary buffers still load.
#[test]
fn checkpoint_tensors_a_layer_would_drop_are_refused() {
    // Qwen2-MoE with a shared expert and qkv biases, loaded as without either.
    let doc = tiny_json("qwen2_moe");
    let weights = tiny_weights(&parse(doc.clone()), 3, DType::F32);
    let dir = Scratch::new("hf-v5-parity-qwen2");
    write_checkpoint(&dir, weights.tensors());
    load(&dir, doc.clone()).expect("the checkpoint's own config");
    let mut no_shared = doc.clone();
    no_shared["shared_expert_intermediate_size"] = json!(0);
    refused(&dir, no_shared, "model.layers.0.mlp.shared_expert");
    let mut no_bias = doc.clone();
    no_bias["qkv_bias"] = json!(false);
    refused(&dir, no_bias, "model.layers.0.self_attn.k_proj.bias");

    // DeepSeek-V3 with one shared expert, loaded as with none.
    let ds = tiny_json("deepseek_v3");
    let weights = tiny_weights(&parse(ds.clone()), 3, DType::F32);
    let dir = Scratch::new("hf-v5-parity-deepseek");
    write_checkpoint(&dir, weights.tensors());
    let mut none = ds.clone();
    none["n_shared_experts"] = json!(0);
    refused(&dir, none, "mlp.shared_experts.");

    // A layer past the config's (an MTP layer) and a rotary buffer: a warning only.
    let mut deeper = tiny_json("qwen3_moe");
    deeper["num_hidden_layers"] = json!(4);
    let mut tensors = tiny_weights(&parse(deeper), 3, DType::F32)
        .tensors()
        .clone();
    tensors.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Tensor::ones(4, DType::F32, &Device::Cpu).expect("buffer"),
    );
    let dir = Scratch::new("hf-v5-parity-mtp");
    write_checkpoint(&dir, &tensors);
    load(&dir, tiny_json("qwen3_moe")).expect("extra layer and rotary buffer only warn");
}

/// `DeepseekV3Config.__init__`'s defaults (transformers v5, `configuration_deepseek_v3.py`,
/// written out by hand here): `vocab_size=129280, hidden_size=7168, intermediate_size=18432,
/// moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
/// n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
/// q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
/// topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
/// max_position_embeddings=4096, rms_norm_eps=1e-6, rope_interleave=True`. A config.json
/// holding only its `model_type` is that model in HF, and in r3.
#[test]
fn a_deepseek_v3_config_without_its_keys_is_transformers_default_model() {
    let c = parse(json!({"model_type": "deepseek_v3"}));
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.max_position_embeddings,
        ),
        (129_280, 7168, 18_432, 61, 128, 4096)
    );
    assert_eq!(c.rms_norm_eps, 1e-6);
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
        (256, 8, 2048)
    );
    assert_eq!(
        moe.router,
        RouterKind::GroupedSigmoid {
            n_group: 8,
            topk_group: 4,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        }
    );
    assert_eq!(
        moe.shared,
        SharedExpert::Plain {
            intermediate_size: 2048
        }
    );
    assert_eq!(
        c.attention,
        AttentionConfig::Mla {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }
    );
    // first_k_dense_replace = 3: layers 3 to 60 are the MoE layers, and a route table's
    // layout, read from the same config.json by r3-routing, agrees.
    assert_eq!(
        c.layout.moe_layers(),
        (3..61).collect::<Vec<_>>().as_slice()
    );
    let routing = r3_routing::RoutingConfig::from_hf_config(&json!({"model_type": "deepseek_v3"}))
        .expect("routing keys");
    assert_eq!(routing.layout().expect("layout"), c.layout);
    assert_eq!(routing.top_k, moe.top_k);
    assert!(c.rope.interleaved);
    assert_eq!(c.rope.dim, 64);
}

/// One key at a time left out of a tiny DeepSeek-V3 config (16 experts, so that HF's
/// `n_group = 8` leaves two experts a group) takes HF's default and nothing else changes; an
/// explicit `null` of a size key is refused naming it (HF would keep `None` and fail).
#[test]
fn a_tiny_deepseek_v3_config_missing_one_key_takes_its_transformers_default() {
    let mut tiny = tiny_json("deepseek_v3");
    tiny["n_routed_experts"] = json!(16);
    let without = |key: &str| {
        let mut doc = tiny.clone();
        doc.as_object_mut().expect("object").remove(key);
        parse(doc)
    };
    let router = |c: &Config| c.moe.as_ref().expect("moe").router;
    assert_eq!(
        router(&without("n_group")),
        RouterKind::GroupedSigmoid {
            n_group: 8,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        }
    );
    assert_eq!(
        router(&without("routed_scaling_factor")),
        RouterKind::GroupedSigmoid {
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        }
    );
    assert_eq!(
        router(&without("topk_group")),
        RouterKind::GroupedSigmoid {
            n_group: 4,
            topk_group: 4,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        }
    );
    assert_eq!(without("num_hidden_layers").num_hidden_layers, 61);
    // No layer is dense but the first three.
    let c = without("first_k_dense_replace");
    assert_eq!(c.layer_rules.first_k_dense_replace, 3);
    assert!(c.layout.moe_layers().is_empty(), "3 layers, all dense");
    let mla = |c: &Config| match c.attention {
        AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } => (
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        ),
        AttentionConfig::Gqa { .. } => panic!("DeepSeek-V3 has MLA"),
    };
    assert_eq!(mla(&parse(tiny.clone())), (Some(12), 8, 4, 4, 6));
    assert_eq!(mla(&without("q_lora_rank")), (Some(1536), 8, 4, 4, 6));
    assert_eq!(mla(&without("kv_lora_rank")), (Some(12), 512, 4, 4, 6));
    assert_eq!(mla(&without("qk_nope_head_dim")), (Some(12), 8, 128, 4, 6));
    assert_eq!(mla(&without("v_head_dim")), (Some(12), 8, 4, 4, 128));
    assert_eq!(without("qk_rope_head_dim").rope.dim, 64);
    let c = without("moe_intermediate_size");
    let moe = c.moe.as_ref().expect("moe");
    assert_eq!(moe.expert_intermediate_size, 2048);
    assert_eq!(
        moe.shared,
        SharedExpert::Plain {
            intermediate_size: 2048
        }
    );
    assert_eq!(
        without("num_experts_per_tok")
            .moe
            .as_ref()
            .expect("moe")
            .top_k,
        8
    );
    assert_eq!(without("intermediate_size").intermediate_size, 18_432);
    assert_eq!(without("vocab_size").vocab_size, 129_280);

    for key in [
        "n_group",
        "routed_scaling_factor",
        "kv_lora_rank",
        "first_k_dense_replace",
    ] {
        let mut doc = tiny.clone();
        doc[key] = Value::Null;
        let err = Config::from_value(doc).expect_err("a null size");
        assert!(err.to_string().contains(key), "{key}: {err}");
    }
}

/// `q_lora_rank`: an explicit `null` (Moonlight) is a plain `q_proj`, a missing key HF's
/// low-rank q of rank 1536. A Moonlight checkpoint loaded under the latter is refused, the
/// error naming the low-rank tensors it lacks.
#[test]
fn a_missing_q_lora_rank_is_hfs_low_rank_q_and_a_null_one_a_plain_q_proj() {
    let moonlight = tiny_json("moonlight");
    assert_eq!(moonlight["q_lora_rank"], Value::Null);
    let plain = parse(moonlight.clone());
    assert!(matches!(
        plain.attention,
        AttentionConfig::Mla {
            q_lora_rank: None,
            ..
        }
    ));
    let mut missing = moonlight.clone();
    missing
        .as_object_mut()
        .expect("object")
        .remove("q_lora_rank");
    assert!(matches!(
        parse(missing.clone()).attention,
        AttentionConfig::Mla {
            q_lora_rank: Some(1536),
            ..
        }
    ));

    let weights = tiny_weights(&plain, 3, DType::F32);
    assert!(weights
        .tensors()
        .contains_key("model.layers.0.self_attn.q_proj.weight"));
    let dir = Scratch::new("hf-v5-parity-q-lora");
    write_checkpoint(&dir, weights.tensors());
    load(&dir, moonlight).expect("the checkpoint's own config");
    let err = load(&dir, missing).expect_err("no q_a_proj in a plain-q checkpoint");
    assert!(
        matches!(&err, ModelError::MissingTensor(name)
            if name == "model.layers.0.self_attn.q_a_proj.weight"),
        "the error names the missing low-rank q: {err}"
    );
}
