"""End to end against the real server process (default model): the OpenAI API through
the `openai` client, SGLang's /generate with raw HTTP, greedy parity with the reference,
prefix caching, and the 4xx classes of bad input."""

from __future__ import annotations

import itertools
import json
import math
import urllib.request

import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="none", timeout=300, max_retries=0
    )


@pytest.fixture(scope="module")
def model(client):
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def post(server, path, body, timeout_s=300.0):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.base_url + path, data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize(
    "names", [("tips", "raw_fox"), pytest.param(None, marks=pytest.mark.heavy, id="all")]
)
def test_greedy_generate_equals_the_reference_ids(server, reference, names):
    """Reference prompts in one batched /generate (they decode side by side): a chat
    templated and a raw one in the default tier, every one in the heavy tier."""
    prompts = [p for p in reference["prompts"] if names is None or p["name"] in names]
    assert len(prompts) == (len(names) if names else len(reference["prompts"]))
    status, body = post(server, "/generate", {
        "input_ids": [p["input_ids"] for p in prompts],
        "sampling_params": {"temperature": 0, "max_new_tokens": 32},
    }, timeout_s=540)  # fmt: skip
    assert status == 200, body
    outs = json.loads(body)
    assert len(outs) == len(prompts)
    for p, out in zip(prompts, outs, strict=True):
        assert out["output_ids"] == p["output_ids"], p["name"]
        # the reference text was decoded with special tokens; the API skips them
        assert out["text"] == p["output_text"].replace("<|im_end|>", ""), p["name"]
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(p["input_ids"])
        assert meta["completion_tokens"] == len(p["output_ids"])
        assert meta["finish_reason"]["type"] == ("stop" if p["stopped_on_eos"] else "length")


def test_chat_applies_the_template_and_matches_the_reference(client, model, reference):
    p = next(p for p in reference["prompts"] if p["name"] == "capital")  # stops at eos
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": p["prompt"]}], temperature=0,
        max_tokens=32,
    )  # fmt: skip
    assert r.choices[0].message.content == p["output_text"].replace("<|im_end|>", "")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p["input_ids"]),
                                                                  len(p["output_ids"]))  # fmt: skip


def test_completion_stream_equals_the_non_streamed_text(client, model):
    kw = dict(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )


