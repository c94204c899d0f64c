//! Behaviour tests of the prefix cache against hand-computed expectations and invariants.

use super::*;

/// Test payload: the block's first token and a size.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Blob {
    tag: u32,
    bytes: usize,
}

impl BlockPayload for Blob {
    fn size_bytes(&self) -> usize {
        self.bytes
    }
}

fn blobs(tokens: &[u32], bs: usize, from_block: usize, bytes: usize) -> Vec<Blob> {
    tokens
        .chunks_exact(bs)
        .skip(from_block)
        .map(|b| Blob { tag: b[0], bytes })
        .collect()
}

/// Checks every documented invariant of the cache's fields.
fn check_invariants<P: BlockPayload>(c: &PrefixCache<P>) {
    let ids = c.arena.ids();
    let mut used = 0;
    let mut children: HashMap<BlockId, u32> = HashMap::new();
    for &id in &ids {
        let n = c.arena.get(id).expect("listed id is stored");
        used += n.size_bytes;
        assert_eq!(n.tokens.len(), c.block_size);
        if let Some(p) = n.parent {
            let pn = c.arena.get(p).expect("parent of a stored block is stored");
            assert!(pn.refs >= n.refs, "parent refs < child refs");
            assert_eq!(pn.version, n.version);
            if pn.stale {
                assert!(n.stale, "child of a stale block must be stale");
            }
            *children.entry(p).or_default() += 1;
        }
        assert_eq!(c.index.get(&n.hash) == Some(&id), !n.stale);
        let evictable = !n.stale && n.refs == 0 && n.children == 0;
        assert_eq!(c.evictable.contains(&(n.last_used, id)), evictable);
        if n.stale {
            assert!(n.refs > 0, "unleased stale blocks are freed at once");
        }
    }
    for &id in &ids {
        let n = c.arena.get(id).expect("stored");
        assert_eq!(n.children, children.get(&id).copied().unwrap_or(0));
    }
    assert_eq!(used, c.used_bytes);
    assert_eq!(
        c.evictable.len(),
        c.evictable
            .iter()
            .filter(|(_, id)| ids.contains(id))
            .count()
    );
    assert_eq!(
        c.index.len(),
        ids.iter()
            .filter(|&&id| c.arena.get(id).is_some_and(|n| !n.stale))
            .count()
    );
    if c.used_bytes > c.budget_bytes {
        assert!(
            c.evictable.is_empty(),
            "over budget with an evictable block"
        );
    }
}

fn cache(bs: usize, budget: usize) -> PrefixCache<Blob> {
    PrefixCache::new(bs, budget).expect("block size > 0")
}

#[test]
fn zero_block_size_is_an_error() {
    assert_eq!(
        PrefixCache::<Blob>::new(0, 10).err(),
        Some(PrefixCacheError::ZeroBlockSize)
    );
}

#[test]
fn insert_then_match_returns_stored_payloads() {
    let mut c = cache(4, 1 << 20);
    let toks: Vec<u32> = (10..22).collect(); // 3 full blocks
    let out = c
        .insert(&toks, 0, 0, blobs(&toks, 4, 0, 8))
        .expect("insert");
    assert_eq!(out.inserted, 3);
    assert_eq!(out.blocks.len(), 3);
    let _ = c.release(out.lease);
    check_invariants(&c);

    // A longer prompt (next turn) that extends the cached prefix.
    let mut longer = toks.clone();
    longer.extend([99, 98, 97]);
    let m = c.match_prefix(&longer, 0);
    assert_eq!(m.matched_tokens, 12);
    let tags: Vec<u32> = m.payloads.iter().map(|p| p.tag).collect();
    assert_eq!(tags, vec![10, 14, 18]);
    let _ = c.release(m.lease);

    // Diverging in the second block matches only the first.
    let mut diverge = toks.clone();
    diverge[5] = 0;
    let m = c.match_prefix(&diverge, 0);
    assert_eq!(m.matched_tokens, 4);
    let _ = c.release(m.lease);

    // Diverging in the first block matches nothing, even if later blocks are equal.
    let mut first = toks.clone();
    first[0] = 0;
    let m = c.match_prefix(&first, 0);
    assert_eq!(m.matched_tokens, 0);
    assert!(m.payloads.is_empty());
    let _ = c.release(m.lease);

    let s = c.stats();
    assert_eq!(
        (s.lookups, s.hit_lookups, s.queried_blocks, s.hit_blocks),
        (3, 2, 9, 4)
    );
    assert_eq!(s.cached_blocks, 3);
    check_invariants(&c);
}

