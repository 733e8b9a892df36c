"""sft.py: demonstrations built as the RL rollout builds its prompts, the NLL update and its
schedule, and the checkpoint every RL file takes as --model."""

import json
import math
import shutil

import pytest
import torch

import envs
import grpo
import sft
from conftest import SHARED_DATA
from test_grpo_e2e import TINY_FLAGS, logged_steps, only_run, read_metrics, run_script

SFT_FLAGS = [
    "--env", "cooking-easy", "--num-tasks", "2", "--max-steps", "2", "--max-new-tokens", "8", "--num-eval-tasks", "1",
    "--num-env-workers", "2", "--minibatch-size", "4", "--learning-rate", "1e-3", "--no-gradient-checkpointing",
]


def test_learning_rate_warms_up_linearly_then_follows_a_cosine_to_zero():
    # 10 steps, warmup 0.2 -> 2 warmup steps at 1/3, 2/3; then 0.5 (1 + cos(pi k / 8)) for k = 0..7
    factors = [sft.lr_factor(s, 10, 0.2, "cosine") for s in range(10)]
    assert factors[:2] == pytest.approx([1 / 3, 2 / 3])
    assert factors[2:] == pytest.approx([0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)])
    assert factors[2] == 1.0 and factors[-1] == pytest.approx(0.0381, abs=1e-4)
    assert [sft.lr_factor(s, 10, 0.2, "constant") for s in (0, 2, 9)] == pytest.approx([1 / 3, 1.0, 1.0])


def test_the_target_is_the_answer_format_after_the_prefix_then_end_of_turn(tiny_model, cooking_spec):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    args = sft.Args(env="cooking", response_prefix="<think>", think_text="Get the pepper.")
    ids, action = sft.expert_target(cooking_spec, tokenizer, args, "take red pepper from fridge")
    assert action == "take red pepper from fridge"
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[:-1]) == "Get the pepper.</think>\n<action>take red pepper from fridge</action>"


def test_demonstration_prompts_equal_the_rollout_prompts_of_the_same_states(tiny_model, cooking_spec):
    """The same game played by grpo.rollout, with a policy that writes exactly the SFT targets,
    sees token for token the prompts sft.py trains on, and wins: targets are what the policy should write."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    common = dict(env="cooking", response_prefix="<think>", history_length=2, max_prompt_tokens=2048, max_steps=10)
    sft_args = sft.Args(**common)
    rl_args = grpo.Args(**common, success_reward=10.0, invalid_penalty=0.1)
    task = "train-easy-0"
    with envs.EnvRunner(cooking_spec, 1) as runner:
        samples, counts = sft.demonstrations(cooking_spec, runner, tokenizer, sft_args, [task])
        plan = runner.demonstrations([task])[0]
        targets = iter([target for _, target in samples])
        episode = grpo.Episode(task, 0)
        grpo.rollout(cooking_spec, runner, tokenizer, lambda prompts, temperature: [next(targets) for _ in prompts],
                     rl_args, [episode], 1.0, "test")
    assert plan == ["inventory", "examine cookbook", "take orange bell pepper from fridge", "prepare meal", "eat meal"]
    assert counts == {"demos/tasks": 1, "demos/without_plan": 0, "demos/won": 1, "demos/samples": 5}
    assert [t.prompt_ids for t in episode.turns] == [prompt for prompt, _ in samples]
    assert [t.action for t in episode.turns] == plan
    assert episode.won and all(t.valid for t in episode.turns)
    # history enters the prompt from step 2 on, as rollout's does
    assert "Action 1: 'inventory'" in tokenizer.decode(samples[1][0]) and "Action 1" not in tokenizer.decode(samples[0][0])


def test_sft_trains_checkpoints_resumes_and_warm_starts_grpo_and_proas(tiny_model, tmp_path):
    flags = [*SFT_FLAGS, "--lr-schedule", "constant", "--warmup-ratio", "0"]
    straight = run_script("sft.py", "--model", tiny_model, *flags, "--epochs", "2", "--output-dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "demonstrations: 2 of 2 tasks replayed to a win, 10 step samples" in straight.stdout
    run_a = only_run(tmp_path / "a")
    metrics = read_metrics(run_a)
    assert sorted(metrics) == [0, 1, 2]
    assert metrics[0]["demos/samples"] == 10 and "eval/success_rate" in metrics[0] and "eval_sampling/success_rate" in metrics[0]
    assert metrics[1]["perf/optimizer_steps"] == 3  # ceil(10 / 4) minibatches of 4, 3, 3
    assert metrics[2]["losses/nll"] < metrics[1]["losses/nll"]
    steps = [json.loads(line) for line in (run_a / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(6)) and {s["lr"] for s in steps} == {1e-3}
    assert sum(s["losses/nll"] for s in steps[:3]) / 3 == pytest.approx(metrics[1]["losses/nll"], rel=0.2)

    # stop after 1 epoch (run B), resume to 2: epoch 2 must equal the straight run's. The resume is of
    # run A with run B's checkpoint: a kill during epoch 2's save, after epoch 2 was logged. Those rows
    # are dropped and redone once, in metrics.jsonl, steps.jsonl and both TensorBoard axes.
    first = run_script("sft.py", "--model", tiny_model, *flags, "--epochs", "1", "--output-dir", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(run_a / "checkpoint")
    shutil.copytree(only_run(tmp_path / "b") / "checkpoint", run_a / "checkpoint")
    resumed = run_script("sft.py", "--resume", str(run_a), "--epochs", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed {run_a} at epoch 1" in resumed.stdout
    rows = [json.loads(line) for line in (run_a / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    assert rows[2]["losses/nll"] == pytest.approx(metrics[2]["losses/nll"], rel=1e-5)
    assert [json.loads(line)["step"] for line in (run_a / "steps.jsonl").read_text().splitlines()] == list(range(6))
    assert logged_steps(run_a, "losses/nll") == [1, 2] and logged_steps(run_a / "steps", "losses/nll_step") == list(range(6))

    model = run_a / "checkpoint" / "model"
    for script in ("grpo.py", "proas.py"):
        rl = run_script(script, "--model", str(model), *TINY_FLAGS, "--total-iterations", "1", "--num-eval-tasks", "1",
                        "--output-dir", str(tmp_path / script))
        assert rl.returncode == 0, rl.stderr[-3000:]
        assert "charts/success_rate" in read_metrics(only_run(tmp_path / script))[1]


def test_an_env_without_expert_trajectories_is_one_clear_line(tiny_model, tmp_path):
    """Search questions with no successful trajectory on disk have no demonstration."""
    questions = SHARED_DATA / "search_qa" / "questions" / "flashrag_format"
    if not questions.exists():
        pytest.skip(f"shared search data not found at {questions}")
    nq = sorted(questions.glob("nq*.jsonl"))[0]
    out = run_script("sft.py", "--model", tiny_model, "--env", "search", "--env-data", str(nq), "--num-tasks", "3",
                     "--search-url", "http://127.0.0.1:9/retrieve", "--num-env-workers", "1", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "none of the 3 'train' tasks has an expert trajectory" in out.stderr and "3 have no reference actions" in out.stderr
    assert "Traceback" not in out.stderr
