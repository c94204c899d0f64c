//! The kernels' signatures, read from `kernels.cu` by build.rs (`size_t` is `usize`, a bf16 or
//! f16 value its `half` type, `void *` a `c_void` pointer), bound twice: to the variant
//! compiled as written ([`PLAIN`]) and to the contracted one ([`FMA`]).

use std::ffi::c_void;

use half::{bf16, f16};

/// Declares every kernel once per variant and the table of each variant's entry points.
macro_rules! kernels {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ); )*) => {
        mod plain_symbols {
            use super::*;
            extern "C" {
                $(
                    #[link_name = concat!("emu_plain_", stringify!($name))]
                    pub fn $name($($arg: $ty),*);
                )*
            }
        }
        mod fma_symbols {
            use super::*;
            extern "C" {
                $(
                    #[link_name = concat!("emu_fma_", stringify!($name))]
                    pub fn $name($($arg: $ty),*);
                )*
            }
        }
        /// One variant's kernels, by their names in `kernels.cu`. Calling one outside
        /// [`crate::launch`]'s body, or with pointers that do not cover what the kernel
        /// reads and writes for its grid, is undefined behaviour, as on a GPU.
        #[allow(missing_docs)]
        pub struct Kernels {
            $( pub $name: unsafe extern "C" fn($($ty),*), )*
        }
        /// The kernels compiled with every expression rounded as written.
        pub static PLAIN: Kernels = Kernels { $( $name: plain_symbols::$name, )* };
        /// The kernels compiled with multiplies and adds contracted into fused multiply-adds.
        pub static FMA: Kernels = Kernels { $( $name: fma_symbols::$name, )* };
    };
}

// Every kernel of kernels.cu, as build.rs reads their signatures from the source.
include!(concat!(env!("OUT_DIR"), "/kernel_signatures.rs"));
