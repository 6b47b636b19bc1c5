"""Tokenizer core: requests in as token ids, tokens out as text.

Theory of operation
-------------------
Inbound, a `GenerateRequest` (text, ids or a chat conversation) becomes `Tokenized`:
the chat template is applied, text is encoded, the prompt is checked against the
vocabulary and the context length, and the model's eos ids join `stop_token_ids`
(unless `ignore_eos`; the scheduler checks ids). A request that cannot run becomes
`RequestFailed` (http 400) and nothing else.

Outbound, each `TokensOut` (one scheduler step) becomes one `TextDeltas` holding the
deltas that are due: a request's first and last delta always, the others once
`stream_interval` tokens (`non_stream_interval` when not streamed) are pending. Every running
request owns an incremental detokenizer and a stop-string matcher (detok.py). When a stop
string or a stop regex matches, the request's last delta carries finish_reason "stop"
and the matched string (a regex's pattern), and an `AbortRequest(reason="stop_string")`
tells the scheduler to stop it; the scheduler's later outputs for it are dropped. A finished request whose stop was a token
id has that token's text trimmed unless `no_stop_trim`.

`TokenizeQuery` / `DetokenizeQuery` from the gateway are answered directly.

Without a tokenizer (--skip-tokenizer-init, loading.py's IdsCodec) prompts must be
token ids, stop strings and text queries are refused, and every delta's text is empty:
the ids pass through as they are.

Invariants
----------
- Every `GenerateRequest` gets exactly one answer: `Tokenized` or `RequestFailed`.
- Every request that produced a delta gets exactly one delta with a finish_reason,
  unless it was aborted from outside (the gateway ends those itself).
- Delta text is never cut inside a UTF-8 character and never holds (part of) a stop
  string unless `no_stop_trim`.
- No clock, environment or randomness: outputs are a function of the inputs.
"""

from __future__ import annotations

import msgspec

from shunter.actors.grammar.token_fsm import constraint_error
from shunter.actors.tokenizer.chat import ChatTemplateError
from shunter.actors.tokenizer.config import TokenizerConfig
from shunter.actors.tokenizer.detok import IncrementalDetokenizer, StopStringMatcher
from shunter.actors.tokenizer.loading import IdsCodec, TextCodec
from shunter.actors.tokenizer.stop_regex import MAX_STATES, StopRegex, compile_stop_regex
from shunter.bus.messages import (
    AbortRequest,
    ActorDied,
    DetokenizeQuery,
    DetokenizeReply,
    FinishReason,
    GenerateRequest,
    Msg,
    RequestFailed,
    RequestOutput,
    TextDelta,
    TextDeltas,
    Tokenized,
    TokenizeQuery,
    TokenizeReply,
    TokensOut,
    TopLogprob,
)

Inbox = (
    GenerateRequest | TokensOut | AbortRequest | RequestFailed | ActorDied | TokenizeQuery
    | DetokenizeQuery
)  # fmt: skip
INBOX_TYPES = (
    GenerateRequest, TokensOut, AbortRequest, RequestFailed, ActorDied, TokenizeQuery,
    DetokenizeQuery,
)  # fmt: skip


NO_TOKENIZER = "this server runs without a tokenizer (--skip-tokenizer-init)"


class TokenizerStats(msgspec.Struct, frozen=True):
    num_active: int  # requests with detokenization state
    num_tokenized: int
    num_rejected: int  # GenerateRequests answered with RequestFailed
    num_finished: int
    num_stop_string_matches: int
    num_output_tokens: int
    num_queries: int  # tokenize / detokenize queries answered


class _Active:
    """Output state of one running request."""

    __slots__ = (
        "detok", "first", "held", "num_deltas", "num_output_tokens", "num_prompt_tokens",
        "prompt_ids", "sampling", "stops", "stream",
    )  # fmt: skip

    def __init__(self, detok, stops, sampling, num_prompt_tokens, prompt_ids, stream) -> None:
        self.detok: IncrementalDetokenizer = detok
        self.stops: StopStringMatcher = stops
        self.sampling = sampling
        self.num_prompt_tokens: int = num_prompt_tokens
        self.num_output_tokens = 0
        self.first = True
        self.stream: bool = stream
        self.held: TextDelta | None = None  # output not sent yet (stream_interval)
        self.num_deltas = 0
        self.prompt_ids: list[int] = prompt_ids  # kept only when prompt logprobs are asked


