"""`python -m envs check --env cooking --num-tasks 5`: replay each task's reference actions.

Prints, per task, the steps taken and whether the replay won; exits 0 only when every replay
wins. Run it after installing an env to see that the package and its data work.
"""

from __future__ import annotations

import argparse
import sys
import time

import envs


def check(name: str, split: str | None, num_tasks: int, num_workers: int, data: str | None, url: str | None) -> int:
    try:
        spec = envs.load(name, data=data, url=url)
        split = split or spec.preset.eval_split.split(",")[0]  # the first of the env's eval splits
        tasks = spec.task_ids(split)[:num_tasks]
    except (ValueError, envs.EnvUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not tasks:
        print(f"error: env {name} has no tasks in split {split!r}", file=sys.stderr)
        return 2
    if hasattr(spec.module, "check"):  # envs whose expert data cannot win by replay (search) check themselves
        return spec.module.check(spec, split, num_tasks)
    start = time.perf_counter()
    failures = steps_total = 0
    with envs.EnvRunner(spec, num_workers) as runner:
        # a few tasks per worker at a time, so results print as they come
        for first in range(0, len(tasks), 4 * num_workers):
            chunk = tasks[first : first + 4 * num_workers]
            won, taken, plans = replay(runner, chunk)
            for i, task in enumerate(chunk):
                steps_total += taken[i]
                print(f"{task}: {taken[i]}/{len(plans[i])} reference steps, {'won' if won[i] else 'NOT WON'}")
                failures += not won[i]
    elapsed = time.perf_counter() - start
    print(f"{len(tasks) - failures}/{len(tasks)} won, {steps_total} steps in {elapsed:.1f}s "
          f"({steps_total / max(elapsed, 1e-9):.1f} steps/s over {num_workers} workers, setup included)")
    return 0 if failures == 0 else 1


def replay(runner, tasks: list[str]):
    """Play each task's reference actions in lockstep; print why an episode could not run."""
    plans = runner.reference_actions(tasks)
    obs = runner.reset(tasks)
    done = {i: o.done for i, o in enumerate(obs)}
    won = {i: o.won for i, o in enumerate(obs)}
    taken = {i: 0 for i in range(len(tasks))}
    for i, o in enumerate(obs):
        if o.crashed:
            print(f"  {tasks[i]}: reset failed: {o.observation}")
        elif not plans[i]:
            print(f"  {tasks[i]}: no reference actions")
    for t in range(max((len(p) for p in plans), default=0)):
        actions = {i: p[t] for i, p in enumerate(plans) if t < len(p) and not done[i]}
        for i, result in runner.step(actions).items():
            taken[i] += 1
            done[i], won[i] = result.done, result.won
            if result.crashed:
                print(f"  {tasks[i]}: {result.observation}")
    return won, taken, plans


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="replay reference actions; exit 0 when every task is won")
    c.add_argument("--env", required=True, choices=list(envs.ENVS))
    c.add_argument("--split", default=None, help="default: the env's evaluation split")
    c.add_argument("--num-tasks", type=int, default=5)
    c.add_argument("--num-workers", type=int, default=2)
    c.add_argument("--data", default=None, help="the env's data location (as --env-data of the scripts)")
    c.add_argument("--url", default=None, help="retrieval server URL (search env)")
    args = parser.parse_args(argv)
    return check(args.env, args.split, args.num_tasks, args.num_workers, args.data, args.url)


if __name__ == "__main__":
    sys.exit(main())
