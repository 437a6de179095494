#!/usr/bin/env python3
"""The official `openai` client against a running `flashplan serve`: chat and completion, streamed and not;
the streamed text equals the non-streamed text, and `draft: false` gives the same token_sha.

    scripts/openai_client_test.py --base-url http://127.0.0.1:8000/v1
"""
import argparse
import sys

import openai


def extra(obj, key):
    """A non-standard response field (pydantic keeps unknown fields in model_extra)."""
    return (getattr(obj, "model_extra", None) or {}).get(key)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="none")
    model = client.models.list().data[0].id
    print(f"model {model}")
    failures = 0

    def check(name, ok, detail=""):
        nonlocal failures
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
        failures += 0 if ok else 1

    prompt = 'def read_lines(path):\n    """Return the lines of a file."""\n'
    common = dict(model=model, max_tokens=a.max_tokens, temperature=0)

    # Completions.
    whole = client.completions.create(prompt=prompt, **common)
    text = whole.choices[0].text
    sha = extra(whole, "flashplan")["token_sha"]
    pieces, sha_s, usage = [], None, None
    for chunk in client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **common
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text or "")
        fp = extra(chunk, "flashplan")
        if fp:
            sha_s = fp["token_sha"]
        if chunk.usage:
            usage = chunk.usage
    check("completion: streamed text == non-streamed text", "".join(pieces) == text, repr(text[:40]))
    check("completion: streamed token_sha", sha_s == sha)
    check(
        "completion: usage in the stream",
        usage is not None and usage.completion_tokens == whole.usage.completion_tokens,
    )
    plain = client.completions.create(prompt=prompt, extra_body={"draft": False}, **common)
    check("completion: draft false gives the same token_sha", extra(plain, "flashplan")["token_sha"] == sha)

    # Chat.
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    cw = client.chat.completions.create(messages=messages, **common)
    ctext = cw.choices[0].message.content
    csha = extra(cw, "flashplan")["token_sha"]
    cpieces, csha_s, with_usage = [], None, 0
    for chunk in client.chat.completions.create(messages=messages, stream=True, **common):
        # model_fields_set holds the keys the chunk's JSON had (a null one included).
        with_usage += "usage" in chunk.model_fields_set
        if chunk.choices and chunk.choices[0].delta.content:
            cpieces.append(chunk.choices[0].delta.content)
        fp = extra(chunk, "flashplan")
        if fp:
            csha_s = fp["token_sha"]
    check("chat: streamed text == non-streamed text", "".join(cpieces) == ctext, repr(ctext[:40]))
    check("chat: streamed token_sha", csha_s == csha)
    check("chat: without include_usage no chunk has a usage key", with_usage == 0, f"{with_usage} chunks had one")
    # With include_usage: the usage chunk (no choices) comes last and carries the flashplan block, once.
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    blocks = [c for c in chunks if extra(c, "flashplan")]
    last = chunks[-1] if chunks else None
    utext = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check("chat: include_usage streams the same text", utext == ctext, repr(utext[:40]))
    check(
        "chat: include_usage ends with one usage chunk",
        last is not None
        and not last.choices
        and last.usage is not None
        and last.usage.completion_tokens == cw.usage.completion_tokens
        and all(c.usage is None for c in chunks[:-1]),
        "" if last is None else f"{len(chunks)} chunks; the last: {len(last.choices)} choices, usage {last.usage}",
    )
    check(
        "chat: the flashplan block comes once, in the usage chunk",
        len(blocks) == 1 and blocks[0] is last and extra(last, "flashplan")["token_sha"] == csha,
        f"{len(blocks)} chunks with the block",
    )
    cplain = client.chat.completions.create(messages=messages, extra_body={"draft": False}, **common)
    check("chat: draft false gives the same token_sha", extra(cplain, "flashplan")["token_sha"] == csha)

    # A bad request is a 400 the client raises as BadRequestError.
    try:
        client.completions.create(prompt=prompt, model=model, max_tokens=4, temperature=-1)
        check("bad request raises BadRequestError", False)
    except openai.BadRequestError as e:
        check("bad request raises BadRequestError", "temperature" in str(e))

    print("all passed" if failures == 0 else f"{failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
