"""r3's built-in rewards in Python, for the TRL side-by-side (`trl_grpo_step.py`).

A line-by-line port of `crates/r3-tasks/src/math_answer.rs` (the `math` reward: the last
`\\boxed{}`, else the text after the last `####`, else the last number; equal as exact
rationals or as normalised text) and of `crates/r3-tasks/src/reward.rs` (the `arith` reward:
the integer after the first `#`). It is trusted only because `check_against_r3` scores the
same responses with the `r3` binary (`r3 data show --response`) and the port, and the TRL
script refuses to run when one differs.
"""

import json
import subprocess

# `char::is_whitespace` (Unicode White_Space): Python's `str.isspace` also takes U+001C..1F.
RUST_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
DIGITS = frozenset("0123456789")
# `math_answer.rs`: longest digit string parsed as a number.
MAX_DIGITS = 30
# `reward.rs`: longest digit run accepted as an arithmetic answer.
MAX_ANSWER_DIGITS = 18
I128_MAX = 2**127 - 1


def rust_trim(s):
    """`str::trim`."""
    start, end = 0, len(s)
    while start < end and s[start] in RUST_WHITESPACE:
        start += 1
    while end > start and s[end - 1] in RUST_WHITESPACE:
        end -= 1
    return s[start:end]


def rust_trim_start(s):
    """`str::trim_start`."""
    i = 0
    while i < len(s) and s[i] in RUST_WHITESPACE:
        i += 1
    return s[i:]


def all_digits(s):
    return all(c in DIGITS for c in s)


def checked_mul(a, b):
    """`i128::checked_mul`: None on overflow."""
    p = a * b
    return p if -I128_MAX - 1 <= p <= I128_MAX else None


