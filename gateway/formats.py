"""Response pieces shared by the OpenAI and native endpoints: per-choice accumulation,
usage, and the two OpenAI logprob layouts (legacy completions and chat)."""

from __future__ import annotations

from shunter.bus.messages import TextDelta


class Acc:
    """Everything one choice produced so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.token_texts: list[str] = []
        self.top_logprobs: list[list] = []
        self.prompt_ids: list[int] = []  # the whole prompt, when prompt logprobs were asked
        self.prompt_texts: list[str] = []
        self.prompt_logprobs: list[float] = []  # may arrive over several deltas (chunks)
        self.prompt_tops: list[list] = []  # each prompt_logprobs item's top tokens, if asked
        self.last: TextDelta | None = None

    def add(self, d: TextDelta) -> None:
        self.text.append(d.text)
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.token_texts += d.token_texts
        self.top_logprobs += d.top_logprobs
        if d.prompt_token_ids:
            self.prompt_ids, self.prompt_texts = d.prompt_token_ids, d.prompt_token_texts
        self.prompt_logprobs += d.prompt_logprobs
        self.prompt_tops += d.prompt_top_logprobs
        self.last = d

    def prompt_entries(self, start: int) -> list[tuple[float | None, int, str, list]]:
        """(logprob, id, text, top tokens) of prompt positions start.. (logprob None and
        top [] where nothing scored it: the first position; top [] where none was
        asked for)."""
        ids = self.prompt_ids[start:]
        if not ids:
            return []
        n = len(ids)
        lps = self.prompt_logprobs[-n:]
        lps = [None] * (n - len(lps)) + [None if lp != lp else lp for lp in lps]
        tops = self.prompt_tops[-n:]
        tops = [[]] * (n - len(tops)) + tops
        return list(zip(lps, ids, self.prompt_texts[start:], tops))


def usage(accs: list[Acc], n: int) -> dict:
    """OpenAI usage: each prompt's tokens once (choice 0 of each prompt)."""
    prompt = sum(a.last.num_prompt_tokens for k, a in enumerate(accs) if a.last and k % n == 0)
    cached = sum(a.last.num_cached_tokens for k, a in enumerate(accs) if a.last and k % n == 0)
    completion = sum(a.last.num_completion_tokens for a in accs if a.last)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(
    tokens: list[str], lps: list[float], tops: list[list], offset0: int
) -> dict:
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{t.text: t.logprob for t in row} if row else None for row in tops]
        if tops
        else None,
        "text_offset": offsets,
    }


def chat_logprobs(tokens: list[str], lps: list[float], tops: list[list], num_top: int) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        row = tops[i] if i < len(tops) else []
        content.append({
            "token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
            "top_logprobs": [
                {"token": x.text, "logprob": x.logprob, "bytes": list(x.text.encode("utf-8"))}
                for x in row[:num_top]
            ],
        })  # fmt: skip
    return {"content": content}
