//! r3-model's table of the kernels' parameters (`kernel_params/table.rs`, which every GPU
//! launch is checked against) against the one this crate's build writes from `kernels.cu`.

/// The checked-in table is the one written from today's `kernels.cu`: a kernel added or
/// changed there without the table fails here, naming the file to copy.
#[test]
fn the_checked_in_kernel_params_are_current() {
    let fresh = include_str!(concat!(env!("OUT_DIR"), "/kernel_params_table.rs"));
    let checked_in = include_str!("../../r3-model/src/kernel_params/table.rs");
    assert!(
        fresh == checked_in,
        "crates/r3-model/src/kernel_params/table.rs is stale: copy {}/kernel_params_table.rs over it",
        env!("OUT_DIR")
    );
}

/// Every kernel the emulator binds is in the table with as many parameters.
#[test]
fn every_bound_kernel_is_in_the_table() {
    let fresh = include_str!(concat!(env!("OUT_DIR"), "/kernel_params_table.rs"));
    let signatures = include_str!(concat!(env!("OUT_DIR"), "/kernel_signatures.rs"));
    let mut bound = 0;
    for line in signatures
        .lines()
        .filter_map(|l| l.trim().strip_prefix("fn "))
    {
        let (name, rest) = line.split_once('(').expect("a signature");
        let arity = rest
            .trim_end_matches(");")
            .split(", ")
            .filter(|p| !p.is_empty())
            .count();
        let params = r3_model::kernel_params::kernel_params(name)
            .unwrap_or_else(|| panic!("{name} is missing from r3-model's table"));
        assert_eq!(params.len(), arity, "{name}");
        assert!(fresh.contains(&format!("(\"{name}\", ")), "{name}");
        bound += 1;
    }
    assert_eq!(bound, 71);
}
