//! The emulated grid itself: indices, barriers, shuffles and dynamic shared memory behave
//! as on a GPU, checked with r3's own kernels whose results are known by hand.

use r3_cuda_emu::{in_both_orders, launch, variants, LaunchShape, ORDERS};

/// `r3_round_bf16_f32` over more elements than the grid has threads (a grid-stride loop
/// over blockIdx, blockDim, gridDim): every element is written (none is left at its NaN
/// fill) with its own value rounded as bf16 rounds it. (An element written twice with the
/// same value would not show.)
#[test]
fn a_grid_stride_loop_writes_every_element() {
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
    // reads first: the garbage a block's shared memory starts with (0xff bytes, a NaN).
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

/// A race between two threads that leave a barrier together shows: thread 1 writes a cell
/// after the barrier and thread 0 reads it, so thread 0 sees 0 first-to-last and 1
/// last-to-first (the releasing thread does not run ahead of the order).
#[test]
fn a_race_after_a_barrier_shows_as_two_answers() {
    let run = |order| {
        let mut out = vec![f32::NAN; 2];
        let op = out.as_mut_ptr();
        launch(LaunchShape::blocks(2, 64), order, &|| unsafe {
            r3_cuda_emu::faulty::r3emu_faulty_read_after_barrier(op)
        })
        .expect("launch");
        out
    };
    assert_eq!(run(ORDERS[0]), vec![0.0, 0.0]);
    assert_eq!(run(ORDERS[1]), vec![1.0, 1.0]);
}

/// A shuffle that reads lanes which have finished is an error, as it is undefined on a GPU.
#[test]
fn a_shuffle_of_exited_lanes_is_an_error() {
    let mut out = vec![f32::NAN; 64];
    let op = out.as_mut_ptr();
    let err = launch(LaunchShape::blocks(1, 64), ORDERS[0], &|| unsafe {
        r3_cuda_emu::faulty::r3emu_faulty_shuffle_of_exited_lanes(op)
    })
    .expect_err("absent lanes");
    assert!(matches!(err, r3_cuda_emu::EmuError::AbsentLane), "{err}");
}

/// A write past the dynamic shared memory a launch asked for is an error; within it, none.
#[test]
fn a_write_past_the_dynamic_shared_memory_is_an_error() {
    let mut out = vec![f32::NAN; 64];
    let op = out.as_mut_ptr();
    let run = |bytes| {
        launch(
            LaunchShape::blocks(1, 64).with_shared_bytes(bytes),
            ORDERS[0],
            &|| unsafe { r3_cuda_emu::faulty::r3emu_faulty_dynamic_shared_write(op) },
        )
    };
    run(64 * 4).expect("64 floats fit");
    let err = run(60 * 4).expect_err("four floats past the end");
    assert!(matches!(err, r3_cuda_emu::EmuError::SharedOverrun), "{err}");
    let err = run(49 * 1024).expect_err("past 48 KiB");
    assert!(err.to_string().contains("blocks"), "{err}");
}

/// Runs `launch_at(offset)` (a launch whose 16-byte vector access starts `offset` floats
/// into a 16-byte aligned buffer) at offset 0, which must pass, and at 1, which must be the
/// misaligned-access error; `what` names the case.
fn misaligned_is_an_error(
    what: &str,
    launch_at: impl Fn(usize) -> Result<(), r3_cuda_emu::EmuError>,
) {
    launch_at(0).expect("aligned");
    let err = launch_at(1).expect_err("misaligned");
    assert!(
        matches!(err, r3_cuda_emu::EmuError::Misaligned),
        "{what}: {err}"
    );
}

/// r3's cast kernels move f32 values four at a time as a `float4`: a narrowing's source and
/// a widening's output off a 16-byte boundary are errors (a GPU faults; not a crash of the
/// test), on the boundary none.
#[test]
fn a_vector_access_off_its_alignment_is_an_error() {
    // 16-byte aligned storage (u128), viewed as f32; 16 + 1 floats lie inside its 32.
    let mut words = [0u128; 8];
    let floats = words.as_mut_ptr().cast::<f32>();
    let mut narrow = [half::bf16::ZERO; 16];
    let narrow_out = narrow.as_mut_ptr();
    let wide_in = [half::bf16::ONE; 16];
    for (name, k) in variants() {
        misaligned_is_an_error(&format!("{name}: a float4 read"), |offset| {
            // SAFETY: within the words (above).
            let src = unsafe { floats.add(offset) };
            launch(LaunchShape::blocks(1, 32), ORDERS[0], &|| unsafe {
                (k.r3_narrow_bf16)(src, narrow_out, 16)
            })
        });
        misaligned_is_an_error(&format!("{name}: a float4 write"), |offset| {
            // SAFETY: within the words (above).
            let dst = unsafe { floats.add(offset) };
            launch(LaunchShape::blocks(1, 32), ORDERS[0], &|| unsafe {
                (k.r3_widen_bf16)(wide_in.as_ptr(), dst, 16)
            })
        });
    }
}

/// Each variant computes a product and a sum as it is named: the plain one rounds the
/// product, the contracted one fuses it (where this CPU has fused multiply-adds, so that
/// the contracted variant's tests are not a second run of the plain one).
#[test]
fn the_variants_contract_as_named() {
    let (plain, fused) = r3_cuda_emu::variants_contract_as_named();
    assert!(plain, "the plain variant fused a product into a sum");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        assert!(
            fused,
            "the contracted variant did not fuse on a CPU with FMA"
        );
        assert_eq!(variants().len(), 2);
    }
    let _ = fused;
}

/// A panic in a launch's body fails the caller's test as a panic (raised again after the
/// grid), not as an abort of the whole test binary.
#[test]
fn a_panic_in_the_body_is_raised_again_after_the_launch() {
    let caught = std::panic::catch_unwind(|| {
        let _ = launch(LaunchShape::blocks(2, 32), ORDERS[0], &|| {
            panic!("a body's panic")
        });
    });
    let payload = caught.expect_err("the panic comes back");
    let message = payload.downcast_ref::<&str>().copied().unwrap_or_default();
    assert_eq!(message, "a body's panic");
}
