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


def test_one_jvm_serves_every_episode(env):
    env.reset("find-plant-225")
    pid = env._sw._gateway.java_process.pid
    env.reset("lifespan-shortest-lived-93")
    env.reset("find-plant-226")
    assert env._sw._gateway.java_process.pid == pid
    assert env.jvm_starts == 1


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
