"""The cooking env on real generated TextWorld games, the verl-agent projection, the runner."""

import os
import signal
import subprocess
import sys
import time

import pytest

import envs
from envs import cooking

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>go</think><action>Take Red Apple</action>", ("take red apple", True)),
        ("<think>x</think>   <action>  open fridge </action> trailing", ("open fridge", True)),
        ("<action>look</action>", ("look", False)),  # no <think>: sent, but invalid
        ("<think>a</think><action>看 look</action>", ("看 look", False)),  # CJK text
        ("<THINK>a</THINK><action>look</action>", ("look", False)),  # the think tags are case-sensitive
        ("no tags at all, just chatter about the kitchen and more", ("ter about the kitchen and more", False)),
        ("", ("", False)),
        # malformed tag structure (verl-agent accepts these): the tail is sent, invalid
        ("<think>x</think></action>examine egg<action>", ("k></action>examine egg<action>", False)),
        ("<think>x</think><action><action>take egg</action>", ("tion><action>take egg</action>", False)),
        ("<think>x</think><action>look</action><action>eat meal</action>", ("tion><action>eat meal</action>", False)),
        ("</think>x<think><action>look</action>", ("look", False)),  # think tags reversed
        ("<think>a</think><think>b</think><action>look</action>", ("look", True)),  # two thoughts are fine
    ],
)
def test_verl_projection(response, expected):
    action, valid = cooking.parse(response)
    assert (action, valid) == expected
    if not expected[1] and "<action>" not in response:
        assert action == response.lower()[-30:]  # the raw tail is what reaches the env


def test_huge_response_sends_only_its_tail():
    action, valid = cooking.parse("blah " * 10_000)
    assert len(action) == 30 and not valid


def test_task_ids_splits_are_disjoint_and_typed():
    train, test = cooking.task_ids("train"), cooking.task_ids("test")
    assert len(train) == 2000 * 5 and len(test) == 128 * 5
    assert not set(train) & set(test)
    assert cooking.task_ids("test", level="easy")[:2] == ["test-easy-0", "test-easy-1"]
    with pytest.raises(ValueError):
        cooking.task_ids("nope")


def test_reference_replay_wins_every_level():
    env = cooking.Env()
    try:
        for level in cooking.LEVELS:
            task_id = f"train-{level}-3"
            plan = env.reference_actions(task_id)
            step = env.reset(task_id)
            assert step.task_type == level and step.task.startswith("You are hungry")
            assert not step.done and step.admissible and "help" not in step.admissible
            for k, action in enumerate(plan):
                assert not step.done, f"{task_id} ended early at step {k}"
                step = env.step(action)
            assert step.won and step.done and step.score == 1.0, task_id
    finally:
        env.close()


def test_garbage_and_control_bytes_do_not_crash_the_game():
    env = cooking.Env()
    try:
        env.reset("train-easy-0")
        for garbage in ["\\q", "quit", "restart", "\x10\x0c\u00e9\ufffd meal", "", "take the moon", "x" * 2000]:
            step = env.step(garbage)
            assert not step.done and not step.won and isinstance(step.observation, str)
        assert env.step("look").observation.startswith("-= Kitchen =-")
    finally:
        env.close()


def test_state_is_order_invariant_and_changes_with_the_world():
    env = cooking.Env()
    try:
        first = env.reset("train-easy-0")
        takes = [a for a in first.admissible if a.startswith("take ") and "cookbook" not in a][:2]
        assert len(takes) == 2
        env.step(takes[0])
        after_a_b = env.step(takes[1]).state
        env.reset("train-easy-0")
        env.step(takes[1])
        after_b_a = env.step(takes[0]).state
        assert after_a_b == after_b_a
        assert after_a_b != first.state
        assert env.step("look").state == after_b_a  # looking changes nothing
    finally:
        env.close()


def test_project_state_ignores_unrelated_objects():
    env = cooking.Env()
    try:
        task_id = "train-easy-0"
        plan = env.reference_actions(task_id)
        start = env.reset(task_id)
        distractor = next(a for a in start.admissible if a.startswith("take ") and not any(a in p for p in plan) and "cookbook" not in a)
        moved = env.step(distractor)
        assert moved.state != start.state
        project = lambda s: cooking.project_state(s, start.task, plan)  # noqa: E731
        assert project(moved.state) == project(start.state)
        took = env.step(plan[2])  # the plan's own take changes the projected state
        assert plan[2].startswith("take ") and project(took.state) != project(moved.state)
    finally:
        env.close()


def test_prompt_follows_verl_agent_template_with_history():
    history = [("obs one", "look"), ("obs two", "open fridge")]
    text = cooking.prompt("cook", "obs three", ["look", "eat meal"], history, step_count=5, history_length=2)
    assert "Prior to this step, you have already taken 5 step(s). Below are the most recent 2 observations" in text
    assert "[Observation 4: 'obs one', Action 4: 'look']\n[Observation 5: 'obs two', Action 5: 'open fridge']" in text
    assert "You are now at step 6 and your current observation is: obs three" in text
    assert "[\'look\'\n \'eat meal\']" in text
    first = cooking.prompt("cook", "obs", ["look"], [], step_count=0, history_length=2)
    assert "Prior to this step" not in first and "<action> </action>" in first


def test_cooking_small_asks_for_one_line_with_an_example_and_keeps_the_rest():
    history = [("obs one", "look")]
    verl = cooking.prompt("cook", "obs two", ["look", "eat meal"], history, step_count=1, history_length=2)
    small = envs.load("cooking-small").prompt("cook", "obs two", ["look", "eat meal"], history, step_count=1, history_length=2)
    head = verl[: verl.index("Now it's your turn")]
    assert small.startswith(head) and "[Observation 1: 'obs one', Action 1: 'look']" in small
    assert small.endswith("<think>I should look around first.</think><action>look</action>\n")
    assert "MUST be enclosed" not in small
    # the example parses as a well-formed step once the trainer puts a prefilled `<think>` back in front
    assert cooking.parse("<think>" + "I should look around first.</think><action>look</action>") == ("look", True)
    with pytest.raises(ValueError, match="template"):
        cooking.prompt("cook", "obs", ["look"], [], 0, 2, template="chatty")


