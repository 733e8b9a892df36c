"""gigpo.py: anchor groups, discounted step returns and the two-level advantage, by hand on a real
cooking game; `--step-advantage-w 0` is grpo.py; 2 iterations end to end through the CLI."""

import math
import statistics
from collections import defaultdict

import numpy as np
import pytest

import gigpo
import grpo

TASK = "train-easy-0"  # plan: inventory, examine cookbook, take orange bell pepper from fridge, prepare meal, eat meal
S2 = 1 / math.sqrt(2)  # any 2-member group with two different values normalises to -+1/sqrt(2)


@pytest.fixture(scope="module")
def played():
    """Real episodes of one cooking game, actions chosen by hand (no model, no mock env).
    Task group 0: W plays the walkthrough and wins in 5 steps; L plays `inventory`, `dance`,
    `dance`, `look` (the two `dance` steps flagged malformed) and runs out of steps.
    Task group 1: the same game again, two episodes of `inventory` only (a different group)."""
    from envs import cooking

    env = cooking.Env()

    def play(actions, valid, group):
        episode = gigpo.Episode(TASK, group)
        step = env.reset(TASK)
        for action, ok in zip(actions, valid):
            episode.turns.append(gigpo.Turn([], [], action, ok, step.observation, step.state))
            step = env.step(action)
        episode.won = step.won
        return episode

    try:
        plan = env.reference_actions(TASK)
        episodes = [
            play(plan, [True] * 5, 0),
            play(["inventory", "dance", "dance", "look"], [True, False, False, True], 0),
            play(["inventory"], [True], 1),
            play(["inventory"], [True], 1),
        ]
    finally:
        env.close()
    return episodes


def gigpo_pieces(episodes, gamma=0.95, similarity=None):
    turns, groups, rewards, invalid = gigpo.flatten_turns(episodes, 10.0)
    trajectories, env_rewards, anchors = gigpo.flatten_steps(episodes, 10.0)
    returns = gigpo.step_scores(gigpo.discounted_returns(env_rewards, trajectories, gamma), invalid, 0.1)
    step_groups = gigpo.anchor_groups(anchors, groups, similarity)
    return gigpo.step_scores(rewards, invalid, 0.1), groups, returns, step_groups, anchors


def test_the_real_game_gives_the_observations_the_anchors_are_made_of(played):
    w, l, _, _ = played
    assert w.won and not l.won and len(w.turns) == 5 and len(l.turns) == 4
    assert w.turns[0].observation == l.turns[0].observation  # both start in the same state
    assert w.turns[1].observation == l.turns[1].observation == "You are carrying nothing."
    assert l.turns[2].observation == l.turns[3].observation == "That's not a verb I recognise."


def test_win_reward_sits_on_the_winning_step_only(played):
    trajectories, env_rewards, anchors = gigpo.flatten_steps(played, 10.0)
    assert trajectories.tolist() == [0] * 5 + [1] * 4 + [2, 3]
    assert env_rewards.tolist() == [0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0]
    assert anchors[5] == played[1].turns[0].observation


def test_step_return_discounts_the_win_back_and_charges_the_penalty_on_its_own_step():
    # trajectory 0 wins at its 3rd step, gamma 0.5: G = [10*0.25, 10*0.5, 10] = [2.5, 5, 10]
    # trajectory 1 never wins: G = 0; the penalty (0.1) is taken after discounting, on its own step only
    env_rewards = np.array([0.0, 0.0, 10.0, 0.0, 0.0])
    trajectories = np.array([0, 0, 0, 1, 1])
    returns = gigpo.discounted_returns(env_rewards, trajectories, gamma=0.5)
    assert returns.tolist() == [2.5, 5.0, 10.0, 0.0, 0.0]
    invalid = np.array([False, True, False, True, False])
    assert gigpo.step_scores(returns, invalid, 0.1).tolist() == pytest.approx([2.5, 4.9, 10.0, -0.1, 0.0])
    # gamma 1: every step of the winner gets the full 10 (the trajectories do not leak into each other)
    assert gigpo.discounted_returns(env_rewards, trajectories, gamma=1.0).tolist() == [10, 10, 10, 0, 0]


