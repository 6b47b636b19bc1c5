"""Synthetic request lists for `shunter bench serve`: `random` and `generated-shared-prefix`.

Theory of operation
    A dataset is a list of BenchRequest: prompt token ids plus the number of output
    tokens to ask for. Everything is drawn from one seeded numpy Generator, so the same
    arguments give the same list on any machine, and the same list can be sent to our
    server, to a peer, and to HF transformers (bench_hf.py).

    - random: lengths uniform in [max(1, int(LEN * RATIO)), LEN] for inputs and
      outputs, the convention of SGLang's random dataset (RATIO 1.0 = fixed lengths,
      0.0 = anything from 1 to LEN); prompt ids uniform over the token pool.
    - generated-shared-prefix: NUM_GROUPS groups, each with its own system prompt of
      SYSTEM_LEN random ids, followed in each of the group's PROMPTS_PER_GROUP requests
      by a fresh question of QUESTION_LEN ids. Requests are listed group by group, so
      the first request of a group fills the prefix cache and its followers hit it; or,
      with ORDER "round-robin", one request of each group in turn (the groups' system
      prompts then compete for the cache: with more of them than the device KV pool
      holds, a group's prefix is evicted before its next request, which is what a host
      KV tier is for).

    The token pool is the vocabulary minus special tokens (an eos in the middle of a
    prompt is legal, but a chat template marker would change what the prompt means).
    With prompts sent as text (chat, or --prompt-format text), the ids are decoded; the
    text may re-tokenize to a slightly different length, and the server's usage figure
    is then the one counted.

Invariants
    - every request has 1 <= len(prompt_ids) and 1 <= output_len;
    - within a shared-prefix group, the first SYSTEM_LEN ids of every prompt are equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import numpy as np

DATASETS = ("random", "generated-shared-prefix")
GSP_ORDERS = ("grouped", "round-robin")


class BenchRequest(msgspec.Struct, frozen=True):
    """One request of a benchmark run."""

    prompt_ids: list[int]
    output_len: int  # max_tokens asked for (and min_tokens with --ignore-eos)
    prompt_text: str | None = None  # set when the prompt is sent as text
    group_idx: int = -1  # shared-prefix group, -1 outside that dataset

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


class RandomSpec(msgspec.Struct, frozen=True):
    """Arguments of the random dataset."""

    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        _positive(num_prompts=self.num_prompts, input_len=self.input_len,
                  output_len=self.output_len)  # fmt: skip
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError(f"random range ratio must be in [0, 1], got {self.range_ratio}")


class SharedPrefixSpec(msgspec.Struct, frozen=True):
    """Arguments of the generated-shared-prefix dataset."""

    num_groups: int
    prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    order: str = "grouped"

    def __post_init__(self) -> None:
        _positive(num_groups=self.num_groups, prompts_per_group=self.prompts_per_group,
                  question_len=self.question_len, output_len=self.output_len)  # fmt: skip
        if self.system_prompt_len < 0:
            raise ValueError(f"system prompt length must be >= 0, got {self.system_prompt_len}")
        if self.order not in GSP_ORDERS:
            raise ValueError(f"order must be one of {', '.join(GSP_ORDERS)}, got {self.order!r}")


def _positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def token_pool(vocab_size: int, special_ids: Iterable[int] = ()) -> np.ndarray:
    """The ids prompts are drawn from: [0, vocab_size) minus the special ones."""
    if vocab_size < 1:
        raise ValueError(f"vocab size must be >= 1, got {vocab_size}")
    ids = np.arange(vocab_size, dtype=np.int64)  # [vocab_size]
    pool = ids[~np.isin(ids, np.fromiter(special_ids, dtype=np.int64))]
    if pool.size == 0:
        raise ValueError("every token of the vocabulary is special: no prompt can be drawn")
    return pool


def _lengths(rng: np.random.Generator, length: int, ratio: float, num: int) -> np.ndarray:
    low = max(1, int(length * ratio))
    return rng.integers(low, length + 1, size=num)  # [num], uniform in [low, length]


def random_requests(spec: RandomSpec, pool: np.ndarray, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lens = _lengths(rng, spec.input_len, spec.range_ratio, spec.num_prompts)
    out_lens = _lengths(rng, spec.output_len, spec.range_ratio, spec.num_prompts)
    return [
        BenchRequest(rng.choice(pool, size=int(n)).tolist(), int(m))
        for n, m in zip(in_lens, out_lens)
    ]


def shared_prefix_requests(
    spec: SharedPrefixSpec, pool: np.ndarray, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    for g in range(spec.num_groups):
        prefix = rng.choice(pool, size=spec.system_prompt_len).tolist()
        for _ in range(spec.prompts_per_group):
            question = rng.choice(pool, size=spec.question_len).tolist()
            out.append(BenchRequest(prefix + question, spec.output_len, group_idx=g))
    if spec.order == "round-robin":  # the i-th request of every group, then the next
        n = spec.prompts_per_group
        out = [out[g * n + i] for i in range(n) for g in range(spec.num_groups)]
    return out


def with_text(
    requests: list[BenchRequest], decode: Callable[[list[int]], str]
) -> list[BenchRequest]:
    """The same requests with their prompts decoded, for text-only endpoints."""
    return [msgspec.structs.replace(r, prompt_text=decode(r.prompt_ids)) for r in requests]


def with_output_len(requests: list[BenchRequest], output_len: int) -> list[BenchRequest]:
    """Every request asks for exactly `output_len` tokens (--max-tokens)."""
    _positive(max_tokens=output_len)
    return [msgspec.structs.replace(r, output_len=output_len) for r in requests]


def warmup_request(first: BenchRequest, max_output_len: int = 16) -> BenchRequest:
    """A warm-up request as long as `first` that shares no prefix with the dataset: its
    prompt is `first`'s rotated by half. Warming up with a dataset prompt itself would
    put that prompt (a whole shared-prefix group's system prompt) into the server's
    prefix cache before the timed run."""
    half = first.prompt_len // 2
    text = first.prompt_text
    return BenchRequest(
        first.prompt_ids[half:] + first.prompt_ids[:half],
        min(first.output_len, max_output_len),
        None if text is None else text[len(text) // 2 :] + text[: len(text) // 2],
    )


def from_args(args, load_tokenizer: Callable) -> list[BenchRequest]:
    """The dataset `shunter bench serve`'s arguments describe, with text prompts where the
    backend needs them. The tokenizer (`load_tokenizer(model_path)`) is loaded only for
    text prompts or when --vocab-size is not given."""
    as_text = args.backend == "openai-chat" or args.prompt_format == "text"
    tokenizer = None
    if as_text or args.vocab_size is None:
        tokenizer = load_tokenizer(args.model_path)
    if args.vocab_size is not None:
        pool = token_pool(args.vocab_size)
    else:
        pool = token_pool(len(tokenizer), tokenizer.all_special_ids)
    if args.dataset_name == "random":
        spec = RandomSpec(args.num_prompts, args.random_input_len, args.random_output_len,
                          args.random_range_ratio)  # fmt: skip
        requests = random_requests(spec, pool, args.seed)
    else:
        gsp = SharedPrefixSpec(args.gsp_num_groups, args.gsp_prompts_per_group,
                               args.gsp_system_prompt_len, args.gsp_question_len,
                               args.gsp_output_len, args.gsp_order)  # fmt: skip
        requests = shared_prefix_requests(gsp, pool, args.seed)
    if args.max_tokens is not None:
        requests = with_output_len(requests, args.max_tokens)
    if as_text:
        requests = with_text(requests, tokenizer.decode)
    return requests
