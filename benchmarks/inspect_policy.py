"""What does a trained policy answer? Samples a checkpoint's first-step answers on held-out games.

A rising valid-action rate can hide a collapse onto one answer; this shows the answers and the
actions they parse to, counted, and writes them as JSON.

    python benchmarks/inspect_policy.py runs/<run>/checkpoint/model --env cooking-small --response-prefix "<think>"
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import tyro

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import envs  # noqa: E402
import grpo  # noqa: E402


@dataclass
class Args:
    model: tyro.conf.Positional[str]
    """a checkpoint's model folder (runs/<run>/checkpoint/model) or any grpo.py --model"""
    env: str = "cooking-small"
    """--env the policy was trained on"""
    response_prefix: str = "<think>"
    """--response-prefix it was trained with"""
    num_games: int = 4
    """held-out games (the env's eval split, first ones)"""
    samples: int = 4
    """answers sampled per game"""
    temperature: float = 0.8
    """sampling temperature"""
    max_new_tokens: int = 64
    """response budget"""
    seed: int = 0
    """sampling seed"""
    out: Optional[Path] = None
    """JSON result (printed only when not given)"""


def main(args: Args) -> dict:
    torch.manual_seed(args.seed)
    tokenizer, model = grpo.load_policy(args.model, torch.device("cpu"))  # resolves names and .gguf files as grpo.py does
    spec = envs.load(args.env)
    env = spec.make()
    actions, answers, valid = Counter(), Counter(), 0
    try:
        for task_id in spec.task_ids(spec.preset.eval_split.split(",")[0])[: args.num_games]:
            step = env.reset(task_id)
            prompt = grpo.encode_prompt(tokenizer, spec.prompt(step.task, step.observation, step.admissible, [], 0, 0), args.response_prefix)
            responses = grpo.generate_hf(model, tokenizer, [prompt] * args.samples, args.max_new_tokens, args.temperature, 1.0,
                                         lambda: torch.autocast("cpu", enabled=False))
            for response in responses:
                text = args.response_prefix + tokenizer.decode(response, skip_special_tokens=True)
                action, ok = spec.parse(text)
                actions[action] += 1
                answers[text.strip()] += 1
                valid += ok
    finally:
        env.close()
    n = args.num_games * args.samples
    result = {"model": args.model, "env": args.env, "answers_sampled": n, "valid_fraction": valid / n,
              "distinct_actions": len(actions), "distinct_answers": len(answers),
              "actions": actions.most_common(), "answers": answers.most_common(10), "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"{n} answers: {valid} well formed, {len(actions)} distinct actions, {len(answers)} distinct answers")
    for action, count in actions.most_common(8):
        print(f"  {count:3d}  {action!r}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