def _merge(a: TextDelta, b: TextDelta) -> TextDelta:
    """One delta holding a's output followed by b's (b is the later one)."""
    return msgspec.structs.replace(
        b,
        text=a.text + b.text,
        token_ids=a.token_ids + b.token_ids,
        logprobs=a.logprobs + b.logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        prompt_logprobs=a.prompt_logprobs + b.prompt_logprobs,
        token_texts=a.token_texts + b.token_texts,
        prompt_token_ids=a.prompt_token_ids or b.prompt_token_ids,
        prompt_token_texts=a.prompt_token_texts or b.prompt_token_texts,
        prompt_top_logprobs=a.prompt_top_logprobs + b.prompt_top_logprobs,
    )


class _Invalid(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TokenizerCore:
    def __init__(self, codec: TextCodec | IdsCodec, config: TokenizerConfig) -> None:
        self.codec = codec
        self.config = config
        self.context_len = config.context_len or codec.context_len
        self._active: dict[str, _Active] = {}
        self._num_tokenized = self._num_rejected = self._num_finished = 0
        self._num_stop_matches = self._num_output_tokens = self._num_queries = 0

    def handle(self, msg: Msg) -> list[Msg]:
        match msg:
            case GenerateRequest():
                return [self._tokenize_request(msg)]
            case TokensOut():
                return self._detokenize_step(msg)
            case AbortRequest() | RequestFailed():
                # Ended from outside (client, admin, another actor): its text is moot.
                self._active.pop(msg.request_id, None)
                return []
            case ActorDied():
                # The gateway fails every in-flight request; their state is garbage now.
                self._active.clear()
                return []
            case TokenizeQuery():
                return [self._answer_tokenize(msg)]
            case DetokenizeQuery():
                return [self._answer_detokenize(msg)]
        return []

    def statistics(self) -> TokenizerStats:
        return TokenizerStats(
            len(self._active), self._num_tokenized, self._num_rejected, self._num_finished,
            self._num_stop_matches, self._num_output_tokens, self._num_queries,
        )  # fmt: skip

    # -- inbound -------------------------------------------------------------------------

    def _prompt_ids(self, req: GenerateRequest | TokenizeQuery) -> list[int]:
        given = [x is not None for x in (req.text, getattr(req, "input_ids", None), req.messages)]
        if sum(given) != 1:
            raise _Invalid("invalid_request", "give exactly one of text, input_ids, messages")
        if not self.codec.has_text and (req.text is not None or req.messages is not None):
            raise _Invalid("invalid_request", f"{NO_TOKENIZER}: send input_ids, not text")
        if req.messages is not None:
            if not req.messages:
                raise _Invalid("invalid_request", "messages must not be empty")
            try:
                text = self.codec.render_chat(
                    req.messages,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    template_kwargs=req.chat_template_kwargs,
                    tools=getattr(req, "tools", ()),
                )
            except ChatTemplateError as e:
                raise _Invalid("invalid_request", str(e)) from None
            return self.codec.encode(text, add_special_tokens=False)
        if req.text is not None:
            add_special = getattr(req, "add_special_tokens", True)
            return self.codec.encode(req.text, add_special_tokens=add_special)
        ids = list(req.input_ids)  # type: ignore[union-attr]
        bad = [i for i in ids if not 0 <= i < self.codec.vocab_size]
        if bad:
            raise _Invalid(
                "invalid_request",
                f"input_ids holds {len(bad)} id(s) outside the vocabulary "
                f"[0, {self.codec.vocab_size}), first {bad[0]}",
            )
        return ids

    def _tokenize_request(self, req: GenerateRequest) -> Msg:
        try:
            return self._tokenize_checked(req)
        except _Invalid as e:
            self._num_rejected += 1
            return RequestFailed(req.request_id, e.code, e.message, 400)

    def _stop_regexes(self, patterns: list[str]) -> list[StopRegex]:
        """The request's stop regexes compiled (a refused one is the request's 400)."""
        if len(patterns) > self.config.max_stop_strings:
            raise _Invalid("invalid_request", f"{len(patterns)} stop regexes; at most "
                           f"{self.config.max_stop_strings}")  # fmt: skip
        if patterns and not self.codec.has_text:
            raise _Invalid("invalid_request", f"{NO_TOKENIZER}: stop regexes cannot match; "
                           "use stop_token_ids")  # fmt: skip
        try:
            regexes = [compile_stop_regex(p) for p in patterns]
        except ValueError as e:
            raise _Invalid("invalid_request", str(e)) from None
        if sum(r.num_states for r in regexes) > MAX_STATES:  # each character's work
            raise _Invalid("invalid_request", f"the stop regexes are too large together (over "
                           f"{MAX_STATES} states)")  # fmt: skip
        return regexes

    def _tokenize_checked(self, req: GenerateRequest) -> Tokenized:
        if req.request_id in self._active:
            raise _Invalid("invalid_request", f"request id {req.request_id!r} is already running")
        sp = req.sampling
        if len(sp.stop) > self.config.max_stop_strings:
            raise _Invalid(
                "invalid_request",
                f"{len(sp.stop)} stop strings; at most {self.config.max_stop_strings}",
            )
        if sp.stop and not self.codec.has_text:
            raise _Invalid("invalid_request", f"{NO_TOKENIZER}: stop strings cannot match; "
                           "use stop_token_ids")  # fmt: skip
        if any(not s for s in sp.stop):
            raise _Invalid("invalid_request", "stop strings must not be empty")
        if any(len(s) > self.config.max_stop_len_chars for s in sp.stop):
            raise _Invalid(
                "invalid_request",
                f"stop strings are limited to {self.config.max_stop_len_chars} characters",
            )
        regexes = self._stop_regexes(sp.stop_regex)
        if sp.regex:
            if not self.codec.has_text:
                raise _Invalid("invalid_request", f"{NO_TOKENIZER}: constrained decoding needs "
                               "the tokenizer's texts")  # fmt: skip
            error = constraint_error(sp.regex)
            if error is not None:
                raise _Invalid("invalid_request", error)
        vocab = self.codec.vocab_size
        named = (*sp.stop_token_ids, *sp.logit_bias, *sp.token_ids_logprob)
        bad_ids = [i for i in named if not 0 <= i < vocab]
        if bad_ids:  # caught here, they would fail a whole executor step
            raise _Invalid(
                "invalid_request",
                f"token id {bad_ids[0]} in stop_token_ids, logit_bias or token_ids_logprob "
                f"is outside the vocabulary [0, {vocab})",
            )
        ids = self._prompt_ids(req)
        n, ctx = len(ids), self.context_len
        if n == 0:
            raise _Invalid("invalid_request", "the prompt is empty (0 tokens)")
        if n >= ctx and self.config.allow_auto_truncate:
            ids = ids[: ctx - 1]  # SGLang's order: the prompt's start is kept
            n = len(ids)
        if n >= ctx:
            raise _Invalid(
                "context_length_exceeded",
                f"the prompt is {n} tokens long, but this model's context length is {ctx} "
                "tokens and the prompt must leave room for at least one output token",
            )
        max_new = sp.max_new_tokens
        if n + max_new > ctx:
            if not (req.clamp_max_new_tokens or self.config.allow_auto_truncate):
                raise _Invalid(
                    "context_length_exceeded",
                    f"this model's context length is {ctx} tokens, but {n + max_new} were "
                    f"requested ({n} in the prompt and {max_new} for the output); reduce the "
                    "prompt or max_tokens",
                )
            max_new = ctx - n
        stop_ids = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop_ids += [e for e in self.codec.eos_token_ids if e not in stop_ids]
        sampling = msgspec.structs.replace(sp, max_new_tokens=max_new, stop_token_ids=stop_ids)
        num_ctx = self.config.num_prompt_context_tokens
        ctx_ids = ids[-num_ctx:] if num_ctx else []
        self._active[req.request_id] = _Active(
            IncrementalDetokenizer(
                self.codec,
                ctx_ids,
                skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
            ),
            StopStringMatcher(sp.stop, no_stop_trim=sp.no_stop_trim, regexes=regexes),
            sampling,
            n,
            ids if sp.logprob_start_len >= 0 else [],
            req.stream,
        )
        self._num_tokenized += 1
        return Tokenized(
            req.request_id, ids, sampling, req.priority, req.extra_key, req.arrival_ns, req.stream
        )

    # -- outbound ------------------------------------------------------------------------

    def _detokenize_step(self, msg: TokensOut) -> list[Msg]:
        deltas: list[TextDelta] = []
        aborts: list[Msg] = []
        for out in msg.outputs:
            state = self._active.get(out.request_id)
            if state is None:  # ended here (stop string) or from outside: late output
                continue
            delta, matched = self._delta(state, out)
            if state.held is not None:
                delta = _merge(state.held, delta)
                state.held = None
            if not self._due(state, delta):
                state.held = delta  # coalesced into a later delta (stream_interval)
                continue
            state.num_deltas += 1
            deltas.append(delta)
            if delta.finish_reason is not None:
                del self._active[out.request_id]
                self._num_finished += 1
                if matched is not None and out.finish_reason is None:
                    aborts.append(AbortRequest(out.request_id, "stop_string", matched))
        return ([TextDeltas(deltas)] if deltas else []) + aborts

    def _due(self, state: _Active, delta: TextDelta) -> bool:
        """Send now? Always the first delta (time to first token) and the last; otherwise
        once stream_interval tokens are pending (non_stream_interval for requests that
        are not streamed: their client sees only the end)."""
        if delta.finish_reason is not None or state.num_deltas == 0:
            return True
        interval = self.config.stream_interval
        if not state.stream:
            interval = max(interval, self.config.non_stream_interval)
        return len(delta.token_ids) >= interval

    def _delta(self, state: _Active, out: RequestOutput) -> tuple[TextDelta, str | None]:
        sp = state.sampling
        ids = out.token_ids
        state.num_output_tokens += len(ids)
        self._num_output_tokens += len(ids)
        finished = out.finish_reason is not None
        text_ids = ids
        if (
            out.finish_reason == FinishReason.STOP
            and isinstance(out.matched_stop, int)
            and not sp.no_stop_trim
            and ids
            and ids[-1] == out.matched_stop
        ):
            text_ids = ids[:-1]  # the stop token's own text is not part of the output
        chunk = state.detok.push(text_ids)
        if finished:
            chunk += state.detok.flush()
        matched: str | None = None
        if (sp.stop or sp.stop_regex) and state.num_output_tokens >= sp.min_new_tokens:
            text, matched = state.stops.push(chunk, final=finished)
        else:  # no stop strings, or too early for them to count: release everything
            text, state.stops.pending = state.stops.pending + chunk, ""
        finish_reason = out.finish_reason
        matched_stop: int | str | None = out.matched_stop
        if matched is not None:
            finish_reason, matched_stop = FinishReason.STOP, matched
            self._num_stop_matches += 1
        want_lp = sp.return_logprob or sp.top_logprobs_num > 0
        top = self._with_texts(out.top_logprobs)
        first = state.first
        state.first = False
        prompt_ids = state.prompt_ids if first else []
        # Positional (the hot path); lists from the decoded message are not copied, as
        # neither messages nor deltas are ever mutated.
        return TextDelta(
            out.request_id, text, ids, out.logprobs, top, out.prompt_logprobs, finish_reason,
            matched_stop, out.num_prompt_tokens or state.num_prompt_tokens,
            state.num_output_tokens, out.num_cached_tokens,
            [self.codec.token_text(i) for i in ids] if want_lp else [],
            prompt_ids, [self.codec.token_text(i) for i in prompt_ids],
            self._with_texts(out.prompt_top_logprobs),
        ), matched  # fmt: skip

    def _with_texts(self, tops: list[list[TopLogprob]]) -> list[list[TopLogprob]]:
        """Top-logprob lists with each token's text filled in."""
        if not tops:
            return tops
        text = self.codec.token_text
        return [[TopLogprob(t.token_id, t.logprob, text(t.token_id)) for t in row] for row in tops]

    # -- queries -------------------------------------------------------------------------

    def _answer_tokenize(self, q: TokenizeQuery) -> TokenizeReply:
        self._num_queries += 1
        try:
            ids = self._prompt_ids(q)
        except _Invalid as e:
            return TokenizeReply(q.query_id, error=e.message, max_model_len=self.context_len)
        return TokenizeReply(q.query_id, ids, self.context_len)

    def _answer_detokenize(self, q: DetokenizeQuery) -> DetokenizeReply:
        self._num_queries += 1
        if not self.codec.has_text:
            return DetokenizeReply(q.query_id, error=NO_TOKENIZER)
        bad = [i for i in q.tokens if not 0 <= i < self.codec.vocab_size]
        if bad:
            return DetokenizeReply(
                q.query_id,
                error=f"token id {bad[0]} is outside the vocabulary [0, {self.codec.vocab_size})",
            )
        text = self.codec.decode(
            q.tokens, skip_special_tokens=q.skip_special_tokens, spaces_between_special_tokens=False
        )
        return DetokenizeReply(q.query_id, text)
