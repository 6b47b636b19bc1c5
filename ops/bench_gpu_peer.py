"""`python -m shunter.ops.bench_gpu_peer --gpt-fast DIR`: the peer's decode on our model's shape.

Theory of operation
    gpt-fast (pytorch-labs/gpt-fast) is the peer: a plain-PyTorch Llama whose decode
    step is `torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)`,
    Inductor kernels replayed as CUDA graphs. Nothing of it is copied here: its `model`
    and `generate` modules are imported from the checkout DIR (importing `generate`
    sets the Inductor flags its main() runs under), and their own functions are timed
    on the architecture of one of our MODELS (bench_gpu_model.py):
      1. ModelArgs: gpt-fast's named config where it has one (`PEER_NAMES`), checked
         field by field against `peer_args` of our ModelConfig; otherwise built from
         `peer_args` (tiny-llama, the CPU smoke test's model).
      2. The Transformer is built on the meta device, allocated in bf16 on --device
         and filled with seeded N(0, 0.02) weights (norm weights 1): a dummy, like ours.
      3. A run: `prefill` of --batch-size random --prompt-len prompts, one untimed
         `decode_n_tokens` step, then --decode-steps steps of `decode_n_tokens` timed
         (synchronized, perf_counter). That is bench_gpu.bench_decode's pattern, so
         `roofline_frac`'s mean context is right for both.
      4. Compiled (the default), decode_one_token in generate's namespace is replaced
         by the compiled one, as main() does, and restored afterwards. Every mode
         makes one untimed run first; compiled, its seconds are compile_s (what main()
         prints as "Compilation time").
    Figures: tok/s = B * steps / time, ms/step, and the fraction of the copy-bandwidth
    roofline (bench_gpu's `_copy_gbs` and `roofline_frac`), under the same keys as
    `shunter bench executor --device cuda`, so the two summaries line up. Sampling is
    main()'s default (temperature 0.8, top_k 200) unless told otherwise; `--top-k 0`
    passes None, which skips gpt-fast's per-step topk over the vocabulary. The JSON
    summary is the last stdout line; --out writes it too.
    A module of its own rather than an option of `shunter bench executor`: it needs a
    gpt-fast checkout, and gpt-fast's `generate` imports sentencepiece and tiktoken.

Invariants: the timed region starts and ends on a synchronized device; generate's
module state is restored after a run. gpt-fast's attention reads the whole KV cache
(prompt + steps + 1 positions, rounded up to 8) under a mask, not only the context;
at the default sizes on the 8B model that is under 0.3% of a step's bytes, and the
roofline does not count it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import pathlib
import sys
import time
from collections.abc import Iterator
from types import ModuleType

import torch
from tqdm import tqdm

from shunter.actors.executor.models.config import ModelConfig, from_hf_dict
from shunter.ops.bench_gpu import _copy_gbs, _sync, roofline_frac
from shunter.ops.bench_gpu_model import MODELS

# our MODELS key -> the key of gpt-fast's model.transformer_configs with that shape
PEER_NAMES = {"llama-3.1-8b": "llama-3.1-8b"}
DTYPE = torch.bfloat16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m shunter.ops.bench_gpu_peer",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--gpt-fast", required=True, metavar="DIR", help="a gpt-fast checkout")
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run gpt-fast eagerly (a CPU smoke test)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.8, help="generate.py main()'s default")
    p.add_argument("--top-k", type=int, default=200,
                   help="generate.py main()'s default; 0: no top-k (sampling over all ids)")  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    return p


# ---- the peer's model ----------------------------------------------------------------------


def peer_args(c: ModelConfig) -> dict:
    """gpt-fast ModelArgs fields (after its __post_init__) for our config. Raises
    ValueError for a switch gpt-fast's model lacks."""
    rs = c.rope_scaling
    lacks = [what for what, on in (
        ("tied embeddings", c.tie_word_embeddings), ("q/k/v biases", c.qkv_bias),
        ("an output bias", c.o_bias), ("MLP biases", c.mlp_bias), ("q/k norm", c.qk_norm),
        ("a sliding window", c.sliding_window is not None),
        ("rope frequency factors", c.rope_freq_factors is not None),
        ("head_dim other than hidden_size / num_heads", c.head_dim * c.num_heads != c.hidden_size),
        (f"{rs and rs.rope_type} rope scaling", rs is not None and rs.rope_type != "llama3"),
    ) if on]  # fmt: skip
    if lacks:
        raise ValueError(f"gpt-fast's model has no {', '.join(lacks)}")
    scaling = None
    if rs is not None:  # gpt-fast's apply_rope_scaling is Llama 3.1's, reading these four
        scaling = dict(factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                       high_freq_factor=rs.high_freq_factor,
                       original_max_position_embeddings=rs.original_max_position_embeddings)  # fmt: skip
    return dict(block_size=c.max_position_embeddings, vocab_size=c.vocab_size,
                n_layer=c.num_layers, n_head=c.num_heads, dim=c.hidden_size,
                intermediate_size=c.intermediate_size, n_local_heads=c.num_kv_heads,
                head_dim=c.head_dim, rope_base=c.rope_theta, norm_eps=c.rms_norm_eps,
                rope_scaling=scaling)  # fmt: skip


