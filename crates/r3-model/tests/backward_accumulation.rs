//! candle's backward as this workspace builds it (`vendor/candle-core`: a gradient's first
//! contribution is stored as it is instead of being added to a zero-filled tensor) sums
//! every contribution exactly once: gradients of tensors read several times, through a
//! subtraction, a broadcast, a transpose and a fused op's own backward, each checked
//! against values computed by hand. Every gradient handed out is contiguous, as a sum was; a
//! strided gradient that a transpose's rule turns back into a contiguous one is not copied.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, Var, D};

fn var(values: &[f32], shape: &[usize]) -> Var {
    let t = Tensor::from_slice(values, shape, &Device::Cpu).expect("tensor");
    Var::from_tensor(&t).expect("var")
}

fn constant(values: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(values, shape, &Device::Cpu).expect("tensor")
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .expect("flat")
        .to_vec1::<f32>()
        .expect("vec")
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-6, "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn a_tensor_read_three_times_gets_the_sum_of_its_three_gradients() {
    // loss = Σ (x·a + x·b + x)  →  ∂/∂x = a + b + 1, ∂/∂a = x, ∂/∂b = x
    let x = var(&[1.0, -2.0, 3.0], &[3]);
    let a = var(&[0.5, 4.0, -1.0], &[3]);
    let b = var(&[2.0, 0.25, 7.0], &[3]);
    let y = ((x.as_tensor() * a.as_tensor()).expect("xa")
        + (x.as_tensor() * b.as_tensor()).expect("xb"))
    .expect("sum")
    .add(x.as_tensor())
    .expect("plus x");
    let grads = y.sum_all().expect("loss").backward().expect("backward");
    let gx = grads.get(x.as_tensor()).expect("x has a gradient");
    assert_close(&flat(gx), &[3.5, 5.25, 7.0], "dx");
    assert_close(
        &flat(grads.get(a.as_tensor()).expect("a")),
        &[1.0, -2.0, 3.0],
        "da",
    );
    assert_close(
        &flat(grads.get(b.as_tensor()).expect("b")),
        &[1.0, -2.0, 3.0],
        "db",
    );
}

#[test]
fn a_subtracted_tensor_s_first_gradient_is_negated() {
    // loss = Σ (p − q)·c  →  ∂/∂p = c, ∂/∂q = −c (q's only contribution is the subtraction's)
    let p = var(&[1.0, 2.0], &[2]);
    let q = var(&[3.0, -4.0], &[2]);
    let c = constant(&[5.0, -6.0], &[2]);
    let loss = (p.as_tensor() - q.as_tensor())
        .expect("sub")
        .mul(&c)
        .expect("mul")
        .sum_all()
        .expect("loss");
    let grads = loss.backward().expect("backward");
    assert_close(
        &flat(grads.get(p.as_tensor()).expect("p")),
        &[5.0, -6.0],
        "dp",
    );
    assert_close(
        &flat(grads.get(q.as_tensor()).expect("q")),
        &[-5.0, 6.0],
        "dq",
    );
    // q also read once more, after the subtraction: its two contributions add
    let loss = (p.as_tensor() - q.as_tensor())
        .expect("sub")
        .mul(&c)
        .expect("mul")
        .add(q.as_tensor())
        .expect("plus q")
        .sum_all()
        .expect("loss");
    let grads = loss.backward().expect("backward");
    assert_close(
        &flat(grads.get(q.as_tensor()).expect("q")),
        &[-4.0, 7.0],
        "dq twice",
    );
}

