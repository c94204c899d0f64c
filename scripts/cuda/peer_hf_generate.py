#!/usr/bin/env python3
"""The peer of `r3 bench decode` on a GPU: HF transformers `generate` tokens/s on the same
Qwen3-MoE config (`peer_hf.py`'s `--config`: mid, or a3b-8l, Qwen3-30B-A3B's layer shape with
8 layers; seeded random weights), greedy, the same prompt length and new tokens, at each
batch size, on the same GPU.

Needs transformers (HF's own KV cache and `generate`); without it one line says the peer was
skipped. Every sequence generates exactly `--new-tokens` (no eos), as `r3 bench decode` does.

    python3 scripts/cuda/peer_hf_generate.py --dtype bf16 --batches 1,64,256 [--config a3b-8l] [--repeats 2]
"""

import argparse
import time

import torch

from peer_hf import CONFIGS, hf_model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="mid")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per batch size, the best reported (as r3 bench decode's)")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the CPU peer)")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    config = CONFIGS[a.config]
    model, label = hf_model(dtype, config)
    if model is None:
        print("peer-generate skipped: transformers is not installed")
        return
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    model = model.to(dev).eval()

    def generate(batch):
        ids = torch.randint(3, config["vocab_size"], (batch, a.prompt_len), device=dev)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=a.new_tokens,
                min_new_tokens=a.new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        if cuda:
            torch.cuda.synchronize()
        return out.shape[0] * (out.shape[1] - a.prompt_len)

    generate(1)  # warm-up
    for batch in (int(b) for b in a.batches.split(",")):
        best = 0.0
        for _ in range(max(a.repeats, 1)):
            t0 = time.perf_counter()
            tokens = generate(batch)
            best = max(best, tokens / (time.perf_counter() - t0))
        where = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} threads"
        print(f"peer-generate {label}: {a.config} {a.dtype} batch {batch}, {where},"
              f" {best:.1f} tokens/s")


if __name__ == "__main__":
    main()