def import_peer(root: str | pathlib.Path, name: str) -> ModuleType:
    """gpt-fast's top-level module `name` from the checkout `root` (put first on
    sys.path). Raises ValueError when a module of that name came from elsewhere."""
    root = pathlib.Path(root).resolve()
    if not (root / f"{name}.py").is_file():
        raise ValueError(f"{root} has no {name}.py: not a gpt-fast checkout")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    mod = importlib.import_module(name)
    if pathlib.Path(mod.__file__ or "").resolve().parent != root:
        raise ValueError(f"module {name!r} was imported from {mod.__file__}, not {root}")
    return mod


def model_args(peer_model: ModuleType, model: str, c: ModelConfig) -> tuple[object, str | None]:
    """(gpt-fast ModelArgs, the name of its config used or None when built from ours).
    Raises ValueError when gpt-fast's named config differs from ours."""
    ours = peer_args(c)
    name = PEER_NAMES.get(model)
    if name is None or name not in peer_model.transformer_configs:
        return peer_model.ModelArgs(**ours), None
    args = peer_model.ModelArgs.from_name(name)
    theirs = dataclasses.asdict(args)
    diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if diff:
        raise ValueError(f"gpt-fast's {name!r} differs from ours (theirs, ours): {diff}")
    return args, name


def build_model(peer_model: ModuleType, args: object, dev: torch.device, seed: int):
    """gpt-fast's Transformer in bf16 on `dev`, seeded random weights drawn there."""
    with torch.device("meta"):
        model = peer_model.Transformer(args)
    model = model.to(DTYPE).to_empty(device=dev)  # no fp32 copy of the weights anywhere
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


# ---- timing -------------------------------------------------------------------------------


@contextlib.contextmanager
def decode_compiled(gen: ModuleType, compile: bool) -> Iterator[None]:
    """generate.decode_one_token compiled as main() compiles it (decode_n_tokens looks
    it up in generate's namespace on each step), the eager one restored on exit."""
    eager = gen.decode_one_token
    if compile:
        gen.decode_one_token = torch.compile(eager, mode="reduce-overhead", fullgraph=True)
    try:
        yield
    finally:
        gen.decode_one_token = eager


def decode_run(gen: ModuleType, model, prompts: torch.Tensor, steps: int, sampling: dict,
               desc: str) -> float:  # fmt: skip
    """Seconds of `steps` decode steps after prefilling `prompts` and one untimed step."""
    dev = prompts.device
    plen = prompts.shape[1]  # prompts: [B, P] int32 dev
    with torch.no_grad():
        tok = gen.prefill(model, prompts, torch.arange(plen, device=dev), **sampling)  # [B, 1]
        pos = torch.tensor([plen], device=dev, dtype=torch.int)  # [1]; decode_n_tokens bumps it
        (tok,), _ = gen.decode_n_tokens(model, tok.clone(), pos, 1, **sampling)
        with tqdm(total=steps, desc=desc, file=sys.stderr, leave=False) as bar:
            _sync(dev)
            t0 = time.perf_counter()
            gen.decode_n_tokens(model, tok, pos, steps, callback=lambda _: bar.update(), **sampling)
            _sync(dev)
            return time.perf_counter() - t0


