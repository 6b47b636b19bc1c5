"""HF transformers baseline of `shunter bench serve`: the same request list, static batches.

Theory of operation
    The model is the one the server serves, read from the same local files
    (AutoModelForCausalLM on the GGUF, dequantized to --hf-dtype), so the comparison is
    engine against engine. Every request is present at the start (the offline case a
    server run with --request-rate inf measures); they are taken in list order in static
    batches of --hf-batch-size, left-padded, and decoded greedily by `generate` with
    min_new_tokens = max_new_tokens = the largest output length of the batch, so no
    sequence stops early.

    A stopping criterion that never stops records the time after every decoding step
    (HF calls it once per generated token, the first included), which gives each
    request real TTFT, ITL and E2E figures: request i of a batch is done at the step of
    its own output_len (tokens past that, produced only because a longer request shares
    the batch, count as generated but not as output). Duration = first batch start to
    last batch end, as for the server run.

    Nothing here is imported by `shunter bench serve` unless the baseline is asked for,
    and torch/transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import itertools
import pathlib
import sys
import time

import msgspec
import structlog
from tqdm import tqdm

from shunter.actors.model_files import resolve_model
from shunter.ops.bench_datasets import BenchRequest
from shunter.ops.bench_metrics import RequestResult

log = structlog.get_logger("shunter.bench_hf")


class HFRun(msgspec.Struct, frozen=True):
    """One baseline run."""

    results: list[RequestResult]
    duration_s: float
    load_s: float
    batch_size: int
    num_generated_tokens: int  # includes tokens generated past a request's own length


def _from_pretrained(cls, model_path: str | None, **kwargs):
    src = resolve_model(model_path)
    if src.kind == "gguf":
        p = pathlib.Path(src.path)
        return cls.from_pretrained(str(p.parent), gguf_file=p.name, **kwargs)
    return cls.from_pretrained(src.path, **kwargs)


def load_tokenizer(model_path: str | None):
    """The HF tokenizer of a local model (GGUF metadata or an HF directory)."""
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, model_path)


def load_model(model_path: str | None, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, model_path, dtype=getattr(torch, dtype))
    return model.eval()


class _StepClock:
    """A stopping criterion that never stops: it timestamps every decoding step."""

    def __init__(self, device: str) -> None:
        self.times_s: list[float] = []
        self.sync = device.startswith("cuda")

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.sync:  # the step's kernels are queued, not done
            torch.cuda.synchronize()
        self.times_s.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(
    model, batch: list[BenchRequest], pad_id: int, device: str
) -> tuple[list[float], int]:
    """Greedy generate for one static batch -> (step times, tokens generated per row)."""
    import torch
    from transformers import StoppingCriteriaList

    width = max(r.prompt_len for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, width]
    for i, r in enumerate(batch):
        input_ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
        mask[i, width - r.prompt_len :] = 1
    num_new = max(r.output_len for r in batch)
    clock = _StepClock(device)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=num_new,
            min_new_tokens=num_new, do_sample=False, pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )  # fmt: skip
    # out: [B, width + num_generated] on device
    return clock.times_s, int(out.shape[1] - width)


def run_hf(
    requests: list[BenchRequest], *, model_path: str | None = None, batch_size: int = 8,
    dtype: str = "float32", num_threads: int | None = None, device: str = "cpu",
    progress: bool = True,
) -> HFRun:  # fmt: skip
    """Generate every request with HF transformers; per-request records like the server run's."""
    import torch

    if batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {batch_size}")
    if not requests:
        raise ValueError("the HF baseline needs at least one request")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--hf-device {device}: torch sees no CUDA device")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    t_load = time.perf_counter()
    model = load_model(model_path, dtype).to(device)
    load_s = time.perf_counter() - t_load
    cfg = model.generation_config
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else model.config.eos_token_id
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else eos
    pad_id = (pad_id[0] if isinstance(pad_id, list) else pad_id) or 0
    log.info("hf model loaded", load_s=round(load_s, 2), dtype=dtype, device=device,
             threads=torch.get_num_threads())  # fmt: skip
    warm = msgspec.structs.replace(requests[0], output_len=2)
    _generate(model, [warm], pad_id, device)

    results: list[RequestResult] = []
    num_generated = 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="hf batches", file=sys.stderr, disable=not progress):
        steps_s, num_new = _generate(model, batch, pad_id, device)
        num_generated += num_new * len(batch)
        for r in batch:
            n = min(r.output_len, num_new, len(steps_s))
            mine = steps_s[:n]
            results.append(RequestResult(
                success=n > 0, error="" if n > 0 else "HF generated no token",
                prompt_len=r.prompt_len, output_len=n, ttft_s=mine[0] - t0 if n else float("nan"),
                itl_s=[b - a for a, b in itertools.pairwise(mine)],
                e2e_s=mine[-1] - t0 if n else float("nan"), start_s=0.0,
            ))  # fmt: skip
    duration_s = time.perf_counter() - t0
    return HFRun(results, duration_s, load_s, batch_size, num_generated)
