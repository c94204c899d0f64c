//! The seed of every random draw of the RL loop: one run seed mixed with where the draw
//! happens (step, prompt, sample, stream tag), so a run is the same on any thread count and
//! a resumed run draws what the uninterrupted one would have.

/// SplitMix64 finaliser: decorrelates the per-request seeds derived from one run seed.
pub fn mix_seed(parts: &[u64]) -> u64 {
    let mut h: u64 = 0x9E37_79B9_7F4A_7C15;
    for &p in parts {
        let mut z = h ^ p.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h = z ^ (z >> 31);
    }
    h
}
