//! 16-bit copies of a trainable model's f32 weight matrices, held beside them: Megatron's
//! bf16 model parameters beside its fp32 main parameters.
//!
//! A mixed-precision forward rounds every weight matrix to bf16 (or f16) at each matmul. On
//! a GPU that is a cast of the whole matrix per use: the forward casts each weight, the
//! backward casts it again for the input gradient, and again in every micro-batch (on a
//! 30B-A3B-shaped layer the expert stacks' cast took two thirds of the cast-then-GEMM time:
//! `gemm16_modes`, docs/gpu.md). A held copy is cast once per optimiser step instead (the
//! optimiser rewrites it after each update: `AdamW::hold_narrow_copies` in r3-train) and the
//! layers read it where they would have cast. The copy holds exactly the values the cast
//! gives, so every output is bit for bit the same; it costs 2 bytes per parameter held.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor, Var};

use super::Weights;
use crate::cast16::cast16;
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::spec::{tensor_specs_in, weight, TensorRole, EMBED};

/// Refuses `copy` as the held 16-bit copy of the weight `w` unless `w` is f32 and `copy` is
/// shaped as `w`, in `narrow` where that is given, else in bf16 or f16. The one check every
/// holder and reader of a copy makes (`with_narrow_copies`, the 16-bit GEMMs, the optimiser).
pub fn check_narrow_copy(w: &Tensor, copy: &Tensor, narrow: Option<DType>) -> Result<()> {
    let dtype_fits = match narrow {
        Some(narrow) => copy.dtype() == narrow,
        None => matches!(copy.dtype(), DType::BF16 | DType::F16),
    };
    if !dtype_fits || w.dtype() != DType::F32 || copy.dims() != w.dims() {
        let wanted = narrow.map_or("bf16 or f16".to_string(), |n| format!("{n:?}"));
        return Err(ModelError::Input(format!(
            "a 16-bit weight copy is {:?} {:?}, its weight {:?} {:?}: expected {wanted} of the \
             shape of an f32 weight",
            copy.dtype(),
            copy.dims(),
            w.dtype(),
            w.dims()
        )));
    }
    Ok(())
}

impl Weights {
    /// The held 16-bit copy of the weight `name`, where one is held.
    pub fn narrow_copy(&self, name: &str) -> Option<&Tensor> {
        self.copies.get(name)
    }

    /// Every held 16-bit copy, by weight name.
    pub fn narrow_copies(&self) -> &BTreeMap<String, Tensor> {
        &self.copies
    }

    /// These weights with `copies` held beside them (each a 16-bit copy of the f32 weight of
    /// its name, the shape of that weight), replacing any held before.
    pub fn with_narrow_copies(mut self, copies: BTreeMap<String, Tensor>) -> Result<Self> {
        for (name, copy) in &copies {
            check_narrow_copy(self.get(name)?, copy, None)
                .map_err(|e| ModelError::Input(format!("{name}: {e}")))?;
        }
        self.copies = copies;
        Ok(self)
    }

    /// Makes a `narrow` (bf16 or f16) copy of every f32 weight matrix the forward rounds at
    /// its matmuls — the attention projections, the dense and shared MLPs, the routed
    /// experts' stacks and the head; not the embedding (its rows are looked up) nor the
    /// router (small, and often kept f32) — and holds it beside its weight, replacing any
    /// held before. Returns each copy as a variable under its weight's name, for the owner of
    /// the weights' updates to rewrite after each one (`Var::set` writes in place, so the
    /// copies held here see it); a copy not rewritten after its weight changed would be read
    /// stale, so only an optimiser that refreshes them should hold them.
    pub fn hold_narrow_copies(
        &mut self,
        cfg: &Config,
        narrow: DType,
    ) -> Result<Vec<(String, Var)>> {
        if !matches!(narrow, DType::BF16 | DType::F16) {
            return Err(ModelError::Input(format!(
                "16-bit weight copies in {narrow:?}: expected bf16 or f16"
            )));
        }
        let embed = weight(EMBED);
        let mut vars = Vec::new();
        let mut copies = BTreeMap::new();
        for spec in tensor_specs_in(cfg, self.expert_layout(cfg)) {
            if spec.role != TensorRole::Matrix || spec.name == embed {
                continue;
            }
            let Some(w) = self.tensors.get(&spec.name) else {
                continue;
            };
            if w.dtype() != DType::F32 {
                continue;
            }
            let var = Var::from_tensor(&cast16(&w.detach(), narrow)?)?;
            // A detached view shares the variable's storage: it sees every rewrite.
            copies.insert(spec.name.clone(), var.as_tensor().detach());
            vars.push((spec.name, var));
        }
        self.copies = copies;
        Ok(vars)
    }
}