def test_identical_observations_share_an_anchor_group_only_within_their_task(played):
    _, _, _, step_groups, _ = gigpo_pieces(played)
    w, l, g1 = step_groups[:5], step_groups[5:9], step_groups[9:]
    assert w[0] == l[0] and w[1] == l[1]  # initial state; "You are carrying nothing."
    assert l[2] == l[3]  # the same trajectory back in the same state: one anchor group
    assert len({w[2], w[3], w[4], l[2]}) == 4  # cookbook / fridge / meal texts: singletons
    assert g1[0] == g1[1] and g1[0] != w[0]  # same game and text, but another task group
    assert len(set(step_groups.tolist())) == 7


def test_step_advantage_by_hand_on_a_real_game_and_singletons_get_zero(played):
    scores, groups, returns, step_groups, _ = gigpo_pieces(played)
    # W: G = 10 * 0.95^(4-t) = [8.1450625, 8.57375, 9.025, 9.5, 10]; L: 0 minus 0.1 on the two dance steps
    assert returns.tolist() == pytest.approx([8.1450625, 8.57375, 9.025, 9.5, 10, 0, -0.1, -0.1, 0, 0, 0])
    adv = gigpo.step_advantages(returns, step_groups, "mean_std")
    # initial state {W0 8.145, L0 0} and "carrying nothing" {W1 8.574, L1 -0.1}: +-1/sqrt2 (winner up);
    # "not a verb" {L2 -0.1, L3 0}: mean -0.05, std sqrt(2 * 0.05^2) = 0.0707107 -> -+0.7071;
    # singletons W2 W3 W4 -> 0; group 1 {0, 0}: std 0 -> 0 / (0 + 1e-6) = 0
    expected = [S2, S2, 0, 0, 0, -S2, -S2, -S2, S2, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    # A = A^E + w A^S: W0 gets its GRPO advantage plus w * 0.7071
    combined = gigpo.episode_advantages(scores, groups, "mean_std") + 0.5 * adv
    assert combined[0] - grpo.grpo_advantages(scores, groups)[0] == pytest.approx(0.5 * S2, abs=1e-5)


def test_mean_norm_subtracts_the_anchor_mean_without_scaling(played):
    scores, groups, returns, step_groups, _ = gigpo_pieces(played)
    adv = gigpo.step_advantages(returns, step_groups, "mean")
    # {8.1450625, 0}: +-4.07253125; {8.57375, -0.1}: mean 4.236875 -> +-4.336875; {-0.1, 0}: -+0.05
    expected = [4.07253125, 4.336875, 0, 0, 0, -4.07253125, -4.336875, -0.05, 0.05, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-9)
    # episode level, group 0: scores [10]*5 + [0, -0.1, -0.1, 0], mean 49.8 / 9 = 5.5333...
    episode = gigpo.episode_advantages(scores, groups, "mean")
    assert episode[:9].tolist() == pytest.approx([10 - 49.8 / 9] * 5 + [-49.8 / 9, -0.1 - 49.8 / 9, -0.1 - 49.8 / 9, -49.8 / 9])
    assert episode[9:].tolist() == [0.0, 0.0]


def test_episode_mean_norm_keeps_a_lone_sample_whole():
    # verl-agent's episode_norm_reward: a group with one sample has mean 0, so s - 0 = s
    scores = np.array([3.0, 1.0, 7.0])
    groups = np.array([0, 0, 1])
    assert gigpo.episode_advantages(scores, groups, "mean").tolist() == [1.0, -1.0, 7.0]


def test_zero_step_weight_reproduces_grpo_advantages(played):
    scores, groups, returns, step_groups, _ = gigpo_pieces(played)
    grpo_adv = grpo.grpo_advantages(scores, groups)
    step_adv = gigpo.step_advantages(returns, step_groups, "mean_std")
    assert np.abs(step_adv).max() > 0.7  # the step level has something to add here ...
    assert (gigpo.episode_advantages(scores, groups, "mean_std") + 0.0 * step_adv).tolist() == grpo_adv.tolist()  # ... w=0 drops it
    assert not np.allclose(gigpo.episode_advantages(scores, groups, "mean_std") + 1.0 * step_adv, grpo_adv)


def test_similarity_threshold_joins_near_identical_anchors():
    a = "You are in the kitchen. You see a knife"  # 39 characters
    b = a[:-5] + "fork!"  # 39 characters; difflib matches "You ... see a " (34) and "k" (1): 2 * 35 / 78 = 0.897
    c = a + "."  # 40 characters; matches all 39 of a: 2 * 39 / 79 = 0.987
    d = "That's not a verb I recognise."
    groups = np.zeros(4, dtype=int)
    assert gigpo.anchor_groups([a, b, c, d], groups).tolist() == [0, 1, 2, 3]  # exact match only
    ids = gigpo.anchor_groups([a, b, c, d], groups, similarity_thresh=0.95).tolist()
    assert ids[0] == ids[2] and len({ids[0], ids[1], ids[3]}) == 3  # 0.987 joins, 0.897 does not
    # thresh 0.85: b joins a's group too; the same text in another task group never does
    ids = gigpo.anchor_groups([a, b, c, a], np.array([0, 0, 0, 1]), similarity_thresh=0.85).tolist()
    assert ids[0] == ids[1] == ids[2] != ids[3]


def test_anchor_group_stats_count_steps_in_singleton_groups():
    sizes = np.unique(np.array([0, 0, 0, 1, 1, 2, 3, 4, 4]), return_counts=True)[1]  # as gigpo.py logs them
    assert sizes.tolist() == [3, 2, 1, 1, 2]
    step_adv = np.array([1.0, -0.5, -0.5, 0.7, -0.7, 0.0, 0.0, 0.0, 0.0])
    stats = gigpo.anchor_group_stats(sizes, step_adv, np.arange(9.0))
    assert stats["gigpo/anchor_groups"] == 5
    assert stats["gigpo/anchor_group_size_mean"] == pytest.approx(9 / 5)
    assert stats["gigpo/anchor_group_size_median"] == 2 and stats["gigpo/anchor_group_size_max"] == 3
    assert stats["gigpo/singleton_group_frac"] == pytest.approx(2 / 5)
    assert stats["gigpo/singleton_step_frac"] == pytest.approx(2 / 9)
    assert stats["gigpo/step_adv_nonzero_frac"] == pytest.approx(5 / 9)
    assert stats["gigpo/step_adv_abs_mean"] == pytest.approx(3.4 / 9)  # (1 + 0.5 + 0.5 + 0.7 + 0.7) / 9
    assert stats["gigpo/step_return_mean"] == 4.0  # (0 + 1 + ... + 8) / 9


# ---- the iteration's algorithm: training_batch, as the main loop calls it ------------------------------
@pytest.fixture(scope="module")
def two_tasks():
    """Real episodes of two cooking games, actions chosen by hand. Task group 0 (train-easy-0): the
    walkthrough won (W); the walkthrough with a malformed `dance` as its 3rd step, won in 6 steps (WI);
    `inventory`, malformed `dance`, `look`, lost (L). Task group 1 (train-easy-1): its walkthrough won,
    and `inventory` twice, lost."""
    from envs import cooking

    env = cooking.Env()

    def play(task, actions, valid, group):
        episode = gigpo.Episode(task, group)
        step = env.reset(task)
        for action, ok in zip(actions, valid):
            k = len(episode.turns)
            episode.turns.append(gigpo.Turn([group, k], [k], action, ok, step.observation, step.state))
            step = env.step(action)
        episode.won = step.won
        return episode

    try:
        plan_a, plan_b = env.reference_actions("train-easy-0"), env.reference_actions("train-easy-1")
        episodes = [
            play("train-easy-0", plan_a, [True] * 5, 0),
            play("train-easy-0", plan_a[:2] + ["dance"] + plan_a[2:], [True, True, False, True, True, True], 0),
            play("train-easy-0", ["inventory", "dance", "look"], [True, False, True], 0),
            play("train-easy-1", plan_b, [True] * 5, 1),
            play("train-easy-1", ["inventory", "inventory"], [True, True], 1),
        ]
    finally:
        env.close()
    assert [e.won for e in episodes] == [True, True, False, True, False]
    return episodes


def normalised(values: list[float], norm: str) -> list[float]:
    """mean_std: (v - mean) / (unbiased std + 1e-6); mean: v - mean; a lone value is its own mean."""
    if len(values) == 1:
        return [0.0]
    mean = statistics.mean(values)
    return [(v - mean) / (statistics.stdev(values) + 1e-6) if norm == "mean_std" else v - mean for v in values]


def gigpo_by_hand(episodes, gamma, w, step_norm, episode_norm):
    """A = A^E + w A^S written out: s = 10 won - 0.1 invalid over each task group (a lone sample keeps
    s); G~_t = 10 gamma^(T-1-t) won - 0.1 invalid_t over the steps that saw the same observation in
    the same task group."""
    scores, returns, anchors = defaultdict(list), defaultdict(list), defaultdict(list)
    for i, e in enumerate(episodes):
        for t, turn in enumerate(e.turns):
            penalty = 0.1 * (not turn.valid)
            scores[e.group].append(((i, t), 10.0 * e.won - penalty))
            step_return = 10.0 * gamma ** (len(e.turns) - 1 - t) * e.won - penalty
            anchors[(e.group, turn.observation)].append(((i, t), step_return))
    episode_level, step_level = {}, {}
    for members in scores.values():
        episode_level.update(zip([k for k, _ in members], normalised([v for _, v in members], episode_norm)))
    for members in anchors.values():
        step_level.update(zip([k for k, _ in members], normalised([v for _, v in members], step_norm)))
    keys = [(i, t) for i, e in enumerate(episodes) for t in range(len(e.turns))]
    return [episode_level[k] + w * step_level[k] for k in keys], [step_level[k] for k in keys]


@pytest.mark.parametrize("step_norm, episode_norm, w, gamma", [
    ("mean_std", "mean_std", 1.0, 0.95), ("mean", "mean", 0.5, 0.95), ("mean_std", "mean", 1.0, 0.95),
    ("mean", "mean_std", 1.0, 0.5),  # --gamma 0.5
])
def test_training_batch_gives_each_step_its_episode_and_anchor_advantage(two_tasks, step_norm, episode_norm, w, gamma):
    args = gigpo.Args(success_reward=10.0, invalid_penalty=0.1, gamma=gamma, step_advantage_w=w, step_norm=step_norm,
                      episode_norm=episode_norm)
    prompts, responses, advantages, metrics = gigpo.training_batch(two_tasks, args)
    expected, step_level = gigpo_by_hand(two_tasks, gamma, w, step_norm, episode_norm)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if step_norm == "mean":
        # W's and WI's first steps: the same score 10 (A^E alike), one anchor group, returns 10 gamma^4 and 10 gamma^5
        # (WI wins a step later): with --gamma 0.5, 0.625 - 0.3125; with 0.95, 8.1450625 - 7.737809375
        assert advantages[0] - advantages[5] == pytest.approx(w * {0.5: 0.3125, 0.95: 0.407253125}[gamma], rel=1e-9)
    turns = [t for e in two_tasks for t in e.turns]
    assert prompts == [t.prompt_ids for t in turns] and responses == [t.response_ids for t in turns]
    # anchor groups, task 0: start (W, WI, L), "carrying nothing" (W, WI, L), cookbook (W, WI), "not a verb"
    # (WI, L), after the take and after prepare (W, WI); task 1: start and "carrying nothing" (2 each), and
    # the walkthrough's last 3 observations alone: 11 groups, 3 of the 21 samples in singletons
    assert metrics["gigpo/anchor_groups"] == 11 and metrics["gigpo/singleton_step_frac"] == pytest.approx(3 / 21)
    assert metrics["gigpo/step_adv_nonzero_frac"] == pytest.approx(np.mean(np.abs(step_level) > 1e-8))


def test_training_batch_similarity_thresh_joins_the_meal_line_to_the_take_line(two_tasks):
    """--similarity-thresh 0.6: in each task group the line after `prepare meal` ("Adding the meal to your
    inventory. ...") joins the anchor group of the line after the take ("You take the ... bell pepper from the
    fridge. ..."), difflib ratio 2 * 56 / (77 + 91) = 2/3; no other two lines of the batch reach 0.6 (11 anchor
    groups -> 9). A^E + w A^S by hand as if the two lines read the same."""
    from dataclasses import replace
    from difflib import SequenceMatcher

    meal = two_tasks[0].turns[4].observation
    take = {e.group: e.turns[3].observation for e in (two_tasks[0], two_tasks[3])}  # the walkthroughs' 4th steps
    assert meal.startswith("Adding the meal") and all(t.startswith("You take the") for t in take.values())
    assert [SequenceMatcher(None, meal, t).ratio() for t in take.values()] == pytest.approx([2 / 3, 2 / 3])
    alike = [replace(e, turns=[replace(t, observation=take[e.group] if t.observation == meal else t.observation)
                               for t in e.turns]) for e in two_tasks]
    args = gigpo.Args(success_reward=10.0, invalid_penalty=0.1, similarity_thresh=0.6, step_norm="mean_std",
                      episode_norm="mean_std")
    advantages, metrics = gigpo.training_batch(two_tasks, args)[2:]
    assert advantages.tolist() == pytest.approx(gigpo_by_hand(alike, 0.95, 1.0, "mean_std", "mean_std")[0],
                                                rel=1e-9, abs=1e-12)
    assert metrics["gigpo/anchor_groups"] == 9
    # W's and WI's take and meal steps (same score 10, so the same A^E): alone, each line's group holds equal
    # returns (9.5, 9.5 and 10, 10) and A^S = 0; joined, task 0's group is [9.5, 10, 9.5, 10]: mean 9.75, std
    # sqrt(4 * 0.25^2 / 3) = 0.288675, A^S -+sqrt(3)/2; task 1's [9.5, 10]: -+1/sqrt(2)
    assert advantages[4] - advantages[3] == advantages[10] - advantages[9] == pytest.approx(math.sqrt(3), rel=1e-5)
    assert advantages[18] - advantages[17] == pytest.approx(math.sqrt(2), rel=1e-5)


def test_two_iterations_on_cooking_log_anchor_groups(tiny_model, tmp_path):
    from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics, run_script

    out = run_script("gigpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "2", "--eval-every", "2",
                     "--similarity-thresh", "0.9", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path)
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1, 2] and "eval/success_rate" in metrics[2]
    for row in (metrics[1], metrics[2]):
        for key in ["losses/policy_loss", "losses/kl", "charts/success_rate", "gigpo/singleton_step_frac",
                    "gigpo/step_adv_std", "gigpo/anchor_group_size_max", "gigpo/step_return_mean"]:
            assert key in row, key
        # every step sample sits in exactly one anchor group, and one group is at most all samples of one task
        assert row["gigpo/anchor_groups"] * row["gigpo/anchor_group_size_mean"] == pytest.approx(row["tokens/samples"])
        assert row["gigpo/anchor_groups"] >= 2  # 2 tasks never share an anchor group
        assert 0 <= row["gigpo/singleton_step_frac"] <= 1
        # all first steps of a task share the initial observation: a group of group_size (2) at least
        assert row["gigpo/anchor_group_size_max"] >= 2
    assert (run / "checkpoint" / "trainer_state.pt").exists()
    assert '"similarity_thresh": 0.9' in (run / "checkpoint" / "args.json").read_text()  # what --resume reads back


