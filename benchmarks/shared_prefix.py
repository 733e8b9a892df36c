"""--share-prefix on and off, side by side, in the warm-start comparison's setting (issue 55).

grpo.py from compare.py's warm start (sft.py on 16 cooking-easy games, built here first if absent), one seed, vLLM,
2 iterations, 32 held-out games at iterations 0 and 2; fp32 and bf16, each with and without sharing, one run at a
time. Per run: the pi_old pass, the update and the iteration (seconds per iteration), the tokens the update computed
against the samples' tokens, peak RSS, and the held-out wins.

    python benchmarks/shared_prefix.py                 # 4 runs, about 2 h on 2 cores; resumable: a finished run is kept
    python benchmarks/shared_prefix.py --runs fp32-on fp32-off
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402
from _common import REPO, RESULTS, machine, read_metrics, resolve_model, run_training, write_json  # noqa: E402

RUNS = {"fp32-on": ("False", "--share-prefix"), "fp32-off": ("False", "--no-share-prefix"),
        "bf16-on": ("True", "--share-prefix"), "bf16-off": ("True", "--no-share-prefix")}  # name: (--bf16, sharing)


@dataclass
class Args:
    runs: tuple[str, ...] = tuple(RUNS)
    """which runs, in this order (fp32-on, fp32-off, bf16-on, bf16-off)"""
    seed: int = 1
    """the seed of every run"""
    iterations: int = 2
    """--total-iterations (held-out games at iteration 0 and at the last)"""
    warm_start: Path = REPO / "runs" / "compare" / "warm-start"
    """where compare.py's warm start is (built there with its flags when it has no checkpoint)"""
    runs_dir: Path = REPO / "runs" / "shared-prefix"
    """where the runs are written"""
    out: Path = RESULTS / "shared_prefix.json"
    """the results"""


def warm_start(args: Args) -> str:
    """compare.py's warm start: sft.py with its flags, once."""
    found = sorted(args.warm_start.glob("*/checkpoint/model/config.json"))
    if not found:
        flags = compare.sft_flags(compare.Args(), resolve_model("smollm2"))
        info = run_training("sft.py", flags, args.warm_start, args.warm_start.with_suffix(".log"))
        if info["returncode"] != 0:
            raise SystemExit(f"sft.py failed: see {info['log']}")
        found = sorted(args.warm_start.glob("*/checkpoint/model/config.json"))
    return str(found[-1].parent)


def summary(name: str, info: dict, last: int) -> dict:
    metrics = read_metrics(info["run_dir"])
    its = [metrics[i] for i in sorted(metrics) if 0 < i <= last and "perf/update_s" in metrics[i]]
    wins = {i: round(metrics[i]["eval/success_rate"] * len(metrics[i]["eval/won_by_task"]))
            for i in (0, last) if i in metrics and "eval/success_rate" in metrics[i]}
    per = lambda key: [round(m[key], 1) for m in its]  # noqa: E731
    return {"run": name, "command": info["command"], "returncode": info["returncode"], "peak_rss_mb": info["peak_rss_mb"],
            "logprob_s": per("perf/logprob_s"), "update_s": per("perf/update_s"), "iteration_s": per("perf/iteration_s"),
            "gen_s": per("perf/gen_s"), "tokens_computed": [m["tokens/computed"] for m in its],
            "tokens": [m["tokens/prompt"] + m["tokens/response"] for m in its], "heldout_wins": wins,
            "losses": [{k: m[k] for k in m if k.startswith("losses/")} for m in its]}


def main(args: Args) -> None:
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    model, setting = warm_start(args), compare.Args()
    result.update({"benchmark": "shared_prefix", "machine": machine(), "warm_start": model})
    for name in args.runs:
        if result.get("runs", {}).get(name, {}).get("returncode") == 0:
            print(f"kept: {name}")
            continue
        bf16, share = RUNS[name]
        flags = ["--model", model, *compare.common_flags(setting, args.seed), "--total-iterations", str(args.iterations),
                 "--eval-every", str(args.iterations), "--vllm", "True", "--bf16", bf16, share]
        out = args.runs_dir / name
        info = run_training("grpo.py", flags, out, out.with_suffix(".log"))
        result.setdefault("runs", {})[name] = summary(name, info, args.iterations)
        write_json(args.out, result)
        print(json.dumps(result["runs"][name]), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
