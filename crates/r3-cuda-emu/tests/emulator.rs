//! The emulated grid itself: indices, barriers, shuffles and dynamic shared memory behave
//! as on a GPU, checked with r3's own kernels whose results are known by hand.

use r3_cuda_emu::{in_both_orders, launch, variants, LaunchShape, ORDERS};

/// `r3_round_bf16_f32` over more elements than the grid has threads: every element is
/// visited once (grid-stride loop over blockIdx, blockDim, gridDim) and rounds as bf16 does.
#[test]
fn a_grid_stride_loop_visits_every_element_once() {
    let x: Vec<f32> = (0..1_000).map(|i| 1.0 + i as f32 * 1e-3).collect();
    for (name, k) in variants() {
        let y = in_both_orders(name, |order| {
            let mut y = vec![f32::NAN; x.len()];
            let yp = y.as_mut_ptr();
            launch(LaunchShape::blocks(3, 64), order, &|| unsafe {
                (k.r3_round_bf16_f32)(x.as_ptr(), yp, x.len())
            })
            .expect("launch");
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        });
        for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
            let expected = half::bf16::from_f32(a).to_f32();
            assert_eq!(f32::from_bits(b), expected, "{name}: element {i}");
        }
    }
}

/// `r3_token_logprob_f32` reduces each row across its block (warp shuffles, then the warps'
/// partials through shared memory, two barriers): the max and log-sum-exp of a row whose
/// answer is known, for block sizes of one warp up to 1,024 threads.
#[test]
fn block_reductions_give_the_rows_log_prob() {
    let vocab = 1_500u32;
    // Row r: every logit 0 except column r·7, which is 5: logp of that column is
    // 5 − ln(e⁵ + vocab − 1).
    let rows = 4usize;
    let mut logits = vec![0f32; rows * vocab as usize];
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 7).collect();
    for r in 0..rows {
        logits[r * vocab as usize + targets[r] as usize] = 5.0;
    }
    let exact = 5.0 - (5f64.exp() + f64::from(vocab - 1)).ln();
    for (name, k) in variants() {
        for threads in [32u32, 96, 256, 1024] {
            let logp = in_both_orders(name, |order| {
                let mut out = vec![f32::NAN; rows];
                let op = out.as_mut_ptr();
                launch(
                    LaunchShape::blocks(rows as u32, threads),
                    order,
                    &|| unsafe {
                        (k.r3_token_logprob_f32)(logits.as_ptr(), targets.as_ptr(), op, vocab)
                    },
                )
                .expect("launch");
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            });
            for (r, bits) in logp.iter().enumerate() {
                let v = f64::from(f32::from_bits(*bits));
                assert!(
                    (v - exact).abs() < 1e-5,
                    "{name}, {threads} threads, row {r}: {v} vs {exact}"
                );
            }
        }
    }
}

/// A launch the emulator cannot run is an error naming its shape.
#[test]
fn a_block_past_1024_threads_is_refused() {
    let err = launch(LaunchShape::blocks(1, 2048), ORDERS[0], &|| {}).expect_err("refused");
    assert!(err.to_string().contains("2048"), "{err}");
}

/// A read of shared memory with no barrier after another thread's write gives two answers
/// for the two thread orders; with the barrier, one.
#[test]
fn a_missing_barrier_shows_as_two_answers() {
    use r3_cuda_emu::faulty::{r3emu_faulty_unsynced_read, r3emu_synced_read};
    let run = |order, synced: bool| {
        let mut out = vec![f32::NAN; 2];
        let op = out.as_mut_ptr();
        launch(LaunchShape::blocks(2, 64), order, &|| unsafe {
            if synced {
                r3emu_synced_read(op)
            } else {
                r3emu_faulty_unsynced_read(op)
            }
        })
        .expect("launch");
        out
    };
    // Forward, thread 0 writes before the last thread reads; backward, the last thread
    // reads first (what the cell held before: a GPU's shared memory holds garbage there).
    assert_eq!(run(ORDERS[0], false), vec![1.0, 1.0]);
    assert_ne!(run(ORDERS[1], false), vec![1.0, 1.0]);
    for order in ORDERS {
        assert_eq!(run(order, true), vec![1.0, 1.0], "{order:?}");
    }
}

/// A thread at the block's barrier while its warp waits for it in a shuffle ends the launch
/// with an error, not a hang.
#[test]
fn a_split_barrier_is_a_deadlock_error() {
    let mut out = vec![f32::NAN; 64];
    let op = out.as_mut_ptr();
    let err = launch(LaunchShape::blocks(1, 64), ORDERS[0], &|| unsafe {
        r3_cuda_emu::faulty::r3emu_faulty_split_barrier(op)
    })
    .expect_err("deadlock");
    assert!(matches!(err, r3_cuda_emu::EmuError::Deadlock), "{err}");
}