def test_chat_stream_starts_with_the_role_and_ends_once(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
        temperature=0, stream=True,
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_logprobs_and_top_logprobs(client, model):
    r = client.completions.create(model=model, prompt="One, two, three,", max_tokens=5,
                                  temperature=0, logprobs=3)  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert max(top.values()) == pytest.approx(sampled, abs=1e-4)  # greedy takes the top one
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_n_choices_with_a_seed_are_reproducible(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=3, temperature=1.0, n=3, seed=42)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert 3 <= a.usage.completion_tokens <= 9


def test_generate_streaming_framing(server):
    body = json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                       "stream": True}).encode()  # fmt: skip
    req = urllib.request.Request(server.base_url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    texts = [p["text"] for p in payloads]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative text
    assert payloads[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(payloads[-1]["output_ids"]) == 6


def test_a_repeated_prompt_reports_cached_tokens(client, model):
    prompt = "Here is a long shared preamble about caching. " * 8 + "Now answer:"
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens - 1 >= cached >= 64, cached  # all but the last token
    assert second.choices[0].text == first.choices[0].text


def test_echoed_prompt_logprobs_do_not_depend_on_the_prefix_cache(client, model):
    """A prompt scored with echo + logprobs is computed in full every time (a cached
    prefix would leave its tokens unscored), so a repeat reports the same logprobs."""
    kw = dict(model=model, prompt="Zebras graze near the river every morning", echo=True,
              logprobs=1, max_tokens=1, temperature=0)  # fmt: skip
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    a, b = first.choices[0].logprobs.token_logprobs, second.choices[0].logprobs.token_logprobs
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert a[0] is None and b[0] is None and len(a) == len(b) == first.usage.total_tokens
    assert b[1:] == pytest.approx(a[1:], abs=1e-4)
    plain = client.completions.create(model=model, prompt=kw["prompt"], max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1


def test_a_prompt_is_scored_without_generating(client, model, server):
    """echo + logprobs with max_tokens 0 (how evaluation harnesses score a text), and
    /generate with max_new_tokens 0: the prompt is computed and scored, nothing sampled."""
    kw = dict(model=model, prompt="The quick brown fox jumps", echo=True, logprobs=1,
              temperature=0)  # fmt: skip
    scored = client.completions.create(max_tokens=0, **kw)
    ref = client.completions.create(max_tokens=1, **kw)
    (c,) = scored.choices
    n = scored.usage.prompt_tokens
    assert c.text == kw["prompt"] and scored.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == n
    assert c.logprobs.token_logprobs[1:] == pytest.approx(
        ref.choices[0].logprobs.token_logprobs[1:n], abs=1e-4
    )
    # each scored prompt token's top-1, as a harness checks whether a text is greedy
    tops = c.logprobs.top_logprobs
    assert tops[0] is None and len(tops) == n and all(len(t) == 1 for t in tops[1:])
    for tok, lp, top in zip(c.logprobs.tokens[1:], c.logprobs.token_logprobs[1:], tops[1:]):
        ((best, best_lp),) = top.items()
        assert best_lp >= lp - 1e-5 and (best == tok) == (best_lp == pytest.approx(lp, abs=1e-5))
    status, raw = post(server, "/generate", {
        "text": kw["prompt"], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 2})  # fmt: skip
    meta = json.loads(raw)["meta_info"]
    assert status == 200 and meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    got = [lp for lp, _, _ in meta["input_token_logprobs"]]
    assert got[0] is None and got[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-4)
    in_tops = meta["input_top_logprobs"]
    assert in_tops[0] is None and all(len(t) == 2 for t in in_tops[1:])
    assert [t[0][0] for t in in_tops[1:]] == pytest.approx([max(t.values()) for t in tops[1:]])


def test_token_ids_logprob_reports_the_asked_ids_at_every_position(server):
    """/generate's token_ids_logprob: each output and scored prompt position gives the
    asked ids' logprobs, in the order asked, from the distribution the chosen and top
    logprobs come from (so an asked id equal to the chosen token has its logprob)."""
    text = "The capital of France is"
    status, raw = post(server, "/generate", {"text": text, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 4, "temperature": 0}})  # fmt: skip
    first = json.loads(raw)["output_ids"][0]
    status, raw = post(server, "/generate", {
        "text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
        "token_ids_logprob": [first, 7]})  # fmt: skip
    assert status == 200, raw
    meta = json.loads(raw)["meta_info"]
    outs, asked = meta["output_token_logprobs"], meta["output_token_ids_logprobs"]
    assert len(asked) == len(outs) == 4 and all(len(t) == 1 for t in meta["output_top_logprobs"])
    assert [[e[1] for e in pos] for pos in asked] == [[first, 7]] * 4
    assert asked[0][0][0] == pytest.approx(outs[0][0], abs=1e-6)  # the chosen token itself
    assert all(e[0] <= meta["output_top_logprobs"][i][0][0] + 1e-6
               for i, pos in enumerate(asked) for e in pos)  # fmt: skip
    ins, in_asked = meta["input_token_logprobs"], meta["input_token_ids_logprobs"]
    assert in_asked[0] is None and len(in_asked) == len(ins) == meta["prompt_tokens"]
    assert all([e[1] for e in pos] == [first, 7] for pos in in_asked[1:])
    # a prompt token asked for by id: its logprob at its own position
    status, raw = post(server, "/generate", {
        "input_ids": [5, 6, 9, 11], "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0, "token_ids_logprob": [[9]]})  # fmt: skip
    meta = json.loads(raw)["meta_info"]
    assert meta["output_top_logprobs"] == [] and "input_top_logprobs" not in meta
    assert meta["input_token_ids_logprobs"][2][0][0] == pytest.approx(
        meta["input_token_logprobs"][2][0], abs=1e-6
    )
    for bad in ([-1], ["x"], [[1], [2]], [10**9]):
        status, raw = post(server, "/generate", {"text": "x", "return_logprob": True,
                                                 "token_ids_logprob": bad})  # fmt: skip
        assert status == 400 and "token_ids_logprob" in json.loads(raw)["error"]["message"], raw


def test_score_gives_each_items_label_probabilities(server, model):
    """/v1/score: each item's label probabilities are those /generate reports for the
    joined prompt; apply_softmax renormalizes over the labels; ids work as text does."""
    query, items = "The capital of France is", [" Paris", " a city", " London"]
    labels = [5, 11, 42]
    status, raw = post(server, "/v1/score", {"query": query, "items": items,
                       "label_token_ids": labels, "model": model})  # fmt: skip
    assert status == 200, raw
    out = json.loads(raw)
    assert out["object"] == "scoring" and len(out["scores"]) == 3
    assert out["usage"]["prompt_tokens"] > 3 * 5
    for item, got in zip(items, out["scores"], strict=True):
        status, raw = post(server, "/generate", {"text": query + item, "return_logprob": True,
                           "token_ids_logprob": labels, "sampling_params": {
                               "max_new_tokens": 1, "temperature": 0}})  # fmt: skip
        want = [
            math.exp(e[0]) for e in json.loads(raw)["meta_info"]["output_token_ids_logprobs"][0]
        ]
        assert got == pytest.approx(want, rel=1e-4) and all(0 < p < 1 for p in got)
    status, raw = post(server, "/v1/score", {"query": query, "items": items,
                       "label_token_ids": labels, "apply_softmax": True})  # fmt: skip
    soft = json.loads(raw)["scores"]
    for s, p in zip(soft, out["scores"], strict=True):
        assert sum(s) == pytest.approx(1.0) and s == pytest.approx(
            [x / sum(p) for x in p], rel=1e-4
        )
    status, raw = post(server, "/v1/score", {"query": [5, 6, 9], "items": [[11], [12, 13]],
                       "label_token_ids": [7], "item_first": True})  # fmt: skip
    got = [p for (p,) in json.loads(raw)["scores"]]
    for ids, p in zip([[11, 5, 6, 9], [12, 13, 5, 6, 9]], got, strict=True):
        status, raw = post(server, "/generate", {"input_ids": ids, "return_logprob": True,
                           "token_ids_logprob": [7], "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
        ((lp, _, _),) = json.loads(raw)["meta_info"]["output_token_ids_logprobs"][0]
        assert p == pytest.approx(math.exp(lp), rel=1e-4)
    for bad, param in [({"query": "x"}, "items"), ({"query": "x", "items": [[1]]}, "items"),
                       ({"query": [1], "items": ["y"]}, "items"),
                       ({"query": "x", "items": "y", "label_token_ids": []}, "label_token_ids"),
                       ({"query": "x", "items": "y", "label_token_ids": [10**9]}, "token_ids_logprob")]:  # fmt: skip
        status, raw = post(server, "/v1/score", {"label_token_ids": [1], **bad})
        assert status == 400 and param in raw.decode(), raw
    status, raw = post(server, "/v1/score", {"query": "x", "items": "y", "label_token_ids": [1],
                                             "model": "no-such-model"})  # fmt: skip
    assert status == 404


def test_a_burst_with_one_preamble_computes_it_once(client, model):
    """Requests sent together that share a long preamble (and nothing cached yet): the
    first computes it, the others wait for it and report it as cached."""
    from concurrent.futures import ThreadPoolExecutor

    preamble = "A burst preamble on how tides follow the moon, told at length. " * 10 + "\n"
    prompts = [preamble + f"Question {i}: name a color." for i in range(4)]

    def ask(prompt):
        return client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                         temperature=0)  # fmt: skip

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(ask, prompts))
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in results)
    assert min(r.usage.prompt_tokens for r in results) > 100
    assert cached[0] == 0 and all(c >= 100 for c in cached[1:]), cached


def test_stop_regex_cuts_the_output_where_its_first_match_starts(client, model, server):
    """A regex built from the greedy output's own words stops the same generation
    there, through the openai client (extra_body, streamed and not) and /generate."""
    import re

    kw = dict(model=model, prompt="The quick brown fox jumps over the lazy dog. Once upon a time,",
              max_tokens=32, temperature=0)  # fmt: skip
    full = client.completions.create(**kw).choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", full)
    assert len(words) >= 4, full
    pattern = rf"{words[2]}\W+[a-z]+"
    first = re.search(pattern, full)
    r = client.completions.create(**kw, extra_body={"stop_regex": pattern})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (full[: first.start()], "stop")
    chunks = list(
        client.completions.create(**kw, stream=True, extra_body={"stop_regex": [pattern]})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[: first.start()]
    status, body = post(server, "/generate", {"text": kw["prompt"], "sampling_params": {
        "temperature": 0, "max_new_tokens": 32, "stop_regex": pattern, "no_stop_trim": True}})  # fmt: skip
    assert status == 200, body
    out = json.loads(body)  # kept up to where a match first completed (not re's greedy end)
    end = next(
        e for e in range(first.start(), len(full)) if re.fullmatch(pattern, full[first.start() : e])
    )
    assert out["text"] == full[:end]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", {"prompt": "x", "stop_regex": "a(?=b)"}, 400, "lookaround"),
        ("/generate", {"text": "x", "sampling_params": {"stop_regex": [""]}}, 400, "stop_regex"),
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 100000}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "no-such-model"),
        ("/v1/completions", {"prompt": "word " * 9000, "max_tokens": 4}, 400, "context"),
        ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
        ("/generate", {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 1}}, 400, ""),
        ("/generate", {"sampling_params": {}}, 400, ""),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_with_an_error_body(server, path, body, status, fragment):
    got, raw = post(server, path, body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert err["message"] and fragment.lower() in json.dumps(err).lower()


def test_the_server_is_healthy_after_all_that(server):
    assert server.get("/health")[0] == 200
    status, body = server.get("/get_server_info")
    info = json.loads(body)
    assert status == 200 and info["max_prefill_tokens"] == 16384
    ex = info["executor"]  # what the executor resolved from the arguments
    assert (ex["device"], ex["attention_backend"], ex["cuda_graph_max_bs"]) == ("cpu", "torch", 0)
    assert info["max_total_num_tokens"] == ex["num_pages"] * ex["page_size"]
    if server.mode != "attached":  # the config file's values reached the server
        assert (info["max_total_tokens"], info["heartbeat_interval"]) == (32768, 0.5)
