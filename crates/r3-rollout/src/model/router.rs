//! Router math of the inference path on host rows: `select` picks the top-k experts of one
//! token from its router logits, `weigh` computes their gates — the same formulas as
//! r3-model's router (HF semantics per `RouterKind`), evaluated on f32 rows without a tensor
//! library because the engine's hot loop has the logits on the host already.

use r3_model::RouterKind;

use crate::kernels::ops::sigmoid;

/// Scratch buffers reused across tokens.
#[derive(Debug, Default)]
pub struct RouterScratch {
    scores: Vec<f32>,
    choice: Vec<f32>,
    order: Vec<u32>,
    groups: Vec<(f32, usize)>,
}

/// Picks `top_k` experts for one token and computes their gates.
/// Writes ids (descending by selection score) into `ids` and gates into `gates`.
pub fn route_token(
    kind: &RouterKind,
    logits: &[f32],
    bias: Option<&[f32]>,
    top_k: usize,
    s: &mut RouterScratch,
    ids: &mut [u16],
    gates: &mut [f32],
) {
    let e = logits.len();
    match *kind {
        RouterKind::Softmax { norm_topk_prob } => {
            // softmax over all experts (f32), then top-k of the probabilities.
            s.scores.clear();
            s.scores.extend_from_slice(logits);
            crate::kernels::ops::softmax_in_place(&mut s.scores);
            top_k_indices(&s.scores, top_k, &mut s.order);
            let mut sum = 0f32;
            for (j, &i) in s.order.iter().enumerate() {
                ids[j] = i as u16;
                gates[j] = s.scores[i as usize];
                sum += gates[j];
            }
            if norm_topk_prob {
                for g in gates.iter_mut() {
                    *g /= sum;
                }
            }
        }
        RouterKind::GroupedSigmoid {
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        } => {
            s.scores.clear();
            s.scores.extend(logits.iter().map(|&v| sigmoid(v)));
            s.choice.clear();
            s.choice.extend_from_slice(&s.scores);
            if let Some(b) = bias {
                for (c, bv) in s.choice.iter_mut().zip(b) {
                    *c += bv;
                }
            }
            // Group score = sum of the two best choice scores in the group.
            let per = e / n_group;
            s.groups.clear();
            for g in 0..n_group {
                let grp = &s.choice[g * per..(g + 1) * per];
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &v in grp {
                    if v > a {
                        b = a;
                        a = v;
                    } else if v > b {
                        b = v;
                    }
                }
                let two = if per >= 2 { a + b } else { a };
                s.groups.push((two, g));
            }
            s.groups
                .sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
            let mut keep = vec![false; n_group];
            for &(_, g) in s.groups.iter().take(topk_group) {
                keep[g] = true;
            }
            // HF masks experts of dropped groups with 0.0 (not -inf).
            for (i, c) in s.choice.iter_mut().enumerate() {
                if !keep[i / per] {
                    *c = 0.0;
                }
            }
            top_k_indices(&s.choice, top_k, &mut s.order);
            let mut sum = 0f32;
            for (j, &i) in s.order.iter().enumerate() {
                ids[j] = i as u16;
                gates[j] = s.scores[i as usize];
                sum += gates[j];
            }
            let scale = routed_scaling_factor as f32;
            for g in gates.iter_mut() {
                if norm_topk_prob {
                    *g /= sum + 1e-20;
                }
                *g *= scale;
            }
        }
    }
}

/// Indices of the `k` largest values, largest first (lower index first on ties).
fn top_k_indices(v: &[f32], k: usize, out: &mut Vec<u32>) {
    out.clear();
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, x) in v.iter().enumerate() {
            if out.contains(&(i as u32)) {
                continue;
            }
            if best.is_none_or(|b| *x > v[b]) {
                best = Some(i);
            }
        }
        if let Some(b) = best {
            out.push(b as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_router_by_hand() {
        let logits = [1.0f32, 3.0, 2.0, 0.0];
        let (mut ids, mut gates) = ([0u16; 2], [0f32; 2]);
        let kind = RouterKind::Softmax {
            norm_topk_prob: true,
        };
        route_token(
            &kind,
            &logits,
            None,
            2,
            &mut RouterScratch::default(),
            &mut ids,
            &mut gates,
        );
        assert_eq!(ids, [1, 2]);
        let (a, b) = (3f32.exp(), 2f32.exp());
        assert!((gates[0] - a / (a + b)).abs() < 1e-6 && (gates[1] - b / (a + b)).abs() < 1e-6);
        let kind = RouterKind::Softmax {
            norm_topk_prob: false,
        };
        route_token(
            &kind,
            &logits,
            None,
            2,
            &mut RouterScratch::default(),
            &mut ids,
            &mut gates,
        );
        let z: f32 = logits.iter().map(|v| v.exp()).sum();
        assert!((gates[0] - a / z).abs() < 1e-6);
    }

    #[test]
    fn grouped_router_respects_groups_and_bias() {
        // 4 groups of 2. Group scores (choice = sigmoid + bias): group 3 has the single
        // best expert but group 0 and 1 have the best pairs.
        let logits = [2.0f32, 2.0, 1.5, 1.5, -3.0, -3.0, 4.0, -5.0];
        let kind = RouterKind::GroupedSigmoid {
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        };
        let (mut ids, mut gates) = ([0u16; 2], [0f32; 2]);
        route_token(
            &kind,
            &logits,
            None,
            2,
            &mut RouterScratch::default(),
            &mut ids,
            &mut gates,
        );
        let mut got = ids.to_vec();
        got.sort();
        assert_eq!(got, vec![0, 1], "expert 6 is in a dropped group");
        assert!((gates[0] + gates[1] - 2.0).abs() < 1e-6);
        // A bias that favours expert 2 moves the choice but not the gate values' source.
        let bias = [0.0f32, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0];
        route_token(
            &kind,
            &logits,
            Some(&bias),
            2,
            &mut RouterScratch::default(),
            &mut ids,
            &mut gates,
        );
        assert_eq!(ids[0], 2);
        let (s2, s0) = (sigmoid(1.5), sigmoid(2.0));
        assert!((gates[0] - 2.0 * s2 / (s2 + s0)).abs() < 1e-5);
    }
}