#[test]
fn a_transposed_or_broadcast_first_gradient_is_stored_contiguous_with_its_values() {
    // W [2, 3] read as Wᵀ: ∂/∂W Σ Wᵀ ⊙ M = Mᵀ, which candle's transpose backward hands over
    // as a strided view; the bias [3] broadcast over 2 rows gets its column sums.
    let w = var(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let bias = var(&[0.1, 0.2, 0.3], &[3]);
    let m = constant(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]);
    let wt = w.as_tensor().t().expect("transpose");
    let loss = (wt.mul(&m).expect("mul").sum_all().expect("sum")
        + w.as_tensor()
            .broadcast_add(bias.as_tensor())
            .expect("bias")
            .sqr()
            .expect("sqr")
            .sum_all()
            .expect("sum"))
    .expect("loss");
    let grads = loss.backward().expect("backward");
    let gw = grads.get(w.as_tensor()).expect("w");
    let gb = grads.get(bias.as_tensor()).expect("bias");
    assert!(gw.is_contiguous(), "W's gradient is contiguous");
    assert!(gb.is_contiguous(), "the bias's gradient is contiguous");
    // Mᵀ + 2(W + bias)
    let wv = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let bv = [0.1f32, 0.2, 0.3];
    let mt = [1.0f32, 3.0, 5.0, 2.0, 4.0, 6.0];
    let want_w: Vec<f32> = (0..6).map(|i| mt[i] + 2.0 * (wv[i] + bv[i % 3])).collect();
    assert_close(&flat(gw), &want_w, "dW");
    let want_b: Vec<f32> = (0..3)
        .map(|j| 2.0 * (wv[j] + bv[j]) + 2.0 * (wv[3 + j] + bv[j]))
        .collect();
    assert_close(&flat(gb), &want_b, "dbias");

    // V read only through its transpose: its one gradient is the strided view itself
    let v = var(&[1.0, -1.0, 2.0, -2.0, 3.0, -3.0], &[2, 3]);
    let loss = v
        .as_tensor()
        .t()
        .expect("transpose")
        .mul(&m)
        .expect("mul")
        .sum_all()
        .expect("loss");
    let grads = loss.backward().expect("backward");
    let gv = grads.get(v.as_tensor()).expect("v");
    assert!(
        gv.is_contiguous(),
        "a strided first gradient is stored contiguous"
    );
    assert_eq!(gv.dims(), &[2, 3]);
    assert_close(&flat(gv), &mt, "dV");
}

#[test]
fn gradients_through_a_fused_op_and_a_softmax_match_finite_differences() {
    // A small graph through candle's softmax (a fused op with its own backward), a matmul
    // and a residual: each of x's gradients against a central difference in f64.
    let dev = Device::Cpu;
    let xs: Vec<f64> = (0..12).map(|i| ((i * 7 % 11) as f64 - 5.0) / 4.0).collect();
    let ws: Vec<f64> = (0..16).map(|i| ((i * 5 % 13) as f64 - 6.0) / 5.0).collect();
    let wt = Tensor::from_slice(&ws, (4, 4), &dev).expect("w");
    let f = |x: &Tensor| -> Tensor {
        let h = x.matmul(&wt).expect("matmul");
        let p = candle_nn::ops::softmax(&h, D::Minus1).expect("softmax");
        (p + x)
            .expect("residual")
            .sqr()
            .expect("sqr")
            .sum_all()
            .expect("loss")
    };
    let x = Var::from_tensor(&Tensor::from_slice(&xs, (3, 4), &dev).expect("x")).expect("var");
    let grads = f(x.as_tensor()).backward().expect("backward");
    let gx = grads
        .get(x.as_tensor())
        .expect("x")
        .flatten_all()
        .expect("flat")
        .to_vec1::<f64>()
        .expect("vec");
    let h = 1e-6;
    for i in 0..xs.len() {
        let mut up = xs.clone();
        up[i] += h;
        let mut down = xs.clone();
        down[i] -= h;
        let at = |v: &[f64]| -> f64 {
            f(&Tensor::from_slice(v, (3, 4), &dev).expect("x"))
                .to_dtype(DType::F64)
                .expect("f64")
                .to_scalar::<f64>()
                .expect("scalar")
        };
        let numeric = (at(&up) - at(&down)) / (2.0 * h);
        assert!(
            (gx[i] - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
            "dx[{i}]: backward {}, finite difference {numeric}",
            gx[i]
        );
    }
}

/// `y = 3·x` for a 2-D f32 `x` read through its strides, whose backward hands the input gradient back as the
/// transpose of a contiguous buffer (as r3's attention and RoPE ops do for the transposed
/// views they read) and remembers where that buffer's data lies.
struct TripleWithTransposedGrad(Mutex<Option<usize>>);

fn data_address(t: &Tensor) -> usize {
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        panic!("not on the CPU")
    };
    let data = cpu.as_slice::<f32>().expect("f32");
    data[layout.start_offset()..].as_ptr() as usize
}

impl CustomOp1 for TripleWithTransposedGrad {
    fn name(&self) -> &'static str {
        "triple-with-transposed-grad"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let data = x.as_slice::<f32>()?;
        let (rows, cols) = l.shape().dims2()?;
        let (st, start) = (l.stride(), l.start_offset());
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| 3.0 * data[start + (i / cols) * st[0] + (i % cols) * st[1]])
            .collect();
        Ok((CpuStorage::F32(v), l.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let buffer = (grad.t()?.contiguous()? * 3.0)?;
        *self.0.lock().expect("lock") = Some(data_address(&buffer));
        Ok(Some(buffer.t()?))
    }
}

