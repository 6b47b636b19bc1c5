"""TokenizerCore on the real SmolLM2 tokenizer: inbound checks, chat template, deltas,
stop strings and stop tokens, queries."""

from __future__ import annotations

import math

import msgspec
import pytest

from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.actors.tokenizer.core import TokenizerCore
from shunter.bus.messages import (
    AbortRequest,
    ChatMessage,
    DetokenizeQuery,
    DetokenizeReply,
    GenerateRequest,
    RequestFailed,
    RequestOutput,
    SamplingParams,
    TextDeltas,
    Tokenized,
    TokenizeQuery,
    TokenizeReply,
    TokensOut,
    TopLogprob,
)


@pytest.fixture
def core(codec):
    return TokenizerCore(codec, TokenizerConfig(context_len=256))


def _gen(rid="r", **kw):
    sampling = SamplingParams(**kw.pop("sampling", {}))
    return GenerateRequest(rid, sampling, **kw)


def _tokens(rid, ids, step=0, **kw):
    return TokensOut(step, [RequestOutput(rid, list(ids), **kw)])


def _feed(core, rid, ids, finish_at_end=None, matched=None):
    """Send ids one per step; return (all deltas, all other messages)."""
    deltas, other = [], []
    for k, i in enumerate(ids):
        last = k == len(ids) - 1
        fr = finish_at_end if last else None
        outs = core.handle(
            _tokens(rid, [i], k, finish_reason=fr, matched_stop=matched if last else None)
        )
        for m in outs:
            (deltas.extend(m.deltas) if isinstance(m, TextDeltas) else other.append(m))
    return deltas, other


def test_chat_template_matches_reference(codec, reference):
    core = TokenizerCore(codec, TokenizerConfig())
    for p in reference["prompts"]:
        if not p["chat_templated"]:
            continue
        msgs = [ChatMessage("user", p["prompt"])]
        assert codec.render_chat(msgs, add_generation_prompt=True) == p["templated_text"]
        (tok,) = core.handle(_gen(p["name"], messages=msgs))
        assert isinstance(tok, Tokenized)
        assert tok.input_ids == p["input_ids"], p["name"]


def test_reference_output_ids_detokenize_to_reference_text(codec, reference):
    core = TokenizerCore(codec, TokenizerConfig())
    p = reference["prompts"][0]
    core.handle(_gen("ref", messages=[ChatMessage("user", p["prompt"])]))
    deltas, _ = _feed(core, "ref", p["output_ids"], finish_at_end="length")
    assert "".join(d.text for d in deltas) == p["output_text"]
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].num_completion_tokens == len(p["output_ids"])
    assert deltas[-1].num_prompt_tokens == len(p["input_ids"])
    assert core.statistics().num_active == 0


def test_eos_joins_stop_token_ids_unless_ignore_eos(core):
    (t,) = core.handle(_gen("a", text="hello", sampling={"stop_token_ids": [7]}))
    assert t.sampling.stop_token_ids == [7, 2]
    (t,) = core.handle(_gen("b", text="hello", sampling={"ignore_eos": True}))
    assert t.sampling.stop_token_ids == []


def test_allow_auto_truncate_keeps_the_prompt_start_and_clamps_the_output(codec):
    core = TokenizerCore(codec, TokenizerConfig(context_len=256, allow_auto_truncate=True))
    (t,) = core.handle(_gen(input_ids=list(range(10, 310)), sampling={"max_new_tokens": 16}))
    assert t.input_ids == list(range(10, 265)) and t.sampling.max_new_tokens == 1
    (t,) = core.handle(_gen("b", input_ids=[5] * 10, sampling={"max_new_tokens": 250}))
    assert len(t.input_ids) == 10 and t.sampling.max_new_tokens == 246


