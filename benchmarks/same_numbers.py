"""Same numbers before and after a refactor: every script for 2 iterations from seed 1, then a metric-by-metric diff.

    python benchmarks/same_numbers.py run OUT_DIR [SCRIPT...]   # 7 scripts with HF generate, 6 with vLLM
    python benchmarks/same_numbers.py compare BEFORE AFTER   # every logged value but timings, side by side

The runs use the tests' tiny random Qwen2 (tests/conftest.py), minibatches of 4 step samples (several optimizer steps
per iteration, so the pi_old pass matters) and lr 1e-3 (each update moves the log-probs visibly).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from _common import REPO, tiny_model

COMMON = ["--env", "cooking", "--num-tasks", "2", "--group-size", "2", "--max-steps", "3", "--max-new-tokens", "16",
          "--num-eval-tasks", "2", "--eval-every", "1", "--num-env-workers", "2", "--minibatch-size", "4",
          "--learning-rate", "1e-3", "--no-gradient-checkpointing", "--seed", "1"]
METHOD = {
    "grpo.py": [], "gigpo.py": [], "proas.py": [], "pats.py": ["--reviewer", "rules"],
    "strata.py": ["--num-strategies", "2", "--episodes-per-strategy", "2", "--oversample", "2",
                  "--max-prompt-tokens", "400"],
    "actguide.py": ["--probe-episodes", "1", "--max-probe-rounds", "1", "--max-steps", "2", "--max-new-tokens", "8"],
}
SFT = ["--env", "cooking-easy", "--num-tasks", "2", "--max-steps", "2", "--max-new-tokens", "8", "--num-eval-tasks", "1",
       "--num-env-workers", "2", "--minibatch-size", "4", "--learning-rate", "1e-3", "--no-gradient-checkpointing",
       "--epochs", "2", "--seed", "1"]


def run(out: Path, only: list[str]) -> None:
    models = {"hf": tiny_model(out / "tiny"), "vllm": tiny_model(out / "tiny-hd64", hidden=256)}
    vllm_ok = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0
    jobs = [(s, "hf", [*COMMON, *flags, "--total-iterations", "2", "--vllm", "False"]) for s, flags in METHOD.items()]
    jobs.append(("sft.py", "hf", [*SFT, "--vllm", "False"]))
    if vllm_ok:
        jobs += [(s, "vllm", [*COMMON, *flags, "--total-iterations", "2", "--vllm", "True"]) for s, flags in METHOD.items()]
    for script, backend, flags in jobs:
        if only and script not in only:
            continue
        folder = out / f"{script[:-3]}-{backend}"
        if (folder / "done").exists():
            continue
        cmd = [sys.executable, script, "--model", models[backend], *flags, "--output-dir", str(folder)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        (out / f"{script[:-3]}-{backend}.log").write_text(proc.stdout + proc.stderr)
        print(f"{script} {backend}: exit {proc.returncode}", flush=True)
        if proc.returncode == 0:
            (folder / "done").write_text(" ".join(cmd))


def rows(folder: Path) -> dict[int, dict]:
    found = [p for p in folder.glob("*/metrics.jsonl")]
    lines = found[0].read_text().splitlines() if found else []
    return {r["iteration"]: r for r in map(json.loads, lines)} if "iteration" in (lines[:1] or ["iteration"])[0] else {
        r.get("epoch", k): r for k, r in enumerate(map(json.loads, lines))}


def compare(before: Path, after: Path) -> int:
    """Each metric but perf/* whose value differs, with the largest difference per run; exit 1 on any key present
    in one run only."""
    bad = 0
    for folder in sorted(p for p in before.iterdir() if p.is_dir() and (p / "done").exists()):
        a, b = rows(folder), rows(after / folder.name)
        worst, differ, missing = 0.0, [], set()
        for step in sorted(set(a) | set(b)):
            ra, rb = a.get(step, {}), b.get(step, {})
            for key in sorted(set(ra) | set(rb)):
                if key.startswith("perf/"):
                    continue
                if key not in ra or key not in rb:
                    missing.add(key)
                    continue
                va, vb = ra[key], rb[key]
                if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
                    d = abs(va - vb) if not (math.isnan(va) and math.isnan(vb)) else 0.0
                    if d > 0:
                        differ.append((step, key, va, vb))
                        worst = max(worst, d / max(abs(va), 1e-12))
                elif va != vb:
                    differ.append((step, key, va, vb))
                    worst = math.inf
        print(f"{folder.name}: {len(differ)} values differ (largest relative difference {worst:.3g})"
              + (f"; only in one run: {sorted(missing)}" if missing else ""))
        for step, key, va, vb in differ[:12]:
            print(f"    {step} {key}: {va} -> {vb}")
        bad += bool(missing)
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(Path(sys.argv[2]).resolve(), sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