#[test]
fn a_transposed_gradient_transposed_back_reaches_the_variable_without_a_copy() {
    // loss = Σ op(Xᵀ) ⊙ M with op = 3·: ∂/∂X = 3 Mᵀ. The op reads X [2, 3] through a
    // transpose and returns that view's gradient as a transposed view; the transpose's rule
    // re-views it, and X's gradient is the op's own buffer.
    let x = var(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let m = constant(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]);
    let op = std::sync::Arc::new(TripleWithTransposedGrad(Mutex::new(None)));
    struct Shared(std::sync::Arc<TripleWithTransposedGrad>);
    impl CustomOp1 for Shared {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            self.0.cpu_fwd(s, l)
        }
        fn bwd(&self, x: &Tensor, r: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
            self.0.bwd(x, r, g)
        }
    }
    let xt = x.as_tensor().t().expect("transpose");
    let y = xt.apply_op1(Shared(op.clone())).expect("op");
    let loss = y.mul(&m).expect("mul").sum_all().expect("loss");
    let grads = loss.backward().expect("backward");
    let gx = grads.get(x.as_tensor()).expect("x");
    assert!(gx.is_contiguous(), "X's gradient is handed out contiguous");
    let mt = [1.0f32, 3.0, 5.0, 2.0, 4.0, 6.0];
    let want: Vec<f32> = mt.iter().map(|v| 3.0 * v).collect();
    assert_close(&flat(gx), &want, "dX");
    let buffer = op.0.lock().expect("lock").expect("the op's backward ran");
    assert_eq!(
        data_address(gx),
        buffer,
        "X's gradient is the op's buffer, not a copy of it"
    );
}

/// `backward_with` hands each variable's gradient to its hook once, whole (here after three
/// contributions, one through a transpose), and stores what the hook returns: the store
/// holds the hook's tensor, and the other variables' gradients are those `backward` gives.
#[test]
fn the_variable_hook_sees_each_whole_gradient_once() {
    // loss = Σ (x·a) + Σ (x·x) + Σ (xᵀ·b)ᵀ  →  ∂/∂x = a + 2x + b, ∂/∂a = x, ∂/∂b = x
    let x = var(&[1.0, -2.0, 3.0, 0.5], &[2, 2]);
    let a = var(&[0.5, 4.0, -1.0, 2.0], &[2, 2]);
    let b = var(&[2.0, 0.25, 7.0, -3.0], &[2, 2]);
    let loss = || {
        let xa = (x.as_tensor() * a.as_tensor()).expect("xa");
        let xx = (x.as_tensor() * x.as_tensor()).expect("xx");
        let xb = (x.as_tensor().t().expect("t") * b.as_tensor().t().expect("bt"))
            .and_then(|t| t.t())
            .expect("xb");
        (xa + xx)
            .and_then(|s| s + xb)
            .and_then(|s| s.sum_all())
            .expect("loss")
    };
    let mut seen: Vec<(candle_core::TensorId, Vec<f32>)> = Vec::new();
    let grads = loss()
        .backward_with(|node, grad| {
            seen.push((node.id(), flat(&grad)));
            // The store keeps what the hook returns: x's gradient tripled.
            if node.id() == x.as_tensor().id() {
                grad.affine(3.0, 0.0)
            } else {
                Ok(grad)
            }
        })
        .expect("backward");
    let plain = loss().backward().expect("plain backward");
    let want_x = [
        0.5 + 2.0 + 2.0,
        4.0 - 4.0 + 0.25,
        -1.0 + 6.0 + 7.0,
        2.0 + 1.0 - 3.0,
    ];
    for (v, want) in [
        (&x, want_x.to_vec()),
        (&a, flat(x.as_tensor())),
        (&b, flat(x.as_tensor())),
    ] {
        let at = seen
            .iter()
            .filter(|(id, _)| *id == v.as_tensor().id())
            .collect::<Vec<_>>();
        assert_eq!(at.len(), 1, "each variable once");
        assert_close(&at[0].1, &want, "the hook's gradient");
        assert_close(
            &flat(plain.get(v.as_tensor()).expect("plain")),
            &want,
            "backward's",
        );
    }
    let tripled: Vec<f32> = want_x.iter().map(|g| 3.0 * g).collect();
    assert_close(
        &flat(grads.get(x.as_tensor()).expect("x")),
        &tripled,
        "the stored x",
    );
    assert_close(
        &flat(grads.get(a.as_tensor()).expect("a")),
        &flat(x.as_tensor()),
        "the stored a",
    );
}