@pytest.mark.parametrize(
    ("req", "code", "words"),
    [
        (_gen(text=""), "invalid_request", "empty"),
        (_gen(input_ids=[]), "invalid_request", "empty"),
        (_gen(input_ids=[1, 49152]), "invalid_request", "outside the vocabulary"),
        (_gen(input_ids=[-1]), "invalid_request", "outside the vocabulary"),
        (_gen(text="a", input_ids=[1]), "invalid_request", "exactly one"),
        (_gen(), "invalid_request", "exactly one"),
        (_gen(input_ids=[5] * 256), "context_length_exceeded", "256 tokens long"),
        (
            _gen(input_ids=[5] * 10, sampling={"max_new_tokens": 250}),
            "context_length_exceeded",
            "260 were",
        ),
        (_gen(text="x", sampling={"stop": [""]}), "invalid_request", "stop strings"),
        (_gen(text="x", sampling={"stop_regex": ["(a)\\1"]}), "invalid_request", "backreferences"),
        (_gen(text="x", sampling={"stop_regex": ["x*"]}), "invalid_request", "empty string"),
        (_gen(text="x", sampling={"stop_regex": ["x"] * 33}), "invalid_request", "33 stop regexes"),
        (_gen(text="x", sampling={"stop_regex": ["a{200}"] * 3}), "invalid_request", "together"),
        (_gen(messages=[]), "invalid_request", "messages"),
        (_gen(text="x", sampling={"stop_token_ids": [49152]}), "invalid_request", "49152"),
        (_gen(text="x", sampling={"logit_bias": {-3: 1.0}}), "invalid_request", "logit_bias"),
    ],
)
def test_invalid_requests_fail_with_a_clear_reason(core, req, code, words):
    (out,) = core.handle(req)
    assert isinstance(out, RequestFailed)
    assert out.request_id == req.request_id
    assert (out.code, out.http_status) == (code, 400)
    assert words in out.message
    assert core.statistics().num_rejected == 1
    assert core.statistics().num_active == 0


def test_clamp_shortens_max_new_tokens_to_fit(core):
    req = msgspec.structs.replace(
        _gen(input_ids=[5] * 10, sampling={"max_new_tokens": 300}), clamp_max_new_tokens=True
    )
    (t,) = core.handle(req)
    assert isinstance(t, Tokenized)
    assert t.sampling.max_new_tokens == 246


def test_stop_string_across_tokens_is_trimmed_and_aborts(codec, core):
    text = "1. Stay hydrated: Drink plenty of water"
    ids = codec.encode(text)
    core.handle(_gen("s", text="q", sampling={"stop": ["plenty of"]}))
    deltas, other = _feed(core, "s", ids)
    assert "".join(d.text for d in deltas) == "1. Stay hydrated: Drink "
    last = deltas[-1]
    assert (last.finish_reason, last.matched_stop) == ("stop", "plenty of")
    assert other == [AbortRequest("s", "stop_string", "plenty of")]
    # The stop string spans tokens; no delta before the match leaked its start.
    assert all("plen" not in d.text for d in deltas)
    # The scheduler's own late outputs for the request are dropped.
    assert core.handle(_tokens("s", [5], 99)) == []
    assert core.handle(_tokens("s", [5], 100, finish_reason="abort")) == []
    assert core.statistics().num_stop_string_matches == 1


def test_stop_regex_across_tokens_is_trimmed_and_aborts(codec, core):
    text = "Step 1: mix. Step 2: bake at 180 degrees. Step 3: eat."
    pattern = r"\d{3} degrees"
    core.handle(_gen("r", text="q", sampling={"stop_regex": [pattern]}))
    deltas, other = _feed(core, "r", codec.encode(text))
    assert "".join(d.text for d in deltas) == "Step 1: mix. Step 2: bake at "
    assert (deltas[-1].finish_reason, deltas[-1].matched_stop) == ("stop", pattern)
    assert other == [AbortRequest("r", "stop_string", pattern)]
    assert all("18" not in d.text for d in deltas)  # the match's start never leaked


def test_stop_string_no_trim_keeps_it(codec, core):
    core.handle(_gen("s", text="q", sampling={"stop": ["water"], "no_stop_trim": True}))
    deltas, _ = _feed(core, "s", codec.encode("Drink water now"))
    assert "".join(d.text for d in deltas) == "Drink water"
    assert deltas[-1].matched_stop == "water"


def test_stop_string_ignored_before_min_new_tokens(codec, core):
    core.handle(_gen("s", text="q", sampling={"stop": ["a"], "min_new_tokens": 100}))
    ids = codec.encode("a a a")
    deltas, other = _feed(core, "s", ids, finish_at_end="length")
    assert "".join(d.text for d in deltas) == "a a a"
    assert other == []