def test_runner_survives_a_killed_worker():
    spec = envs.load("cooking")
    with envs.EnvRunner(spec, num_workers=2) as runner:
        obs = runner.reset(["train-easy-0"] * 4)
        assert [o.crashed for o in obs] == [False] * 4
        victim = runner._procs[1].pid  # episodes 1 and 3 live on worker 1
        os.kill(victim, signal.SIGKILL)
        out = runner.step({i: "look" for i in range(4)})
        assert [out[i].crashed for i in range(4)] == [False, True, False, True]
        assert out[1].done and not out[1].won and out[1].task_type == "easy"
        assert runner.crashes == 1
        again = runner.reset(["train-easy-1"] * 4)  # the restarted worker serves new episodes
        assert [o.crashed for o in again] == [False] * 4


def test_runner_restarts_a_frozen_worker_after_its_timeout():
    spec = envs.load("cooking")
    with envs.EnvRunner(spec, num_workers=2) as runner:
        runner.reset(["train-easy-0"] * 4)  # workers start and import under the default timeout
        runner.timeout_s = 3.0
        os.kill(runner._procs[1].pid, signal.SIGSTOP)  # a real freeze: the worker lives but never answers
        start = time.monotonic()
        out = runner.step({i: "look" for i in range(4)})
        waited = time.monotonic() - start
        assert [out[i].crashed for i in range(4)] == [False, True, False, True]
        assert out[1].done and not out[1].won and out[1].task_type == "easy"
        assert 3.0 <= waited < 15.0 and runner.crashes == 1  # one timeout, not one per episode
        again = runner.reset(["train-easy-1"] * 4)
        assert [o.crashed for o in again] == [False] * 4


def test_runner_timeout_is_per_env_call_not_per_batch():
    """256 resets on one worker take longer than the timeout together, each far less: none is cut
    (64 of ~15 ms each once took 0.95 s, under the 1 s floor of the timeout)."""
    spec = envs.load("cooking")
    with envs.EnvRunner(spec, num_workers=1) as runner:
        runner.reset(["train-easy-0"])  # worker start and imports, under the default timeout
        start = time.monotonic()
        runner.reset(["train-easy-0"])
        runner.timeout_s = max(1.0, 8 * (time.monotonic() - start))
        start = time.monotonic()
        steps = runner.reset(["train-easy-0"] * 256)
        assert time.monotonic() - start > runner.timeout_s  # the batch outlasts the timeout...
        assert [s.crashed for s in steps] == [False] * 256 and runner.crashes == 0  # ...and is not cut


def test_a_slow_build_gets_the_setup_timeout_not_the_step_timeout(tmp_path):
    """Compiling a game takes seconds (4.6 s CPU measured): `reference` and `prepare` calls are timed
    by SETUP_TIMEOUT_S, so a short reset/step timeout does not cut them."""
    spec = envs.load("cooking", data=str(tmp_path))  # an empty game cache: the game is compiled now
    with envs.EnvRunner(spec, num_workers=1, timeout_s=0.5) as runner:
        (plan,) = runner.reference_actions(["train-easy-5"])
        assert plan and plan[-1] == "eat meal" and runner.crashes == 0
    assert (tmp_path / "train-easy-5.z8").exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc")
def test_env_workers_do_not_rerun_the_training_script(tmp_path):
    """Spawn re-runs the parent script's imports in each worker unless told not to: torch alone is
    about 230 MB per worker, and a worker needs only envs."""
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {REPO!r})\nimport torch\nimport envs\n\n"
        "if __name__ == '__main__':\n"
        "    with envs.EnvRunner(envs.load('cooking'), num_workers=1) as runner:\n"
        "        assert not runner.reset(['train-easy-0'])[0].crashed\n"
        "        maps = open(f'/proc/{runner._procs[0].pid}/maps').read()\n"
        "        print('worker loaded torch:', 'libtorch' in maps)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "worker loaded torch: False" in out.stdout


def test_env_check_command_replays_and_exits_zero():
    out = subprocess.run([sys.executable, "-m", "envs", "check", "--env", "cooking", "--split", "train", "--num-tasks", "3"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "3/3 won" in out.stdout and "train-easy-0: 5/5 reference steps, won" in out.stdout


def test_probe_starts_one_env_and_turns_any_failure_into_one_line(tmp_path):
    line = envs.load("cooking").probe(["train-easy-0", "train-cut-0"])
    assert line.startswith("env cooking: started train-easy-0 in ") and line.endswith("s (2 tasks)")
    not_a_folder = tmp_path / "games.txt"
    not_a_folder.write_text("")
    with pytest.raises(envs.EnvUnavailable, match=r"^env cooking cannot start task train-easy-0: FileExistsError: "):
        envs.load("cooking", data=str(not_a_folder)).probe(["train-easy-0"])
    with pytest.raises(envs.EnvUnavailable, match="has no training tasks"):
        envs.load("cooking").probe([])


def test_most_crashed_stops_a_run_only_past_half():
    assert envs.most_crashed([True, True, False, False]) is None
    assert envs.most_crashed([True, True, True, False]) == (
        "3 of 4 episodes of this iteration crashed (see the warnings above): the env is failing; "
        "stopping rather than training on them")


def test_unknown_env_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        envs.load("nope")