def rational(num, den):
    """`Rational::new`: lowest terms, positive denominator; None when `den` is 0."""
    if den == 0:
        return None
    from math import gcd

    g = max(gcd(abs(num), abs(den)), 1)
    sign = -1 if den < 0 else 1
    return (sign * num // g, sign * den // g)


def braced(s):
    """The content of a leading balanced `{...}` group and what follows, or None."""
    s = rust_trim_start(s)
    if not s.startswith("{"):
        return None
    inner = s[1:]
    depth = 1
    for i, c in enumerate(inner):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return inner[:i], inner[i + 1 :]
    return None


def last_boxed(text):
    b = text.rfind("\\boxed")
    f = text.rfind("\\fbox")
    if b < 0 and f < 0:
        return None
    if f >= 0 and (b < 0 or f > b):
        pos, length = f, 5
    else:
        pos, length = b, 6
    got = braced(text[pos + length :])
    return None if got is None else got[0]


def last_number(text):
    data = text.encode("utf-8")
    isdig = lambda b: 48 <= b <= 57
    end = len(data)
    while end > 0 and not isdig(data[end - 1]):
        end -= 1
    if end == 0:
        return None
    start = end
    while start > 0:
        c = data[start - 1]
        lead = 0
        for b in data[start:end]:
            if not isdig(b):
                break
            lead += 1
        grouping_comma = c == ord(",") and start >= 2 and isdig(data[start - 2]) and lead == 3
        decimal_point = c == ord(".") and start >= 2 and isdig(data[start - 2])
        if isdig(c) or grouping_comma or decimal_point:
            start -= 1
        else:
            break
    if start > 0 and data[start - 1] == ord("-"):
        start -= 1
    return data[start:end].decode("utf-8")


def extract_math_answer(text):
    """`extract_math_answer`: the final answer of a completion, or None."""
    b = last_boxed(text)
    if b is not None:
        return rust_trim(b)
    pos = text.rfind("####")
    if pos >= 0:
        rest = text[pos + 4 :]
        line = rest.split("\n", 1)[0] if rest else ""
        line = line.removesuffix("\r")
        line = rust_trim(line)
        if line:
            return line
    return last_number(text)


def valid_grouping(s):
    if "," not in s:
        return all_digits(s)
    groups = s.split(",")
    first_ok = 1 <= len(groups[0]) <= 3 and all_digits(groups[0])
    return first_ok and all(len(g) == 3 and all_digits(g) for g in groups[1:])


def parse_decimal(s):
    s = rust_trim(s)
    if s.startswith("-"):
        neg, body = True, rust_trim_start(s[1:])
    else:
        neg, body = False, (s.removeprefix("+"))
    int_part, _, frac_part = body.partition(".")
    if not valid_grouping(int_part) or not all_digits(frac_part):
        return None
    digits = int_part.replace(",", "")
    if not digits and not frac_part:
        return None
    if len(digits) + len(frac_part) > MAX_DIGITS:
        return None
    num = int(digits + frac_part)
    return rational(-num if neg else num, 10 ** len(frac_part))


def split_frac(t):
    for cmd in ("\\frac", "\\dfrac", "\\tfrac"):
        if t.startswith(cmd):
            a = braced(t[len(cmd) :])
            if a is None:
                return None
            b = braced(a[1])
            if b is None:
                return None
            return (a[0], b[0]) if b[1] == "" else None
    if "/" not in t:
        return None
    a, b = t.split("/", 1)
    return None if "/" in b else (a, b)


def parse_unsigned(t):
    parts = split_frac(t)
    if parts is None:
        return parse_decimal(t)
    n, d = parse_decimal(parts[0]), parse_decimal(parts[1])
    if n is None or d is None:
        return None
    num, den = checked_mul(n[0], d[1]), checked_mul(n[1], d[0])
    if num is None or den is None:
        return None
    return rational(num, den)


def strip_wrappers(s):
    t = s.replace("\\!", "").replace("\\,", "").replace("\\$", "")
    t = "".join(c for c in t if c not in RUST_WHITESPACE and c != "$")
    if t.startswith("\\text"):
        got = braced(t[5:])
        if got is not None:
            t = got[0] + got[1]
    return t.lstrip("=")


def parse_number(s):
    t = strip_wrappers(s).rstrip(".")
    if t.startswith("-"):
        rest = t[1:]
        if rest.startswith("-"):
            return None
        r = parse_unsigned(rest)
        return None if r is None else (-r[0], r[1])
    return parse_unsigned(t)


def normalise_text(s):
    return strip_wrappers(s).lower()


def math_equal(answer, truth):
    a, b = parse_number(answer), parse_number(truth)
    if a is not None and b is not None:
        return a == b
    return normalise_text(answer) == normalise_text(truth)


def math_reward(response, ground_truth):
    """`math_reward`: 1.0 when the extracted answer equals the ground truth, else 0.0."""
    answer = extract_math_answer(response)
    return 1.0 if answer is not None and math_equal(answer, ground_truth) else 0.0


def extract_arith_answer(completion):
    """`extract_answer`: the integer right after the first `#`, or None."""
    if "#" not in completion:
        return None
    after = completion.split("#", 1)[1]
    negative = after.startswith("-")
    body = after[1:] if negative else after
    n = 0
    while n < len(body) and body[n] in DIGITS:
        n += 1
    digits = body[:n]
    if not digits or len(digits) > MAX_ANSWER_DIGITS:
        return None
    value = int(digits)
    return -value if negative else value


def arith_reward(response, ground_truth, format_reward):
    """`arith_reward`: 1.0 correct, `format_reward` wrong, 0.0 without an answer."""
    expected = int(rust_trim(ground_truth))
    got = extract_arith_answer(response)
    if got is None:
        return 0.0
    return 1.0 if got == expected else float(format_reward)


def reward_fn(cfg):
    """The reward of a resolved r3 config as `f(response, ground_truth) -> float`, or raises
    `ValueError` naming what this port does not cover."""
    spec = cfg.get("reward", {})
    funcs = spec.get("funcs") or [{"kind": spec.get("kind", "arith"), "weight": 1.0}]
    format_reward = float(cfg.get("task", {}).get("format_reward", 0.0))
    parts = []
    for f in funcs:
        kind, weight = f.get("kind", "arith"), float(f.get("weight", 1.0))
        if kind == "math":
            parts.append((math_reward, weight))
        elif kind == "arith":
            parts.append((lambda r, g: arith_reward(r, g, format_reward), weight))
        elif kind == "exact":
            parts.append((lambda r, g: 1.0 if rust_trim(r) == rust_trim(g) else 0.0, weight))
        else:
            raise ValueError(f"reward kind {kind!r} has no Python port (math, arith, exact)")

    def score(response, ground_truth):
        return sum(w * f(response, ground_truth) for f, w in parts)

    return score


# Responses that take each branch of the two rules (boxed, fbox, ####, last number, commas,
# decimals, fractions, \frac, $, \text{}, signs, no answer; `#N` with signs and junk).
CHECK_RESPONSES = [
    "",
    "no answer here",
    "#### 2",
    "so 2 boxes. #### 2.0",
    "#### $1,234",
    "#### 1,234.50",
    "#### 12,34",
    "#### -3",
    "#### --3",
    "#### 3/1",
    "#### \\frac{6}{3}",
    "#### \\dfrac{4}{2}",
    "#### \\text{2}",
    "#### 2 boxes",
    "####\n2",
    "The answer is \\boxed{2}. #### 5",
    "\\boxed{ 2 } and \\fbox{3}",
    "\\fbox{3} and \\boxed{2}",
    "\\boxed{2",
    "first 4, then 2.",
    "total 1,000,002 - 1,000,000 = 2",
    "it is 2.5 or 2.",
    "x = -2",
    "30",
    "#30",
    "#-30",
    "#30;#31",
    "6*5=30#30",
    "6*5=30#31",
    "6*5=30#",
    "#0030",
    "#9999999999999999999",
    "# 30",
    "24",
    "#24",
]


def check_against_r3(r3, config_args, n_rows, score):
    """Scores `CHECK_RESPONSES` (and the first rows' own ground truths as responses) against
    the first `n_rows` prompts with `r3 data show` and with the port `score`; returns
    (checked, mismatches) where each mismatch is (response, ground_truth, r3, port)."""
    responses = list(CHECK_RESPONSES)
    rows = r3_show(r3, config_args, n_rows, None)
    for row in rows:
        gt = row["ground_truth"]
        responses += [gt, f"#### {gt}", f"#{gt}", f"\\boxed{{{gt}}}"]
    checked, bad = 0, []
    for response in responses:
        for row in r3_show(r3, config_args, n_rows, response):
            port = score(response, row["ground_truth"])
            checked += 1
            if abs(port - float(row["reward"])) > 1e-6:
                bad.append((response, row["ground_truth"], row["reward"], port))
    return checked, bad


def r3_show(r3, config_args, n_rows, response):
    """The rows of `r3 data show` (prompt text, token ids, ground truth; the reward of
    `response` when given) as dicts."""
    cmd = [r3, "data", "show", *config_args, "--n", str(n_rows)]
    if response is not None:
        cmd += ["--response", response]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def main():
    """`python3 scripts/peers/r3_rewards.py R3 [CONFIG ...]`: checks the port against the r3
    binary on each config's first rows (default: the built-in task and gsm8k-style)."""
    import sys
    import tomllib

    if len(sys.argv) < 2:
        sys.exit("usage: r3_rewards.py R3_BINARY [CONFIG.toml ...]")
    r3, configs = sys.argv[1], sys.argv[2:] or [None, "configs/gsm8k-style.toml"]
    failed = False
    for path in configs:
        if path is None:
            cfg, args = {"reward": {"kind": "arith"}}, []
        else:
            with open(path, "rb") as f:
                cfg, args = tomllib.load(f), ["--config", path]
        checked, bad = check_against_r3(r3, args, 4, reward_fn(cfg))
        print(f"{path or 'default'}: {checked} (response, prompt) pairs, {len(bad)} differ {bad[:5]}")
        failed |= bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
