"""How held-out are compare.json's held-out games? Their expert plans against the plans the runs trained on.

cooking-easy plans are five steps (inventory, examine cookbook, take one item, prepare meal, eat meal), so a test
game (another layout, other objects) can share its plan word for word with a training game. For each seed this
counts, on the held-out list every script of that seed played, the games whose plan equals the plan of a game
the runs trained on: the warm start's demonstrations (sft.py seed 1, its 16 games) and the tasks the seed's RL
runs drew (num_tasks per iteration; every script of a seed draws the same ones, the filter being off). The lists
are redrawn with the scripts' own generators: `default_rng(seed + 1000)` for the held-out list,
`default_rng(seed)` for the training tasks, `default_rng(1)` for sft.py's demonstrations.

    python benchmarks/heldout_plans.py                 # seeds 1 and 2 of compare.json -> results/heldout_plans.json
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS  # noqa: E402

sys.path.insert(0, str(REPO))


@dataclass
class Args:
    seeds: tuple[int, ...] = (1, 2)
    """seeds whose held-out lists are counted"""
    num_eval_tasks: int = 32
    """held-out games per seed (compare.json's seeds 1 and 2: 32; seeds 3 and 4: 64)"""
    env: str = "cooking-easy"
    """env of the runs"""
    num_tasks: int = 4
    """training tasks drawn per iteration"""
    iterations: int = 4
    """iterations of each run"""
    sft_num_tasks: int = 16
    """the warm start's demonstration games"""
    out: Path = RESULTS / "heldout_plans.json"
    """where the counts go"""


def drawn_lists(spec, seed: int, args: Args) -> tuple[list[str], list[str], list[str]]:
    """(held-out list, the RL runs' training tasks, sft.py's demonstrations), drawn as the scripts draw them."""
    train, test = spec.task_ids(spec.preset.train_split), spec.task_ids(spec.preset.eval_split)
    eval_rng = np.random.default_rng(seed + 1000)
    held_out = [test[k] for k in sorted(eval_rng.choice(len(test), min(args.num_eval_tasks, len(test)), replace=False))]
    task_rng = np.random.default_rng(seed)
    trained = [train[k] for _ in range(args.iterations) for k in task_rng.choice(len(train), args.num_tasks, replace=False)]
    demo_rng = np.random.default_rng(1)
    demos = [train[k] for k in sorted(demo_rng.choice(len(train), args.sft_num_tasks, replace=False))]
    return held_out, trained, demos


def main(args: Args) -> dict:
    import envs

    os.environ.setdefault("COOKING_CACHE", str(REPO / ".cache" / "cooking"))
    spec = envs.load(args.env)
    env, plans = spec.make(), {}
    plan = lambda task: plans.setdefault(task, tuple(env.reference_actions(task)))  # noqa: E731
    result = {"benchmark": "heldout_plans", "setting": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "seeds": {}}
    for seed in args.seeds:
        held_out, trained, demos = drawn_lists(spec, seed, args)
        seen = {plan(t) for t in trained + demos}
        shared = [t for t in held_out if plan(t) in seen]
        result["seeds"][str(seed)] = {
            "held_out": held_out, "trained_tasks": trained, "demonstrations": demos,
            "plan_seen": {t: plan(t) in seen for t in held_out},
            "games": len(held_out), "games_whose_plan_was_trained": len(shared),
            "distinct_plans_held_out": len({plan(t) for t in held_out}), "distinct_plans_trained": len(seen),
        }
        print(f"seed {seed}: {len(shared)} of {len(held_out)} held-out games share their plan with a trained game "
              f"({len(seen)} distinct trained plans)", flush=True)
    env.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