@pytest.mark.parametrize("flags, message", [(["--gamma", "1.5"], "--gamma must be in [0, 1]"),
                                            (["--similarity-thresh", "1.0"], "--similarity-thresh must be in (0, 1)")])
def test_bad_gigpo_flags_are_one_clear_line(tiny_model, flags, message):
    from test_grpo_e2e import run_script

    out = run_script("gigpo.py", "--model", tiny_model, *flags, timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


def test_webshop_preset_is_verl_agents_run_webshop_and_flags_override_it():
    """verl-agent's run_webshop.sh trains on minibatches of 64 step samples with GiGPO's mean_norm (both levels);
    its ALFWorld script (and the cooking preset) keep 256 and mean_std. Flags typed by the user win."""
    import envs

    webshop, cooking = envs.load("webshop"), envs.load("cooking")
    args = gigpo.resolve_args(gigpo.Args(), webshop)
    assert (args.minibatch_size, args.step_norm, args.episode_norm) == (64, "mean", "mean")
    args = gigpo.resolve_args(gigpo.Args(), cooking)
    assert (args.minibatch_size, args.step_norm, args.episode_norm) == (256, "mean_std", "mean_std")
    args = gigpo.resolve_args(gigpo.Args(minibatch_size=8, step_norm="mean_std"), webshop)
    assert (args.minibatch_size, args.step_norm, args.episode_norm) == (8, "mean_std", "mean_std")
    import proas  # --base gigpo takes the same knobs the same way

    args = proas.resolve_args(proas.Args(base="gigpo"), webshop)
    assert (args.minibatch_size, args.step_norm, args.episode_norm) == (64, "mean", "mean")
