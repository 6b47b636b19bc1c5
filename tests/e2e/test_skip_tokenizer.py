"""A server started with --skip-tokenizer-init (SGLang's, as RL trainers run it): no
tokenizer is loaded, token-id prompts give the same greedy ids as the shared server,
outputs carry no text, and what needs a tokenizer is a 400 that names the option."""

from __future__ import annotations


def test_token_ids_in_and_out_with_no_tokenizer(server, start_server, call, tmp_path):
    status, tok = call(server, "/v1/tokenize", {"prompt": "The capital of France is"})
    assert status == 200, tok
    ids = tok["tokens"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True}}  # fmt: skip
    status, want = call(server, "/generate", body)
    assert status == 200, want
    with start_server(tmp_path / "bare", "embedded", "--skip-tokenizer-init") as bare:
        status, got = call(bare, "/generate", body)
        assert status == 200, got
        assert got["output_ids"] == want["output_ids"] and got["text"] == ""
        assert got["meta_info"]["completion_tokens"] == 8
        status, out = call(bare, "/v1/completions", {"prompt": ids, "max_tokens": 3,
                                                     "temperature": 0})  # fmt: skip
        assert status == 200 and out["choices"][0]["text"] == "", out
        assert out["usage"]["completion_tokens"] == 3
        for path, bad in [
            ("/generate", {"text": "hi"}),
            ("/generate", {"input_ids": ids, "sampling_params": {"stop": ["x"]}}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/tokenize", {"prompt": "hi"}),
        ]:
            status, err = call(bare, path, bad)
            assert status == 400 and "skip-tokenizer-init" in err["error"]["message"], (path, err)
        assert bare.get("/health")[0] == 200
