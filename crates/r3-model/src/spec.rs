//! The list of tensors a config requires — HF name, shape, role — the single source
//! for load validation, random init, trainable variables and save order.

use crate::config::{
    Architecture, AttentionConfig, Config, MoeConfig, QkNorm, RouterKind, SharedExpert,
};

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
        self.push(weight(prefix), vec![out_dim, in_dim], TensorRole::Matrix);
    }

    fn norm(&mut self, prefix: &str, dim: usize) {
        self.push(weight(prefix), vec![dim], TensorRole::NormScale);
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
        Architecture::Mixtral => SWIGLU_MIXTRAL,
        _ => SWIGLU_HF,
    }
}

/// HF name of the token embedding (also the output head when embeddings are tied).
pub const EMBED: &str = "model.embed_tokens";
/// HF name of the final RMSNorm.
pub const FINAL_NORM: &str = "model.norm";
/// HF name of the untied output head.
pub const LM_HEAD: &str = "lm_head";
/// GQA projections, in the order engines stack them: `q`, `k`, `v`.
pub const QKV_PROJ: [&str; 3] = ["q_proj", "k_proj", "v_proj"];
/// Attention output projection (GQA and MLA).
pub const O_PROJ: &str = "o_proj";
/// GQA q norm.
pub const Q_NORM: &str = "q_norm";
/// GQA k norm.
pub const K_NORM: &str = "k_norm";
/// MLA q compression `q_a_proj`.
pub const MLA_Q_A: &str = "q_a_proj";
/// MLA norm of the compressed q.
pub const MLA_Q_A_NORM: &str = "q_a_layernorm";
/// MLA q decompression `q_b_proj`.
pub const MLA_Q_B: &str = "q_b_proj";
/// MLA q projection without compression.
pub const MLA_Q: &str = "q_proj";
/// MLA compressed kv plus the shared rotary key.
pub const MLA_KV_A: &str = "kv_a_proj_with_mqa";
/// MLA norm of the compressed kv.
pub const MLA_KV_A_NORM: &str = "kv_a_layernorm";
/// MLA kv decompression.
pub const MLA_KV_B: &str = "kv_b_proj";
/// Router matrix under a MoE block.
pub const ROUTER: &str = "gate";
/// DeepSeek selection bias under a MoE block.
pub const SCORE_BIAS: &str = "gate.e_score_correction_bias";
/// Qwen2-MoE shared-expert gate under a MoE block.
pub const SHARED_EXPERT_GATE: &str = "shared_expert_gate";

/// `{prefix}.weight`.
pub fn weight(prefix: &str) -> String {
    format!("{prefix}.weight")
}

/// `{prefix}.bias`.
pub fn bias(prefix: &str) -> String {
    format!("{prefix}.bias")
}

/// Prefix of layer `i` in HF names.
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}")
}

/// `input_layernorm` of layer `i`.
pub fn input_norm(i: usize) -> String {
    format!("{}.input_layernorm", layer_prefix(i))
}

/// `post_attention_layernorm` of layer `i`.
pub fn post_attention_norm(i: usize) -> String {
    format!("{}.post_attention_layernorm", layer_prefix(i))
}

/// Attention prefix of layer `i`.
pub fn attention_prefix(i: usize) -> String {
    format!("{}.self_attn", layer_prefix(i))
}

/// Dense SwiGLU prefix of layer `i`.
pub fn dense_mlp_prefix(i: usize) -> String {
    format!("{}.mlp", layer_prefix(i))
}

/// MoE block prefix of layer `i` (`mlp`, Mixtral `block_sparse_moe`).
pub fn moe_prefix(cfg: &Config, i: usize) -> String {
    format!("{}.{}", layer_prefix(i), cfg.moe_prefix())
}

/// Prefix of routed expert `j` (per-expert layout) under a MoE block.
pub fn expert_prefix(moe_prefix: &str, j: usize) -> String {
    format!("{moe_prefix}.experts.{j}")
}

