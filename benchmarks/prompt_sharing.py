"""How much of one rollout's prompt compute repeats, and how much of it --share-prefix skips.

Plays one grpo.py rollout (its own `rollout` and Sampler: vLLM where it imports, else HF `generate`; the compare
setting by default: 4 tasks x 8 episodes, 8 steps, 48 new tokens, temperature 1.0) and counts, over the step samples
the update would train on:
- duplicate samples: prompts identical to an earlier sample's (every group's first turn, and
  episodes whose last observations and actions coincide);
- shared-prefix tokens: for each sample, the longest prefix it shares with any earlier sample.
  Their share of all prompt tokens bounds what a forward pass that computes each shared prefix
  once could skip, in generation prefill and in the update alike;
- tokens computed (prompt and response, each shared prefix once) by grpo.py's own packing (`micro_batches`,
  `pack_samples`) under --micro-batch-tokens: in the no-grad pass over all samples, in the update's minibatches as
  update_policy draws them (a random split, as verl-agent), and with each group's samples kept in one minibatch.

    python benchmarks/prompt_sharing.py --model runs/<an sft.py run>/checkpoint/model
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

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
    """seeds the task draw and sampling"""
    num_tasks: int = 4
    """groups"""
    group_size: int = 8
    """episodes per group"""
    max_steps: int = 8
    """turns per episode at most"""
    max_new_tokens: int = 48
    """tokens per answer at most"""
    temperature: float = 1.0
    """sampling temperature"""
    response_prefix: str = ""
    """--response-prefix (the README run's: <think>)"""
    minibatch_size: int = 64
    """the update's --minibatch-size (compare.py's)"""
    micro_batch_tokens: int = 4096
    """the update's --micro-batch-tokens (compare.py's)"""
    out: Path = RESULTS / "prompt_sharing.json"
    """JSON result"""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sharing(prompts: list[list[int]]) -> dict:
    """Duplicates and longest shared prefixes, each sample against the samples before it."""
    seen, duplicates, shared = set(), 0, 0
    for k, p in enumerate(prompts):
        duplicates += tuple(p) in seen
        seen.add(tuple(p))
        shared += max((common_prefix(p, q) for q in prompts[:k]), default=0)
    total = sum(map(len, prompts))
    return {"samples": len(prompts), "distinct_prompts": len(seen), "duplicate_samples": duplicates, "prompt_tokens": total,
            "shared_prefix_tokens": shared, "shared_prefix_frac": shared / max(total, 1)}


def computed_tokens(samples: list[list[int]], groups: list[int], minibatch_size: int, budget: int,
                    seed: int = 0) -> dict:
    """Tokens grpo.py's packing computes, each shared prefix once, against all of them: one pass over every sample
    (the pi_old and reference pass), the update's random minibatches (update_policy's draw), and minibatches that
    keep a group's samples together (the groups in random order, split into as many equal parts)."""
    import torch

    import grpo

    def packed(rows: list[int]) -> int:
        seqs = {i: samples[i] for i in rows}
        order = grpo.token_order(seqs, True)
        return sum(grpo.pack_samples([seqs[i] for i in batch], [order[i] for i in batch])[0].shape[1]
                   for batch in grpo.micro_batches(seqs, order, budget, True))

    n = len(samples)
    parts = max(1, -(-n // minibatch_size))
    drawn = np.array_split(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy(), parts)
    order = np.random.default_rng(seed).permutation(sorted(set(groups)))
    by_group = np.array_split(np.array([i for g in order for i in range(n) if groups[i] == g]), parts)
    whole = sum(map(len, samples))
    return {"tokens": whole, "one_pass": packed(list(range(n))) / whole,
            "update_random_minibatches": sum(packed(m.tolist()) for m in drawn) / whole,
            "update_group_minibatches": sum(packed(m.tolist()) for m in by_group) / whole,
            "unshared_micro_batches": sum(packed([i]) for i in range(n)) / whole}


def play(args: Args):
    """One grpo.py rollout in `args`'s setting: (model, bf16 autocast on, episodes, rollout timing, rollout seconds)."""
    import torch

    import envs
    import grpo

    model_path = resolve_model(args.model)
    run = grpo.Args(model=model_path, env=args.env, num_tasks=args.num_tasks, group_size=args.group_size,
                    max_steps=args.max_steps, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    response_prefix=args.response_prefix, cuda=False)
    spec = envs.load(args.env)
    run = grpo.resolve_args(run, spec)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer, model = grpo.load_policy(model_path, torch.device("cpu"))
    use_bf16 = grpo.bf16_is_fast(torch.device("cpu"))
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731

    llm = grpo.make_vllm(run, model, tokenizer, torch.device("cpu"), use_bf16, 1)
    generate = grpo.Sampler(llm, model, tokenizer, run, autocast)
    generate.sync(model)

    train = spec.task_ids("train")
    tasks = [train[i] for i in np.random.default_rng(args.seed).choice(len(train), args.num_tasks, replace=False)]
    episodes = [grpo.Episode(task, group) for group, task in enumerate(tasks) for _ in range(args.group_size)]
    runner = envs.EnvRunner(spec, 2)
    t0 = time.perf_counter()
    try:
        timing = grpo.rollout(spec, runner, tokenizer, generate, run, episodes, args.temperature, "rollout")
    finally:
        runner.close()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    return model, use_bf16, episodes, timing, time.perf_counter() - t0


def main(args: Args) -> None:
    model, use_bf16, episodes, timing, rollout_s = play(args)
    result = {"benchmark": "prompt_sharing", "setting": {k: str(v) for k, v in asdict(args).items()}, "machine": machine(),
              "bf16_autocast": use_bf16, **sharing([t.prompt_ids for e in episodes for t in e.turns]),
              "won": sum(e.won for e in episodes), "episodes": len(episodes),
              "invalid_rate": float(np.mean([not t.valid for e in episodes for t in e.turns])),
              "rollout_s": rollout_s, "gen_s": timing["gen_s"], "gen_tokens": timing["gen_tokens"],
              "computed_frac": computed_tokens([t.prompt_ids + t.response_ids for e in episodes for t in e.turns],
                                               [e.group for e in episodes for _ in e.turns], args.minibatch_size,
                                               args.micro_batch_tokens, args.seed)}
    write_json(args.out, result)
    print(f"{result['duplicate_samples']} of {result['samples']} samples repeat a prompt; "
          f"{result['shared_prefix_frac']:.1%} of {result['prompt_tokens']} prompt tokens are a prefix shared with an earlier sample")
    print("tokens computed, of all:", {k: round(v, 3) for k, v in result["computed_frac"].items() if k != "tokens"})


if __name__ == "__main__":
    main(tyro.cli(Args))
