//! The list of tensors a config requires — HF name, shape, role — the single source
//! for load validation, random init, trainable variables and save order.

use crate::config::{AttentionConfig, Config, QkNorm, SharedExpert};

/// What a tensor is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// A weight matrix or embedding (trainable).
    Matrix,
    /// An RMSNorm scale (trainable, initialised near one).
    NormScale,
    /// A projection bias (trainable).
    Bias,
    /// A router matrix `gate.weight` (trainable).
    Router,
    /// A non-trainable buffer (DeepSeek `e_score_correction_bias`).
    Buffer,
}

impl TensorRole {
    /// Whether the optimiser updates this tensor.
    pub fn is_trainable(self) -> bool {
        self != TensorRole::Buffer
    }
}

/// One required tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// HF tensor name
    pub name: String,
    /// shape
    pub shape: Vec<usize>,
    /// role
    pub role: TensorRole,
}

/// Accumulates specs under a name prefix.
struct SpecList {
    specs: Vec<TensorSpec>,
}

impl SpecList {
    fn push(&mut self, name: String, shape: Vec<usize>, role: TensorRole) {
        self.specs.push(TensorSpec { name, shape, role });
    }

    fn linear(&mut self, prefix: &str, out_dim: usize, in_dim: usize) {
        self.push(
            format!("{prefix}.weight"),
            vec![out_dim, in_dim],
            TensorRole::Matrix,
        );
    }

    fn norm(&mut self, prefix: &str, dim: usize) {
        self.push(format!("{prefix}.weight"), vec![dim], TensorRole::NormScale);
    }

    fn swiglu(&mut self, prefix: &str, names: &SwigluNames, hidden: usize, inner: usize) {
        self.linear(&format!("{prefix}.{}", names.gate), inner, hidden);
        self.linear(&format!("{prefix}.{}", names.up), inner, hidden);
        self.linear(&format!("{prefix}.{}", names.down), hidden, inner);
    }
}

/// HF names of the three SwiGLU projections (Mixtral experts use `w1/w3/w2`).
#[derive(Debug, Clone, Copy)]
pub struct SwigluNames {
    /// gate projection (`gate_proj` / `w1`)
    pub gate: &'static str,
    /// up projection (`up_proj` / `w3`)
    pub up: &'static str,
    /// down projection (`down_proj` / `w2`)
    pub down: &'static str,
}

/// `gate_proj` / `up_proj` / `down_proj`.
pub const SWIGLU_HF: SwigluNames = SwigluNames {
    gate: "gate_proj",
    up: "up_proj",
    down: "down_proj",
};

/// Mixtral expert names `w1` / `w3` / `w2`.
pub const SWIGLU_MIXTRAL: SwigluNames = SwigluNames {
    gate: "w1",
    up: "w3",
    down: "w2",
};

/// The projection names routed experts of this config use.
pub fn expert_names(cfg: &Config) -> SwigluNames {
    match cfg.architecture {
        crate::config::Architecture::Mixtral => SWIGLU_MIXTRAL,
        _ => SWIGLU_HF,
    }
}

/// Prefix of layer `i` in HF names.
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}")
}

/// How a name→tensor map holds the routed experts of MoE layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// HF per-expert tensors `experts.{j}.{gate,up,down}_proj.weight` (what checkpoints hold).
    PerExpert,
    /// Two stacked tensors per layer, `experts.gate_up_proj` `[E, 2I, H]` (gate rows first)
    /// and `experts.down_proj` `[E, H, I]` (transformers 5's layout; what training updates).
    Fused,
}

/// Names of the fused expert tensors under a MoE block prefix: `(gate_up, down)`.
pub fn fused_expert_names(moe_prefix: &str) -> (String, String) {
    (
        format!("{moe_prefix}.experts.gate_up_proj"),
        format!("{moe_prefix}.experts.down_proj"),
    )
}

/// Every tensor the config requires, with per-expert HF names, in a stable order.
pub fn tensor_specs(cfg: &Config) -> Vec<TensorSpec> {
    tensor_specs_in(cfg, ExpertLayout::PerExpert)
}

