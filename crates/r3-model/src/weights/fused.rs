//! Fused 3-D expert tensors (transformers 5 in-memory layout:
//! `experts.gate_up_proj` [E, 2I, H] with gate rows first, `experts.down_proj` [E, H, I];
//! or separate `experts.gate_proj` / `experts.up_proj` [E, I, H]) ↔ HF per-expert names.

use std::collections::{BTreeMap, HashMap};

use candle_core::Tensor;

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::spec::{
    dense_mlp_prefix, expert_names, expert_prefix, fused_expert_names, moe_prefix, weight, ROUTER,
};

/// Looks a fused tensor up with and without a `.weight` suffix.
fn take(map: &mut HashMap<String, Tensor>, base: &str) -> Option<(String, Tensor)> {
    for name in [base.to_string(), format!("{base}.weight")] {
        if let Some(t) = map.remove(&name) {
            return Some((name, t));
        }
    }
    None
}

fn check_shape(name: &str, t: &Tensor, expected: [usize; 3]) -> Result<()> {
    if t.dims() != expected {
        return Err(ModelError::TensorShape {
            name: name.to_string(),
            expected: expected.to_vec(),
            got: t.dims().to_vec(),
        });
    }
    Ok(())
}

/// Rows `[from, from+len)` of expert `j` as an owned contiguous matrix.
fn expert_rows(t: &Tensor, j: usize, from: usize, len: usize) -> Result<Tensor> {
    Ok(t.get(j)?.narrow(0, from, len)?.contiguous()?)
}

/// Replaces fused expert tensors in `map` by per-expert HF names; per-expert checkpoints
/// pass through unchanged. Mixtral's transformers-5 names (`mlp.*`) map to `block_sparse_moe.*`.
pub(super) fn unfuse_experts(
    mut map: HashMap<String, Tensor>,
    cfg: &Config,
) -> Result<HashMap<String, Tensor>> {
    let Some(moe) = &cfg.moe else {
        return Ok(map);
    };
    let names = expert_names(cfg);
    let (e, i_dim, h) = (
        moe.num_experts,
        moe.expert_intermediate_size,
        cfg.hidden_size,
    );
    for &layer in cfg.layout.moe_layers() {
        let canonical = moe_prefix(cfg, layer);
        let alt = dense_mlp_prefix(layer);
        if canonical != alt {
            let router = weight(&format!("{canonical}.{ROUTER}"));
            if !map.contains_key(&router) {
                if let Some(t) = map.remove(&weight(&format!("{alt}.{ROUTER}"))) {
                    map.insert(router, t);
                }
            }
        }
        if map.contains_key(&weight(&format!(
            "{}.{}",
            expert_prefix(&canonical, 0),
            names.gate
        ))) {
            continue;
        }
        for prefix in [canonical.clone(), alt.clone()] {
            let experts = format!("{prefix}.experts");
            let fused = take(&mut map, &format!("{experts}.gate_up_proj"));
            let (gate, up) = match fused {
                Some((name, t)) => {
                    check_shape(&name, &t, [e, 2 * i_dim, h])?;
                    (Some((name.clone(), t.clone(), 0)), Some((name, t, i_dim)))
                }
                None => (
                    take(&mut map, &format!("{experts}.gate_proj")).map(|(n, t)| (n, t, 0)),
                    take(&mut map, &format!("{experts}.up_proj")).map(|(n, t)| (n, t, 0)),
                ),
            };
            let down = take(&mut map, &format!("{experts}.down_proj"));
            if gate.is_none() && up.is_none() && down.is_none() {
                continue;
            }
            let (Some(gate), Some(up), Some((down_name, down))) = (gate, up, down) else {
                return Err(ModelError::MissingTensor(format!(
                    "{experts}: fused expert tensors incomplete (need gate_up_proj or gate_proj+up_proj, and down_proj)"
                )));
            };
            if gate.0 != up.0 {
                check_shape(&gate.0, &gate.1, [e, i_dim, h])?;
                check_shape(&up.0, &up.1, [e, i_dim, h])?;
            }
            check_shape(&down_name, &down, [e, h, i_dim])?;
            for j in 0..e {
                let p = expert_prefix(&canonical, j);
                map.insert(
                    weight(&format!("{p}.{}", names.gate)),
                    expert_rows(&gate.1, j, gate.2, i_dim)?,
                );
                map.insert(
                    weight(&format!("{p}.{}", names.up)),
                    expert_rows(&up.1, j, up.2, i_dim)?,
                );
                map.insert(
                    weight(&format!("{p}.{}", names.down)),
                    expert_rows(&down, j, 0, h)?,
                );
            }
            break;
        }
    }
    Ok(map)
}

/// Replaces the per-expert tensors of every MoE layer in `map` by the fused pair
/// `experts.gate_up_proj` `[E, 2I, H]` and `experts.down_proj` `[E, H, I]` (copies).
pub(super) fn fuse_experts(
    mut map: BTreeMap<String, Tensor>,
    cfg: &Config,
) -> Result<BTreeMap<String, Tensor>> {
    let Some(moe) = &cfg.moe else {
        return Ok(map);
    };
    let names = expert_names(cfg);
    for &layer in cfg.layout.moe_layers() {
        let prefix = moe_prefix(cfg, layer);
        let (gate_up_name, down_name) = fused_expert_names(&prefix);
        if map.contains_key(&gate_up_name) && map.contains_key(&down_name) {
            continue;
        }
        let mut gate_up = Vec::with_capacity(moe.num_experts);
        let mut down = Vec::with_capacity(moe.num_experts);
        for j in 0..moe.num_experts {
            let p = expert_prefix(&prefix, j);
            let mut take = |proj: &str| {
                let name = weight(&format!("{p}.{proj}"));
                map.remove(&name).ok_or(ModelError::MissingTensor(name))
            };
            let (g, u, d) = (take(names.gate)?, take(names.up)?, take(names.down)?);
            gate_up.push(Tensor::cat(&[&g, &u], 0)?);
            down.push(d);
        }
        map.insert(gate_up_name, Tensor::stack(&gate_up, 0)?);
        map.insert(down_name, Tensor::stack(&down, 0)?);
    }
    Ok(map)
}
