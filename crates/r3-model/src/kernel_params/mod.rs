//! What each of r3's CUDA kernels takes, argument by argument, and the check every launch
//! makes against it (`cuda/mod.rs` `CheckedLaunch`): a kernel launched with an argument
//! missing, one too many, or a value of another kind (a 64-bit length where the kernel reads
//! 32 bits, a float where it reads an integer, a buffer where it reads a number) reads its
//! arguments at the wrong offsets on a GPU and computes garbage without a word. The table
//! (`table.rs`) is written from `kernels.cu` by the r3-cuda-emu crate's build, whose test
//! keeps this copy current. Outside the `cuda` feature, so the CPU tests check the check.

mod table;

use table::KERNEL_PARAMS;

/// A kernel parameter's kind, as the kernel reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A device address (`const float *`, `void *`, ...).
    Pointer,
    /// A 32-bit float.
    F32,
    /// A 64-bit float.
    F64,
    /// A 32-bit integer (`uint32_t`, `int`).
    Int32,
    /// A 64-bit integer (`size_t`, `uint64_t`).
    Int64,
}

/// The parameters of the kernel `name` of `kernels.cu`, in order; `None` for no such kernel.
pub fn kernel_params(name: &str) -> Option<&'static [ParamKind]> {
    // The table is sorted by name (a launch looks its kernel up every time).
    KERNEL_PARAMS
        .binary_search_by(|(kernel, _)| (*kernel).cmp(name))
        .ok()
        .map(|at| KERNEL_PARAMS[at].1)
}

/// Checks a launch of the kernel `name` with arguments of kinds `args` against the kernel's
/// parameters; the error names the kernel and the first argument that does not fit.
pub fn check_launch_args(name: &str, args: &[ParamKind]) -> Result<(), String> {
    let Some(params) = kernel_params(name) else {
        return Err(format!("{name} is not a kernel of kernels.cu"));
    };
    if args.len() != params.len() {
        return Err(format!(
            "{name} launched with {} arguments where kernels.cu declares {}",
            args.len(),
            params.len()
        ));
    }
    // Only the same kind fits: a device address held as a number passes as a pointer only
    // where the launch says so (`cuda::DeviceAddr`).
    for (i, (param, arg)) in params.iter().zip(args).enumerate() {
        if param != arg {
            return Err(format!(
                "{name}: argument {} is a {arg:?} where kernels.cu declares a {param:?}",
                i + 1
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::ParamKind::*;
    use super::*;

    /// The table holds every kernel once, sorted, with the parameters read off kernels.cu by hand
    /// for two of them (one written out, one made by the AdamW macro).
    #[test]
    fn the_table_holds_each_kernel_once_with_its_parameters() {
        let names: Vec<&str> = KERNEL_PARAMS.iter().map(|(name, _)| *name).collect();
        let count = names.len();
        assert!(
            names.windows(2).all(|w| w[0] < w[1]),
            "the table is sorted by name, each kernel once (binary search)"
        );
        assert_eq!(count, 71);
        assert_eq!(
            kernel_params("r3_combine_slots_f32"),
            Some(&[Pointer, Pointer, Pointer, Pointer, Int32, Int32][..])
        );
        let adamw = kernel_params("r3_adamw_bf16_grad_bf16_mbf16").expect("an AdamW kernel");
        assert_eq!(adamw.len(), 26);
        assert_eq!(adamw[8], Int64, "n is a size_t");
        assert_eq!(adamw[9..19], [F32; 10]);
        assert_eq!(adamw[21], Pointer, "copy_out is a void *");
        assert_eq!(adamw[23..], [Int64; 3], "the three rounding keys");
    }

    /// A launch that fits passes; one argument short, one too many, a 64-bit length for a
    /// 32-bit parameter, a float for an integer, a number for a buffer, and an unknown
    /// kernel each fail, naming the kernel and (where one is at fault) the argument.
    #[test]
    fn a_launch_that_does_not_fit_its_kernel_is_refused() {
        let fits = [Pointer, Pointer, Pointer, Pointer, Int32, Int32];
        check_launch_args("r3_combine_slots_f32", &fits).expect("fits");
        let short = check_launch_args("r3_combine_slots_f32", &fits[..5]).expect_err("short");
        assert!(
            short.contains("5 arguments") && short.contains("declares 6"),
            "{short}"
        );
        let mut long = fits.to_vec();
        long.push(Int32);
        assert!(check_launch_args("r3_combine_slots_f32", &long).is_err());
        let mut wide = fits;
        wide[5] = Int64;
        let err = check_launch_args("r3_combine_slots_f32", &wide).expect_err("a 64-bit h");
        assert!(err.contains("argument 6") && err.contains("Int64"), "{err}");
        let mut float = fits;
        float[4] = F32;
        assert!(check_launch_args("r3_combine_slots_f32", &float).is_err());
        // No kind stands in for another: a 32- or 64-bit number is no buffer.
        for number_kind in [Int32, Int64] {
            let mut number = fits;
            number[0] = number_kind;
            assert!(check_launch_args("r3_combine_slots_f32", &number).is_err());
        }
        let err = check_launch_args("r3_no_such_kernel", &fits).expect_err("unknown");
        assert!(err.contains("r3_no_such_kernel"), "{err}");
    }
}