#[test]
fn partial_blocks_never_match() {
    let mut c = cache(4, 1 << 20);
    let toks: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tokens
    let out = c
        .insert(&toks, 0, 0, blobs(&toks, 4, 0, 1))
        .expect("insert");
    assert_eq!(out.inserted, 2, "the trailing partial block is not cached");
    let _ = c.release(out.lease);
    for (len, expect) in [(3, 0), (4, 4), (7, 4), (8, 8), (10, 8)] {
        assert_eq!(
            c.peek_prefix(&toks[..len], 0),
            expect,
            "prefix of {len} tokens"
        );
        let m = c.match_prefix(&toks[..len], 0);
        assert_eq!(m.matched_tokens, expect);
        let _ = c.release(m.lease);
    }
    check_invariants(&c);
}

#[test]
fn weight_version_separates_blocks() {
    let mut c = cache(2, 1 << 20);
    let toks = [1, 2, 3, 4];
    let out = c
        .insert(&toks, 7, 0, blobs(&toks, 2, 0, 1))
        .expect("insert v7");
    let _ = c.release(out.lease);
    assert_eq!(c.peek_prefix(&toks, 7), 4);
    assert_eq!(
        c.peek_prefix(&toks, 8),
        0,
        "new weights must not hit old blocks"
    );
    let out = c
        .insert(&toks, 8, 0, blobs(&toks, 2, 0, 1))
        .expect("insert v8");
    assert_eq!(
        out.inserted, 2,
        "same tokens under new weights are new blocks"
    );
    let _ = c.release(out.lease);
    assert_eq!(c.num_blocks(), 4);
    // Dropping the old version keeps the new one.
    let freed = c.retain_version(8);
    assert_eq!(freed.len(), 2);
    assert_eq!(c.peek_prefix(&toks, 7), 0);
    assert_eq!(c.peek_prefix(&toks, 8), 4);
    check_invariants(&c);
}

#[test]
fn eviction_is_least_recently_used_first() {
    // Budget of 3 one-block sequences (10 bytes each).
    let mut c = cache(2, 30);
    let seqs: [[u32; 2]; 4] = [[1, 1], [2, 2], [3, 3], [4, 4]];
    for s in &seqs[..3] {
        let out = c.insert(s, 0, 0, blobs(s, 2, 0, 10)).expect("insert");
        assert!(out.evicted.is_empty());
        let _ = c.release(out.lease);
    }
    // Use [1,1] again: [2,2] becomes the least recently used.
    let m = c.match_prefix(&seqs[0], 0);
    assert_eq!(m.matched_tokens, 2);
    let _ = c.release(m.lease);
    let out = c
        .insert(&seqs[3], 0, 0, blobs(&seqs[3], 2, 0, 10))
        .expect("insert");
    let evicted: Vec<u32> = out.evicted.iter().map(|p| p.tag).collect();
    assert_eq!(evicted, vec![2]);
    let _ = c.release(out.lease);
    assert_eq!(c.peek_prefix(&seqs[0], 0), 2);
    assert_eq!(c.peek_prefix(&seqs[1], 0), 0);
    assert_eq!(c.peek_prefix(&seqs[2], 0), 2);
    assert_eq!(c.stats().evicted_blocks, 1);
    check_invariants(&c);
}

#[test]
fn eviction_takes_leaves_before_their_prefix() {
    let mut c = cache(1, 3);
    let toks = [5, 6, 7];
    let out = c
        .insert(&toks, 0, 0, blobs(&toks, 1, 0, 1))
        .expect("insert");
    let _ = c.release(out.lease);
    let freed = c.set_budget_bytes(1);
    let tags: Vec<u32> = freed.iter().map(|p| p.tag).collect();
    assert_eq!(tags, vec![7, 6], "the chain shrinks from its end");
    assert_eq!(c.peek_prefix(&toks, 0), 1);
    check_invariants(&c);
}

