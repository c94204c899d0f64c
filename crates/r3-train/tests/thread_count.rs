//! The same config and seed give the same run bit for bit whatever the rayon pool's thread
//! count: every reduction of the trainer and the rollout engine has a fixed order.

mod common;

use common::{tiny_config, tiny_model, Scratch};
use r3_train::config::RouterReplay;
use r3_train::Trainer;

/// Every weight of the policy after `steps` RL steps run inside a pool of `threads`.
fn weights_after(
    cfg: &r3_train::TrainConfig,
    steps: usize,
    threads: usize,
) -> Vec<(String, Vec<u32>)> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    pool.install(|| {
        let mut t = Trainer::new(cfg.clone()).expect("trainer");
        for _ in 0..steps {
            t.rl_step().expect("step");
        }
        t.policy
            .vars()
            .iter()
            .map(|(name, var)| {
                let bits = var
                    .as_tensor()
                    .flatten_all()
                    .and_then(|v| v.to_vec1::<f32>())
                    .expect("f32 weights")
                    .into_iter()
                    .map(f32::to_bits)
                    .collect();
                (name.clone(), bits)
            })
            .collect()
    })
}

#[test]
fn ten_steps_on_one_and_two_threads_give_identical_weights() {
    let dir = Scratch::new("thread-count");
    let model = dir.path().join("model");
    tiny_model(&model, 31);
    let mut cfg = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 2);
    // Enough rows that the per-row work splits into many parallel tasks (several RMSNorm
    // weight-gradient chunks, many sampled sequences).
    cfg.rollout.prompts_per_step = 4;
    cfg.rollout.group_size = 4;
    cfg.rollout.max_new_tokens = 8;
    cfg.validate().expect("valid config");
    let one = weights_after(&cfg, 10, 1);
    let two = weights_after(&cfg, 10, 2);
    assert_eq!(one.len(), two.len());
    let base = Trainer::new(cfg.clone()).expect("base");
    let mut moved = 0;
    for ((name, a), (name_b, b)) in one.iter().zip(&two) {
        assert_eq!(name, name_b);
        let differing = a.iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(
            differing,
            0,
            "{name}: {differing} of {} weights differ",
            a.len()
        );
        let start = base
            .policy
            .vars()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_tensor().flatten_all().and_then(|t| t.to_vec1::<f32>()))
            .expect("same variables")
            .expect("f32");
        moved += usize::from(start.iter().map(|v| v.to_bits()).ne(a.iter().copied()));
    }
    assert!(
        moved > 0,
        "training moved the weights (the comparison is not vacuous)"
    );
}