# ---- the run -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    bs, plen, steps = args.batch_size, args.prompt_len, args.decode_steps
    c = from_hf_dict(MODELS[args.model])
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench peer: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if min(bs, plen, steps) < 1 or plen + steps + 1 > c.max_position_embeddings:
        print("bench peer: sizes must be >= 1 and fit the model's context", file=sys.stderr)
        return 2
    try:
        peer_model = import_peer(args.gpt_fast, "model")
        gen = import_peer(args.gpt_fast, "generate")
    except (ImportError, ValueError) as e:
        print(f"bench peer: cannot import gpt-fast from {args.gpt_fast}: {e}", file=sys.stderr)
        return 2
    s: dict = {}
    if dev.type == "cuda":
        s["copy_gbs"] = _copy_gbs(dev)
        torch.cuda.empty_cache()
        name = torch.cuda.get_device_name(dev)
        print(f"ceiling: copy {s['copy_gbs']:.0f} GB/s ({name})", flush=True)
    margs, peer_name = model_args(peer_model, args.model, c)
    t0 = time.perf_counter()
    model = build_model(peer_model, margs, dev, args.seed)
    with torch.device(dev):  # generate() builds the caches under the device too
        model.setup_caches(max_batch_size=bs, max_seq_length=plen + steps + 1)
    print(f"gpt-fast {peer_name or 'ModelArgs from our config'}: built in "
          f"{time.perf_counter() - t0:.1f} s (bfloat16, {dev})", flush=True)  # fmt: skip
    gen_cpu = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, c.vocab_size, (bs, plen), generator=gen_cpu, dtype=torch.int)
    prompts = prompts.to(dev)  # [B, P] int32
    sampling = {"temperature": args.temperature, "top_k": args.top_k or None}

    with decode_compiled(gen, args.compile):
        t0 = time.perf_counter()
        decode_run(gen, model, prompts, steps, sampling, "warm-up" + " (compile)" * args.compile)
        _sync(dev)
        warmup_s = time.perf_counter() - t0
        dt = decode_run(gen, model, prompts, steps, sampling, f"decode bs={bs}")
    tok_s = bs * steps / dt
    frac = roofline_frac(c, tok_s, bs, plen, steps, s.get("copy_gbs"), DTYPE.itemsize)
    s["compile_s"] = warmup_s if args.compile else None
    s[f"decode_tok_s_bs{bs}"], s[f"decode_ms_bs{bs}"] = tok_s, dt / steps * 1e3
    s[f"decode_bs{bs}_roofline_frac"] = frac
    print(f"gpt-fast decode bs={bs} ({plen}-token prompts, {steps} steps): {tok_s:.1f} tok/s, "
          f"{dt / steps * 1e3:.2f} ms/step" + (f", {frac:.1%} of roofline" if frac else "")
          + (f"; compile {warmup_s:.1f} s" if args.compile else ""), flush=True)  # fmt: skip
    s["config"] = {"engine": "gpt-fast", "gpt_fast": str(pathlib.Path(args.gpt_fast).resolve()),
                   "gpt_fast_config": peer_name, "model": args.model, "dtype": "bfloat16",
                   "batch_size": bs, "prompt_len": plen, "decode_steps": steps,
                   "compile": args.compile, **sampling, "device": args.device,
                   "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                   "seed": args.seed, "torch": torch.__version__}  # fmt: skip
    out = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()})
    if args.out:
        pathlib.Path(args.out).write_text(out + "\n")
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