def test_stop_token_id_text_is_trimmed(codec, core):
    ids = [*codec.encode("bye"), 2]
    core.handle(_gen("t", text="q", sampling={"skip_special_tokens": False}))
    deltas, _ = _feed(core, "t", ids, finish_at_end="stop", matched=2)
    assert "".join(d.text for d in deltas) == "bye"
    assert (deltas[-1].finish_reason, deltas[-1].matched_stop) == ("stop", 2)
    core.handle(_gen("u", text="q", sampling={"skip_special_tokens": False, "no_stop_trim": True}))
    deltas, _ = _feed(core, "u", ids, finish_at_end="stop", matched=2)
    assert "".join(d.text for d in deltas) == "bye <|im_end|>"  # spaces_between_special_tokens


def test_logprob_texts_are_filled(codec, core):
    core.handle(_gen("l", text="q", sampling={"return_logprob": True, "top_logprobs_num": 2}))
    hi = codec.encode("Hi")[0]
    out = RequestOutput(
        "l", [hi], logprobs=[-0.5], top_logprobs=[[TopLogprob(hi, -0.5), TopLogprob(2, -1.0)]]
    )
    (deltas,) = core.handle(TokensOut(0, [out]))
    (d,) = deltas.deltas
    assert d.token_texts == ["Hi"]
    assert [(t.token_id, t.text) for t in d.top_logprobs[0]] == [(hi, "Hi"), (2, "<|im_end|>")]
    assert d.logprobs == [-0.5]
    # prompt scores: each position's top tokens get their texts too
    core.handle(_gen("p", text="Hi Hi", sampling={"logprob_start_len": 0, "top_logprobs_num": 1,
                                                  "max_new_tokens": 0}))  # fmt: skip
    out = RequestOutput("p", [], prompt_logprobs=[math.nan, -0.1], finish_reason="length",
                        prompt_top_logprobs=[[], [TopLogprob(hi, -0.1)]])  # fmt: skip
    (deltas,) = core.handle(TokensOut(1, [out]))
    (d,) = deltas.deltas
    assert len(d.prompt_token_ids) == 2 and d.prompt_top_logprobs[0] == []
    assert [(t.token_id, t.text) for t in d.prompt_top_logprobs[1]] == [(hi, "Hi")]


def test_external_abort_forgets_the_request(codec, core):
    core.handle(_gen("x", text="q"))
    assert core.statistics().num_active == 1
    assert core.handle(AbortRequest("x", "disconnect")) == []
    assert core.statistics().num_active == 0
    assert core.handle(_tokens("x", [5], finish_reason="abort")) == []


def test_duplicate_running_request_id_is_refused(core):
    assert isinstance(core.handle(_gen("d", text="a"))[0], Tokenized)
    (f,) = core.handle(_gen("d", text="b"))
    assert isinstance(f, RequestFailed) and "already running" in f.message


def test_tokenize_and_detokenize_queries(codec, core):
    (r,) = core.handle(TokenizeQuery("q1", text="hello world"))
    assert r == TokenizeReply("q1", codec.encode("hello world"), 256)
    (r,) = core.handle(TokenizeQuery("q2", messages=[ChatMessage("user", "hi")]))
    assert r.tokens[0] == 1 and r.error == ""
    (r,) = core.handle(DetokenizeQuery("q3", r.tokens))
    assert isinstance(r, DetokenizeReply) and "<|im_start|>user\nhi<|im_end|>" in r.text
    (r,) = core.handle(DetokenizeQuery("q4", [10**6]))
    assert "outside the vocabulary" in r.error


def test_chat_template_override_as_text_and_file(codec, tmp_path):
    from shunter.actors.tokenizer.chat import ChatTemplateError, resolve_chat_template
    from shunter.actors.tokenizer.loading import TextCodec

    tmpl = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    f = tmp_path / "t.jinja"
    f.write_text(tmpl)
    assert resolve_chat_template(tmpl, "model's") == tmpl
    assert resolve_chat_template(str(f), "model's") == tmpl
    assert resolve_chat_template(None, "model's") == "model's"
    with pytest.raises(ChatTemplateError, match="neither a readable file"):
        resolve_chat_template("/no/such/file", None)
    custom = TextCodec(
        codec.tk, eos_token_ids=[2], context_len=512, chat_template=tmpl,
        special_tokens=codec.special_tokens,
    )  # fmt: skip
    text = custom.render_chat([ChatMessage("user", "hi")], add_generation_prompt=True)
    assert text == "[user]hi<|im_end|>"
    (t,) = TokenizerCore(custom, TokenizerConfig()).handle(
        _gen("c", messages=[ChatMessage("user", "hi")])
    )
    assert t.input_ids == codec.encode(text, add_special_tokens=False)


