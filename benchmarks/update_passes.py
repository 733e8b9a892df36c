"""The update's passes with each shared prompt prefix computed once and without, against their token bound.

Plays one grpo.py rollout (benchmarks/prompt_sharing.py's `play`; the README run's setting by default), then, on
those samples, times grpo.py's own passes, one setting at a time: the no-grad pass over every sample (pi_old and
the reference) and a pass with gradients (forward and backward of the summed log-probs, gradient checkpointing on as
grpo.py's default), each with --share-prefix and --no-share-prefix (padded batches through the model's own
attention), at each --micro-batch-tokens. The token bound of sharing is the plain pass's tokens over the shared
pass's (padding included); against the samples' own tokens it is the issue's "sample tokens / computed tokens".

    python benchmarks/update_passes.py                          # README run's rollout; 2048 and 16384 tokens
    python benchmarks/update_passes.py --preset compare --model runs/<an sft.py run>/checkpoint/model
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prompt_sharing  # noqa: E402
from _common import REPO, RESULTS, machine, write_json  # noqa: E402

sys.path.insert(0, str(REPO))

PRESETS = {  # the README run's rollout, and the warm-start comparison's (compare.py)
    "readme": dict(env="cooking-small", response_prefix="<think>", num_tasks=2, group_size=4, max_steps=4,
                   max_new_tokens=64),
    "compare": dict(env="cooking-easy", response_prefix="", num_tasks=4, group_size=8, max_steps=8,
                    max_new_tokens=48),
    "smoke": dict(env="cooking", response_prefix="", num_tasks=1, group_size=2, max_steps=2, max_new_tokens=4),
}  # smoke: the tests' minimal setting


@dataclass
class Args:
    preset: Literal["readme", "compare", "smoke"] = "readme"
    """whose rollout: the README run's or the warm-start comparison's"""
    model: str = "smollm2"
    """`smollm2` or any grpo.py --model"""
    seed: int = 1
    """seeds the task draw and sampling"""
    micro_batch_tokens: tuple[int, ...] = (2048, 16384)
    """--micro-batch-tokens to time"""
    bf16: tuple[bool, ...] = (False,)
    """autocast settings to time (bf16 only where the CPU is fast at it: AVX512-BF16 or AMX)"""
    repeats: int = 1
    """timed repetitions of each pass (the median is kept)"""
    warmup: int = 0
    """untimed passes before them"""
    out: Path = RESULTS / "update_passes.json"
    """JSON result"""


def time_pass(model, prompts, responses, run, autocast, grad: bool, repeats: int, warmup: int) -> dict:
    """Median seconds of one pass over every sample, and the tokens it computed."""
    import grpo
    import torch

    seconds, tokens = [], Counter()
    for k in range(warmup + repeats):
        tokens.clear()
        start = time.perf_counter()
        if grad:
            model.train()
            for _, logp, _ in grpo.micro_batch_logprobs(model, prompts, responses, list(range(len(prompts))), run,
                                                        autocast, tokens):
                logp.sum().backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                model.eval()
                for _ in grpo.micro_batch_logprobs(model, prompts, responses, list(range(len(prompts))), run,
                                                   autocast, tokens):
                    pass
        if k >= warmup:
            seconds.append(time.perf_counter() - start)
    return {"s": statistics.median(seconds), "all_s": seconds, "computed": tokens["computed"]}


def main(args: Args) -> None:
    import grpo
    import torch

    setting = prompt_sharing.Args(model=args.model, seed=args.seed, **PRESETS[args.preset])
    model, _, episodes, _, rollout_s = prompt_sharing.play(setting)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts = [t.prompt_ids for e in episodes for t in e.turns]
    responses = [t.response_ids for e in episodes for t in e.turns]
    sample_tokens = sum(map(len, prompts)) + sum(map(len, responses))
    result = {"benchmark": "update_passes", "setting": {k: str(v) for k, v in asdict(args).items()},
              "rollout": PRESETS[args.preset], "machine": machine(), "samples": len(prompts),
              "sample_tokens": sample_tokens, "rollout_s": rollout_s, "runs": []}
    for bf16 in args.bf16:
        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
        for budget in args.micro_batch_tokens:
            for grad in (False, True):
                row = {"bf16": bf16, "micro_batch_tokens": budget, "pass": "grad" if grad else "no_grad"}
                for share in (True, False):
                    run = grpo.Args(cuda=False, share_prefix=share, micro_batch_tokens=budget, temperature=1.0)
                    row["shared" if share else "plain"] = time_pass(model, prompts, responses, run, autocast, grad,
                                                                     args.repeats, args.warmup)
                shared, plain = row["shared"], row["plain"]
                row["speedup"] = plain["s"] / shared["s"]
                row["token_bound"] = plain["computed"] / shared["computed"]
                row["of_bound"] = row["speedup"] / row["token_bound"]
                row["sample_token_bound"] = sample_tokens / shared["computed"]
                result["runs"].append(row)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                       if k not in ("shared", "plain")}, f"shared {shared['s']:.1f} s, plain {plain['s']:.1f} s",
                      flush=True)
                write_json(args.out, {**result, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                      / 1024})


if __name__ == "__main__":
    main(tyro.cli(Args))