#[test]
fn leased_blocks_survive_eviction() {
    let mut c = cache(2, 20);
    let a = [1, 1, 1, 1];
    let held = c.insert(&a, 0, 0, blobs(&a, 2, 0, 10)).expect("insert a");
    // Far over budget while `a` is held: only unleased blocks go.
    for t in 2..6u32 {
        let s = [t, t];
        let out = c.insert(&s, 0, 0, blobs(&s, 2, 0, 10)).expect("insert");
        let _ = c.release(out.lease);
        check_invariants(&c);
    }
    assert_eq!(c.peek_prefix(&a, 0), 4, "held chain is intact");
    assert!(c.used_bytes() <= c.budget_bytes());
    // Once released, the held chain is evictable like any other.
    let freed = c.release(held.lease);
    assert!(freed.is_empty(), "still within budget");
    let freed = c.set_budget_bytes(0);
    assert_eq!(freed.len(), 2);
    assert_eq!(c.num_blocks(), 0);
    check_invariants(&c);
}

#[test]
fn budget_exceeded_only_by_leased_blocks() {
    let mut c = cache(2, 10);
    let a = [1, 2, 3, 4];
    let held = c.insert(&a, 0, 0, blobs(&a, 2, 0, 10)).expect("insert");
    assert!(held.evicted.is_empty());
    assert_eq!(c.used_bytes(), 20, "over budget but everything is leased");
    check_invariants(&c);
    let freed = c.release(held.lease);
    let tags: Vec<u32> = freed.iter().map(|p| p.tag).collect();
    assert_eq!(tags, vec![3], "release evicts down to the budget");
    assert_eq!(c.used_bytes(), 10);
    check_invariants(&c);
}

#[test]
fn extending_a_match_and_duplicate_payloads() {
    let mut c = cache(2, 1 << 20);
    let turn1 = [1, 2, 3, 4];
    let out = c
        .insert(&turn1, 0, 0, blobs(&turn1, 2, 0, 1))
        .expect("insert");
    let _ = c.release(out.lease);
    let turn2 = [1, 2, 3, 4, 5, 6, 7];
    let m = c.match_prefix(&turn2, 0);
    assert_eq!(m.blocks.len(), 2);
    let out = c
        .insert(
            &turn2,
            0,
            m.blocks.len(),
            blobs(&turn2, 2, m.blocks.len(), 1),
        )
        .expect("extend");
    assert_eq!(out.inserted, 1);
    assert_eq!(&out.blocks[..2], &m.blocks[..]);
    let _ = c.release(m.lease);
    let _ = c.release(out.lease);
    // Re-inserting everything stores nothing new and hands the payloads back.
    let out = c
        .insert(&turn2, 0, 0, blobs(&turn2, 2, 0, 1))
        .expect("re-insert");
    assert_eq!((out.inserted, out.unused.len()), (0, 3));
    let _ = c.release(out.lease);
    check_invariants(&c);
}

#[test]
fn insert_rejects_bad_arguments() {
    let mut c = cache(2, 100);
    let toks = [1, 2, 3, 4, 5];
    let err = c.insert(&toks, 0, 1, blobs(&toks, 2, 1, 1)).err();
    assert_eq!(
        err,
        Some(PrefixCacheError::MissingPrefix {
            block: 0,
            from: 0,
            to: 2,
            version: 0
        })
    );
    let too_many = vec![Blob { tag: 0, bytes: 1 }; 3];
    assert!(matches!(
        c.insert(&toks, 0, 0, too_many),
        Err(PrefixCacheError::TooManyPayloads { full_blocks: 2, .. })
    ));
    assert_eq!(c.num_blocks(), 0);
}