def test_continue_final_message_and_template_variables(codec, core):
    """continue_final_message ends the prompt inside the last message (the model goes
    on with a reply the client began); chat_template_kwargs reach the template."""
    from shunter.actors.tokenizer.chat import ChatTemplateError, render_chat

    msgs = [ChatMessage("user", "hi"), ChatMessage("assistant", "Hello, my name ")]
    closed = codec.render_chat(msgs, add_generation_prompt=False)
    cont = codec.render_chat(msgs, add_generation_prompt=False, continue_final_message=True)
    assert closed.startswith(cont) and cont.endswith("<|im_start|>assistant\nHello, my name")
    (t,) = core.handle(_gen("cf", messages=msgs, add_generation_prompt=False,
                            continue_final_message=True))  # fmt: skip
    assert t.input_ids == codec.encode(cont, add_special_tokens=False)
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        codec.render_chat(msgs, add_generation_prompt=True, continue_final_message=True)
    (f,) = core.handle(_gen("cf2", messages=[ChatMessage("user", "")],
                            add_generation_prompt=False, continue_final_message=True))  # fmt: skip
    assert isinstance(f, RequestFailed) and f.http_status == 400 and "does not appear" in f.message
    tmpl = "{% if think %}<think>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    one = [ChatMessage("user", "x")]
    assert render_chat(tmpl, one, add_generation_prompt=False) == "x"
    assert render_chat(tmpl, one, add_generation_prompt=False,
                       template_kwargs={"think": True}) == "<think>x"  # fmt: skip
    # the renderer's own names win over a template variable of the same name
    assert render_chat(tmpl, one, add_generation_prompt=False,
                       template_kwargs={"messages": []}) == "x"  # fmt: skip


def test_template_that_refuses_input_is_a_400(codec):
    from shunter.actors.tokenizer.loading import TextCodec

    tmpl = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}x"
    strict = TextCodec(codec.tk, eos_token_ids=[2], context_len=512, chat_template=tmpl)
    (f,) = TokenizerCore(strict, TokenizerConfig()).handle(
        _gen("c", messages=[ChatMessage("user", "hi")])
    )
    assert isinstance(f, RequestFailed) and "system first" in f.message
    none = TextCodec(codec.tk, eos_token_ids=[2], context_len=512, chat_template=None)
    (f,) = TokenizerCore(none, TokenizerConfig()).handle(
        _gen("c", messages=[ChatMessage("user", "hi")])
    )
    assert isinstance(f, RequestFailed) and "no chat template" in f.message


@pytest.mark.parametrize(
    ("stream", "interval", "expected"), [(True, 1, 1), (True, 3, 3), (False, 3, 8)]
)
def test_deltas_are_coalesced_by_stream_interval(codec, stream, interval, expected):
    core = TokenizerCore(codec, TokenizerConfig(context_len=256, stream_interval=interval,
                                                non_stream_interval=8))  # fmt: skip
    core.handle(_gen("i", text="q", stream=stream, sampling={"return_logprob": True}))
    ids = codec.encode("one two three four five six seven eight nine ten eleven twelve")
    sizes = []
    for k, i in enumerate(ids):
        fr = "length" if k == len(ids) - 1 else None
        for m in core.handle(_tokens("i", [i], k, finish_reason=fr, logprobs=[-1.0])):
            sizes += [len(d.token_ids) for d in m.deltas]
            for d in m.deltas:
                assert len(d.logprobs) == len(d.token_ids) == len(d.token_texts)
    assert sizes[0] == 1  # the first token is never held (time to first token)
    assert all(s == expected for s in sizes[1:-1])
    assert sum(sizes) == len(ids)


