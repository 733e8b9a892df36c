"""HF `generate` against colocated vLLM on this machine, side by side in one sitting.

The compare setting's warm-start grpo.py run (benchmarks/compare.py: SmolLM2-135M-Instruct after sft.py on 16
cooking-easy games; 4 tasks x 8 episodes, 8 steps, 48 new tokens, lr 1e-5, no KL, fp32; 32 held-out games at T = 1
at iterations 0, 2, 4), one seed, made once with `--vllm False` and once with `--vllm True`. Nothing else differs.
For each: generation tokens/s of the training rollouts, seconds per evaluation, seconds per iteration (rollout and
update, evaluation apart), the trainer's peak RSS, the engine's log-prob gap to the trained weights, and held-out
success. vLLM's KV cache on CPU is $VLLM_CPU_KVCACHE_SPACE GiB (the scripts' default 2, of this machine's 24).

    python benchmarks/backends.py                                  # builds the warm start first (compare.py's sft.py run)
    python benchmarks/backends.py --sft-run runs/compare/warm-start/<run>
    python benchmarks/backends.py --hf-iterations 1                # HF's timings only: iteration 0's evaluation + 1 iteration

Runs are resumable: a finished run is read back, an unfinished one continues with --resume.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402
from _common import REPO, RESULTS, machine, read_metrics, resolve_model, write_json  # noqa: E402


@dataclass
class Args:
    setting: compare.Args = field(default_factory=compare.Args)
    """the compare setting (its --setting.* flags: model, env, tasks, steps, iterations, held-out games, ...)"""
    sft_run: Optional[Path] = None
    """a finished sft.py run to start from (default: compare.py's warm start, made here under runs_dir)"""
    seed: int = 1
    """the one seed both backends run"""
    hf_iterations: Optional[int] = None
    """iterations of the HF run (default: the setting's); fewer measures HF's costs without its held-out curve"""
    backends: tuple[str, ...] = ("vllm", "hf")
    """which runs to make, in this order"""
    runs_dir: Path = REPO / "runs" / "backends"
    """where the runs (and a warm start made here) are written"""
    out: Path = RESULTS / "backends.json"
    """the results"""


def mean_of(metrics: dict[int, dict], key: str) -> Optional[float]:
    values = [row[key] for i, row in sorted(metrics.items()) if key in row and (i > 0 or key == "perf/eval_s")]
    return float(np.mean(values)) if values else None


def summary(backend: str, info: dict) -> dict:
    metrics = read_metrics(info["run_dir"])
    rows = [metrics[i] for i in sorted(metrics) if i > 0]
    timed = sum(r["perf/iteration_s"] for r in rows) + sum(m.get("perf/eval_s", 0.0) for m in metrics.values())
    return {
        "backend": backend, "command": info["command"], "run_dir": info["run_dir"],
        "iterations": max(metrics, default=0),
        "gen_tokens_per_s": mean_of(metrics, "perf/gen_tokens_per_s"),
        "gen_s_per_iteration": mean_of(metrics, "perf/gen_s"),
        "logprob_s_per_iteration": mean_of(metrics, "perf/logprob_s"),
        "update_s_per_iteration": mean_of(metrics, "perf/update_s"),
        "iteration_s": mean_of(metrics, "perf/iteration_s"),
        "eval_s": mean_of(metrics, "perf/eval_s"),
        "eval_s_each": compare.series(metrics, "perf/eval_s"),
        "iteration_s_each": compare.series(metrics, "perf/iteration_s"),
        # what no iteration or evaluation timer holds: model load, engine start, env start, checkpoints
        "outside_s": info["wall_s"] - timed if "wall_s" in info else None,
        "wall_s": info.get("wall_s"),
        "peak_rss_mb": info.get("peak_rss_mb"),
        "logprob_abs_diff_mean": compare.series(metrics, "rollout/logprob_abs_diff_mean"),
        "logprob_abs_diff_max": compare.series(metrics, "rollout/logprob_abs_diff_max"),
        "eval_success": compare.series(metrics, "eval/success_rate"),
        "train_success": compare.series(metrics, "charts/success_rate"),
        "response_tokens": compare.series(metrics, "tokens/response"),
    }


def main(args: Args) -> None:
    setting = args.setting
    host = machine()
    earlier = compare.load(args.out)
    result = {"benchmark": "backends", "setting": {**asdict(setting), "seed": args.seed, "hf_iterations": args.hf_iterations},
              "machine": host, "runs": []}
    result["setting"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in result["setting"].items()}
    if args.sft_run is None:
        info = compare.drive("sft.py", compare.sft_flags(setting, resolve_model(setting.model)), args.runs_dir / "warm-start",
                             setting.sft_epochs, float("inf"), "--epochs")
        args.sft_run = Path(info["run_dir"])
    warm = str(args.sft_run / "checkpoint" / "model")
    result["warm_start"] = str(args.sft_run)
    for backend in args.backends:
        last = setting.iterations if backend == "vllm" else (args.hf_iterations or setting.iterations)
        flags = ["--model", warm, *compare.common_flags(setting, args.seed), "--vllm", str(backend == "vllm")]
        flags[flags.index("--total-iterations") + 1] = str(last)
        out = args.runs_dir / f"grpo-{backend}-seed{args.seed}"
        info = compare.drive("grpo.py", flags, out, last, float("inf"), "--total-iterations")
        if "wall_s" not in info:  # finished earlier: its wall time and peak RSS as recorded when it ran, if they were
            ran = next((r for r in earlier.get("runs", []) if r["run_dir"] == info["run_dir"]), {})
            info.update({k: ran[k] for k in ("wall_s", "peak_rss_mb") if ran.get(k) is not None})
            print(f"{backend}: finished earlier, read back from {info['run_dir']}")
        result["runs"].append(summary(backend, info))
        write_json(args.out, result)
    hf, vllm = (next((r for r in result["runs"] if r["backend"] == b), None) for b in ("hf", "vllm"))
    if hf and vllm:  # how many times faster vLLM is (HF's seconds over vLLM's; tokens/s the other way round)
        result["vllm_speedup"] = {k: hf[k] / vllm[k] for k in ("gen_s_per_iteration", "iteration_s", "eval_s") if hf[k] and vllm[k]}
        result["vllm_speedup"]["gen_tokens_per_s"] = vllm["gen_tokens_per_s"] / hf["gen_tokens_per_s"]
        write_json(args.out, result)
        print("vLLM speed-up:", {k: round(v, 2) for k, v in result["vllm_speedup"].items()})


if __name__ == "__main__":
    main(tyro.cli(Args))
