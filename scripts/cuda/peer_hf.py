#!/usr/bin/env python3
"""The peer of `r3 bench train` on a GPU: forward + backward tokens/s of the same model
(`--config mid`: the mid-size Qwen3-MoE bench config; `a3b-8l`: Qwen3-30B-A3B's layer shape
with 8 layers; seeded random weights) with the same loss (mean
next-token log-prob), batch and sequence length, on the same GPU.

HF transformers (`Qwen3MoeForCausalLM`, eager attention, `grouped_mm` experts where the
installed version has them) when it is importable; otherwise the same architecture in plain
torch (this file's `TorchQwen3Moe`: RMSNorm, q/k norm, RoPE, GQA attention, softmax top-k
router with renormalised weights, SwiGLU experts), so the check runs on a machine with torch
alone. The output's first word says which peer ran.

`--dtype bf16` is the model held in bf16 (weights and gradients; no f32 master copy).
`--dtype amp-bf16` is what HF's `Trainer` / TRL do with `bf16=True`: f32 parameters and
gradients, the forward under `torch.autocast(bfloat16)` — the same precision scheme as
`r3 train`'s `train.dtype = "bf16"` (f32 master weights, matmuls on bf16 operands), so its
time and memory are the like-for-like peer of r3's bf16 figures.

    python3 scripts/cuda/peer_hf.py --dtype bf16 --batch 8 --seq-len 512 --steps 3
"""

import contextlib

import argparse
import math
import time

import torch
import torch.nn.functional as F

# `r3_model::presets::mid_size_bench_config` (crates/r3-model/src/presets.rs).
MID = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    hidden_act="silu",
)

# `r3_model::presets::qwen3_30b_a3b_layers_config(8)`: Qwen3-30B-A3B's layer shape, 8 layers.
A3B_8L = dict(
    MID,
    vocab_size=151936,
    hidden_size=2048,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    max_position_embeddings=40960,
)

CONFIGS = {"mid": MID, "a3b-8l": A3B_8L}


def hf_model(dtype, config=MID, grouped=True):
    """HF's Qwen3-MoE with `config` (`grouped_mm` experts where available and `grouped`), or
    None when transformers is not installed."""
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError:
        return None, None
    import transformers

    cfg = Qwen3MoeConfig(**config, attn_implementation="eager")
    cfg.initializer_range = 0.02
    experts = "default"
    # Billions of parameters are initialised on the GPU (on the host, torch's init of the
    # 5.6 B-parameter config takes minutes); the mid config keeps the host init.
    where = torch.device("cuda") if config is not MID and torch.cuda.is_available() else torch.device("cpu")
    with where:
        model = None
        if grouped:
            try:
                model = Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="grouped_mm")
                experts = "grouped_mm"
            except (TypeError, ValueError, KeyError):
                model = None
        if model is None:
            model = Qwen3MoeForCausalLM._from_config(cfg)
    return model.to(dtype), f"transformers {transformers.__version__} (eager attention, {experts} experts)"


class RmsNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Layer(torch.nn.Module):
    """One Qwen3-MoE decoder layer: attention with q/k norm, then the routed experts."""

    def __init__(self, c):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], d
        self.q = torch.nn.Linear(h, self.nh * d, bias=False)
        self.k = torch.nn.Linear(h, self.nkv * d, bias=False)
        self.v = torch.nn.Linear(h, self.nkv * d, bias=False)
        self.o = torch.nn.Linear(self.nh * d, h, bias=False)
        self.q_norm, self.k_norm = RmsNorm(d, c["rms_norm_eps"]), RmsNorm(d, c["rms_norm_eps"])
        self.in_norm = RmsNorm(h, c["rms_norm_eps"])
        self.post_norm = RmsNorm(h, c["rms_norm_eps"])
        e, i = c["num_experts"], c["moe_intermediate_size"]
        self.e, self.k_top = e, c["num_experts_per_tok"]
        self.gate = torch.nn.Linear(h, e, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(e, 2 * i, h) * 0.02)
        self.down = torch.nn.Parameter(torch.randn(e, h, i) * 0.02)
        self.i = i

    def attention(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).view(b, t, self.nh, self.d)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, self.nkv, self.d)).transpose(1, 2)
        v = self.v(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        probs = torch.softmax(scores.float() + mask, dim=-1).to(q.dtype)
        return self.o((probs @ v).transpose(1, 2).reshape(b, t, -1))

    def experts(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, ids = probs.topk(self.k_top, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        flat = ids.reshape(-1)
        order = flat.argsort()
        rows = order // self.k_top
        xs = x[rows]
        counts = torch.bincount(flat, minlength=self.e)
        y = None
        if hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16:
            # One launch for all experts (torch 2.9+, bf16); the loop below where it is absent.
            try:
                offs = counts.cumsum(0).to(torch.int32)
                h = torch._grouped_mm(xs, self.gate_up.transpose(1, 2), offs=offs)
                a = F.silu(h[:, : self.i]) * h[:, self.i :]
                y = torch._grouped_mm(a, self.down.transpose(1, 2), offs=offs)
            except RuntimeError:
                y = None
        if y is None:
            parts, start = [], 0
            for j, n in enumerate(counts.tolist()):
                if n:
                    h = xs[start : start + n] @ self.gate_up[j].t()
                    a = F.silu(h[:, : self.i]) * h[:, self.i :]
                    parts.append(a @ self.down[j].t())
                start += n
            y = torch.cat(parts)
        y = y * w.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, rows, y)
        return out.reshape(shape)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.in_norm(x), cos, sin)
        return x + self.experts(self.post_norm(x))


class TorchQwen3Moe(torch.nn.Module):
    """Qwen3-MoE in plain torch (the bench config's architecture), returning logits."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RmsNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        t, d = ids.shape[1], self.c["head_dim"]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, d, 2, device=ids.device) / d))
        ang = torch.outer(torch.arange(t, device=ids.device).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        x = self.embed(ids)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["f32", "bf16", "amp-bf16"], default="f32")
    p.add_argument("--config", choices=sorted(CONFIGS), default="mid")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-only", action="store_true", help="skip transformers")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run)")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    # amp-bf16 keeps f32 parameters; autocast runs the matmuls on bf16 copies.
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    autocast = (
        (lambda: torch.autocast(dev.type, dtype=torch.bfloat16))
        if a.dtype == "amp-bf16"
        else contextlib.nullcontext
    )
    config = CONFIGS[a.config]
    model, label = (None, None) if a.torch_only else hf_model(dtype, config)
    if model is None:
        model = TorchQwen3Moe(config).to(dtype)
        label = f"plain torch {torch.__version__} Qwen3-MoE"
    model = model.to(dev).train()
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config["vocab_size"], (a.batch, a.seq_len), device=dev)
    targets = torch.roll(ids, -1, dims=1)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def step():
        with autocast():
            out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1))
        loss = -logp.mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    try:
        for _ in range(a.warmup):
            step()
    except RuntimeError as err:
        # grouped_mm may refuse autocast's mixed operands (f32 expert weights, bf16 rows):
        # then HF's default experts, said in the label.
        if "grouped_mm" not in (label or "") or a.dtype != "amp-bf16":
            raise
        print(f"note: grouped_mm under autocast failed ({str(err)[:120]}); default experts")
        del model
        model, label = hf_model(dtype, config, grouped=False)
        model = model.to(dev).train()
        for _ in range(a.warmup):
            step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    tokens = a.batch * a.seq_len
    mean = sum(times) / len(times)
    where = torch.cuda.get_device_name() if cuda else "cpu"
    peak = f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if cuda else "peak n/a"
    print(f"peer {label}: {a.config}, {params / 1e6:.1f}M params, {a.dtype}, batch {a.batch} x {a.seq_len},"
          f" {where}, {peak},"
          f" mean {mean:.4f} s/step, best {min(times):.4f} s, {tokens / mean:.1f} tokens/s")


if __name__ == "__main__":
    main()
