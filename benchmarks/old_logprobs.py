"""pi_old from the sampling pass against a second forward pass, side by side on one real batch.

Plays one grpo.py rollout with its own `rollout` and HF Sampler (which keeps the log-prob of every
sampled token), then, in this one process and on the same samples:
1. exactness: the kept log-probs against `recompute_logprobs` over every sample (the no-grad pass
   the update used to make for each sample trained after its first optimizer step);
2. speed: `update_policy` twice from the same weights, once made to recompute pi_old (no
   `sampler`, the behaviour before pi_old came from sampling) and once with the kept log-probs, with the time of the
   old-log-prob pass, of the whole update, and how far the two updated models end up apart.

    python benchmarks/old_logprobs.py --model runs/<an sft.py run>/checkpoint/model
"""

from __future__ import annotations

import copy
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, machine, resolve_model, write_json  # noqa: E402

sys.path.insert(0, str(REPO))


@dataclass
class Args:
    model: str = "smollm2"
    """`smollm2`, `tiny`, or any grpo.py --model (an sft.py checkpoint is the warm start of compare.py)"""
    env: str = "cooking-easy"
    """--env"""
    seed: int = 1
    """seeds the task draw, sampling and the update's minibatches"""
    num_tasks: int = 2
    """groups"""
    group_size: int = 8
    """episodes per group"""
    max_steps: int = 4
    """turns per episode at most"""
    max_new_tokens: int = 48
    """tokens per answer at most"""
    temperature: float = 1.0
    """sampling temperature (and the update's)"""
    minibatch_size: int = 16
    """samples per optimizer step: with 4 minibatches, 3 of 4 samples are trained after a step (compare.py: 230 / 64)"""
    micro_batch_tokens: int = 4096
    """--micro-batch-tokens"""
    bf16: Optional[bool] = None
    """bf16 autocast (None: the scripts' choice by device, `grpo.bf16_is_fast`; in bf16 kept and recomputed
    log-probs agree only to ~1e-3, since the KV-cache decode and the teacher-forced pass round differently)"""
    out: Path = RESULTS / "old_logprobs.json"
    """JSON result"""


def main(args: Args) -> None:
    import torch

    import envs
    import grpo

    model_path = resolve_model(args.model)
    run = grpo.Args(model=model_path, env=args.env, num_tasks=args.num_tasks, group_size=args.group_size, max_steps=args.max_steps,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, minibatch_size=args.minibatch_size,
                    micro_batch_tokens=args.micro_batch_tokens, kl_coef=0.0, cuda=False)
    spec = envs.load(args.env)
    run = grpo.resolve_args(run, spec)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer, model = grpo.load_policy(model_path, torch.device("cpu"))
    use_bf16 = grpo.bf16_is_fast(torch.device("cpu")) if args.bf16 is None else args.bf16
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
    generate = grpo.Sampler(None, model, tokenizer, run, autocast, exact=True)  # HF on the trained module: pi_old from sampling
    kept = generate.logprobs

    train = spec.task_ids("train")
    tasks = [train[i] for i in np.random.default_rng(args.seed).choice(len(train), args.num_tasks, replace=False)]
    episodes = [grpo.Episode(task, group) for group, task in enumerate(tasks) for _ in range(args.group_size)]
    runner = envs.EnvRunner(spec, 2)
    t0 = time.perf_counter()
    try:
        grpo.rollout(spec, runner, tokenizer, generate, run, episodes, args.temperature, "rollout")
    finally:
        runner.close()
    rollout_s = time.perf_counter() - t0
    prompts, responses, advantages, _ = grpo.training_batch(episodes, run)
    print(f"rollout: {len(prompts)} samples, {sum(map(len, prompts))} prompt tokens in {rollout_s:.0f} s", flush=True)

    # 1. exactness: what the sampling pass kept against the no-grad pass over the same samples
    t0 = time.perf_counter()
    recomputed = grpo.recompute_logprobs(model, prompts, responses, run, tokenizer.pad_token_id, autocast)
    recompute_all_s = time.perf_counter() - t0
    diffs = torch.cat([(kept[(args.temperature, tuple(p), tuple(r))] - q).abs() for p, r, q in zip(prompts, responses, recomputed)])

    # 2. speed: the same update, made to recompute pi_old, then with the kept log-probs
    updates, models = {}, {}
    for name, sampler in (("recomputed", None), ("from_sampling", generate)):
        policy = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=run.learning_rate, weight_decay=run.weight_decay)
        t0 = time.perf_counter()
        metrics = grpo.update_policy(policy, None, optimizer, prompts, responses, advantages, run, tokenizer.pad_token_id, autocast,
                                     torch.Generator().manual_seed(args.seed), sampler=sampler)
        updates[name] = {"total_s": time.perf_counter() - t0, **{k: metrics[k] for k in (
            "perf/logprob_s", "perf/update_s", "perf/old_logprobs_sampled", "perf/old_logprobs_recomputed", "losses/policy_loss",
            "losses/approx_kl_old", "losses/clipfrac", "losses/grad_norm", "perf/optimizer_steps")}}
        models[name] = policy
        print(f"update, pi_old {name}: {updates[name]['total_s']:.0f} s (old log-probs {metrics['perf/logprob_s']:.1f} s)", flush=True)
    weight_diff = max(float((a - b).detach().abs().max()) for a, b in zip(models["recomputed"].parameters(), models["from_sampling"].parameters()))
    result = {
        "benchmark": "old_logprobs", "setting": {k: str(v) for k, v in asdict(args).items()}, "machine": machine(),
        "bf16_autocast": use_bf16, "samples": len(prompts), "prompt_tokens": sum(map(len, prompts)),
        "response_tokens": sum(map(len, responses)), "rollout_s": rollout_s, "recompute_all_s": recompute_all_s,
        "logprob_abs_diff_max": float(diffs.max()), "logprob_abs_diff_mean": float(diffs.mean()),
        "updates": updates, "updated_weights_abs_diff_max": weight_diff,
        "update_time_saved_frac": 1 - updates["from_sampling"]["total_s"] / updates["recomputed"]["total_s"],
    }
    write_json(args.out, result)
    print(f"kept vs recomputed log-probs: max |diff| {result['logprob_abs_diff_max']:.2e} over {len(diffs)} tokens; update "
          f"{updates['recomputed']['total_s']:.0f} s -> {updates['from_sampling']['total_s']:.0f} s "
          f"({result['update_time_saved_frac']:.1%} less); updated weights differ by at most {weight_diff:.2e}")


if __name__ == "__main__":
    main(tyro.cli(Args))
