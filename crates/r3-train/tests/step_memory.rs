//! The step's memory high-water mark and the split of its update time: present in the
//! metrics line where the kernel reports memory, consistent across phases, and left out
//! of run comparisons (`without_timing`), so measuring changes no other metric.

mod common;

use common::{tiny_config, tiny_model, Scratch};
use r3_train::config::RouterReplay;
use r3_train::rl::memory::reset_peak;
use r3_train::Trainer;

#[test]
fn a_step_logs_its_peak_and_its_phases_peaks_and_splits_the_update_time() {
    let dir = Scratch::new("step-memory");
    let model = dir.path().join("model");
    tiny_model(&model, 5);
    // Two mini-batches: the step has a separate old-log-prob pass with its own peak.
    let cfg = tiny_config(&model, &dir.path().join("run"), RouterReplay::R3, 2);
    let mut trainer = Trainer::new(cfg).expect("trainer");
    let m = trainer.rl_step().expect("step");

    // Forward, backward and optimiser are parts of the update's time.
    let parts = m.update_forward_s + m.update_backward_s + m.update_optim_s;
    assert!(m.update_forward_s > 0.0 && m.update_backward_s > 0.0 && m.update_optim_s > 0.0);
    assert!(
        parts <= m.update_s,
        "{parts} s of parts in {} s",
        m.update_s
    );

    let line = serde_json::to_value(&m).expect("json");
    if cfg!(target_os = "linux") && reset_peak() {
        let peak = m.peak_mib.expect("linux reports the step's peak");
        let phases = [
            m.rollout_peak_mib,
            m.old_logp_peak_mib,
            m.update_peak_mib,
            m.sync_peak_mib,
        ];
        for p in phases {
            let p = p.expect("every phase ran, so every phase has a peak");
            assert!(p > 0.0 && p <= peak, "phase {p} MiB, step {peak} MiB");
        }
        assert!(phases.contains(&Some(peak)), "the step's peak is a phase's");
        assert_eq!(line["memory.peak_mib"], serde_json::json!(peak));
    } else {
        assert_eq!(m.peak_mib, None, "unknown memory is absent, not 0");
        assert!(line.get("memory.peak_mib").is_none());
    }
    let compared = m.without_timing().expect("json");
    let keys = compared.as_object().expect("object");
    assert!(keys.keys().all(|k| !k.starts_with("memory.")), "{keys:?}");
    assert!(keys.keys().all(|k| !k.starts_with("time.")), "{keys:?}");
    assert!(keys.contains_key("reward_mean"));
}
