"""sft.py: demonstrations built as the RL rollout builds its prompts, the NLL update and its
schedule, and the checkpoint every RL file takes as --model."""

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import envs
import grpo
import sft
from conftest import SHARED_DATA
from test_grpo_e2e import REPO, TINY_FLAGS, logged_steps, only_run, read_metrics, run_script, run_with_terminal_stderr

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


def test_a_resumed_schedule_takes_up_the_learning_rate_where_it_stopped():
    """Run restores the optimizer before sft.py builds its scheduler, whose first step would set step 0's rate: the
    saved rate goes back, and the steps after the resume follow the straight run's."""
    args = sft.Args(warmup_ratio=0.2, lr_schedule="cosine")

    def steps(optimizer, scheduler, n):
        rates = []
        for _ in range(n):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return rates

    straight = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    rates = steps(straight, sft.lr_scheduler(straight, 10, args), 10)
    first = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = sft.lr_scheduler(first, 10, args)
    assert steps(first, scheduler, 4) == rates[:4]
    resumed = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    resumed.load_state_dict(first.state_dict())
    assert steps(resumed, sft.lr_scheduler(resumed, 10, args, scheduler.state_dict()), 6) == pytest.approx(rates[4:])
    assert rates[4] < 1.0 and rates[:2] == pytest.approx([1 / 3, 2 / 3])


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
    assert counts == {"demos/tasks": 1, "demos/without_plan": 0, "demos/won": 1, "demos/crashed": 0, "demos/samples": 5}
    assert [t.prompt_ids for t in episode.turns] == [prompt for prompt, _ in samples]
    assert [t.action for t in episode.turns] == plan
    assert episode.won and all(t.valid for t in episode.turns)
    # history enters the prompt from step 2 on, as rollout's does
    assert "Action 1: 'inventory'" in tokenizer.decode(samples[1][0]) and "Action 1" not in tokenizer.decode(samples[0][0])


def test_no_held_out_task_plays_no_evaluation_and_logs_none(tiny_model, tmp_path):
    """--num-eval-tasks 0 (a warm start whose RL runs measure it on their own held-out lists): no
    evaluation episode, no eval/ or eval_sampling/ key (they were NaN), the epoch still trains.
    Also the schedule over --epochs x minibatches, and the last epoch's checkpoint under --save-every."""
    # 10 samples in minibatches of 4: 3 optimizer steps for the 1 epoch. --warmup-ratio 0.5: int(0.5 * 3) = 1 warmup
    # step at 1/2 of the peak, then the cosine 0.5 (1 + cos(pi (s - 1) / 2)): 1 and 1/2. --save-every 3: the last
    # epoch is saved all the same. On a terminal the run's progress bar counts epochs, 1 here.
    flags = ["--model", tiny_model, *SFT_FLAGS, "--num-eval-tasks", "0", "--epochs", "1", "--warmup-ratio", "0.5",
             "--save-every", "3"]
    out = run_script("sft.py", *flags, "--output-dir", str(tmp_path / "runs"))
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path / "runs")
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1] and metrics[0]["demos/samples"] == 10 and metrics[1]["losses/nll"] > 0
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["lr"] for s in steps] == pytest.approx([5e-4, 1e-3, 5e-4], rel=1e-9)
    assert torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)["iteration"] == 1
    assert not [k for row in metrics.values() for k in row if k.startswith("eval")]
    assert "epoch 1: nll" in out.stdout + out.stderr and "eval success" not in out.stdout + out.stderr
    redraws = run_with_terminal_stderr("sft.py", *flags, "--output-dir", str(tmp_path / "tty")).split("\r")
    bars = [r.strip() for r in redraws if r.strip().startswith("sft:")]
    assert all("/1 [" in bar for bar in bars) and any("| 1/1 [" in bar and "epochs/s]" in bar for bar in bars)


