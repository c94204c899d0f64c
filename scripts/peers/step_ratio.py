#!/usr/bin/env python3
"""The summary of scripts/peers/step_vs_trl.sh: per round the median step time of r3 (from
its metrics.jsonl: `time.rollout_s + time.old_logp_s + time.update_s + time.sync_s`, the
step as `throughput.tokens_per_s` counts it; the share of r3's wall clock outside those phases
is printed beside it) and of TRL (trl_grpo_step.py's JSON), each over
the steps after the first, and the ratio TRL / r3 of the medians over all rounds.

    python3 scripts/peers/step_ratio.py OUT_DIR/NAME

OUT_DIR/NAME holds r3-roundK/metrics.jsonl, trl-roundK.json and load-roundK.txt files.
"""

import json
import statistics
import sys
from pathlib import Path

R3_PHASES = ("time.rollout_s", "time.old_logp_s", "time.update_s", "time.sync_s")


def r3_steps(metrics):
    steps = []
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        steps.append(
            dict(
                total_s=sum(m.get(k, 0.0) for k in R3_PHASES),
                rollout_s=m["time.rollout_s"],
                update_s=m["time.old_logp_s"] + m["time.update_s"] + m["time.sync_s"],
                response_len_mean=m["response_len_mean"],
            )
        )
    return steps


def r3_untimed(log, steps):
    """The share of `r3 train`'s step loop (`wall_s` of its summary line: every step, the
    first included, without loading) that its phase times do not cover."""
    if not log.exists():
        return None
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{") and '"wall_s"' in line:
            wall = json.loads(line)["wall_s"]
            return (wall - sum(s["total_s"] for s in steps)) / wall if wall > 0 else None
    return None


def after_first(steps):
    return steps[1:] or steps


def med(steps, key):
    return statistics.median(s[key] for s in after_first(steps))


def main():
    d = Path(sys.argv[1])
    rounds = sorted(p.name.removeprefix("r3-round") for p in d.glob("r3-round*") if p.is_dir())
    all_r3, all_trl = [], []
    print(f"{d.name}: medians over the steps after the first of each run (s)")
    print(
        "round  load(r3 / TRL)         r3 step (rollout + update)  len   TRL step (rollout [generate] + update)  len   TRL/r3"
    )
    for k in rounds:
        metrics = d / f"r3-round{k}" / "metrics.jsonl"
        trl_json = d / f"trl-round{k}.json"
        if not metrics.exists() or not trl_json.exists():
            print(f"{k:>5}  incomplete (no {metrics.name if not metrics.exists() else trl_json.name})")
            continue
        r3 = r3_steps(metrics)
        trl = json.loads(trl_json.read_text())["steps"]
        untimed = r3_untimed(d / f"r3-round{k}.log", r3)
        all_r3 += after_first(r3)
        all_trl += after_first(trl)
        load = (
            (d / f"load-round{k}.txt").read_text().split("\n")
            if (d / f"load-round{k}.txt").exists()
            else ["?", "?"]
        )
        r3_load, trl_load = (load + ["?", "?"])[:2]
        print(
            f"{k:>5}  {r3_load.split(' ')[0]:>5} / {trl_load.split(' ')[0]:<5}        "
            f"{med(r3, 'total_s'):6.3f} ({med(r3, 'rollout_s'):.3f} + {med(r3, 'update_s'):.3f})"
            f"   {med(r3, 'response_len_mean'):5.1f} "
            f"  {med(trl, 'total_s'):6.3f} ({med(trl, 'rollout_s'):.3f} [{med(trl, 'generate_s'):.3f}] + {med(trl, 'update_s'):.3f})"
            f"        {med(trl, 'response_len_mean'):5.1f}  {med(trl, 'total_s') / med(r3, 'total_s'):5.2f}x"
        )
        if untimed is not None:
            print(f"       r3 wall clock outside the timed phases: {untimed:.2%} of the run's steps")
    if not all_r3 or not all_trl:
        sys.exit("no complete round")
    r3_med = statistics.median(s["total_s"] for s in all_r3)
    trl_med = statistics.median(s["total_s"] for s in all_trl)
    r3_roll = statistics.median(s["rollout_s"] for s in all_r3)
    trl_roll = statistics.median(s["rollout_s"] for s in all_trl)
    r3_upd = statistics.median(s["update_s"] for s in all_r3)
    trl_upd = statistics.median(s["update_s"] for s in all_trl)
    print(
        f"{d.name}: r3 {r3_med:.3f} s/step ({len(all_r3)} steps), TRL {trl_med:.3f} s/step "
        f"({len(all_trl)} steps): r3 is {trl_med / r3_med:.2f}x TRL's speed "
        f"(rollout {trl_roll / r3_roll:.2f}x, update {trl_upd / r3_upd:.2f}x)"
    )


if __name__ == "__main__":
    main()