#[test]
fn clear_waits_for_leases_and_stale_ids_are_refused() {
    let mut c = cache(2, 100);
    let a = [1, 2, 3, 4];
    let b = [9, 9];
    let held = c.insert(&a, 0, 0, blobs(&a, 2, 0, 1)).expect("insert a");
    let out = c.insert(&b, 0, 0, blobs(&b, 2, 0, 1)).expect("insert b");
    let b_id = out.blocks[0];
    let _ = c.release(out.lease);
    let freed = c.clear();
    assert_eq!(freed.len(), 1, "only the unleased block is freed now");
    assert_eq!(c.peek_prefix(&a, 0), 0, "invalidated blocks never match");
    assert_eq!(
        c.acquire(b_id).err(),
        Some(PrefixCacheError::UnknownBlock(b_id))
    );
    assert_eq!(
        c.acquire(held.blocks[1]).err(),
        Some(PrefixCacheError::UnknownBlock(held.blocks[1]))
    );
    check_invariants(&c);
    // Same tokens can be cached again while the stale copy is still leased.
    let again = c.insert(&a, 0, 0, blobs(&a, 2, 0, 1)).expect("re-insert a");
    assert_eq!(again.inserted, 2);
    check_invariants(&c);
    let freed = c.release(held.lease);
    assert_eq!(freed.len(), 2, "the last lease frees the stale chain");
    let _ = c.release(again.lease);
    assert_eq!(c.num_blocks(), 2);
    check_invariants(&c);
}

#[test]
fn acquire_extends_a_hold() {
    let mut c = cache(1, 0);
    let toks = [1, 2];
    let out = c
        .insert(&toks, 0, 0, blobs(&toks, 1, 0, 5))
        .expect("insert");
    let extra = c.acquire(out.blocks[0]).expect("acquire first block");
    let freed = c.release(out.lease);
    assert_eq!(freed.len(), 1, "budget 0: the unheld second block goes");
    assert_eq!(c.peek_prefix(&toks, 0), 1);
    let _ = c.release(extra);
    assert_eq!(c.num_blocks(), 0);
    check_invariants(&c);
}

#[test]
fn hash_collisions_are_misses_not_wrong_hits() {
    let mut c = cache(2, 100);
    let a = [1, 2];
    let b = [3, 4];
    let out = c.insert(&a, 0, 0, blobs(&a, 2, 0, 1)).expect("insert");
    let _ = c.release(out.lease);
    // Forge a collision: make b's hash point at a's block.
    let b_hash = BlockHash::root(0).chain(0, &b);
    c.index.insert(b_hash, out.blocks[0]);
    let m = c.match_prefix(&b, 0);
    assert_eq!(m.matched_tokens, 0);
    assert_eq!(c.stats().hash_collisions, 1);
    let _ = c.release(m.lease);
}

/// Deterministic xorshift for the randomized invariant test.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn random_operations_keep_every_invariant() {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut c = cache(2, 40);
    let mut leases = Vec::new();
    for step in 0..2000 {
        let len = (next(&mut rng) % 9) as usize;
        let toks: Vec<u32> = (0..len).map(|_| (next(&mut rng) % 3) as u32).collect();
        let version = next(&mut rng) % 2;
        match next(&mut rng) % 6 {
            0 | 1 => {
                let m = c.match_prefix(&toks, version);
                let start = m.blocks.len();
                let out = c
                    .insert(&toks, version, start, blobs(&toks, 2, start, 3))
                    .expect("insert after match");
                leases.push(m.lease);
                leases.push(out.lease);
            }
            2 | 3 if !leases.is_empty() => {
                let i = (next(&mut rng) as usize) % leases.len();
                let _ = c.release(leases.swap_remove(i));
            }
            4 if step % 97 == 0 => {
                let _ = c.clear();
            }
            5 if step % 31 == 0 => {
                let _ = c.retain_version(version);
            }
            _ => {
                let _ = c.set_budget_bytes((next(&mut rng) % 60) as usize);
            }
        }
        check_invariants(&c);
    }
    for l in leases {
        let _ = c.release(l);
    }
    check_invariants(&c);
    let s = c.stats();
    assert!(
        s.hit_blocks > 0 && s.evicted_blocks > 0 && s.invalidations > 0,
        "{s:?}"
    );
    let _ = c.clear();
    assert_eq!((c.num_blocks(), c.used_bytes()), (0, 0));
}

/// Payload as the engine uses it: the route rows of one block.
struct RouteBlock(r3_routing::RouteTable);

impl BlockPayload for RouteBlock {
    fn size_bytes(&self) -> usize {
        self.0.num_tokens() * self.0.num_columns() * self.0.top_k() * 2
    }
}