/// Every tensor the config requires with the routed experts in `layout`, in a stable order.
pub fn tensor_specs_in(cfg: &Config, layout: ExpertLayout) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let nh = cfg.num_attention_heads;
    let mut list = SpecList { specs: Vec::new() };
    list.linear("model.embed_tokens", cfg.vocab_size, h);
    for i in 0..cfg.num_hidden_layers {
        let p = layer_prefix(i);
        list.norm(&format!("{p}.input_layernorm"), h);
        list.norm(&format!("{p}.post_attention_layernorm"), h);
        attention_specs(&mut list, cfg, &format!("{p}.self_attn"), h, nh);
        match (&cfg.moe, cfg.is_moe_layer(i)) {
            (Some(moe), true) => {
                let m = format!("{p}.{}", cfg.moe_prefix());
                let e = moe.num_experts;
                list.push(format!("{m}.gate.weight"), vec![e, h], TensorRole::Router);
                if matches!(moe.router, crate::config::RouterKind::GroupedSigmoid { .. }) {
                    list.push(
                        format!("{m}.gate.e_score_correction_bias"),
                        vec![e],
                        TensorRole::Buffer,
                    );
                }
                let inter = moe.expert_intermediate_size;
                match layout {
                    ExpertLayout::PerExpert => {
                        let names = expert_names(cfg);
                        for j in 0..e {
                            list.swiglu(&format!("{m}.experts.{j}"), &names, h, inter);
                        }
                    }
                    ExpertLayout::Fused => {
                        let (gate_up, down) = fused_expert_names(&m);
                        list.push(gate_up, vec![e, 2 * inter, h], TensorRole::Matrix);
                        list.push(down, vec![e, h, inter], TensorRole::Matrix);
                    }
                }
                match moe.shared {
                    SharedExpert::None => {}
                    SharedExpert::Plain { intermediate_size } => list.swiglu(
                        &format!("{m}.shared_experts"),
                        &SWIGLU_HF,
                        h,
                        intermediate_size,
                    ),
                    SharedExpert::Gated { intermediate_size } => {
                        list.swiglu(
                            &format!("{m}.shared_expert"),
                            &SWIGLU_HF,
                            h,
                            intermediate_size,
                        );
                        list.linear(&format!("{m}.shared_expert_gate"), 1, h);
                    }
                }
            }
            _ => list.swiglu(&format!("{p}.mlp"), &SWIGLU_HF, h, cfg.intermediate_size),
        }
    }
    list.norm("model.norm", h);
    if !cfg.tie_word_embeddings {
        list.linear("lm_head", cfg.vocab_size, h);
    }
    list.specs
}

fn attention_specs(list: &mut SpecList, cfg: &Config, p: &str, h: usize, nh: usize) {
    match &cfg.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            qkv_bias,
            qk_norm,
            ..
        } => {
            let q_dim = nh * head_dim;
            let kv_dim = num_kv_heads * head_dim;
            for (name, dim) in [("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)] {
                list.linear(&format!("{p}.{name}"), dim, h);
                if *qkv_bias {
                    list.push(format!("{p}.{name}.bias"), vec![dim], TensorRole::Bias);
                }
            }
            list.linear(&format!("{p}.o_proj"), h, q_dim);
            match qk_norm {
                QkNorm::None => {}
                QkNorm::PerHead => {
                    list.norm(&format!("{p}.q_norm"), *head_dim);
                    list.norm(&format!("{p}.k_norm"), *head_dim);
                }
                QkNorm::Full => {
                    list.norm(&format!("{p}.q_norm"), q_dim);
                    list.norm(&format!("{p}.k_norm"), kv_dim);
                }
            }
        }
        AttentionConfig::Mla {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        } => {
            let qk_head = qk_nope_head_dim + qk_rope_head_dim;
            match q_lora_rank {
                Some(r) => {
                    list.linear(&format!("{p}.q_a_proj"), *r, h);
                    list.norm(&format!("{p}.q_a_layernorm"), *r);
                    list.linear(&format!("{p}.q_b_proj"), nh * qk_head, *r);
                }
                None => list.linear(&format!("{p}.q_proj"), nh * qk_head, h),
            }
            list.linear(
                &format!("{p}.kv_a_proj_with_mqa"),
                kv_lora_rank + qk_rope_head_dim,
                h,
            );
            list.norm(&format!("{p}.kv_a_layernorm"), *kv_lora_rank);
            list.linear(
                &format!("{p}.kv_b_proj"),
                nh * (qk_nope_head_dim + v_head_dim),
                *kv_lora_rank,
            );
            list.linear(&format!("{p}.o_proj"), h, nh * v_head_dim);
        }
    }
}
