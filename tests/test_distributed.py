"""torchrun + FSDP2 (gloo on CPU): the 2-process update equals the 1-process one, and grpo.py runs,
checkpoints once and resumes under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics

REPO = Path(__file__).resolve().parents[1]


def torchrun(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    run = lambda: subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,  # noqa: E731
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = run()
    # One retry for one known crash, nothing else: on 2026-12-05 tests/dist_update_check.py lost rank 1 to a C++
    # abort ("terminate called without an active exception", SIGABRT) in 2 of 8 runs under pytest and 0 of 10
    # direct ones, cause not found (a barrier before the teardown did not cure it). A wrong result still fails.
    if out.returncode != 0 and "terminate called without an active exception" in out.stderr:
        out = run()
    return out


def test_two_process_update_matches_one_process(tiny_model, tmp_path):
    sys.path.insert(0, str(REPO / "tests"))
    import dist_update_check as check
    from transformers import AutoModelForCausalLM

    out = torchrun("tests/dist_update_check.py", tiny_model, str(tmp_path / "dist.pt"))
    assert out.returncode == 0, out.stderr[-3000:]
    dist = torch.load(tmp_path / "dist.pt", weights_only=False)

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    single = check.update(model, list(range(len(check.PROMPTS))), False)
    moved = 0.0
    for name, value in model.state_dict().items():
        assert torch.allclose(dist["weights"][name], value, atol=1e-6, rtol=1e-5), name
        moved = max(moved, (value - before[name]).abs().max().item())
    assert moved > 1e-4  # the update really changed the weights, so the comparison means something
    for key in ["losses/policy_loss", "losses/entropy", "losses/grad_norm", "perf/optimizer_steps"]:
        assert dist["metrics"][key] == pytest.approx(single[key], rel=1e-5, abs=1e-8), key


def test_two_process_lora_update_matches_one_process(tiny_model, tmp_path):
    """--lora-rank under FSDP2: the frozen base is sharded with the adapters, only the adapters have optimizer state
    and move, the reference is the base (adapters off on a sharded model), and the update equals one process's."""
    sys.path.insert(0, str(REPO / "tests"))
    import dist_update_check as check

    out = torchrun("tests/dist_update_check.py", tiny_model, str(tmp_path / "dist.pt"), "lora")
    assert out.returncode == 0, out.stderr[-3000:]
    dist = torch.load(tmp_path / "dist.pt", weights_only=False)

    model = check.lora_model(tiny_model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    single = check.update(model, list(range(len(check.PROMPTS))), False, lora=True)
    moved = 0.0
    for name, value in model.state_dict().items():
        assert torch.allclose(dist["weights"][name], value, atol=1e-6, rtol=1e-5), name
        if "lora_" in name:
            moved = max(moved, (value - before[name]).abs().max().item())
        else:
            assert torch.equal(dist["weights"][name], before[name]), name  # the base stayed frozen on both ranks
    assert moved > 1e-4
    assert single["losses/kl"] > 1e-4  # the base as reference differs from the policy
    for key in ["losses/policy_loss", "losses/entropy", "losses/kl", "losses/grad_norm", "perf/optimizer_steps"]:
        assert dist["metrics"][key] == pytest.approx(single[key], rel=1e-5, abs=1e-8), key


def test_dapo_filter_fills_the_batch_over_ranks_and_updates_as_one_process(tiny_model, tmp_path):
    """--filter-groups over two ranks: rank 0's surplus informative groups fill rank 1's shortfall (3 groups
    trained on rank 0, 1 on rank 1: tests/dist_filter_check.py's rounds), and the update equals one process's."""
    sys.path.insert(0, str(REPO / "tests"))
    import dist_filter_check as check
    from transformers import AutoModelForCausalLM

    out = torchrun("tests/dist_filter_check.py", tiny_model, str(tmp_path / "dist.pt"))
    assert out.returncode == 0, out.stderr[-3000:]
    dist = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert dist["kept"] == [0, 1, 5, 6]
    assert dist["samples"] == [3 + 3 + 3, 3]  # steps: group 0 (1 + 2), 1 (2 + 1), 5 (2 + 1); group 6 (1 + 2)

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    single = check.update(model, [e for g in [0, 1, 5, 6] for e in check.played(g)])
    moved = 0.0
    for name, value in model.state_dict().items():
        assert torch.allclose(dist["weights"][name], value, atol=1e-6, rtol=1e-5), name
        moved = max(moved, (value - before[name]).abs().max().item())
    assert moved > 1e-4
    for key in ["losses/policy_loss", "losses/grad_norm", "perf/optimizer_steps"]:
        assert dist["metrics"][key] == pytest.approx(single[key], rel=1e-5, abs=1e-8), key


def test_grpo_under_torchrun_checkpoints_once_and_resumes(tiny_model, tmp_path):
    flags = [f for f in TINY_FLAGS]
    flags[flags.index("--num-env-workers") + 1] = "1"
    out = torchrun("grpo.py", "--model", tiny_model, *flags, "--total-iterations", "2", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path)  # one run directory, one checkpoint, both ranks' RNG in it
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    ckpt = run / "checkpoint"
    assert (ckpt / "rng_0.pt").exists() and (ckpt / "rng_1.pt").exists() and (ckpt / "optimizer").is_dir()
    assert json.loads((ckpt / "model" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1, 2]
    assert 4 <= metrics[1]["tokens/samples"] <= 12  # both ranks' groups (2 tasks x 2 episodes) counted

    resumed = torchrun("grpo.py", "--resume", str(run), "--total-iterations", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed {run} at iteration 2" in resumed.stdout
    assert sorted(read_metrics(run)) == [0, 1, 2, 3]


# Each method file under torchrun: 2 processes, 1 iteration, its own smallest settings.
METHOD_FLAGS = {
    "gigpo.py": [],
    "proas.py": [],
    "strata.py": ["--num-strategies", "2", "--episodes-per-strategy", "2", "--oversample", "2", "--max-prompt-tokens", "400"],
    "actguide.py": ["--probe-episodes", "1", "--max-probe-rounds", "1", "--max-steps", "2", "--max-new-tokens", "8"],
    "pats.py": ["--reviewer", "rules"],
}


@pytest.mark.parametrize("method", [m for m in METHOD_FLAGS if (REPO / m).exists()])
def test_method_runs_under_torchrun(tiny_model, tmp_path, method):
    flags = [*TINY_FLAGS, "--num-env-workers", "1", "--num-eval-tasks", "2", "--eval-every", "5", *METHOD_FLAGS[method]]
    out = torchrun(method, "--model", tiny_model, *flags, "--total-iterations", "1", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path)
    assert sorted(read_metrics(run)) == [0, 1]
    assert (run / "checkpoint" / "rng_1.pt").exists()


def test_sft_under_torchrun_counts_both_ranks_demonstrations(tiny_model, tmp_path):
    from test_sft import SFT_FLAGS

    flags = [*SFT_FLAGS, "--num-env-workers", "1", "--epochs", "1"]
    flags[flags.index("--num-env-workers") + 1] = "1"
    out = torchrun("sft.py", "--model", tiny_model, *flags, "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path)
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1]
    assert metrics[0]["demos/won"] == 2 and metrics[0]["demos/samples"] == 10  # one task per rank, 5 steps each
    assert metrics[1]["perf/optimizer_steps"] == 3  # ceil(10 / 4): minibatches are the union of both ranks' slices
    assert (run / "checkpoint" / "rng_1.pt").exists()
