//! GRPO advantages and dynamic sampling against hand-computed values.

use r3_train::{filter_uniform_groups, grpo_advantages, GrpoOptions, TrainError};

fn close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

#[test]
fn grpo_normalises_within_each_group() {
    // Group 0: [1,0,0,1]: mean 0.5, unbiased var = 4·0.25/3 = 1/3, std = 0.577350
    //   → ±0.5/0.577350 = ±0.866025.
    // Group 1: [1,1,1,1]: all equal → 0.
    // Group 2: [0.5,0,0,0]: mean 0.125, var = (0.375² + 3·0.125²)/3 = 0.1875/3 = 0.0625,
    //   std 0.25 → [1.5, -0.5, -0.5, -0.5].
    let rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0];
    let (adv, m) = grpo_advantages(
        &rewards,
        4,
        GrpoOptions {
            norm_by_std: true,
            eps: 0.0,
        },
    )
    .expect("adv");
    close(
        &adv,
        &[
            0.866025, -0.866025, -0.866025, 0.866025, 0.0, 0.0, 0.0, 0.0, 1.5, -0.5, -0.5, -0.5,
        ],
    );
    assert_eq!(m.uniform_groups, 1);
    // reward mean = (2 + 4 + 0.5)/12
    assert!((m.reward_mean - 6.5 / 12.0).abs() < 1e-6);
    // Without std division: reward minus group mean.
    let (adv, _) = grpo_advantages(
        &rewards,
        4,
        GrpoOptions {
            norm_by_std: false,
            eps: 1e-6,
        },
    )
    .expect("adv");
    close(
        &adv,
        &[
            0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.375, -0.125, -0.125, -0.125,
        ],
    );
}

#[test]
fn eps_keeps_uniform_groups_finite_and_singletons_get_raw_reward() {
    let (adv, _) = grpo_advantages(&[0.0, 0.0], 2, GrpoOptions::default()).expect("adv");
    assert_eq!(adv, vec![0.0, 0.0]);
    let (adv, _) = grpo_advantages(&[0.25, 1.0], 1, GrpoOptions::default()).expect("adv");
    close(&adv, &[0.25 / (1.0 + 1e-6), 1.0 / (1.0 + 1e-6)]);
}

/// Equal rewards whose f32 sum is inexact (0.7, 0.1) still give a uniform group exactly 0:
/// the f32 mean was a few ulps off, and its residues over a std of the same size gave every
/// sample of 16 × 0.7 an advantage of +0.106 (−0.41 for 8 × 0.1 at eps 1e-8).
#[test]
fn uniform_groups_of_inexact_rewards_get_exactly_zero() {
    for (reward, n, eps) in [(0.7f32, 16, 1e-6f32), (0.1, 8, 1e-8), (0.1, 8, 0.0)] {
        let rewards = vec![reward; n];
        let opts = GrpoOptions {
            norm_by_std: true,
            eps,
        };
        let (adv, m) = grpo_advantages(&rewards, n, opts).expect("adv");
        assert_eq!(adv, vec![0.0; n], "{n} × {reward} at eps {eps}");
        assert_eq!(m.uniform_groups, 1);
    }
    // One sample apart: the residues are those of the exact rewards (by hand, in f64).
    let mut rewards = vec![0.7f32; 7];
    rewards.push(0.8);
    let (adv, _) = grpo_advantages(&rewards, 8, GrpoOptions::default()).expect("adv");
    let r: Vec<f64> = rewards.iter().map(|&x| f64::from(x)).collect();
    let mean = r.iter().sum::<f64>() / 8.0;
    let std = (r.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 7.0).sqrt();
    let want: Vec<f32> = r
        .iter()
        .map(|x| ((x - mean) / (std + 1e-6)) as f32)
        .collect();
    assert_eq!(adv, want);
    assert!((adv[7] - 2.474_804).abs() < 1e-5, "{}", adv[7]);
}

#[test]
fn bad_reward_layouts_are_errors() {
    let o = GrpoOptions::default();
    assert!(matches!(
        grpo_advantages(&[1.0; 5], 2, o),
        Err(TrainError::RaggedGroups {
            rewards: 5,
            group_size: 2
        })
    ));
    assert!(matches!(
        grpo_advantages(&[1.0; 4], 0, o),
        Err(TrainError::OutOfRange {
            name: "group_size",
            ..
        })
    ));
    match grpo_advantages(&[1.0, f32::NAN], 2, o) {
        Err(TrainError::NonFiniteReward { index, value }) => {
            assert_eq!(index, 1);
            assert!(value.is_nan());
        }
        other => panic!("expected NonFiniteReward, got {other:?}"),
    }
}

#[test]
fn dynamic_sampling_drops_uniform_groups() {
    let rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0];
    let f = filter_uniform_groups(&rewards, 2).expect("filter");
    assert_eq!(f.kept_groups, vec![1, 3]);
    assert_eq!(f.dropped_groups, 2);
    assert_eq!(f.kept_rows(), vec![2, 3, 6, 7]);
    let names = ["a", "b", "c", "d", "e", "f", "g", "h"];
    assert_eq!(f.select(&names).expect("select"), vec!["c", "d", "g", "h"]);
    assert!(matches!(
        f.select(&names[..5]),
        Err(TrainError::RowOutOfRange { row: 6, len: 5 })
    ));
    let all_same = filter_uniform_groups(&[0.0; 6], 3).expect("filter");
    assert!(all_same.kept_groups.is_empty());
    assert_eq!(all_same.dropped_groups, 2);
}

#[test]
fn dynamic_sampling_keeps_groups_of_one_sample() {
    // verl's DAPO filter keeps `std > 0 or len == 1`: a singleton carries its raw reward as
    // advantage (mean 0, std 1), so group_size = 1 must train.
    let f = filter_uniform_groups(&[1.0, 0.0, 0.0], 1).expect("filter");
    assert_eq!(f.kept_groups, vec![0, 1, 2]);
    assert_eq!(f.dropped_groups, 0);
    assert_eq!(f.kept_rows(), vec![0, 1, 2]);
    // And the advantage metrics agree: no singleton counts as uniform.
    let (adv, m) = grpo_advantages(&[1.0, 0.0, 0.0], 1, GrpoOptions::default()).expect("adv");
    assert_eq!(m.uniform_groups, 0);
    close(&adv, &[1.0 / (1.0 + 1e-6), 0.0, 0.0]);
}