def test_sft_trains_checkpoints_resumes_and_warm_starts_grpo_and_proas(tiny_model, tmp_path):
    # the schedule does not depend on --epochs here (constant, no warmup): run B below, stopped after epoch 1, is
    # run A's first epoch. --eval-every 3 skips epoch 1; epoch 2, the last, is evaluated all the same.
    flags = [*SFT_FLAGS, "--lr-schedule", "constant", "--warmup-ratio", "0", "--eval-every", "3"]
    straight = run_script("sft.py", "--model", tiny_model, *flags, "--epochs", "2", "--output-dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "demonstrations: 2 of 2 tasks replayed to a win, 10 step samples" in straight.stdout
    run_a = only_run(tmp_path / "a")
    metrics = read_metrics(run_a)
    assert sorted(metrics) == [0, 1, 2]
    assert metrics[0]["demos/samples"] == 10 and "eval/success_rate" in metrics[0] and "eval_sampling/success_rate" in metrics[0]
    assert metrics[1]["perf/optimizer_steps"] == 3  # ceil(10 / 4) minibatches of 4, 3, 3
    assert metrics[2]["losses/nll"] < metrics[1]["losses/nll"]
    assert "eval/success_rate" not in metrics[1] and "eval/success_rate" in metrics[2] and "eval_sampling/success_rate" in metrics[2]
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
    assert f"resumed {run_a} at iteration 1" in resumed.stdout  # Run's line: an epoch is its iteration
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
    with search_server() as url:  # the env probe needs a live server
        out = run_script("sft.py", "--model", tiny_model, "--env", "search", "--env-data", str(nq), "--num-tasks", "3",
                         "--search-url", url, "--num-env-workers", "1", timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "none of the 3 'train' tasks has an expert trajectory" in out.stderr and "3 have no reference actions" in out.stderr
    assert "Traceback" not in out.stderr


CORPUS = SHARED_DATA / "search_qa" / "corpus" / "wiki18_searchr1_retrieved_passages.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def search_server():
    """The BM25 retrieval server, started as users start it."""
    pytest.importorskip("bm25s", reason="bm25s not installed: pip install bm25s")
    if not CORPUS.exists():
        pytest.skip(f"shared search corpus not found at {CORPUS}")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "envs.search", "serve", "--corpus", str(CORPUS), "--port", str(port)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving" in proc.stdout.readline()
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sft_probes_its_env_and_stops_when_most_replayed_plans_crash(tiny_model, tmp_path):
    """The train split: the 14 Bamboogle questions that have a winning Search-R1 trajectory (a search,
    then the answer) and 2 that have none. A dead server stops sft.py before the model loads; a server
    that dies after the probe crashes all 14 replays, and the run stops instead of training."""
    from envs import search

    qa = SHARED_DATA / "search_qa"
    if not (qa / "questions").exists():
        pytest.skip(f"shared search data not found at {qa}")
    solved = search.reference_trajectories(str(qa))
    rows = (qa / "questions" / "flashrag_format" / "bamboogle_test_subsample.jsonl").read_text().splitlines()
    with_plan = [row for row in rows if json.loads(row)["question"].strip() in solved]
    without = [row for row in rows if json.loads(row)["question"].strip() not in solved][:2]
    assert len(with_plan) == 14
    data = tmp_path / "search"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(with_plan + without) + "\n")
    (data / "test.jsonl").write_text("\n".join(without) + "\n")
    (data / "trajectories").symlink_to(qa / "trajectories")
    flags = ["--model", tiny_model, "--env", "search", "--env-data", str(data), "--num-env-workers", "2",
             "--num-eval-tasks", "2", "--max-new-tokens", "8", "--output-dir", str(tmp_path / "runs")]
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    out = run_script("sft.py", *flags, "--search-url", dead, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"error: retrieval server {dead} is not answering (")
    assert not (tmp_path / "runs").exists()

    with search_server() as url:
        run = subprocess.Popen([sys.executable, "sft.py", *flags, "--search-url", url], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = next(line for line in run.stdout if line.startswith("env search: started"))
        except StopIteration:
            run.kill()
            raise
    try:
        stdout, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
    assert line.startswith("env search: started train/train/0 in ") and line.rstrip().endswith("s (16 tasks)")
    assert run.returncode == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == ("error: 14 of 14 episodes of this iteration crashed (see the warnings "
                                               "above): the env is failing; stopping rather than training on them")
    assert not list((only_run(tmp_path / "runs")).glob("checkpoint*"))


# ---- the update: one epoch against the same SGD steps written with plain torch ---------------------
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
RESPONSES = [[20, 21, 22, 23], [24], [25, 26], [27, 28, 29]]
NO_AUTOCAST = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731


def sft_update(model, optimizer, args, seed):
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    metrics, steps = sft.update_policy(model, optimizer, scheduler, PROMPTS, RESPONSES, args, NO_AUTOCAST,
                                       torch.Generator().manual_seed(seed))
    return metrics, steps, scheduler


def test_update_is_the_token_mean_nll_at_temperature_one_whatever_the_sampling_temperature(tiny_model):
    """--temperature 0.7 (the RL runs' sampling temperature) leaves the clone's loss the plain NLL."""
    from transformers import AutoModelForCausalLM

    lr = 0.2
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    by_hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    args = sft.Args(minibatch_size=2, max_grad_norm=1e9, temperature=0.7)
    metrics, steps, _ = sft_update(model, torch.optim.SGD(model.parameters(), lr=lr), args, 0)

    minibatches = np.array_split(torch.randperm(4, generator=torch.Generator().manual_seed(0)).numpy(), 2)
    nlls = []
    for minibatch in minibatches:
        by_hand.zero_grad()
        n = sum(len(RESPONSES[i]) for i in minibatch)
        loss = 0.0
        for i in minibatch:
            p, r = PROMPTS[i], RESPONSES[i]
            logits = by_hand(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1]
            loss = loss - torch.log_softmax(logits.float(), -1)[torch.arange(len(r)), torch.tensor(r)].sum() / n
        loss.backward()
        nlls.append(loss.item())
        with torch.no_grad():
            for q in by_hand.parameters():
                q -= lr * q.grad
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert [nll for nll, _ in steps] == pytest.approx(nlls, rel=1e-5)
    assert metrics["perf/optimizer_steps"] == 2 and metrics["losses/skipped_steps"] == 0


def test_a_non_finite_gradient_skips_the_optimizer_step_and_is_counted(tiny_model):
    """A nan in the final norm (a diverged model) makes every gradient nan: no step is taken, not even
    AdamW's weight decay, and both minibatches are counted; the learning-rate schedule moves on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    metrics, steps, scheduler = sft_update(model, optimizer, sft.Args(minibatch_size=2), 3)
    assert metrics["losses/skipped_steps"] == 2 and metrics["perf/optimizer_steps"] == 0
    assert math.isnan(metrics["losses/grad_norm"]) and len(steps) == 2 and scheduler.last_epoch == 2
    assert all(torch.allclose(p, q, equal_nan=True) for p, q in zip(model.parameters(), before)) and not optimizer.state
