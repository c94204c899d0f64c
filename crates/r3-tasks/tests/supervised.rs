//! Supervised pretraining batches: layout, shift, masks, determinism, length errors.

use r3_tasks::{
    ArithmeticTask, CharTokenizer, Difficulty, LossOn, SupervisedBatches, TaskError, BOS_ID,
    EOS_ID, PAD_ID,
};

fn task() -> ArithmeticTask {
    ArithmeticTask::new(Difficulty::level(2).expect("preset"), 20, 99).expect("task")
}

#[test]
fn rows_are_shifted_sequences_with_masks() {
    let task = task();
    let tok = CharTokenizer::new().expect("tok");
    let mut it =
        SupervisedBatches::new(&task, &tok, 4, 8, None, LossOn::Solution).expect("batches");
    let batch = it.next().expect("infinite").expect("batch");
    // The same problems, drawn independently from the same seed.
    let problems = task.train_stream(4).take_problems(8).expect("problems");
    let t = batch.seq_len;
    assert_eq!(batch.input_ids.len(), 8 * t);
    let mut longest = 0;
    for (b, p) in problems.iter().enumerate() {
        let row = |v: &[u32]| v[b * t..(b + 1) * t].to_vec();
        let (inp, tgt) = (row(&batch.input_ids), row(&batch.target_ids));
        let mask = batch.loss_mask[b * t..(b + 1) * t].to_vec();
        let len = 1 + p.prompt.len() + p.solution.len(); // <bos> + chars (<eos> is only a target)
        longest = longest.max(len);
        assert_eq!(inp[0], BOS_ID);
        assert_eq!(tok.decode(&inp[..len]).expect("d"), p.full_text());
        assert_eq!(tgt[len - 1], EOS_ID);
        assert_eq!(
            &tgt[..len - 1],
            &inp[1..len],
            "targets are inputs shifted by one"
        );
        assert!(inp[len..].iter().chain(&tgt[len..]).all(|&id| id == PAD_ID));
        // Loss on the solution and <eos> only: positions p.prompt.len() .. len.
        for (i, &m) in mask.iter().enumerate() {
            let want = if i >= p.prompt.len() && i < len {
                1.0
            } else {
                0.0
            };
            assert_eq!(m, want, "row {b} pos {i}");
        }
    }
    assert_eq!(t, longest, "padded to the longest row");
}

#[test]
fn loss_on_all_counts_every_real_token_and_fixed_len_pads() {
    let task = task();
    let tok = CharTokenizer::new().expect("tok");
    let mut it = SupervisedBatches::new(&task, &tok, 1, 3, Some(64), LossOn::All).expect("batches");
    let batch = it.next().expect("infinite").expect("batch");
    assert_eq!(batch.seq_len, 64);
    let real = batch.target_ids.iter().filter(|&&id| id != PAD_ID).count();
    let counted = batch.loss_mask.iter().filter(|&&m| m == 1.0).count();
    assert_eq!(real, counted);
}

#[test]
fn batches_are_reproducible_from_the_seed() {
    let task = task();
    let tok = CharTokenizer::new().expect("tok");
    let take = |seed| {
        SupervisedBatches::new(&task, &tok, seed, 4, Some(40), LossOn::All)
            .expect("batches")
            .take(3)
            .collect::<Result<Vec<_>, _>>()
            .expect("batches")
    };
    assert_eq!(take(1), take(1));
    assert_ne!(take(1), take(2));
}

#[test]
fn too_long_rows_and_empty_batches_are_errors() {
    let task = task();
    let tok = CharTokenizer::new().expect("tok");
    let mut it = SupervisedBatches::new(&task, &tok, 0, 2, Some(5), LossOn::All).expect("it");
    assert!(matches!(
        it.next(),
        Some(Err(TaskError::SequenceTooLong { seq_len: 5, .. }))
    ));
    assert!(matches!(
        SupervisedBatches::new(&task, &tok, 0, 0, None, LossOn::All),
        Err(TaskError::EmptyBatch)
    ));
}
