"""The `openai` Python client against r3 serve: models.list, completions (stop strings,
penalties at 0.0, best_of=1, logit_bias {}, suffix '', logprobs > 0 with text_offset, echo,
token-by-token streaming) and chat completions (plain, logprobs / top_logprobs, streaming).

Usage: client_openai.py --url http://HOST:PORT [--client NAME]
"""

import argparse

from openai import OpenAI

from report import attempt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--client", default="openai")
    a = ap.parse_args()
    client = OpenAI(base_url=a.url + "/v1", api_key="none")
    c = a.client
    box = {}

    def models():
        m = client.models.list()
        box["name"] = m.data[0].id
        return len(m.data) == 1, str(m)

    attempt(c, "models.list", models)
    name = box.get("name", "model")

    def neutral_and_stop():
        r = client.completions.create(
            model=name, prompt="12+7=", max_tokens=12, temperature=0, stop=["#"],
            presence_penalty=0.0, frequency_penalty=0.0, best_of=1, logit_bias={}, suffix="",
            logprobs=2)
        ch = r.choices[0]
        lp = ch.logprobs
        ok = ("#" not in ch.text and len(lp.text_offset) == len(lp.tokens)
              and all(len(t) <= 2 for t in lp.top_logprobs) and r.usage.completion_tokens > 0)
        return ok, f"{ch.text!r} {lp}"

    attempt(c, "completions stop + neutral penalties/best_of/logit_bias/suffix + logprobs=2",
            neutral_and_stop)

    def stream():
        kw = dict(model=name, prompt="12+7=", max_tokens=24, temperature=1.0, seed=3,
                  extra_body={"ignore_eos": True})
        plain = client.completions.create(**kw).choices[0].text
        parts = [ev.choices[0].text for ev in client.completions.create(stream=True, **kw)]
        return "".join(parts) == plain and len(parts) > 2, f"{len(parts)} chunks {parts!r} vs {plain!r}"

    attempt(c, "completions stream (token by token, adds up)", stream)

    def echo():
        e = client.completions.create(model=name, prompt="12+7=", max_tokens=1, temperature=0,
                                      echo=True, logprobs=1)
        lp = e.choices[0].logprobs
        return (e.choices[0].text.startswith("12+7=") and lp.token_logprobs[0] is None
                and all(v is not None for v in lp.token_logprobs[1:])), str(lp)[:200]

    attempt(c, "completions echo + logprobs", echo)

    msgs = [{"role": "system", "content": "3+4=7#"}, {"role": "user", "content": "12+7="}]

    def chat():
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
        m = r.choices[0].message
        return m.role == "assistant" and isinstance(m.content, str) and r.usage.completion_tokens > 0, str(r)

    attempt(c, "chat.completions", chat)

    def chat_logprobs():
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        ok = (len(content) == r.usage.completion_tokens
              and all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
                      and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5 for t in content))
        return ok, str(r.choices[0].logprobs)[:300]

    attempt(c, "chat.completions logprobs=True top_logprobs=3", chat_logprobs)

    def chat_stream():
        kw = dict(model=name, messages=msgs, max_tokens=20, temperature=1.0, seed=5,
                  extra_body={"ignore_eos": True})
        plain = client.chat.completions.create(**kw).choices[0].message.content
        evs = list(client.chat.completions.create(stream=True, **kw))
        parts = [e.choices[0].delta.content or "" for e in evs]
        finish = evs[-1].choices[0].finish_reason
        return ("".join(parts) == plain and len(evs) > 3 and finish == "length",
                f"{len(evs)} chunks, finish {finish}, {parts!r} vs {plain!r}")

    attempt(c, "chat.completions stream (token by token, adds up)", chat_stream)


if __name__ == "__main__":
    main()