/// Doubles its input; its backward hands the gradient back in bf16 (as r3's GPU expert
/// GEMMs do for a trainer keeping 16-bit gradients).
struct DoubleWithBf16Grad;

impl CustomOp1 for DoubleWithBf16Grad {
    fn name(&self) -> &'static str {
        "double-with-bf16-grad"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let data = x.as_slice::<f32>()?;
        let v: Vec<f32> = data[l.start_offset()..][..l.shape().elem_count()]
            .iter()
            .map(|v| 2.0 * v)
            .collect();
        Ok((CpuStorage::F32(v), l.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some((grad * 2.0)?.to_dtype(DType::BF16)?))
    }
}

/// A 16-bit first gradient of an f32 variable is stored as it is, in bf16 (where upstream's
/// zeros-plus-gradient failed on the dtypes); a second contribution is summed in f32:
/// `x · 3 + double(x)` gets 3 + 2 at each element, `double(x)` alone 2 in bf16.
#[test]
fn a_sixteen_bit_gradient_of_an_f32_variable_is_kept_then_summed_in_f32() {
    let x = var(&[1.0, -2.0, 0.5], &[3]);
    let probe = constant(&[1.0, 0.25, -3.0], &[3]);
    let alone = (x.apply_op1(DoubleWithBf16Grad).expect("op") * &probe)
        .and_then(|l| l.sum_all())
        .and_then(|l| l.backward())
        .expect("backward");
    let g = alone.get(x.as_tensor()).expect("gradient");
    assert_eq!(g.dtype(), DType::BF16, "kept as the op gave it");
    assert_close(
        &flat(&g.to_dtype(DType::F32).expect("f32")),
        &[2.0, 0.5, -6.0],
        "alone",
    );
    for first_narrow in [true, false] {
        let doubled = x.apply_op1(DoubleWithBf16Grad).expect("op");
        let tripled = (x.as_tensor() * 3.0).expect("affine");
        let sum = match first_narrow {
            // The reverse topological order reaches the later operand of an add first.
            true => (tripled + doubled).expect("sum"),
            false => (doubled + tripled).expect("sum"),
        };
        let grads = (sum * &probe)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
            .expect("backward");
        let g = grads.get(x.as_tensor()).expect("gradient");
        assert_eq!(g.dtype(), DType::F32, "summed in f32");
        assert_close(&flat(g), &[5.0, 1.25, -15.0], "both");
    }
}

/// `backward_from(seed)` starts from `seed` where `backward` starts from ones: for
/// `y = x ⊙ x + w ⊙ x` seeded with `g`, `∂/∂x = g ⊙ (2x + w)` and `∂/∂w = g ⊙ x`, by hand;
/// a seed of another shape is an error naming both.
#[test]
fn a_seeded_backward_starts_from_its_seed() {
    let x = var(&[1.0, -2.0, 3.0], &[3]);
    let w = var(&[0.5, 4.0, -1.0], &[3]);
    let y = ((x.as_tensor() * x.as_tensor()).expect("x·x")
        + (w.as_tensor() * x.as_tensor()).expect("w·x"))
    .expect("y");
    let g = constant(&[2.0, -1.0, 0.5], &[3]);
    let grads = y.backward_from(&g).expect("seeded backward");
    // 2x + w = 2.5, 0, 5 → times g: 5, 0, 2.5; g ⊙ x: 2, 2, 1.5
    assert_close(&flat(grads.get(&x).expect("dx")), &[5.0, -0.0, 2.5], "dx");
    assert_close(&flat(grads.get(&w).expect("dw")), &[2.0, 2.0, 1.5], "dw");
    let ones = y.backward().expect("backward");
    assert_close(
        &flat(ones.get(&x).expect("dx")),
        &[2.5, 0.0, 5.0],
        "dx of ones",
    );
    let err = y
        .backward_from(&constant(&[1.0, 2.0], &[2]))
        .expect_err("a seed of another shape");
    assert!(
        err.to_string().contains("[2]") && err.to_string().contains("[3]"),
        "{err}"
    );
}