#[test]
fn routes_of_the_cached_part_are_the_stored_ones() {
    use r3_routing::{LayerSpace, RouteTable};
    let bs = 4;
    let (num_experts, top_k, layers) = (8, 2, vec![1, 3]);
    // 14 positions: 3 full blocks + 2; distinct experts per cell derived from the position.
    let ids: Vec<i64> = (0..14i64)
        .flat_map(|t| (0..2i64).flat_map(move |c| [(t + c) % 8, (t + c + 3) % 8]))
        .collect();
    let full = RouteTable::from_flat(num_experts, top_k, LayerSpace::MoeOnly, layers, 0, &ids)
        .expect("valid table");
    let tokens: Vec<u32> = (100..114).collect();
    let payloads: Vec<RouteBlock> = (0..3)
        .map(|b| {
            RouteBlock(
                full.slice_rows(b * bs, (b + 1) * bs)
                    .expect("rows in range"),
            )
        })
        .collect();
    let mut c: PrefixCache<RouteBlock> = PrefixCache::new(bs, 1 << 20).expect("cache");
    let out = c.insert(&tokens, 3, 0, payloads).expect("insert");
    let _ = c.release(out.lease);

    // A next turn sharing the first 10 tokens: 2 blocks are served from the cache.
    let mut next_turn = tokens[..10].to_vec();
    next_turn.extend([7, 7, 7, 7, 7]);
    let m = c.match_prefix(&next_turn, 3);
    assert_eq!(m.matched_tokens, 8);
    let mut served = m.payloads[0].0.clone();
    for p in &m.payloads[1..] {
        served.append(&p.0).expect("consecutive blocks append");
    }
    assert_eq!(served, full.slice_rows(0, 8).expect("rows in range"));
    let _ = c.release(m.lease);
    // Under other weights the same tokens are not served.
    assert_eq!(c.peek_prefix(&next_turn, 4), 0);
}

/// By hand: the shared full blocks stop at the first differing token, a partial block
/// counts nothing, and a block size of 0 shares nothing.
#[test]
fn shared_block_tokens_count_whole_blocks_of_the_common_start() {
    use super::shared_block_tokens;
    let (a, b) = ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9]);
    assert_eq!(shared_block_tokens(&a, &b, 2), 4);
    assert_eq!(shared_block_tokens(&a, &b, 5), 5);
    assert_eq!(shared_block_tokens(&a, &b, 6), 0);
    assert_eq!(shared_block_tokens(&a, &a, 3), 6);
    assert_eq!(shared_block_tokens(&a, &b, 0), 0);
}

/// A cache built by `steps` random matches and inserts (block size 2, three token values,
/// so chains branch and share prefixes); every payload's tag is unique, and about a quarter
/// of the inserts keep their lease (those chains cannot be evicted). The same `seed` builds
/// the same cache.
fn random_cache(seed: u64, steps: usize) -> (PrefixCache<Blob>, Vec<PrefixLease>) {
    let mut rng = seed;
    let mut c = cache(2, 1 << 20);
    let mut leases = Vec::new();
    let mut tag = 0;
    for _ in 0..steps {
        let len = (next(&mut rng) % 13) as usize;
        let toks: Vec<u32> = (0..len).map(|_| (next(&mut rng) % 3) as u32).collect();
        let m = c.match_prefix(&toks, 0);
        let start = m.blocks.len();
        let _ = c.release(m.lease);
        let payloads: Vec<Blob> = (start..len / 2)
            .map(|_| {
                tag += 1;
                Blob { tag, bytes: 1 }
            })
            .collect();
        let out = c
            .insert(&toks, 0, start, payloads)
            .expect("insert after match");
        if next(&mut rng).is_multiple_of(4) {
            leases.push(out.lease);
        } else {
            let _ = c.release(out.lease);
        }
    }
    (c, leases)
}

/// What `evict_blocks_where` promises, spelled out: again and again, the least recently
/// used evictable block that `frees` accepts.
fn evict_one_by_one(
    c: &mut PrefixCache<Blob>,
    n: usize,
    frees: impl Fn(&Blob) -> bool,
) -> Vec<u32> {
    let mut tags = Vec::new();
    while tags.len() < n {
        let Some(&(_, id)) = c
            .evictable
            .iter()
            .find(|&&(_, id)| c.arena.get(id).is_some_and(|b| frees(&b.payload)))
        else {
            break;
        };
        tags.extend(c.free(id).map(|p| p.tag));
    }
    tags
}

