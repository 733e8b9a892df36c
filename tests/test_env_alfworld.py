"""ALFWorld adapter on the real eval games (shared/data/alfworld, or $ALFWORLD_DATA).

Default run: the walkthroughs of 12 games (the first game of each task type in both eval splits)
win; FULL_ENV_TESTS=1 replays all 274 (about 2 s each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("alfworld", reason="alfworld not installed: pip install alfworld textworld fast-downward-textworld")
pytest.importorskip("textworld", reason="textworld not installed")

import envs  # noqa: E402
from envs import alfworld  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "alfworld"


def _data_root() -> Path | None:
    for root in (os.environ.get("ALFWORLD_DATA"), SHARED):
        if root and (Path(root) / "json_2.1.1" / "valid_seen").is_dir():
            return Path(root)
    return None


DATA = _data_root()
pytestmark = pytest.mark.skipif(DATA is None, reason=f"ALFWorld eval games not found ($ALFWORLD_DATA or {SHARED})")
# A small bedroom game (about 0.5 s to ground): the state tests play it.
MUG = "valid_seen/pick_and_place_simple-Mug-None-SideTable-329/trial_T20190909_032340_274147"
SOAP = "valid_seen/pick_and_place_simple-SoapBottle-None-Cabinet-414/trial_T20190908_110131_524518"


@pytest.fixture(scope="module")
def env():
    e = alfworld.Env(data=str(DATA))
    yield e
    e.close()


def sample_games() -> list[str]:
    if DATA is None:
        return []
    splits = ("eval_in_distribution", "eval_out_of_distribution")
    games = [game for split in splits for game in alfworld.task_ids(split, data=str(DATA))]
    if os.environ.get("FULL_ENV_TESTS") == "1":
        return games
    first = {}
    for game in games:
        first.setdefault((game.split("/")[0], alfworld.task_type(game)), game)
    return sorted(first.values())


def test_eval_splits_hold_the_readme_task_type_counts():
    # shared/data/README.md: valid_seen 140 games, valid_unseen 134, per task type as below.
    types = ["look_at_obj_in_light", "pick_and_place_simple", "pick_clean_then_place_in_recep", "pick_cool_then_place_in_recep",
             "pick_heat_then_place_in_recep", "pick_two_obj_and_place"]
    expected = {"eval_in_distribution": dict(zip(types, [13, 35, 27, 25, 16, 24])),
                "eval_out_of_distribution": dict(zip(types, [18, 24, 31, 21, 23, 17]))}
    for split, counts in expected.items():
        ids = alfworld.task_ids(split, data=str(DATA))
        assert Counter(alfworld.task_type(t) for t in ids) == counts
        assert len(ids) == sum(counts.values())


def test_missing_data_names_the_download_command(tmp_path):
    alfworld._games.cache_clear()
    with pytest.raises(envs.EnvUnavailable, match="alfworld-download"):
        alfworld.task_ids("train", data=str(tmp_path))


@pytest.mark.parametrize("game", sample_games(), ids=lambda game: game.split("/trial")[0])
def test_walkthrough_wins_through_the_adapter(env, game):
    plan = env.reference_actions(game)
    step = env.reset(game)
    assert step.task_type == alfworld.task_type(game) and not step.done
    for k, action in enumerate(plan):
        assert not step.done, f"ended early at step {k}"
        step = env.step(action)
    assert step.won and step.done and step.reward == 10.0


def test_reset_gives_task_admissible_actions_and_type(env):
    step = env.reset(MUG)
    assert step.task == "put a mug in sidetable."
    assert step.task_type == "pick_and_place_simple"
    assert step.observation.endswith("Your task is to: put a mug in sidetable.")
    # "you see a bed 1, a diningtable 1, a drawer 4, a drawer 3, a drawer 2, a drawer 1, a garbagecan 1,
    # a sidetable 2, and a sidetable 1": a "go to" each, inventory and look ('help' is dropped)
    assert step.admissible == ["go to bed 1", "go to diningtable 1", "go to drawer 1", "go to drawer 2", "go to drawer 3",
                               "go to drawer 4", "go to garbagecan 1", "go to sidetable 1", "go to sidetable 2",
                               "inventory", "look"]
    step = env.step("go to diningtable 1")
    assert {"take mug 3 from diningtable 1", "take pen 1 from diningtable 1", "examine diningtable 1"} <= set(step.admissible)
    assert "atlocation(agent1, diningtable 1)" in step.state and "inreceptacle(mug 3, diningtable 1)" in step.state


def test_garbage_action_says_nothing_happens(env):
    start = env.reset(MUG)
    step = env.step("dance with the bed")
    assert step.observation == "Nothing happens."
    assert not step.done and not step.won and step.state == start.state


def test_independent_subgoals_in_either_order_give_one_state(env):
    def play(actions):
        env.reset(MUG)
        for action in actions:
            step = env.step(action)
        return step.state

    a = play(["go to drawer 1", "open drawer 1", "go to drawer 2", "open drawer 2", "go to sidetable 1"])
    b = play(["go to drawer 2", "open drawer 2", "go to drawer 1", "open drawer 1", "go to sidetable 1"])
    one = play(["go to drawer 1", "open drawer 1", "go to sidetable 1"])
    assert a == b
    assert {"opened(drawer 1)", "opened(drawer 2)", "atlocation(agent1, sidetable 1)"} <= a
    assert a != one


def test_project_state_ignores_objects_the_task_never_mentions(env):
    plan = env.reference_actions(MUG)
    assert plan == ["go to diningtable 1", "take mug 3 from diningtable 1", "go to sidetable 1", "move mug 3 to sidetable 1"]
    env.reset(MUG)
    at_table = env.step("go to diningtable 1").state
    with_pen = env.step("take pen 1 from diningtable 1").state
    assert with_pen != at_table  # the pen is held now
    assert alfworld.project_state(with_pen, env.task, plan) == alfworld.project_state(at_table, env.task, plan)
    env.reset(MUG)
    env.step("go to diningtable 1")
    with_mug = env.step("take mug 3 from diningtable 1").state
    assert alfworld.project_state(with_mug, env.task, plan) == {"atlocation(agent1, diningtable 1)", "holds(agent1, mug 3)"}


def test_project_state_names_unmentioned_places_elsewhere():
    state = frozenset({"atlocation(agent1, cabinet 3)", "inreceptacle(apple 1, fridge 1)", "inreceptacle(mug 1, countertop 1)",
                       "opened(fridge 1)", "holdsany(agent1)"})
    plan = ["go to countertop 1", "take apple 1 from countertop 1"]
    assert alfworld.project_state(state, "heat some apple and put it in countertop.", plan) == {
        "atlocation(agent1, elsewhere)", "inreceptacle(apple 1, elsewhere)"}


def test_runner_plays_games_in_worker_processes():
    games = [MUG, SOAP]
    spec = envs.load("alfworld", data=str(DATA))
    with envs.EnvRunner(spec, num_workers=2) as runner:
        plans = runner.reference_actions(games)
        steps = runner.reset(games)
        assert [s.task_type for s in steps] == [alfworld.task_type(g) for g in games]
        for t in range(max(map(len, plans))):
            for i, step in runner.step({i: p[t] for i, p in enumerate(plans) if t < len(p)}).items():
                steps[i] = step
    assert all(s.won for s in steps)


def test_prompt_is_verl_agents_alfworld_template():
    first = alfworld.prompt("put a mug in desk.", "You are in the middle of a room.", ["go to desk 1", "help", "look"], [], 0, 2)
    assert first == (
        "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
        "Your current observation is: You are in the middle of a room.\n"
        "Your admissible actions of the current situation are: ['go to desk 1'\n 'look'].\n\n"
        "Now it's your turn to take an action.\n"
        "You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed "
        "within <think> </think> tags. \n"
        "Once you've finished your reasoning, you should choose an admissible action for current step and present it "
        "within <action> </action> tags.\n")
    later = alfworld.prompt("put a mug in desk.", "You arrive at desk 1.", ["look"], [("o2", "a2"), ("o3", "a3")], 3, 2)
    assert ("Your task is to: put a mug in desk.\nPrior to this step, you have already taken 3 step(s). Below are the most "
            "recent 2 observations and the corresponding actions you took: [Observation 2: 'o2', Action 2: 'a2']\n"
            "[Observation 3: 'o3', Action 3: 'a3']\nYou are now at step 4 and your current observation is: "
            "You arrive at desk 1.\n") in later


def test_parse_is_verl_agents_projection():
    assert alfworld.parse("<think>the mug</think><action>Take Mug 1 from Desk 1</action>") == ("take mug 1 from desk 1", True)
    assert alfworld.parse("<action>look</action>") == ("look", False)  # no <think>
    action, valid = alfworld.parse("<think>ok</think> then go to desk 1")
    assert (action, valid) == ("<think>ok</think> then go to desk 1"[-30:].lower(), False)
    assert alfworld.parse("<think>好</think><action>look</action>") == ("look", False)


def test_grpo_trains_one_iteration_on_alfworld(tiny_model, tmp_path):
    """grpo.py --env alfworld end to end with the tiny model. The shared data holds only the eval
    splits, so a data folder whose `train` is valid_seen stands in for alfworld-download's."""
    import subprocess
    import sys

    games = tmp_path / "data" / "json_2.1.1"
    games.mkdir(parents=True)
    for name, target in [("train", "valid_seen"), ("valid_seen", "valid_seen"), ("valid_unseen", "valid_unseen")]:
        (games / name).symlink_to(DATA / "json_2.1.1" / target)
    flags = ["--model", tiny_model, "--env", "alfworld", "--env-data", str(tmp_path / "data"), "--num-tasks", "2",
             "--group-size", "2", "--max-steps", "2", "--max-new-tokens", "8", "--num-eval-tasks", "2", "--eval-every", "1",
             "--num-env-workers", "2", "--minibatch-size", "4", "--no-gradient-checkpointing", "--total-iterations", "1",
             "--output-dir", str(tmp_path / "runs")]
    out = subprocess.run([sys.executable, "grpo.py", *flags], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    assert "eval/success_rate" in rows[0] and "charts/success_rate" in rows[1]
    assert 4 <= rows[1]["tokens/samples"] <= 8  # 2 tasks x 2 episodes x 1..2 steps
    for row in rows:  # the seen and the unseen games, each logged on its own
        assert {"eval/eval_in_distribution/success_rate", "eval/eval_out_of_distribution/success_rate"} <= set(row)


def test_evaluation_plays_both_eval_splits_and_logs_each_apart(tiny_model):
    """The preset evaluates valid_seen and valid_unseen; evaluate() reports every split on its own (a fixed
    answer plays one `look` per game)."""
    from transformers import AutoTokenizer

    import grpo
    import sft

    spec = envs.load("alfworld", data=str(DATA))
    assert spec.preset.eval_split.split(",") == ["eval_in_distribution", "eval_out_of_distribution"]
    unseen = next(t for t in alfworld.task_ids("eval_out_of_distribution", data=str(DATA))
                  if alfworld.task_type(t) == "look_at_obj_in_light")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    answer = tokenizer("<think>x</think><action>look</action>", add_special_tokens=False)["input_ids"]
    args = grpo.Args(max_steps=1, history_length=2, max_prompt_tokens=4096, success_reward=10.0, invalid_penalty=0.1)
    eval_tasks = {"eval_in_distribution": [MUG, SOAP], "eval_out_of_distribution": [unseen]}
    with envs.EnvRunner(spec, 1) as runner:
        metrics = grpo.evaluate(spec, runner, tokenizer, lambda prompts, temperature: [answer for _ in prompts], args,
                                eval_tasks)
        warm = sft.evaluate_warm_start(spec, runner, tokenizer, lambda prompts, temperature: [answer for _ in prompts],
                                       sft.Args(max_steps=1, history_length=2, max_prompt_tokens=4096, success_reward=10.0,
                                                invalid_penalty=0.1), eval_tasks)
    for prefix in ("eval", "eval_sampling"):  # sft.py logs both splits apart too, at both of its temperatures
        assert warm[f"{prefix}/eval_in_distribution/success_rate_pick_and_place_simple"] == 0.0
        assert warm[f"{prefix}/eval_out_of_distribution/success_rate_look_at_obj_in_light"] == 0.0
        assert warm[f"{prefix}/eval_out_of_distribution/episode_length"] == 1.0
    assert metrics["eval/success_rate"] == 0.0 and metrics["eval/episode_length"] == 1.0
    assert metrics["eval/invalid_action_rate"] == 0.0  # every game played its `look`
    seen_types = {k for k in metrics if k.startswith("eval/eval_in_distribution/success_rate_")}
    unseen_types = {k for k in metrics if k.startswith("eval/eval_out_of_distribution/success_rate_")}
    assert seen_types == {"eval/eval_in_distribution/success_rate_pick_and_place_simple"}
    assert unseen_types == {"eval/eval_out_of_distribution/success_rate_look_at_obj_in_light"}
    assert {"eval/success_rate_pick_and_place_simple", "eval/success_rate_look_at_obj_in_light"} <= set(metrics)
