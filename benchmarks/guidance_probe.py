"""Does the expert hint g_k help this policy win? ActGuide-RL's premise, measured before paying for a run.

ActGuide-RL (actguide.py) re-rolls a group that never won with the first k expert actions shown in
the prompt, the smallest k whose probes win. Its learning signal exists only if a guided policy wins
more often than an unguided one. This script plays, with actguide.py's own `rollout`,
`build_prompt` and `render_guidance`, the same training games at several hint lengths k (k = K: the
whole walkthrough) and reports success per k, how often the policy took the hinted action at a
hinted step, and a few guided transcripts.

    python benchmarks/guidance_probe.py --model runs/<an sft.py run>/checkpoint/model
    python benchmarks/guidance_probe.py --model smollm2          # the cold start (no SFT)
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict, dataclass, field
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
    """`smollm2`, `tiny`, or any actguide.py --model (an sft.py checkpoint is compare.py's warm start)"""
    env: str = "cooking-easy"
    """--env (must have reference actions)"""
    seed: int = 1
    """seeds the task draw and the sampling"""
    num_tasks: int = 6
    """training games, drawn by the seed's generator as actguide.py draws an iteration's tasks"""
    episodes: int = 4
    """episodes per game and hint length"""
    hint_fractions: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """hint lengths as fractions of each walkthrough: k = round(f * K); 0 is unguided, 1 the whole plan"""
    max_steps: int = 8
    """turns per episode at most (compare.py's setting)"""
    max_new_tokens: int = 48
    """tokens per answer at most"""
    temperature: float = 1.0
    """sampling temperature (actguide.py probes and re-rolls at the training temperature)"""
    num_env_workers: int = 2
    """--num-env-workers"""
    transcripts: int = 3
    """guided episodes (largest k) whose actions are kept in the JSON"""
    bf16: Optional[bool] = None
    """bf16 autocast (default: actguide.py's choice by CPU; False matches compare.py's fp32 runs)"""
    out: Path = RESULTS / "guidance_probe.json"
    """JSON result"""


def followed_hint(episode) -> tuple[int, int]:
    """(steps t < k at which the action taken was the hint's t-th action, steps t < k played)."""
    norm = lambda a: " ".join(a.lower().split())  # noqa: E731
    played = min(len(episode.hint), len(episode.turns))
    return sum(norm(episode.turns[t].action) == norm(episode.hint[t]) for t in range(played)), played


def main(args: Args) -> None:
    import torch

    import actguide
    import envs

    if not all(0.0 <= f <= 1.0 for f in args.hint_fractions):
        raise SystemExit(f"--hint-fractions must lie in [0, 1] (got {args.hint_fractions})")
    model_path = resolve_model(args.model)
    spec = envs.load(args.env)
    run = actguide.resolve_args(actguide.Args(model=model_path, env=args.env, num_tasks=args.num_tasks, group_size=max(2, args.episodes),
                                              max_steps=args.max_steps, max_new_tokens=args.max_new_tokens,
                                              temperature=args.temperature, cuda=False), spec)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tokenizer, model = actguide.load_policy(model_path, torch.device("cpu"))
    use_bf16 = actguide.bf16_is_fast(torch.device("cpu")) if args.bf16 is None else args.bf16
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731

    def generate(prompts, temperature, max_new_tokens=None):
        return actguide.generate_hf(model, tokenizer, prompts, run.max_new_tokens, temperature, run.top_p, autocast)

    train = spec.task_ids("train")
    tasks = [train[i] for i in np.random.default_rng(args.seed).choice(len(train), args.num_tasks, replace=False)]
    runner = envs.EnvRunner(spec, args.num_env_workers)
    rows, transcripts = [], []
    try:
        plans = runner.reference_actions(tasks)
        if not all(plans):
            raise SystemExit(f"{args.env}: some drawn games have no reference actions; nothing to hint with")
        for frac in args.hint_fractions:
            episodes = [actguide.Episode(task, g, hint=plan[: round(frac * len(plan))])
                        for g, (task, plan) in enumerate(zip(tasks, plans)) for _ in range(args.episodes)]
            t0 = time.perf_counter()
            actguide.rollout(spec, runner, tokenizer, generate, run, episodes, args.temperature, f"k = {frac:g} K")
            took, follow = time.perf_counter() - t0, [followed_hint(e) for e in episodes]
            valid = [t.valid for e in episodes for t in e.turns]
            rows.append({
                "hint_fraction": frac, "k_mean": float(np.mean([len(e.hint) for e in episodes])),
                "episodes": len(episodes), "wins": int(sum(e.won for e in episodes)),
                "success_rate": float(np.mean([e.won for e in episodes])),
                "games_won_at_least_once": int(sum(any(e.won for e in episodes if e.group == g) for g in range(len(tasks)))),
                "hint_step_match_rate": sum(a for a, _ in follow) / max(sum(b for _, b in follow), 1) if frac > 0 else None,
                "valid_rate": float(np.mean(valid)) if valid else 0.0,
                "episode_length": float(np.mean([len(e.turns) for e in episodes])), "seconds": took,
            })
            print(f"k = {frac:g} K: {rows[-1]['wins']}/{len(episodes)} won, {rows[-1]['games_won_at_least_once']}/{len(tasks)} games "
                  f"won at least once, valid {rows[-1]['valid_rate']:.2f}, hinted action taken at "
                  f"{rows[-1]['hint_step_match_rate'] if frac > 0 else float('nan'):.2f} of hinted steps ({took:.0f} s)", flush=True)
            if frac == max(args.hint_fractions) and frac > 0:
                transcripts = [{"task_id": e.task_id, "hint": e.hint, "won": e.won,
                                "actions": [t.action for t in e.turns], "valid": [t.valid for t in e.turns],
                                "first_response": tokenizer.decode(e.turns[0].response_ids, skip_special_tokens=True) if e.turns else ""}
                               for e in episodes[: args.transcripts]]
    finally:
        runner.close()
    write_json(args.out, {"benchmark": "guidance_probe", "setting": {k: str(v) for k, v in asdict(args).items()},
                          "model_path": model_path, "machine": machine(), "bf16": use_bf16, "tasks": tasks, "plans": plans, "rows": rows,
                          "transcripts": transcripts})


if __name__ == "__main__":
    main(tyro.cli(Args))