def test_hf_directory_loads_without_conversion(codec, tmp_path):
    """A model directory with tokenizer.json: facts come from config.json and
    generation_config.json (eos lists), the template from chat_template.jinja."""
    import json as _json

    from shunter.actors.tokenizer.loading import load_codec

    codec.tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(_json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "config.json").write_text(_json.dumps({"max_position_embeddings": 2048}))
    (tmp_path / "generation_config.json").write_text(_json.dumps({"eos_token_id": [0, 2]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    c = load_codec(TokenizerConfig(model_path=str(tmp_path), cache_dir=str(tmp_path / "cache")))
    assert (c.context_len, c.eos_token_ids, c.vocab_size) == (2048, (0, 2), 49152)
    assert c.render_chat([ChatMessage("user", "hey")], add_generation_prompt=True) == "hey!"
    assert c.encode("héllo 😀") == codec.encode("héllo 😀")
    assert not (tmp_path / "cache").exists()  # nothing to convert


def test_without_a_tokenizer_ids_pass_through_and_text_is_refused():
    """--skip-tokenizer-init: an IdsCodec from the config's facts; prompts of ids run
    (eos ids joined to the stops), their outputs come back as ids with empty text, and
    whatever needs a tokenizer is a 400 naming the option."""
    from shunter.actors.tokenizer.loading import IdsCodec, load_codec

    config = TokenizerConfig(skip_tokenizer_init=True, vocab_size=100, eos_token_ids=(2, 7),
                             context_len=64)  # fmt: skip
    codec = load_codec(config)
    assert isinstance(codec, IdsCodec) and not codec.has_text
    core = TokenizerCore(codec, config)
    (t,) = core.handle(_gen("a", input_ids=[5, 6, 99], sampling={"max_new_tokens": 4}))
    assert isinstance(t, Tokenized) and t.input_ids == [5, 6, 99]
    assert sorted(t.sampling.stop_token_ids) == [2, 7]
    deltas, other = _feed(core, "a", [11, 12, 7], finish_at_end="stop", matched=7)
    assert all(d.text == "" for d in deltas) and other == []
    assert [i for d in deltas for i in d.token_ids] == [11, 12, 7]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].num_completion_tokens == 3
    refused = [
        _gen("b", text="hello"),
        _gen("c", messages=[ChatMessage("user", "hi")]),
        _gen("d", input_ids=[5], sampling={"stop": ["x"]}),
        _gen("e", input_ids=[100]),
    ]
    for req in refused:
        (f,) = core.handle(req)
        assert isinstance(f, RequestFailed) and f.http_status == 400, f
    assert "skip-tokenizer-init" in core.handle(refused[0])[0].message
    (q,) = core.handle(TokenizeQuery("q", text="hi"))
    assert "skip-tokenizer-init" in q.error
    (q,) = core.handle(DetokenizeQuery("q", [5]))
    assert "skip-tokenizer-init" in q.error
    with pytest.raises(ValueError, match="vocab_size and context_len"):
        TokenizerConfig(skip_tokenizer_init=True, context_len=64)


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} {{ c.function.arguments.city }}"
    "{% endfor %}{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
)


def test_tools_and_tool_turns_reach_the_template(codec):
    """A request's tools fill the template's `tools`; an assistant turn's calls arrive with
    their JSON arguments decoded (HF's convention), a tool turn with its call id."""
    from shunter.actors.tokenizer.loading import TextCodec

    config = TokenizerConfig(context_len=256, chat_template=TOOLS_TEMPLATE)
    core = TokenizerCore(TextCodec(codec.tk, eos_token_ids=codec.eos_token_ids, context_len=256,
                                   chat_template=TOOLS_TEMPLATE), config)  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [ChatMessage("user", "Weather?"), ChatMessage("assistant", "", [call]),
                ChatMessage("tool", "sunny", tool_call_id="c1")]  # fmt: skip
    (t,) = core.handle(GenerateRequest("r", SamplingParams(max_new_tokens=2), messages=messages,
                                       tools=tools))  # fmt: skip
    assert isinstance(t, Tokenized)
    text = codec.decode(t.input_ids, skip_special_tokens=False)
    assert 'TOOLS [{"type": "function"' in text and "assistant:  CALL weather Paris" in text
    assert "tool: sunny FOR c1" in text
    (t2,) = core.handle(GenerateRequest("r2", SamplingParams(max_new_tokens=2),
                                        messages=messages[:1]))  # fmt: skip
    assert "TOOLS" not in codec.decode(t2.input_ids)  # no tools: the template's None
