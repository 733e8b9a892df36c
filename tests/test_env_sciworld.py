"""ScienceWorld adapter on the real simulator (the `scienceworld` package ships its jar; needs Java).

Default run: gold paths win on the first test variation of one task name per ScienceWorld topic
group except Mendelian genetics (its gold paths take ~30 s); FULL_ENV_TESTS=1 runs all 30 names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("scienceworld", reason="scienceworld not installed: pip install scienceworld")
pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs Java 11+ on PATH")

from envs import sciworld  # noqa: E402

QUICK = ["melt", "use-thermometer", "power-component", "find-non-living-thing", "grow-plant",
         "chemistry-mix-paint-secondary-color", "lifespan-longest-lived", "identify-life-stages-2",
         "inclined-plane-friction-named-surfaces"]


@pytest.fixture(scope="module")
def env():
    e = sciworld.Env()
    yield e
    e.close()


def names() -> list[str]:
    return list(sciworld.variations()) if os.environ.get("FULL_ENV_TESTS") == "1" else QUICK


def test_splits_are_the_packages_variation_lists():
    splits = sciworld.variations()
    assert len(splits) == 30
    # boil has 30 variations: train 0..13, dev 14..20, test 21..29 (ScienceWorld's ~50/25/25 split)
    assert splits["boil"] == {"train": list(range(14)), "dev": list(range(14, 21)), "test": list(range(21, 30))}
    test_ids = sciworld.task_ids("test")
    assert test_ids[:2] == ["boil-21", "boil-22"] and "mendelian-genetics-unknown-plant-479" in test_ids
    assert not set(test_ids) & set(sciworld.task_ids("train"))


@pytest.mark.parametrize("name", names())
def test_gold_path_wins(env, name):
    task_id = f"{name}-{sciworld.variations()[name]['test'][0]}"
    plan = env.reference_actions(task_id)
    step = env.reset(task_id)
    scores = [step.score]
    for action in plan:
        if step.done:
            break
        step = env.step(action)
        scores.append(step.score)
    assert step.won and step.done and step.score == 100 and step.reward == 10.0
    assert scores == sorted(scores)  # the gold path never loses progress


def test_envs_of_a_process_share_one_jvm(env):
    env.reset("find-plant-225")
    starts = sciworld.JVM.starts
    a, b = sciworld.Env(), sciworld.Env()
    a.reset("lifespan-shortest-lived-93")
    b.reset("find-plant-226")
    assert a._jvm is b._jvm is env._jvm and sciworld.JVM.starts == starts  # no JVM per Env
    a.close()
    b.close()
    assert env._jvm.gateway.java_process.poll() is None  # still serving `env`
    assert env.step("look around").observation.startswith("This room is called the")


def test_new_objects_get_fresh_ids_when_another_simulator_loaded_in_between():
    """Loading a task resets the JVM's object-id counter; object equality is id equality. Without
    each simulator's own counter, the 4 objects grow-fruit-1 makes on its first `wait1` took the ids
    of 4 objects it already had (147 objects, not 151, hand-checked in ScienceWorld's object table)."""
    a, b = sciworld.Env(), sciworld.Env()
    try:
        a.reset("grow-fruit-1")  # ids up to 17613
        b.reset("find-animal-3")  # sets the JVM's counter to 17601
        a.step("wait1")
        ids = [int(i) for i in json.loads(a._sim.getAllObjectIdsTypesReferentsLUTJSON())]
        assert len(ids) == 151 and max(ids) == 17625
    finally:
        a.close()
        b.close()


def test_each_simulator_draws_from_its_own_random_state(env):
    env.reset("find-plant-225")  # holds the JVM
    jvm = env._jvm
    state_42 = (42 ^ 0x5DEECE66D) & (2**48 - 1)  # java.util.Random(42)'s internal state
    expected = jvm.gateway.jvm.java.util.Random(42).nextInt(1000)
    draw, _ = jvm.swapped((0, state_42), lambda: jvm.random.nextInt(1000))
    sciworld.Env().reset("boil-1")  # another simulator's load reseeds the JVM's Random
    jvm.random.nextInt(1000)
    again, after = jvm.swapped((0, state_42), lambda: jvm.random.nextInt(1000))
    assert draw == again == expected and after[1] != state_42


def test_a_simulator_whose_jvm_died_gets_a_new_one_at_reset(env):
    env.reset("find-plant-225")
    old = env._jvm.gateway.java_process
    old.kill()
    old.wait()
    with pytest.raises(Exception):
        env.step("look around")
    step = env.reset("find-plant-225")
    assert env._jvm.gateway.java_process.pid != old.pid and step.observation.startswith("This room is called the")


def java_children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and "java" in stat.with_name("comm").read_text():
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def test_runner_workers_run_one_jvm_each_for_all_their_episodes():
    import envs

    with envs.EnvRunner(envs.load("sciworld"), num_workers=2) as runner:
        steps = runner.reset(["find-plant-225"] * 4 + ["boil-1"] * 4)
        runner.step({i: "look around" for i in range(8)})
        assert not any(s.crashed for s in steps)
        assert [len(java_children(p.pid)) for p in runner._procs] == [1, 1]  # not one per episode


def test_meta_commands_are_invalid_and_change_nothing(env):
    """`reset task` wiped a run's progress (75 -> 17); `help` and `objects` list every template and
    object. The engine ignores articles and case: each spelling below is a meta command to it."""
    env.reset("use-thermometer-405")
    for action in ["go to kitchen", "pick up thermometer", "focus on thermometer"]:
        before = env.step(action)
    assert before.score > 0
    for command in ["reset task", "Reset the Task", "  reset   a task ", "help", "objects", "the objects"]:
        step = env.step(command)
        assert step.observation == "No known action matches that input."
        assert step.score == before.score and step.state == before.state and not step.done
        assert sciworld.parse(f"<think>x</think><action>{command}</action>")[1] is False
    assert sciworld.parse("<think>x</think><action>task</action>") == ("task", True)  # a listed template
    assert env.step("look around").score == before.score


def test_state_tracks_score_room_and_inventory(env):
    step = env.reset("use-thermometer-405")
    assert step.task.startswith("Your task is to measure the temperature of unknown substance B")
    assert step.task_type == "use-thermometer"
    assert "focus on OBJ" in step.admissible and "reset task" not in step.admissible
    assert "inventory:orange" in step.state and "score:0" in step.state
    step = env.step("go to kitchen")
    assert "location:kitchen" in step.state
    step = env.step("pick up thermometer")
    assert any(fact.startswith("inventory:thermometer") for fact in step.state)


def test_unknown_action_changes_nothing_and_wrong_focus_fails(env):
    start = env.reset("use-thermometer-405")
    step = env.step("jump over the moon")
    assert step.observation == "No known action matches that input."
    assert not step.done and step.state == start.state
    step = env.step("focus on agent")  # focusing on the wrong thing ends the task, failed
    assert step.done and not step.won and step.score == 0 and step.info["raw_score"] < 0


def test_project_state_keeps_score_and_named_things():
    state = frozenset({"score:43", "location:workshop", "inventory:orange", "inventory:metal pot (containing nothing)",
                       "inventory:thermometer, currently reading a temperature of 10 degrees celsius"})
    plan = ["go to kitchen", "pick up thermometer", "pick up metal pot"]
    assert sciworld.project_state(state, "Your task is to boil water.", plan) == {
        "score:43", "location:elsewhere", "inventory:metal pot (containing nothing)"}


def test_prompt_lists_action_templates_and_parse_is_verl_projection():
    text = sciworld.prompt("Your task is to boil water.", "You move to the kitchen.", ["look around", "focus on OBJ"], [], 0, 2)
    assert text.startswith("\nYou are an expert agent operating in the ScienceWorld text-based science environment. "
                           "Your task is to boil water.\nYour current observation is: You move to the kitchen.\n")
    assert "follow these templates: ['look around'\n 'focus on OBJ'], where OBJ is" in text
    later = sciworld.prompt("Your task is to boil water.", "o3", ["look around"], [("o1", "a1"), ("o2", "a2")], 2, 2)
    assert "[Observation 1: 'o1', Action 1: 'a1']\n[Observation 2: 'o2', Action 2: 'a2']\nYou are now at step 3" in later
    action = sciworld.parse("<think>hot</think><action>Focus on Unknown Substance B</action>")
    assert action == ("focus on unknown substance b", True)


def test_grpo_trains_one_iteration_on_sciworld(tiny_model, tmp_path):
    """grpo.py --env sciworld end to end with the tiny model (JVMs in the env workers)."""
    flags = ["--model", tiny_model, "--env", "sciworld", "--num-tasks", "2", "--group-size", "2", "--max-steps", "2",
             "--max-new-tokens", "8", "--num-eval-tasks", "2", "--eval-every", "1", "--num-env-workers", "2",
             "--minibatch-size", "4", "--no-gradient-checkpointing", "--total-iterations", "1",
             "--output-dir", str(tmp_path / "runs")]
    out = subprocess.run([sys.executable, "grpo.py", *flags], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert "eval/success_rate" in rows[0] and "charts/success_rate" in rows[1]
    assert 4 <= rows[1]["tokens/samples"] <= 8  # 2 tasks x 2 episodes x 1..2 steps
