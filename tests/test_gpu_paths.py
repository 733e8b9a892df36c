"""Smoke test of `benchmarks/gpu_model.py paths` (--share-prefix on and off, timed) at the tiny shape on CPU: the GPU
run (benchmarks/gpu_check.sh a) uses the 1.5B shape and a 16384-token micro-batch, and must not fail there first."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def gpu_model(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # one thread: the sizes are tiny, and a busy 2-core machine makes two threads wait on each other (~10x slower)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "benchmarks/gpu_model.py", *flags], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    return out


def test_paths_reach_their_fractions_and_agree(tmp_path):
    model, out = tmp_path / "model", tmp_path / "gpu_paths.json"
    gpu_model("build", "--shape", "tiny", "--out", str(model))
    gpu_model("paths", "--model", str(model), "--micro-batch-tokens", "1024", "--group-size", "4",
              "--response-tokens", "8", "--repeats", "2", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and not r["bf16_autocast"] and r["micro_batch_tokens"] == 1024
    assert set(r["cases"]) == {"0.55", "0.95"}
    for key, (low, high) in {"0.55": (0.45, 0.65), "0.95": (0.9, 1.0)}.items():
        case = r["cases"][key]
        assert low <= case["computed_fraction"] <= high, case
        assert case["logprob_max_abs_diff"] < 1e-4  # fp32: the two attentions compute the same numbers
        plain, shared = case["plain"], case["shared"]
        assert not plain["share_prefix"] and shared["share_prefix"]
        assert shared["micro_batches"] == 1 and shared["tokens_computed"] <= 1024  # the case fits one micro-batch
        assert plain["sample_tokens"] == shared["sample_tokens"] == plain["tokens_computed"]  # equal lengths: no pad
        assert case["token_bound"] == plain["tokens_computed"] / shared["tokens_computed"] > 1
        for path in (plain, shared):
            for kind in ("forward_backward", "no_grad"):
                assert path[kind]["seconds"] > 0 and len(path[kind]["seconds_all"]) == 2
                assert "peak_rss_growth_mib" in path[kind]
