#!/usr/bin/env python3
"""TRL's GRPOTrainer doing the work of r3 RL steps, timed per step: the peer of `r3 train`'s
step times (`time.rollout_s`, `time.update_s`, ... in metrics.jsonl).

    target/trl-venv/bin/python scripts/peers/trl_grpo_step.py \
        --config runs/x/config.toml --r3 target/release/r3 --steps 4

`--config` is the *resolved* config r3 writes into its run directory (`config.toml`, every
key), so nothing here restates r3's defaults and the two sides cannot drift;
`scripts/peers/step_vs_trl.sh` runs r3 first and hands its config over. From it:

- the model (`model_dir`, an HF Qwen3-MoE checkpoint, loaded by transformers in f32);
- the prompts: `r3 data show` prints them as r3's trainer renders them (the chat template for
  datasets, the built-in arithmetic generator otherwise) with their token ids; step k takes
  the next `prompts_per_step` of them, and the script checks that TRL's tokenizer turns each
  prompt text back into exactly r3's ids;
- the reward: `r3_rewards.py` (a port of r3's `math` / `arith` / `exact` rules), checked
  against `r3 data show --response` on test strings before training and on real completions
  after the first step; any difference stops the run;
- sampling (group size, max new tokens, temperature, top-p 1, no top-k), the loss (PPO clip
  low / high, aggregation, advantage normalisation, no KL, no reference model, one update per
  rollout batch or `algo.mini_batches`), AdamW (lr, betas, eps, weight decay, grad clip) and
  r3's learning-rate schedule.

It prints every setting it maps and every one it cannot, then per step: total (wall clock
between optimiser-step ends), rollout (TRL's `_generate_and_score_completions`: HF `generate`,
rewards, advantages), of which `generate`, and update (the rest: forward, backward, AdamW),
and a summary (medians over the steps after the first). `--out FILE` writes the same as JSON.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
import tomllib
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ beside the scripts in the work tree
sys.path.insert(0, str(Path(__file__).resolve().parent))
import r3_rewards

# Keys of the resolved config this script reads; a config without them is not resolved.
NEEDED = {
    "": ["seed", "model_dir"],
    "rollout": ["prompts_per_step", "group_size", "max_new_tokens", "temperature", "dtype"],
    "algo": ["loss", "eps_low", "eps_high", "loss_agg", "adv_norm_by_std", "mini_batches"],
    "optim": ["lr", "warmup_steps", "lr_decay", "beta1", "beta2", "adam_eps", "grad_clip"],
    "data": ["max_prompt_length"],
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the config.toml of an r3 run (every key)")
    p.add_argument("--r3", required=True, help="the r3 binary (prompts, reward check)")
    p.add_argument("--steps", type=int, default=4, help="RL steps to time (default 4)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="sequences per forward/backward (gradient accumulation); 0 = the whole update "
        "batch at once, as r3 without micro-batches (default 0)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--out", help="write the per-step times and the settings here (JSON)")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="GRPOConfig(bf16=True): f32 parameters under bf16 autocast, the Trainer's bf16 "
        "(r3's counterpart: train.dtype and rollout.dtype bf16); default f32",
    )
    return p.parse_args()


def load_config(path):
    with open(path, "rb") as f:
        cfg = tomllib.load(f)
    missing = [
        f"{sec + '.' if sec else ''}{k}"
        for sec, keys in NEEDED.items()
        for k in keys
        if k not in (cfg.get(sec, {}) if sec else cfg)
    ]
    if missing:
        sys.exit(
            f"{path}: missing {', '.join(missing)}. Pass the config.toml that `r3 train` writes "
            "into its run directory (every key resolved); scripts/peers/step_vs_trl.sh does."
        )
    return cfg


def r3_lr_lambda(cfg, total_steps):
    """`LrSchedule::lr_at` (crates/r3-train/src/algo/schedule.rs) divided by the peak."""
    o = cfg["optim"]
    warmup, decay, min_ratio = o["warmup_steps"], o["lr_decay"], o.get("min_lr_ratio", 0.1)

    def ratio(step):
        if step < warmup:
            return (step + 1) / warmup
        if decay == "constant":
            return 1.0
        span = max(max(total_steps - warmup - 1, 0), 1)
        done = min(step - warmup, span) / span
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * done))

    return ratio


def map_settings(cfg, n_steps, micro, bf16=False):
    """GRPOConfig keyword arguments from r3's config, the (r3 key, value, TRL setting) rows
    mapped, and the (r3 key, value, why) rows that cannot be."""
    r, a, o = cfg["rollout"], cfg["algo"], cfg["optim"]
    batch = r["prompts_per_step"] * r["group_size"]
    mini = a["mini_batches"]
    if batch % mini:
        sys.exit(f"algo.mini_batches = {mini} does not divide the batch of {batch} sequences")
    per_update = batch // mini
    micro = micro or per_update
    if micro <= 0 or per_update % micro:
        sys.exit(f"--micro-batch {micro} does not divide the {per_update} sequences of one update")
    accum = per_update // micro
    mapped, unmapped = [], []
    kw = dict(
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        # One generation of the whole step's batch, split into `mini` optimiser steps of
        # `accum` micro-batches; TRL computes old log-probs exactly when mini > 1, as r3 does.
        steps_per_generation=mini * accum,
        num_iterations=1,
        max_steps=n_steps * mini,
        num_generations=r["group_size"],
        max_completion_length=r["max_new_tokens"],
        temperature=float(r["temperature"]),
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=float(o["lr"]),
        adam_beta1=float(o["beta1"]),
        adam_beta2=float(o["beta2"]),
        adam_epsilon=float(o["adam_eps"]),
        weight_decay=float(o.get("weight_decay", 0.0)),
        max_grad_norm=float(o["grad_clip"]),
        seed=int(cfg["seed"]),
        scale_rewards="group" if a["adv_norm_by_std"] else "none",
        mask_truncated_completions=False,
        entropy_coef=float(a.get("entropy_coef", 0.0)),
    )
    mapped += [
        (
            "rollout.prompts_per_step x group_size",
            batch,
            f"generation batch {batch} (steps_per_generation {mini * accum} x per_device_train_batch_size {micro})",
        ),
        ("rollout.group_size", r["group_size"], "num_generations"),
        ("rollout.max_new_tokens", r["max_new_tokens"], "max_completion_length"),
        ("rollout.temperature", r["temperature"], "temperature (top_p 1.0, top_k 0 = off)"),
        (
            "algo.mini_batches",
            mini,
            f"{mini} optimiser step(s) per generation, gradient_accumulation_steps {accum}, num_iterations 1",
        ),
        ("optim.lr", o["lr"], "learning_rate"),
        (
            "optim.warmup_steps / lr_decay",
            f"{o['warmup_steps']} / {o['lr_decay']}",
            "r3's own schedule as a LambdaLR",
        ),
        (
            "optim.beta1 / beta2 / adam_eps",
            f"{o['beta1']} / {o['beta2']} / {o['adam_eps']}",
            "adam_beta1 / adam_beta2 / adam_epsilon",
        ),
        ("optim.grad_clip", o["grad_clip"], "max_grad_norm"),
        ("optim.weight_decay", o.get("weight_decay", 0.0), "weight_decay"),
        ("algo.adv_norm_by_std", a["adv_norm_by_std"], f"scale_rewards={kw['scale_rewards']}"),
        ("algo.entropy_coef", a.get("entropy_coef", 0.0), "entropy_coef"),
        ("seed", cfg["seed"], "seed"),
        ("(no KL, no reference model)", "-", "beta=0.0"),
    ]
    if a["loss"] == "ppo":
        kw.update(
            epsilon=float(a["eps_low"]), epsilon_high=float(a["eps_high"]), importance_sampling_level="token"
        )
        agg = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}.get(a["loss_agg"])
        if agg is None:
            sys.exit(
                f"algo.loss_agg = {a['loss_agg']!r} has no TRL loss_type (token-mean, seq-mean-token-mean)"
            )
        kw["loss_type"] = agg
        mapped += [
            ("algo.eps_low / eps_high", f"{a['eps_low']} / {a['eps_high']}", "epsilon / epsilon_high"),
            (
                "algo.loss_agg",
                a["loss_agg"],
                f"loss_type={agg} (tokens of the whole update batch)"
                if agg == "dapo"
                else f"loss_type={agg}",
            ),
        ]
    elif a["loss"] == "gspo":
        kw.update(
            epsilon=float(a["gspo_eps_low"]),
            epsilon_high=float(a["gspo_eps_high"]),
            importance_sampling_level="sequence",
            loss_type="grpo",
        )
        mapped.append(
            (
                "algo.loss = gspo",
                f"{a['gspo_eps_low']} / {a['gspo_eps_high']}",
                "importance_sampling_level=sequence, loss_type=grpo",
            )
        )
    else:
        sys.exit(f"algo.loss = {a['loss']!r} has no TRL counterpart here (ppo, gspo)")
    unmapped += [
        (
            "algo.router_replay",
            a.get("router_replay"),
            "TRL has no routing replay (HF generate and the update share one model in one dtype)",
        ),
        (
            "algo.dynamic_sampling",
            a.get("dynamic_sampling"),
            "TRL keeps every group (uniform-reward groups get advantage 0)",
        ),
        ("algo.adv_eps", a.get("adv_eps"), "TRL adds 1e-4 to the group std, fixed"),
        (
            "rollout.dtype",
            r["dtype"],
            "TRL without vLLM generates with the training model ("
            + ("f32 parameters under bf16 autocast" if bf16 else "f32")
            + " here)",
        ),
        ("rollout.router_dtype", r.get("router_dtype"), "no separate rollout engine"),
        (
            "train.dtype",
            cfg.get("train", {}).get("dtype"),
            "TRL trains with f32 parameters under bf16 autocast here (bf16=True)"
            if bf16
            else "TRL trains in f32 here (bf16=False)",
        ),
        ("algo.is_mode", a.get("is_mode"), "TRL's importance-sampling correction is for vLLM rollouts only"),
        (
            "sampling seeds",
            "mix_seed([seed, step, i, j])",
            "TRL samples from torch's global generator seeded once",
        ),
        (
            "optim.weight_decay parameter set",
            "matrices only",
            "HF Trainer: every parameter but biases and norm weights",
        ),
        (
            "data.shuffle",
            cfg.get("data", {}).get("shuffle"),
            "prompts are r3's first rows in file order (`r3 data show`), not its shuffled order",
        ),
        ("eval, checkpoint", "-", "not part of a step: off on both sides"),
    ]
    if a.get("is_mode", "none") != "none":
        sys.exit(f"algo.is_mode = {a['is_mode']!r}: TRL has no such correction without vLLM")
    return kw, mapped, unmapped


def r3_prompts(r3, cfg_path, n, max_len):
    rows = r3_rewards.r3_show(r3, ["--config", cfg_path], n, None)
    kept = [
        r for r in rows if r["token_ids"] is not None and (max_len == 0 or len(r["token_ids"]) <= max_len)
    ]
    return kept, len(rows) - len(kept)


def main():
    args = parse_args()
    cfg = load_config(args.config)

    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()

    kw, mapped, unmapped = map_settings(cfg, args.steps, args.micro_batch, args.bf16)
    r = cfg["rollout"]
    per_step = r["prompts_per_step"]
    model_dir = Path(cfg["model_dir"])

    print(
        f"versions: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, datasets {datasets.__version__}"
    )
    print(f"torch threads {torch.get_num_threads()} (cores {os.cpu_count()})")
    print("mapped (r3 -> TRL):")
    for key, val, to in mapped:
        print(f"  {key} = {val} -> {to}")
    print("not mapped:")
    for key, val, why in unmapped:
        print(f"  {key} = {val}: {why}")

    # The model and its tokenizer: the ids r3 uses for eos / pad name the special tokens.
    model_cfg = json.loads((model_dir / "config.json").read_text())
    if (model_dir / "tokenizer_config.json").exists():
        tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    eos = model_cfg.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tok.eos_token is None and eos_ids:
        tok.eos_token = tok.convert_ids_to_tokens(eos_ids[0])
    if tok.pad_token is None and model_cfg.get("pad_token_id") is not None:
        tok.pad_token = tok.convert_ids_to_tokens(model_cfg["pad_token_id"])
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"{model_dir}: transformers did not load it cleanly: {bad}")
    model.generation_config.eos_token_id = eos_ids
    print(
        f"model {model_dir.name}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"attention {model.config._attn_implementation}, experts "
        f"{getattr(model.config, '_experts_implementation', 'default')}, eos ids {eos_ids}"
    )

    # Prompts as r3 renders them, one batch per step, re-tokenised to exactly r3's ids.
    rows, dropped = r3_prompts(args.r3, args.config, per_step * args.steps, cfg["data"]["max_prompt_length"])
    if len(rows) < per_step * args.steps:
        sys.exit(
            f"r3 data show gave {len(rows)} usable prompts ({dropped} over max_prompt_length), need {per_step * args.steps}"
        )
    texts = [tok.decode(row["token_ids"], skip_special_tokens=False) for row in rows]
    for i, (text, row) in enumerate(zip(texts, rows)):
        ids = tok(text=text)["input_ids"]
        if ids != row["token_ids"]:
            sys.exit(f"prompt {i}: TRL's tokenizer gives {ids[:12]}..., r3 {row['token_ids'][:12]}...")
    lens = [len(row["token_ids"]) for row in rows]
    print(
        f"prompts: {len(rows)} from r3 ({dropped} dropped over max_prompt_length), tokens mean {statistics.mean(lens):.1f}, ids identical to r3's"
    )

    score = r3_rewards.reward_fn(cfg)
    checked, bad = r3_rewards.check_against_r3(args.r3, ["--config", args.config], 4, score)
    if bad:
        sys.exit(f"the Python reward differs from r3's on {len(bad)} of {checked}: {bad[:5]}")
    print(f"reward port: equal to r3's on {checked} (response, prompt) pairs")

    samples = []  # (prompt index, completion) of the first step, for the check after it

    def reward(prompts, completions, ground_truth, row_index, **_):
        if not samples:
            samples.extend(zip(row_index, completions))
        return [score(c, g) for c, g in zip(completions, ground_truth)]

    reward.__name__ = f"r3_{cfg.get('reward', {}).get('kind', 'arith')}"
    train = datasets.Dataset.from_dict(
        {
            "prompt": texts,
            "ground_truth": [row["ground_truth"] for row in rows],
            "row_index": list(range(len(rows))),
        }
    )

    times = {"rollout": [], "generate": [], "tokens": [], "rewards": []}

    class TimedGRPO(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            times["rollout"].append(time.perf_counter() - t)
            return out

        def _generate_single_turn(self, *a, **k):
            t = time.perf_counter()
            ids, logprobs = super()._generate_single_turn(*a, **k)
            times["generate"].append(time.perf_counter() - t)
            times["tokens"].append([len(x) for x in ids])
            return ids, logprobs

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                ratio = r3_lr_lambda(cfg, num_training_steps)
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, ratio)
                self._created_lr_scheduler = True
            return self.lr_scheduler

    ends = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            ends.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        grpo = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=args.bf16,
            fp16=False,
            activation_checkpointing=False,
            use_vllm=False,
            shuffle_dataset=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            dataloader_num_workers=0,
            log_completions=False,
            **kw,
        )
        trainer = TimedGRPO(
            model=model,
            reward_funcs=[reward],
            args=grpo,
            train_dataset=train,
            processing_class=tok,
            callbacks=[StepClock()],
        )
        print(
            f"TRL optimiser {grpo.optim}, loss_type {grpo.loss_type}, activation checkpointing "
            f"{grpo.activation_checkpointing}, bf16 {grpo.bf16}, eos {trainer.eos_token_ids}, pad {tok.pad_token_id}"
        )
        trainer.train()

    # The Python reward against r3's on real completions of the first step.
    mism = 0
    check = samples[: 2 * r["group_size"]]
    for idx, completion in check:
        got = r3_rewards.r3_show(args.r3, ["--config", args.config], idx + 1, completion)[idx]
        if abs(float(got["reward"]) - score(completion, rows[idx]["ground_truth"])) > 1e-6:
            mism += 1
    if mism:
        sys.exit(f"the Python reward differs from r3's on {mism} of {len(check)} real completions")
    print(f"reward port: equal to r3's on {len(check)} completions of step 1")

    mini = cfg["algo"]["mini_batches"]
    totals = [ends[(i + 1) * mini] - ends[i * mini] for i in range(args.steps)]
    steps = []
    print("step  total_s  rollout_s  generate_s  update_s  resp_len_mean")
    for i, total in enumerate(totals):
        toks = times["tokens"][i]
        s = dict(
            step=i + 1,
            total_s=total,
            rollout_s=times["rollout"][i],
            generate_s=times["generate"][i],
            update_s=total - times["rollout"][i],
            response_len_mean=statistics.mean(toks),
            tokens=sum(toks),
        )
        steps.append(s)
        print(
            f"{s['step']:>4}  {total:7.3f}  {s['rollout_s']:9.3f}  {s['generate_s']:10.3f}  {s['update_s']:8.3f}  {s['response_len_mean']:13.1f}"
        )
    later = steps[1:] or steps
    summary = {
        k: statistics.median(s[k] for s in later)
        for k in ("total_s", "rollout_s", "generate_s", "update_s", "response_len_mean")
    }
    span = f"steps 2..{len(steps)}" if len(steps) > 1 else "step 1"
    print(
        "TRL median over {span}: total {total_s:.3f} s (rollout {rollout_s:.3f} s, of which generate "
        "{generate_s:.3f} s; update {update_s:.3f} s), response length {response_len_mean:.1f}".format(
            span=span, **summary
        )
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                dict(
                    versions=dict(
                        torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__
                    ),
                    threads=torch.get_num_threads(),
                    mapped=mapped,
                    unmapped=unmapped,
                    steps=steps,
                    median_after_first=summary,
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