/// Prefix and hidden width of the always-on expert under a MoE block (`shared_experts`,
/// Qwen2-MoE `shared_expert`), `None` without one.
pub fn shared_expert(moe_prefix: &str, shared: SharedExpert) -> Option<(String, usize)> {
    match shared {
        SharedExpert::None => None,
        SharedExpert::Plain { intermediate_size } => {
            Some((format!("{moe_prefix}.shared_experts"), intermediate_size))
        }
        SharedExpert::Gated { intermediate_size } => {
            Some((format!("{moe_prefix}.shared_expert"), intermediate_size))
        }
    }
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

impl ExpertLayout {
    /// The layout of a map that has the names `has` answers for: fused if the first MoE
    /// layer's fused gate/up tensor is there.
    pub fn detect(cfg: &Config, has: impl Fn(&str) -> bool) -> Self {
        let fused = cfg
            .layout
            .moe_layers()
            .first()
            .is_some_and(|&layer| has(&fused_expert_names(&moe_prefix(cfg, layer)).0));
        if fused {
            ExpertLayout::Fused
        } else {
            ExpertLayout::PerExpert
        }
    }
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
    let mut list = SpecList { specs: Vec::new() };
    list.linear(EMBED, cfg.vocab_size, h);
    for i in 0..cfg.num_hidden_layers {
        list.norm(&input_norm(i), h);
        list.norm(&post_attention_norm(i), h);
        attention_specs(&mut list, cfg, &attention_prefix(i));
        match (&cfg.moe, cfg.is_moe_layer(i)) {
            (Some(moe), true) => moe_specs(&mut list, cfg, moe, &moe_prefix(cfg, i), layout),
            _ => list.swiglu(&dense_mlp_prefix(i), &SWIGLU_HF, h, cfg.intermediate_size),
        }
    }
    list.norm(FINAL_NORM, h);
    if !cfg.tie_word_embeddings {
        list.linear(LM_HEAD, cfg.vocab_size, h);
    }
    list.specs
}

fn moe_specs(list: &mut SpecList, cfg: &Config, moe: &MoeConfig, m: &str, layout: ExpertLayout) {
    let (h, e, inter) = (
        cfg.hidden_size,
        moe.num_experts,
        moe.expert_intermediate_size,
    );
    list.push(
        weight(&format!("{m}.{ROUTER}")),
        vec![e, h],
        TensorRole::Router,
    );
    if matches!(moe.router, RouterKind::GroupedSigmoid { .. }) {
        list.push(format!("{m}.{SCORE_BIAS}"), vec![e], TensorRole::Buffer);
    }
    match layout {
        ExpertLayout::PerExpert => {
            let names = expert_names(cfg);
            for j in 0..e {
                list.swiglu(&expert_prefix(m, j), &names, h, inter);
            }
        }
        ExpertLayout::Fused => {
            let (gate_up, down) = fused_expert_names(m);
            list.push(gate_up, vec![e, 2 * inter, h], TensorRole::Matrix);
            list.push(down, vec![e, h, inter], TensorRole::Matrix);
        }
    }
    if let Some((shared, shared_inter)) = shared_expert(m, moe.shared) {
        list.swiglu(&shared, &SWIGLU_HF, h, shared_inter);
    }
    if let SharedExpert::Gated { .. } = moe.shared {
        list.linear(&format!("{m}.{SHARED_EXPERT_GATE}"), 1, h);
    }
}

fn attention_specs(list: &mut SpecList, cfg: &Config, p: &str) {
    let (h, nh) = (cfg.hidden_size, cfg.num_attention_heads);
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
            for (name, dim) in QKV_PROJ.into_iter().zip([q_dim, kv_dim, kv_dim]) {
                list.linear(&format!("{p}.{name}"), dim, h);
                if *qkv_bias {
                    list.push(bias(&format!("{p}.{name}")), vec![dim], TensorRole::Bias);
                }
            }
            list.linear(&format!("{p}.{O_PROJ}"), h, q_dim);
            let norm_dims = match qk_norm {
                QkNorm::None => None,
                QkNorm::PerHead => Some((*head_dim, *head_dim)),
                QkNorm::Full => Some((q_dim, kv_dim)),
            };
            if let Some((q, k)) = norm_dims {
                list.norm(&format!("{p}.{Q_NORM}"), q);
                list.norm(&format!("{p}.{K_NORM}"), k);
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
                    list.linear(&format!("{p}.{MLA_Q_A}"), *r, h);
                    list.norm(&format!("{p}.{MLA_Q_A_NORM}"), *r);
                    list.linear(&format!("{p}.{MLA_Q_B}"), nh * qk_head, *r);
                }
                None => list.linear(&format!("{p}.{MLA_Q}"), nh * qk_head, h),
            }
            list.linear(
                &format!("{p}.{MLA_KV_A}"),
                kv_lora_rank + qk_rope_head_dim,
                h,
            );
            list.norm(&format!("{p}.{MLA_KV_A_NORM}"), *kv_lora_rank);
            list.linear(
                &format!("{p}.{MLA_KV_B}"),
                nh * (qk_nope_head_dim + v_head_dim),
                *kv_lora_rank,
            );
            list.linear(&format!("{p}.{O_PROJ}"), h, nh * v_head_dim);
        }
    }
}