#[test]
fn evict_blocks_where_takes_the_least_recently_used_accepted_leaf_each_time() {
    let filters: [fn(&Blob) -> bool; 3] = [|_| true, |b| b.tag % 3 != 0, |b| b.tag % 5 == 1];
    for seed in 1..20u64 {
        for (f, frees) in filters.iter().enumerate() {
            for n in [1, 3, 10, 1000] {
                let (mut got, _held) = random_cache(seed * 7919, 60);
                let (mut want, _) = random_cache(seed * 7919, 60);
                let cached = got.num_blocks();
                let tags: Vec<u32> = got
                    .evict_blocks_where(n, frees)
                    .iter()
                    .map(|p| p.tag)
                    .collect();
                assert_eq!(
                    tags,
                    evict_one_by_one(&mut want, n, frees),
                    "seed {seed} filter {f} n {n}"
                );
                assert_eq!(got.num_blocks(), cached - tags.len());
                assert_eq!(got.stats().evicted_blocks, tags.len() as u64);
                check_invariants(&got);
                if f == 0 {
                    // Accepting every block, it is `evict_blocks`.
                    let (mut all, _) = random_cache(seed * 7919, 60);
                    let plain: Vec<u32> = all.evict_blocks(n).iter().map(|p| p.tag).collect();
                    assert_eq!(tags, plain, "seed {seed} n {n}");
                }
            }
        }
    }
}

#[test]
fn a_prefix_left_a_leaf_goes_before_newer_leaves() {
    let mut c = cache(1, 1 << 20);
    // Chain 1 <- 2, then leaf 3: 1 is the least recently used, then 2, then 3.
    let out = c
        .insert(&[1, 2], 0, 0, blobs(&[1, 2], 1, 0, 1))
        .expect("insert");
    let _ = c.release(out.lease);
    let out = c.insert(&[3], 0, 0, blobs(&[3], 1, 0, 1)).expect("insert");
    let _ = c.release(out.lease);
    let tags: Vec<u32> = c
        .evict_blocks_where(2, |_| true)
        .iter()
        .map(|p| p.tag)
        .collect();
    assert_eq!(
        tags,
        vec![2, 1],
        "1 is a leaf once 2 is gone, and older than 3"
    );
    check_invariants(&c);
}

#[test]
fn a_held_prefix_is_spared_by_eviction_and_counts_nothing() {
    let mut c = cache(2, 1 << 20);
    let a = [1, 1, 2, 2, 3, 3];
    let b = [4, 4, 5, 5];
    for s in [&a[..], &b[..]] {
        let out = c.insert(s, 0, 0, blobs(s, 2, 0, 1)).expect("insert");
        let _ = c.release(out.lease);
    }
    let before = c.stats();
    // A request starting with `a`'s first two blocks holds them: `a`'s third block (not
    // on its path) and `b`'s blocks are evicted instead, though `a`'s are older.
    let mut probe = a[..4].to_vec();
    probe.push(9);
    let hold = c.hold_prefix(&probe, 0);
    assert_eq!(c.stats(), before, "a hold is no lookup");
    let tags: Vec<u32> = c
        .evict_blocks_where(10, |_| true)
        .iter()
        .map(|p| p.tag)
        .collect();
    assert_eq!(tags, vec![3, 5, 4]);
    assert_eq!(c.peek_prefix(&probe, 0), 4);
    check_invariants(&c);
    // Given back, the chain is evictable again in its old order.
    assert!(c.release(hold).is_empty(), "within budget");
    let tags: Vec<u32> = c.evict_blocks(10).iter().map(|p| p.tag).collect();
    assert_eq!(tags, vec![2, 1]);
    check_invariants(&c);
    // Nothing cached: an empty hold.
    let hold = c.hold_prefix(&probe, 0);
    assert_eq!(hold, PrefixLease::empty());
    assert!(c.release(hold).is_empty());
}
