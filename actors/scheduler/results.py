"""Applying a StepResult: tokens appended, stop conditions, outputs, chunk hand-over.

Split from core.py to keep it readable; this is the per-step hot path (256 rows decode
in well under a millisecond), so plain decode entries (no logprobs, not ended, no error)
run in one tight loop with locals; anything else takes `_apply_entry`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shunter.bus.messages import FinishReason, Msg, RequestFailed, RequestOutput, StepResult

if TYPE_CHECKING:
    from shunter.actors.scheduler.core import SchedulerCore
    from shunter.actors.scheduler.req import Req

_NONE: list = []  # shared empty field value of outputs (never mutated)


def apply_result(core: SchedulerCore, res: StepResult, out: list[Msg]) -> None:
    if not core.in_flight or res.step_id != core.in_flight[0].step_id:
        core._n["unexpected"] += 1
        return
    inf = core.in_flight.popleft()
    core._boundary = True
    rows, tokens = res.rows, res.token_ids
    error = res.error
    if error is None and (len(rows) != inf.num_sampling or len(tokens) != inf.num_sampling):
        error = f"result has {len(rows)} rows, the batch sampled {inf.num_sampling}"
    if error is None and rows != inf.sampling_rows:
        error = "result rows do not match the batch's sampling rows"
    num_generated = num_prefill = 0
    k = -1
    for req, num_new, sample in inf.entries:  # prefill pieces
        if sample:
            k += 1
        g, p = _apply_entry(core, req, num_new, sample, k, res, error, out)
        num_generated += g
        num_prefill += p
    max_context_len = core.config.max_context_len
    outputs = core._outputs
    for req in inf.decodes:  # one token each, from LAST_SAMPLED
        k += 1
        if error is not None or req.end_reason is not None or req.wants_extras:
            num_generated += _apply_entry(core, req, 1, True, k, res, error, out)[0]
            continue
        req.num_computed += 1
        req.num_inflight -= 1
        req.inflight_samples -= 1
        token = tokens[k]
        all_ids = req.all_ids
        all_ids.append(token)
        num_generated += 1
        num_output = len(all_ids) - req.num_prompt
        sp = req.sampling
        # A stop token (once min_new_tokens are out) wins over the length limits, so a
        # request whose last allowed token is eos reports "stop" with matched_stop.
        if token in req.stop_ids and num_output >= sp.min_new_tokens:
            _finish(core, req, token, FinishReason.STOP, token, out)
        elif num_output >= sp.max_new_tokens or len(all_ids) >= max_context_len:
            _finish(core, req, token, FinishReason.LENGTH, None, out)
        else:
            outputs.append(
                RequestOutput(req.request_id, [token], _NONE, _NONE, _NONE, None, None,
                              req.num_prompt, req.num_cached_reported)
            )  # fmt: skip
    n = core._n
    n["generated"] += num_generated
    n["prefill_tokens"] += num_prefill
    core._gen_since_stats += num_generated
    cfg = core.config
    core.new_token_ratio = max(
        cfg.min_new_token_ratio, core.new_token_ratio - cfg.new_token_ratio_decay
    )


def _finish(core: SchedulerCore, req: Req, token: int, finish: str, matched, out) -> None:
    core._emit(req, [token], finish=finish, matched=matched)
    core._n["finished"] += 1
    core.finish_running(req, "finished", out)


def _apply_entry(
    core: SchedulerCore,
    req: Req,
    num_new: int,
    sample: bool,
    k: int,
    res: StepResult,
    error: str | None,
    out: list[Msg],
) -> tuple[int, int]:
    """One entry's result, every case; returns (tokens generated, prefill tokens)."""
    req.num_computed += num_new
    req.num_inflight -= 1
    if sample:
        req.inflight_samples -= 1
    if req.end_reason is not None:  # ended meanwhile: no more output from it
        if sample and error is None:
            req.all_ids.append(res.token_ids[k])  # its KV may be computed (and cached) next
        if req.num_inflight == 0:
            core._end_running(req, req.end_reason, out)
        return 0, 0
    if error is not None:
        core._emit(req, [], finish=FinishReason.ERROR)
        out.append(RequestFailed(req.request_id, "internal", error, 500))
        core._n["failed"] += 1
        core.finish_running(req, "aborted", out)
        return 0, 0
    plp = res.prompt_logprobs.get(req.row) if res.prompt_logprobs else None
    ptop = res.prompt_top_logprobs.get(req.row) if res.prompt_top_logprobs else None
    if not sample:
        core._cache_chunk(req, out)
        if req.num_computed == len(req.all_ids):  # a prompt scored without a sample
            core._emit(req, [], prompt_logprobs=plp, prompt_top=ptop, finish=FinishReason.LENGTH)
            core._n["finished"] += 1
            core.finish_running(req, "finished", out)
        elif plp:
            core._emit(req, [], prompt_logprobs=plp, prompt_top=ptop)
        return 0, num_new
    num_prefill = 0
    if not req.row_sampled:
        num_prefill = num_new
        req.row_sampled = True
        if core.config.in_batch_prefix_sharing:
            core._cache_chunk(req, out)  # the prompt's full pages, for requests deferred on it
    token = res.token_ids[k]
    all_ids = req.all_ids
    all_ids.append(token)
    num_output = len(all_ids) - req.num_prompt
    sp = req.sampling
    if token in req.stop_ids and num_output >= sp.min_new_tokens:
        finish, matched = FinishReason.STOP, token
    elif num_output >= sp.max_new_tokens or len(all_ids) >= core.config.max_context_len:
        finish, matched = FinishReason.LENGTH, None
    else:
        finish, matched = None, None
    lps = [res.logprobs[k]] if sp.return_logprob and k < len(res.logprobs) else None
    ask_top = sp.top_logprobs_num > 0 or bool(sp.token_ids_logprob)
    top = [res.top_logprobs[k]] if ask_top and len(res.top_logprobs) == len(res.rows) else None
    if finish is None:
        core._emit(req, [token], lps, top, plp, prompt_top=ptop)
    else:
        core._emit(req, [token], lps, top, plp, prompt_top=ptop, finish=finish, matched=matched)
        core._n["finished"] += 1
        core.finish_running(req, "finished", out)
    return 1, num_prefill
