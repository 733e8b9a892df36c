"""proas.py: ProAS labels, Eq. 7 shaping and its ablations by hand, graphs of real games, end to end."""

import math
import os
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import envs
import grpo
import proas
from proas import Episode, Turn

# Abstract states for the hand cases: the reference path takes the apple, then the knife, then slices.
S0 = frozenset({"on(apple, table)", "on(knife, table)"})
S1 = frozenset({"in(apple, I)", "on(knife, table)"})
S2 = frozenset({"in(apple, I)", "in(knife, I)"})
S3 = frozenset({"in(apple, I)", "in(knife, I)", "sliced(apple)"})
DETOUR = frozenset({"at(apple, kitchen)", "on(knife, table)"})  # the apple dropped on the floor
KNIFE_FIRST = frozenset({"on(apple, table)", "in(knife, I)"})
REFERENCE = ["take apple", "take knife", "slice apple with knife"]


def hand_graph():
    graph = {"task": "slice the apple", "reference_actions": REFERENCE, "vertices": {S0}, "edges": set()}
    proas.grow_graph(graph, proas.purify([S0, S1, S2, S3], REFERENCE, [True] * 3))
    return graph


def labels(states, actions, edge_match="action", graph=None):
    re, pa = proas.step_labels(graph or hand_graph(), states, actions, [True] * len(actions), edge_match)
    return re.tolist(), pa.tolist()


# ---- purification and the graph ------------------------------------------------------------------
def test_purification_drops_self_loops_and_invalid_steps():
    # examine cookbook changes nothing (s1 == s0): dropped; the malformed 3rd step is dropped even
    # though the state moved; the remaining step is kept with its action normalised
    got = proas.purify([S0, S0, S1, S2], ["examine cookbook", "Take  Apple", "take knife"], [True, True, False])
    assert got == [(S0, "take apple", S1)]


def test_strict_union_adds_only_new_vertices_and_edges():
    graph = hand_graph()
    assert (len(graph["vertices"]), len(graph["edges"])) == (4, 3)
    # the same path again adds nothing; the knife-first order adds 1 vertex and 2 edges
    assert proas.grow_graph(graph, proas.purify([S0, S1, S2], REFERENCE[:2], [True, True])) == 0
    assert proas.grow_graph(graph, proas.purify([S0, KNIFE_FIRST, S2], ["take knife", "take apple"], [True, True])) == 2
    assert (len(graph["vertices"]), len(graph["edges"])) == (5, 5)


# ---- labels -------------------------------------------------------------------------------------
def test_successful_trajectory_detour_is_unreasonable_and_masked():
    # take apple (S1, new vertex), drop apple (off the graph), take apple (back to S1), knife, slice
    states = [S0, S1, DETOUR, S1, S2, S3]
    actions = ["take apple", "drop apple", "take apple", "take knife", "slice apple with knife"]
    re, pa = labels(states, actions)
    assert re == [1, 0, 1, 1, 1]
    assert pa == [1, 0, 0, 1, 1]  # the return reaches S1, visited at step 0: reasonable, not advancing
    shaped, _ = proas.proas_shape([0.5] * 5, re, pa)
    assert shaped.tolist() == [0.5, 0.0, 0.5, 0.5, 0.5]  # MUI: A~ = Re * A, only the detour is masked


def test_return_after_detour_is_reasonable_only_with_action_matching():
    states, actions = [S0, S1, DETOUR, S1], ["take apple", "drop apple", "take apple"]
    assert labels(states, actions)[0] == [1, 0, 1]
    # the literal triple (DETOUR, take apple, S1) is no edge
    assert labels(states, actions, edge_match="full")[0] == [1, 0, 0]


def test_order_swap_reaches_the_same_vertex_and_continues_on_the_graph():
    # knife first, then apple: frozensets make the state after both the reference vertex S2
    states = [S0, KNIFE_FIRST, S2, S3]
    re, pa = labels(states, ["take knife", "take apple", "slice apple with knife"])
    assert states[2] in hand_graph()["vertices"]
    assert re == [0, 0, 1] and pa == [0, 0, 1]  # the swapped steps are no edges of G^(k); slicing is
    assert labels(states, ["take knife", "take apple", "slice apple with knife"], edge_match="full")[0] == [0, 0, 1]


def test_malformed_step_is_never_reasonable_even_when_it_moves_on_the_path():
    re, pa = proas.step_labels(hand_graph(), [S0, S1], ["take apple"], [False])
    assert re.tolist() == [0] and pa.tolist() == [0]


def test_future_drift_counts_the_non_advancing_steps_from_t_on():
    # PA = [1, 0, 0, 1, 0, 0]: 1 - PA = [0, 1, 1, 0, 1, 1]; suffix sums from the end
    assert proas.future_drift([1, 0, 0, 1, 0, 0]).tolist() == [4, 4, 3, 2, 2, 1]


# ---- Eq. 7 and its ablations on one trajectory ----------------------------------------------------
FAILED_PA = [1, 0, 0, 1, 0, 0]


def test_apr_weights_early_steps_more():
    # D = [4, 4, 3, 2, 2, 1]; T = non-advancing steps {1, 2, 4, 5}: D_T = [4, 3, 2, 1], mean 2.5
    # weights 4/2.5 = 1.6, 3/2.5 = 1.2, 2/2.5 = 0.8, 1/2.5 = 0.4; advancing steps 0 and 3 keep A = -1
    shaped, weights = proas.proas_shape([-1.0] * 6, FAILED_PA, FAILED_PA)
    assert shaped.tolist() == pytest.approx([-1.0, -1.6, -1.2, -1.0, -0.8, -0.4], rel=1e-5)
    assert np.isnan(weights[[0, 3]]).all() and weights[[1, 2, 4, 5]].tolist() == pytest.approx([1.6, 1.2, 0.8, 0.4], rel=1e-5)
    assert weights[[1, 2, 4, 5]].mean() == pytest.approx(1.0, rel=1e-5)  # APR redistributes, keeps the total over T


def test_apr_set_all_and_suffix_drift():
    # --apr-set all: T = every step, mean D = 16 / 6; weights D * 6 / 16
    shaped, _ = proas.proas_shape([-1.0] * 6, FAILED_PA, FAILED_PA, apr_set="all")
    assert shaped.tolist() == pytest.approx([-1.5, -1.5, -1.125, -0.75, -0.75, -0.375], rel=1e-5)
    # suffix: D = |tau| - t + 1 = [6, 5, 4, 3, 2, 1]; over T {1, 2, 4, 5}: [5, 4, 2, 1], mean 3
    shaped, _ = proas.proas_shape([-1.0] * 6, FAILED_PA, FAILED_PA, shaping="suffix")
    assert shaped.tolist() == pytest.approx([-1.0, -5 / 3, -4 / 3, -1.0, -2 / 3, -1 / 3], rel=1e-5)


def test_msk_zeroes_advancing_negative_steps_and_keeps_plain_a_elsewhere():
    re = [1, 0, 0, 1, 0, 0]
    shaped, weights = proas.proas_shape([-1.0] * 6, re, FAILED_PA, shaping="msk")
    assert shaped.tolist() == [0.0, -1.0, -1.0, 0.0, -1.0, -1.0]
    assert np.isnan(weights).all()


def test_zero_advantage_is_left_alone():
    shaped, _ = proas.proas_shape([0.0, 0.0], [0, 1], [0, 1])
    assert shaped.tolist() == [0.0, 0.0]


# ---- the batch: every ablation on one batch, none == grpo.py -----------------------------------------
# group 0: a won episode (3 steps, Re [1, 0, 1], PA [1, 0, 1]) and a lost one (4 steps, Re = PA = [0, 1, 0, 0]);
# group 1: two episodes of a task without a graph (labels None): never shaped.
SCORES = np.array([10.0, 10.0, 10.0, 0.0, 0.0, 0.0, 0.0, 10.0, 0.0])
GROUPS = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1])
LENGTHS = [3, 4, 1, 1]
LABELS = [(np.array([1.0, 0, 1]), np.array([1.0, 0, 1])), (np.array([0.0, 1, 0, 0]), np.array([0.0, 1, 0, 0])), None, None]
# group 0: mean 30/7, squared deviations 3 (40/7)^2 + 4 (30/7)^2 = 8400/49, unbiased var 8400/294 = 200/7
STD0 = math.sqrt(200 / 7)
WIN, LOSS = (40 / 7) / (STD0 + 1e-6), -(30 / 7) / (STD0 + 1e-6)  # 1.069045, -0.801784
# lost PA [0, 1, 0, 0]: D = [3, 2, 2, 1]; T = {0, 2, 3}: D_T = [3, 2, 1], mean 2 -> weights 1.5, 1, 0.5
# suffix: D = [4, 3, 2, 1]; D_T = [4, 2, 1], mean 7/3 -> weights 12/7, 6/7, 3/7
EXPECTED = {
    "none": [WIN, WIN, WIN, LOSS, LOSS, LOSS, LOSS],
    "proas": [WIN, 0, WIN, 1.5 * LOSS, LOSS, 1.0 * LOSS, 0.5 * LOSS],
    "no-mui": [WIN, WIN, WIN, 1.5 * LOSS, LOSS, 1.0 * LOSS, 0.5 * LOSS],
    "no-apr": [WIN, 0, WIN, LOSS, LOSS, LOSS, LOSS],
    "msk": [WIN, 0, WIN, LOSS, 0, LOSS, LOSS],
    "suffix": [WIN, 0, WIN, 12 / 7 * LOSS, LOSS, 6 / 7 * LOSS, 3 / 7 * LOSS],
}


@pytest.mark.parametrize("shaping", list(EXPECTED))
def test_every_shaping_ablation_on_one_batch(shaping):
    baseline = grpo.grpo_advantages(SCORES, GROUPS)
    shaped, _ = proas.proas_advantages(baseline, LENGTHS, LABELS, shaping, "nonadvancing", 1e-6)
    assert shaped[:7].tolist() == pytest.approx(EXPECTED[shaping], rel=1e-5, abs=1e-12)
    assert shaped[7:].tolist() == baseline[7:].tolist()
    assert baseline[7] == pytest.approx(5 / (math.sqrt(50) + 1e-6))  # group 1: mean 5, std sqrt(50): no graph, unshaped


def test_shaping_none_and_pr_leave_the_advantages_as_they_are():
    baseline = grpo.grpo_advantages(SCORES, GROUPS)
    for shaping in ("none", "pr"):
        shaped, weights = proas.proas_advantages(baseline, LENGTHS, LABELS, shaping, "nonadvancing", 1e-6)
        assert np.array_equal(shaped, baseline) and np.isnan(weights).all()


def test_progress_per_step_is_pa_in_sample_order_and_zero_without_a_graph():
    assert proas.progress_per_step(LENGTHS, LABELS).tolist() == [1, 0, 1, 0, 1, 0, 0, 0, 0]
    assert proas.progress_per_step([], []).tolist() == []


def test_random_labels_permute_pairs_across_the_batch():
    rng = np.random.default_rng(0)
    out = proas.permute_labels(LABELS, rng)
    assert out[2] is None and out[3] is None and [len(o[0]) for o in out[:2]] == [3, 4]
    before = sorted(zip(np.concatenate([LABELS[0][0], LABELS[1][0]]), np.concatenate([LABELS[0][1], LABELS[1][1]])))
    after = list(zip(np.concatenate([out[0][0], out[1][0]]), np.concatenate([out[0][1], out[1][1]])))
    assert sorted(after) == before  # same (Re, PA) pairs, PA <= Re still
    assert [tuple(map(float, p)) for p in after] != [tuple(map(float, p)) for p in zip(np.concatenate([LABELS[0][0], LABELS[1][0]]), np.concatenate([LABELS[0][1], LABELS[1][1]]))]


def test_edge_drop_removes_a_seeded_fraction_of_edges():
    graph = hand_graph()
    proas.drop_edges(graph, 0.4, seed=7)  # round(0.4 * 3) = 1 edge of 3 removed; vertices kept
    assert (len(graph["vertices"]), len(graph["edges"])) == (4, 2)
    again = hand_graph()
    proas.drop_edges(again, 0.4, seed=7)
    assert again["edges"] == graph["edges"]


# ---- real cooking games ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cooking_runner(cooking_spec):
    runner = envs.EnvRunner(cooking_spec, 2)
    yield runner
    runner.close()


def play(spec, task_id: str, actions: list[str], group: int = 0) -> Episode:
    """An Episode of the real game, with its raw states, played with the given actions."""
    env = spec.make()
    try:
        obs = env.reset(task_id)
        episode = Episode(task_id, group, task=obs.task, task_type=obs.task_type)
        for a in actions:
            result = env.step(a)
            episode.turns.append(Turn([], [], a, True, obs.observation, obs.state, result.state))
            obs = result
        episode.won = obs.won
    finally:
        env.close()
    return episode


SWAP = ["close fridge", "open fridge", "take knife from table", "take red apple from counter", "take red potato from counter",
        "dice red potato with knife", "drop knife", "prepare meal", "eat meal"]


def test_reference_graph_of_a_real_cooking_game(cooking_spec, cooking_runner):
    graphs = proas.replay_reference(cooking_spec, cooking_runner, ["train-cut-0"])
    graph = graphs["train-cut-0"]
    # walkthrough: inventory, examine cookbook (self-loops: dropped), take red potato from counter,
    # take knife from table, dice red potato with knife, drop knife, prepare meal, eat meal: 6 edges, 7 vertices
    assert (len(graph["vertices"]), len(graph["edges"])) == (7, 6)
    assert [a for _, a, _ in graph["edges"]].count("take red potato from counter") == 1
    assert all(s != s_next for s, _, s_next in graph["edges"])
    # Table 2b imperfect graph: round(0.4 * 6) = 2 edges removed
    dropped = proas.replay_reference(cooking_spec, cooking_runner, ["train-cut-0"], edge_drop=0.4, seed=1)["train-cut-0"]
    assert len(dropped["edges"]) == 4 and dropped["edges"] < graph["edges"]


def test_real_game_irrelevant_actions_swap_labels_then_growth(cooking_spec, cooking_runner):
    graphs = proas.replay_reference(cooking_spec, cooking_runner, ["train-cut-0"])
    episode = play(cooking_spec, "train-cut-0", SWAP)
    assert episode.won
    states = proas.episode_states(cooking_spec, graphs["train-cut-0"], episode)
    # closing / opening the fridge and taking the red apple (none in the goal or the walkthrough)
    # leave the projected state unchanged, though the raw facts change
    assert states[0] == states[1] == states[2] and states[3] == states[4]
    assert episode.turns[0].state != episode.turns[0].next_state
    # knife then potato reaches the reference vertex (both held) in the other order
    assert states[5] in graphs["train-cut-0"]["vertices"] and states[3] not in graphs["train-cut-0"]["vertices"]

    # labels of iteration k come from G^(k): the swapped steps are not edges yet; then the won episode grows it
    labels, added = proas.label_then_grow(cooking_spec, graphs, [episode], "action")
    assert labels[0][0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert labels[0][1].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    # growth: purification drops the 3 self-loops; the knife-first vertex and its 2 edges are new
    assert added == 2 and (len(graphs["train-cut-0"]["vertices"]), len(graphs["train-cut-0"]["edges"])) == (8, 8)
    # G^(k+1) labels the same path as reasonable and advancing
    labels, added = proas.label_then_grow(cooking_spec, graphs, [episode], "action")
    assert labels[0][0].tolist() == [0, 0, 1, 0, 1, 1, 1, 1, 1] and added == 0
    # in the successful trajectory MUI masks the 3 remaining unreasonable steps
    stats = proas.proas_metrics([episode.won], [episode.task_id], labels, np.ones(9), proas.proas_shape(np.ones(9), *labels[0])[0], np.full(9, np.nan), graphs)
    assert stats["proas/masked_frac"] == pytest.approx(3 / 9) and stats["proas/mui_zeroed_frac"] == pytest.approx(3 / 9)


def test_static_arg_never_grows_and_failed_episodes_never_grow(cooking_spec, cooking_runner):
    graphs = proas.replay_reference(cooking_spec, cooking_runner, ["train-cut-0"])
    won = play(cooking_spec, "train-cut-0", SWAP)
    lost = play(cooking_spec, "train-cut-0", SWAP[:6], group=0)  # diced, never eaten
    assert not lost.won
    _, added = proas.label_then_grow(cooking_spec, graphs, [won], "action", grow=False)
    _, added_lost = proas.label_then_grow(cooking_spec, graphs, [lost], "action")
    assert added == added_lost == 0 and len(graphs["train-cut-0"]["edges"]) == 6
    # a task without a graph stays unlabelled
    labels, _ = proas.label_then_grow(cooking_spec, {"train-cut-0": None}, [won], "action")
    assert labels == [None]


# ---- the iteration's algorithm: training_batch, as the main loop calls it ------------------------------
def play_steps(spec, task_id: str, steps: list[tuple[str, bool]], group: int) -> Episode:
    """Like play(), with a validity flag per step (a malformed step sends its text, as rollout does)."""
    episode = play(spec, task_id, [a for a, _ in steps], group)
    for turn, (_, ok) in zip(episode.turns, steps):
        turn.valid = ok
    return episode


CUT = ["inventory", "examine cookbook", "take red potato from counter", "take knife from table",
       "dice red potato with knife", "drop knife", "prepare meal", "eat meal"]
EASY = ["inventory", "examine cookbook", "take orange bell pepper from fridge", "prepare meal", "eat meal"]
# Re = PA per episode under G^(0) (walkthrough edges; inventory and examine are self-loops, a malformed step is never
# reasonable, SWAP's first 5 steps leave the walkthrough's path); the won SWAP grows G only after labelling
BATCH_LABELS = [[0, 0, 1, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0],
                [0, 0, 1, 1, 1], [0, 0, 1]]


@pytest.fixture(scope="module")
def batch(cooking_spec):
    """Two tasks. train-cut-0 (group 0): the walkthrough with a malformed 4th step, won; SWAP, won; SWAP's
    first 6 steps, lost; inventory + look, lost. train-easy-0 (group 1): the walkthrough, won; inventory,
    a malformed step, the take, lost."""
    valid = lambda actions: [(a, True) for a in actions]  # noqa: E731
    return [play_steps(cooking_spec, "train-cut-0", valid(CUT[:3]) + [("xyzzy", False)] + valid(CUT[3:]), 0),
            play_steps(cooking_spec, "train-cut-0", valid(SWAP), 0),
            play_steps(cooking_spec, "train-cut-0", valid(SWAP[:6]), 0),
            play_steps(cooking_spec, "train-cut-0", valid(["inventory", "look"]), 0),
            play_steps(cooking_spec, "train-easy-0", valid(EASY), 1),
            play_steps(cooking_spec, "train-easy-0", [("inventory", True), ("dance", False), (EASY[2], True)], 1)]


def shaped_by_hand(adv: list[float], labels: list[int], shaping: str, sign: float = None, clusters: bool = False) -> list[float]:
    """Eq. 7 on one trajectory (Re = PA here), its case chosen by `sign` (the trajectory's A_i) or, when None,
    by each step's A: > 0 -> Re A (not for none); < 0 on a non-advancing step -> D_t / mean_T D * A (proas)
    or A (msk), with D_t the non-advancing steps from t on; < 0 on an advancing step: A, or 0 (msk).
    `clusters` (GiGPO+ProAS): mean_T D over the steps of T whose |A| equals this step's (to 1e-6)."""
    drift = [sum(1 - pa for pa in labels[t:]) for t in range(len(labels))]
    out = []
    for a, pa, d in zip(adv, labels, drift):
        alike = [d2 for a2, pa2, d2 in zip(adv, labels, drift) if pa2 == 0 and (not clusters or abs(abs(a2) - abs(a)) <= 1e-6)]
        mean_t = statistics.mean(alike or [0])
        case = a if sign is None else sign
        if shaping in ("none", "pr"):
            out.append(a)
        elif case > 0:
            out.append(pa * a)
        elif case < 0 and pa == 0:
            out.append(d / (mean_t + 1e-6) * a if shaping == "proas" else a)
        else:
            out.append(0.0 if shaping == "msk" and case < 0 else a)
    return out


@pytest.mark.parametrize("shaping", ["proas", "none", "msk", "pr"])
def test_training_batch_labels_each_trajectory_then_shapes_its_grpo_advantages(cooking_spec, cooking_runner, batch,
                                                                               shaping):
    assert [e.won for e in batch] == [True, True, False, False, True, False]
    graphs = {}  # both tasks are new: their graphs come from replaying the walkthroughs
    args = proas.Args(success_reward=10.0, invalid_penalty=0.1, shaping=shaping, progress_reward_coef=2.0)
    prompts, responses, advantages, metrics = proas.training_batch(cooking_spec, cooking_runner, batch, graphs, args, 1)
    scores = [[10.0 * e.won - 0.1 * (not t.valid) + 2.0 * pa * (shaping == "pr") for t, pa in zip(e.turns, lab)]
              for e, lab in zip(batch, BATCH_LABELS)]
    groups = [sum(scores[:4], []), sum(scores[4:], [])]
    grpo_adv = [(s - statistics.mean(g)) / (statistics.stdev(g) + 1e-6) for g in groups for s in g]
    expected, start = [], 0
    for lab in BATCH_LABELS:
        expected += shaped_by_hand(grpo_adv[start : start + len(lab)], lab, shaping)
        start += len(lab)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert len(prompts) == len(responses) == 34
    assert metrics["proas/graph_edges_added"] == 2 and len(graphs["train-cut-0"]["edges"]) == 8  # + SWAP's order
    # the won trajectories' unreasonable steps: 3 of 9, 5 of 9, 2 of 5
    assert metrics["proas/masked_frac"] == pytest.approx(10 / 23)
    assert metrics["proas/mui_zeroed_frac"] == pytest.approx(0.0 if shaping in ("none", "pr") else 10 / 34)


def test_all_failed_group_the_trajectory_sign_drops_the_invalid_penalty_the_step_sign_spreads_it(cooking_spec,
                                                                                                cooking_runner):
    """No episode of the group wins: R_i = 0 for all, and only the invalid penalty moves the scores. The
    malformed step pulls the group mean below 0, so every trajectory's A_i > 0 (Eq. 7's MUI case): the
    trajectory reading keeps Re_t * A_{i,t}, which zeroes the malformed step (never reasonable) and its
    penalty. The step reading sends the malformed step (A_{i,t} < 0) to APR instead."""
    lost = [play_steps(cooking_spec, "train-cut-0", [(a, True) for a in CUT[:3]] + [("xyzzy", False)], 0),
            play_steps(cooking_spec, "train-cut-0", [("inventory", True), ("look", True)], 0)]
    assert not any(e.won for e in lost)
    # scores [0, 0, 0, -0.1, 0, 0]: mean -0.1/6, unbiased var (5 (0.1/6)^2 + (0.5/6)^2) / 5 = 1/600
    std = math.sqrt(1 / 600)
    valid, malformed = (0.1 / 6) / (std + 1e-6), -(0.5 / 6) / (std + 1e-6)  # 0.408248, -2.041241
    # labels (G^(0)): inventory, examine: self-loops; take the potato: on the path; the malformed step: never
    # PA of the 1st episode [0, 0, 1, 0]: D = [3, 2, 1, 1], T = {0, 1, 3}, mean_T D = 2: the malformed weight 1/2
    expected = {"trajectory": [0, 0, valid, 0, 0, 0], "step": [0, 0, valid, 0.5 * malformed, 0, 0]}
    for sign, want in expected.items():
        args = proas.Args(success_reward=10.0, invalid_penalty=0.1, advantage_sign=sign)
        _, _, advantages, metrics = proas.training_batch(cooking_spec, cooking_runner, lost, {}, args, 1)
        assert advantages.tolist() == pytest.approx(want, rel=1e-6, abs=1e-12), sign
        assert metrics["proas/sign_disagree_frac"] == pytest.approx(1 / 6)  # the malformed step's sign


@pytest.mark.parametrize("shaping", ["proas", "none"])
def test_base_gigpo_shapes_gigpos_advantages_by_the_episode_sign(cooking_spec, cooking_runner, batch, shaping):
    """--base gigpo: the advantages shaped are gigpo.py's A^E + w * A^S of the same episodes; Eq. 7's case comes
    from the trajectory's A_i, whose sign is the episode-level part's: + for the won, - for the lost here. APR's
    mean drift is taken within each |A| cluster (the default) or over the trajectory's T (--gigpo-apr trajectory):
    on SWAP's lost prefix they differ (steps with A^S != 0 stand apart from the A^E-only ones)."""
    import gigpo

    gigpo_adv = gigpo.training_batch(batch, gigpo.Args(success_reward=10.0, invalid_penalty=0.1))[2]
    shaped = {}
    for rule in ("cluster", "trajectory"):
        args = proas.Args(success_reward=10.0, invalid_penalty=0.1, shaping=shaping, base="gigpo", gigpo_apr=rule)
        shaped[rule] = proas.training_batch(cooking_spec, cooking_runner, batch, {}, args, 1)[2]
        expected, start = [], 0
        for e, lab in zip(batch, BATCH_LABELS):
            expected += shaped_by_hand(gigpo_adv[start : start + len(lab)].tolist(), lab, shaping, 1.0 if e.won else -1.0,
                                       clusters=rule == "cluster")
            start += len(lab)
        assert shaped[rule].tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12), rule
        assert (shaping == "none") == np.allclose(shaped[rule], gigpo_adv)
    assert (shaping == "none") == np.allclose(shaped["cluster"], shaped["trajectory"])
    grpo_based = proas.training_batch(cooking_spec, cooking_runner, batch, {}, proas.Args(success_reward=10.0,
                                      invalid_penalty=0.1, shaping=shaping), 1)[2]
    assert not np.allclose(shaped["cluster"], grpo_based)  # the anchor groups' A^S moved something


def test_gigpo_apr_cluster_normalises_the_drift_within_each_magnitude_cluster():
    """A lost trajectory (A_i < 0) with GiGPO-like advantages A = [-2, -1, -1, -2, -1, -0.5], PA = [0, 0, 1, 0, 0, 1].
    D_t (non-advancing steps from t on) = [4, 3, 2, 2, 1, 0]; T = {0, 1, 3, 4}.
    Over T (--gigpo-apr trajectory): mean D = 10/4 = 2.5, weights 1.6, 1.2, 0.8, 0.4.
    By cluster: |A| = 2 holds steps 0, 3 (mean D 3: weights 4/3, 2/3); |A| = 1 holds 1, 4 in T (mean D 2: 1.5, 0.5).
    The cluster rule keeps each level's penalty: -8/3 - 4/3 = -2 - 2 and -1.5 - 0.5 = -1 - 1."""
    adv, pa, a_i = np.array([-2.0, -1.0, -1.0, -2.0, -1.0, -0.5]), np.array([0, 0, 1, 0, 0, 1.0]), np.array([-1.0])
    by_cluster, weights = proas.proas_advantages(adv, [6], [(pa, pa)], "proas", "nonadvancing", 1e-6, a_i, cluster=True)
    assert by_cluster.tolist() == pytest.approx([-8 / 3, -1.5, -1.0, -4 / 3, -0.5, -0.5], rel=1e-5)
    assert weights[[0, 1, 3, 4]].tolist() == pytest.approx([4 / 3, 1.5, 2 / 3, 0.5], rel=1e-5)
    flat = proas.proas_advantages(adv, [6], [(pa, pa)], "proas", "nonadvancing", 1e-6, a_i, cluster=False)[0]
    assert flat.tolist() == pytest.approx([-3.2, -1.2, -1.0, -1.6, -0.4, -0.5], rel=1e-5)
    # magnitudes within 1e-6 share a cluster (GiGPO's eps turns float rounding of equal returns into ~1e-8 gaps)
    assert proas.magnitude_clusters([-1.0, 1.0 + 5e-7, -2.0, 0.5, 1.0 + 2e-6]).tolist() == [1, 1, 3, 0, 2]


# ---- the method's flags, each through training_batch as the main loop calls it (issue 42) ----------------------
def grpo_by_hand(batch: list[Episode]) -> list[float]:
    """grpo.py's A_{i,t} with success 10 and penalty 0.1: (s - mean_g) / (unbiased std_g + 1e-6) per task group."""
    scores = [[10.0 * e.won - 0.1 * (not t.valid) for t in e.turns] for e in batch]
    by_group = {}
    for e, s in zip(batch, scores):
        by_group.setdefault(e.group, []).extend(s)
    return [(v - statistics.mean(by_group[e.group])) / (statistics.stdev(by_group[e.group]) + 1e-6)
            for e, s in zip(batch, scores) for v in s]


# lost episodes of `batch`: SWAP[:6] PA [0, 0, 0, 0, 0, 1] -> D = [5, 4, 3, 2, 1, 0]; inventory + look PA [0, 0]
# -> D = [2, 1]; train-easy-0's lost PA [0, 0, 1] -> D = [2, 1, 0]. Per step: the APR weight
# D_t / (mean_{t in T} D + eps), or 1 (the plain A) on a step outside T.
APR_CASES = {
    # T = all steps: mean D 15/6 = 2.5, 1.5 and 1: the advancing last steps (D = 0) get weight 0 too
    ("all", 1e-6): ([2, 1.6, 1.2, 0.8, 0.4, 0], [4 / 3, 2 / 3], [2, 1, 0]),
    # T = non-advancing steps: mean D 3, 1.5, 1.5, each + eps 1: denominators 4, 2.5, 2.5; advancing steps keep A
    ("nonadvancing", 1.0): ([5 / 4, 1, 3 / 4, 1 / 2, 1 / 4, 1], [0.8, 0.4], [0.8, 0.4, 1]),
    # T = all, eps 1: denominators 3.5, 2.5, 2
    ("all", 1.0): ([10 / 7, 8 / 7, 6 / 7, 4 / 7, 2 / 7, 0], [0.8, 0.4], [1, 0.5, 0]),
}


@pytest.mark.parametrize("apr_set, apr_eps", list(APR_CASES))
def test_training_batch_apr_set_and_eps_give_the_lost_steps_their_weights(cooking_spec, cooking_runner, batch, apr_set,
                                                                         apr_eps):
    """--apr-set / --apr-eps (Eq. 7's T and eps): the APR weights of the lost trajectories' steps, by hand;
    the won trajectories keep MUI's Re_t * A."""
    args = proas.Args(success_reward=10.0, invalid_penalty=0.1, apr_set=apr_set, apr_eps=apr_eps)
    advantages, metrics = proas.training_batch(cooking_spec, cooking_runner, batch, {}, args, 1)[2:]
    lost = iter(APR_CASES[(apr_set, apr_eps)])
    weights = [lab if e.won else next(lost) for e, lab in zip(batch, BATCH_LABELS)]  # won: Re (MUI)
    expected = [a * w for a, w in zip(grpo_by_hand(batch), sum(weights, []))]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-12)
    # APR's steps: 6 + 2 + 3 lost steps with --apr-set all, their 5 + 2 + 2 non-advancing ones otherwise
    assert metrics["proas/apr_frac"] == pytest.approx((11 if apr_set == "all" else 9) / 34)
    assert metrics["proas/apr_weight_max"] == pytest.approx(max(sum(APR_CASES[(apr_set, apr_eps)], [])), rel=1e-5)


@pytest.fixture(scope="module")
def knife(cooking_spec):
    """train-cut-0, group 0. detour (won): the walkthrough's steps with the knife dropped on the ground and picked
    up again by `take knife`; short (won): the knife taken off the table by `take knife` (the game takes it from
    the table); idle (lost): inventory, look; walkthrough (won): the reference actions without the two self-loops."""
    valid = lambda actions: [(a, True) for a in actions]  # noqa: E731
    potato, dice = "take red potato from counter", "dice red potato with knife"
    end = ["drop knife", "prepare meal", "eat meal"]
    played = {"detour": play_steps(cooking_spec, "train-cut-0", valid([potato, "take knife from table", "drop knife",
                                                                         "take knife", dice, *end]), 0),
              "short": play_steps(cooking_spec, "train-cut-0", valid([potato, "take knife", dice, *end]), 0),
              "idle": play_steps(cooking_spec, "train-cut-0", valid(["inventory", "look"]), 0),
              "walkthrough": play_steps(cooking_spec, "train-cut-0", valid(CUT[2:]), 0)}
    assert {k: e.won for k, e in played.items()} == {"detour": True, "short": True, "idle": False, "walkthrough": True}
    return played


# 2nd iteration: short (6 steps, 10 each), idle (2 steps, 0): mean 7.5, squared deviations 6 * 2.5^2 + 2 * 7.5^2 = 150
STD_SHORT = math.sqrt(150 / 7)
WIN_SHORT, LOSS_SHORT = 2.5 / (STD_SHORT + 1e-6), -7.5 / (STD_SHORT + 1e-6)  # 0.540062, -1.620185


@pytest.mark.parametrize("edge_match, static_arg, short_re, added", [
    ("action", False, [1, 1, 1, 1, 1, 1], [2, 1]),  # ("take knife", S2) is the detour's grown edge's (a, s')
    ("full", False, [1, 0, 1, 1, 1, 1], [2, 1]),  # (S1, take knife, S2) is no edge: only (X, take knife, S2) is
    ("action", True, [1, 0, 1, 1, 1, 1], [0, 0]),  # Static: G stays the walkthrough's, no "take knife" edge at all
])
def test_training_batch_edge_match_and_static_arg_over_two_iterations(cooking_spec, cooking_runner, knife, edge_match,
                                                                     static_arg, short_re, added):
    """The main loop's order: iteration 1 labels from G^(0), then grows G^(1) by the won detour: (S2, drop knife, X)
    and (X, take knife, S2), X = the potato held, the knife on the ground. Iteration 2 labels the short episode:
    its `take knife` goes from S1 (the potato held, the knife on the table) to S2, a vertex, by an action some
    edge into S2 carries; --edge-match full also asks the edge to leave S1. --static-arg never grows G."""
    graphs = {}
    args = proas.Args(success_reward=10.0, invalid_penalty=0.1, edge_match=edge_match, static_arg=static_arg)
    first = proas.training_batch(cooking_spec, cooking_runner, [knife["detour"]], graphs, args, 1)[3]
    assert first["proas/graph_edges_added"] == added[0] and len(graphs["train-cut-0"]["edges"]) == 6 + added[0]
    advantages, metrics = proas.training_batch(cooking_spec, cooking_runner, [knife["short"], knife["idle"]], graphs,
                                               args, 2)[2:]
    # idle: inventory and look leave the state as it is, PA = [0, 0], D = [2, 1], mean 1.5: APR weights 4/3, 2/3
    expected = [re * WIN_SHORT for re in short_re] + [4 / 3 * LOSS_SHORT, 2 / 3 * LOSS_SHORT]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-12)
    assert metrics["proas/masked_frac"] == pytest.approx(short_re.count(0) / 6)
    # the short episode's (S1, take knife, S2) is new to G: added unless static
    assert metrics["proas/graph_edges_added"] == added[1] and len(graphs["train-cut-0"]["edges"]) == 6 + sum(added)


def test_training_batch_arg_edge_drop_unlabels_the_dropped_edges_steps(cooking_spec, cooking_runner, knife):
    """--arg-edge-drop 0.4 (Table 2b): G^(0) of train-cut-0 loses round(0.4 * 6) = 2 of its 6 edges, chosen by
    (--seed, task) as replay_reference chooses them: the walkthrough's 2 steps along them are not reasonable (MUI
    zeroes them); growth from the won walkthrough puts both edges back."""
    full = proas.replay_reference(cooking_spec, cooking_runner, ["train-cut-0"])["train-cut-0"]
    kept = proas.replay_reference(cooking_spec, cooking_runner, ["train-cut-0"], edge_drop=0.4, seed=1)["train-cut-0"]
    dropped = {a for _, a, _ in full["edges"] - kept["edges"]}
    assert len(dropped) == 2 and dropped < set(CUT[2:])
    graphs = {}
    args = proas.Args(success_reward=10.0, invalid_penalty=0.1, arg_edge_drop=0.4)  # --seed 1, the default
    episodes = [knife["walkthrough"], knife["idle"]]
    advantages, metrics = proas.training_batch(cooking_spec, cooking_runner, episodes, graphs, args, 1)[2:]
    # walkthrough (6 steps, 10 each), idle (2 steps, 0): mean 7.5, as in the 2nd iteration above
    expected = [(a not in dropped) * WIN_SHORT for a in CUT[2:]] + [4 / 3 * LOSS_SHORT, 2 / 3 * LOSS_SHORT]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-12)
    assert (advantages[:6] == 0).sum() == 2 and metrics["proas/masked_frac"] == pytest.approx(2 / 6)
    assert metrics["proas/graph_edges_added"] == 2 and graphs["train-cut-0"]["edges"] == full["edges"]


def test_training_batch_arg_random_labels_moves_the_labels_but_keeps_their_count(cooking_spec, cooking_runner, batch):
    """--arg-random-labels (Table 2b): the batch's 34 (Re, PA) pairs (15 of them (1, 1), the rest (0, 0)) are
    shuffled across its trajectories by default_rng([seed, iteration, rank]); Eq. 7 then shapes with them."""
    args = proas.Args(success_reward=10.0, invalid_penalty=0.1, arg_random_labels=True)
    advantages, metrics = proas.training_batch(cooking_spec, cooking_runner, batch, {}, args, 3)[2:]
    flat = np.concatenate(BATCH_LABELS)[np.random.default_rng([1, 3, 0]).permutation(34)].tolist()
    moved, start = [], 0
    for lab in BATCH_LABELS:
        moved.append(flat[start : start + len(lab)])
        start += len(lab)
    assert moved != BATCH_LABELS and sum(flat) == 15
    grpo_adv, expected, start = grpo_by_hand(batch), [], 0
    for lab in moved:
        expected += shaped_by_hand(grpo_adv[start : start + len(lab)], lab, "proas")
        start += len(lab)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert metrics["proas/re_mean"] == metrics["proas/pa_mean"] == pytest.approx(15 / 34)  # the count is kept
    won_re = sum((lab for e, lab in zip(batch, moved) if e.won), [])  # 23 steps; 13 of them Re = 1 unshuffled
    assert metrics["proas/masked_frac"] == pytest.approx(1 - sum(won_re) / 23) and sum(won_re) != 13


@pytest.mark.parametrize("knobs", [dict(gamma=0.5, step_norm="mean", episode_norm="mean_std"),
                                   dict(step_advantage_w=0.5, step_norm="mean_std", episode_norm="mean_std"),
                                   dict(step_norm="mean", episode_norm="mean")])
def test_base_gigpo_takes_gigpos_knobs(cooking_spec, cooking_runner, batch, knobs):
    """--base gigpo with --gamma / --step-advantage-w / --step-norm / --episode-norm: the advantages shaped are
    A^E + w A^S by hand (test_gigpo.gigpo_by_hand), with those knobs; each knob changes them on this batch."""
    from test_gigpo import gigpo_by_hand

    full = {"gamma": 0.95, "step_advantage_w": 1.0, "step_norm": "mean_std", "episode_norm": "mean_std", **knobs}
    base = gigpo_by_hand(batch, *full.values())[0]  # (gamma, w, step_norm, episode_norm)
    args = proas.Args(success_reward=10.0, invalid_penalty=0.1, base="gigpo", **knobs)
    advantages = proas.training_batch(cooking_spec, cooking_runner, batch, {}, args, 1)[2]
    expected, start = [], 0
    for e, lab in zip(batch, BATCH_LABELS):
        expected += shaped_by_hand(base[start : start + len(lab)], lab, "proas", 1.0 if e.won else -1.0, clusters=True)
        start += len(lab)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    flip = {"gamma": 0.95, "step_advantage_w": 1.0, "mean": "mean_std", "mean_std": "mean"}
    for name, value in knobs.items():  # the test can fail: each knob on its own moves A^E + w A^S on this batch
        other = {**full, name: flip.get(name, flip.get(value))}
        assert not np.allclose(gigpo_by_hand(batch, *other.values())[0], base), name


def test_base_gigpo_takes_the_similarity_threshold(cooking_spec, cooking_runner, batch):
    """--base gigpo --similarity-thresh 0.8: in train-cut-0's group the dice line joins the take-the-potato line's
    anchor group (difflib ratio 0.848; no other two lines of the batch reach 0.8): A^E + w A^S by hand as if both
    lines read the same, then shaped by Eq. 7."""
    from difflib import SequenceMatcher

    from test_gigpo import gigpo_by_hand

    take = next(t.observation for t in batch[0].turns if t.observation.startswith("You take the red potato"))
    dice = next(t.observation for t in batch[0].turns if t.observation.startswith("You dice the red potato"))
    assert 0.8 <= SequenceMatcher(None, dice, take).ratio() < 0.85  # 2 * 64 matching characters / (67 + 84)
    same = lambda t: replace(t, observation=take if t.observation == dice else t.observation)  # noqa: E731
    alike = [replace(e, turns=[same(t) for t in e.turns]) for e in batch]
    base = gigpo_by_hand(alike, 0.95, 1.0, "mean_std", "mean_std")[0]
    assert not np.allclose(base, gigpo_by_hand(batch, 0.95, 1.0, "mean_std", "mean_std")[0])  # the join moves A^S
    args = proas.Args(success_reward=10.0, invalid_penalty=0.1, base="gigpo", similarity_thresh=0.8,
                      step_norm="mean_std", episode_norm="mean_std")
    advantages = proas.training_batch(cooking_spec, cooking_runner, batch, {}, args, 1)[2]
    expected, start = [], 0
    for e, lab in zip(batch, BATCH_LABELS):
        expected += shaped_by_hand(base[start : start + len(lab)], lab, "proas", 1.0 if e.won else -1.0, clusters=True)
        start += len(lab)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_webshop_graph_takes_the_options_in_any_order_and_any_search_words():
    """WebShop's engine is not installed here: the states are the adapter's (page, product, options) on the
    recorded item page of tests/test_env_webshop.py (B000VOHH8I, size 6.76 fl oz); its second option
    (scent: original) is made up, as no recorded page has two. The graph comes from the reference replay's
    states as replay_reference builds it; the rollout is labelled as training_batch labels it."""
    from envs import webshop

    spec = envs.load("webshop")
    goal = "i need a long lasting 6.76 fl oz bottle of l'eau d'issey, original scent, and price lower than 100.00 dollars"
    asin, size, scent = "B000VOHH8I", "6.76 fl oz (pack of 1)", "original"
    page = lambda kind, options={}, product=asin: webshop.webshop_state(kind, product, options)  # noqa: E731
    plan = ["search[l'eau d'issey 6.76 fl oz bottle]", f"click[{asin.lower()}]", f"click[{size}]", f"click[{scent}]",
            "click[buy now]"]
    both = {"size": size, "scent": scent}
    replay = [page("", product=None), page("search_results", product=None), page("item_page"),
              page("item_page", {"size": size}), page("item_page", both), page("done", both)]
    graph = proas.reference_graph(spec, goal, plan, replay)
    # search, open, size then scent, scent then size (4 option edges over 4 item-page states), buy
    assert (len(graph["vertices"]), len(graph["edges"])) == (7, 7)
    # other search words, a detour through another product, the options in the other order
    steps = [("search[issey miyake men eau de toilette]", page("search_results", product=None)),
             ("click[b000mjzopk]", page("item_page", product="B000MJZOPK")),
             ("click[< prev]", page("search_results", product="B000MJZOPK")),
             (f"click[{asin.lower()}]", page("item_page")), (f"click[{scent}]", page("item_page", {"scent": scent})),
             (f"click[{size}]", page("item_page", both)), ("click[buy now]", page("done", both))]
    episode = Episode("7", 0, task=goal, won=True)
    state = replay[0]
    for action, next_state in steps:
        episode.turns.append(Turn([], [], action, True, "", state, next_state))
        state = next_state
    (re, pa), = proas.label_then_grow(spec, {"7": graph}, [episode], "action", grow=False)[0]
    # the detour (another product, then back to the results) is off the graph; every other step is an edge that
    # reaches a new vertex, whatever the search words or the order of the options
    assert re.tolist() == pa.tolist() == [1, 0, 0, 1, 1, 1, 1]


ALFWORLD_DATA = Path(os.environ.get("ALFWORLD_DATA", Path(__file__).resolve().parents[2] / "shared" / "data" / "alfworld"))


def test_reference_graph_of_an_alfworld_game():
    if not (ALFWORLD_DATA / "json_2.1.1").is_dir():
        pytest.skip(f"ALFWorld games not found at {ALFWORLD_DATA}")
    try:
        spec = envs.load("alfworld", data=str(ALFWORLD_DATA))
        task = spec.task_ids("eval_in_distribution")[0]
    except (envs.EnvUnavailable, ValueError) as e:
        pytest.skip(str(e))
    with envs.EnvRunner(spec, 1) as runner:
        graph = proas.replay_reference(spec, runner, [task])[task]
        plan = runner.reference_actions([task])[0]
    assert graph is not None, "the walkthrough replay should win"
    # a path: one vertex more than edges, at most one edge per walkthrough step
    assert len(graph["vertices"]) == len(graph["edges"]) + 1 and 1 <= len(graph["edges"]) <= len(plan)


# ---- end to end -----------------------------------------------------------------------------------
def test_two_iterations_log_proas_metrics_and_resume_keeps_the_graph(tiny_model, tmp_path):
    from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics, run_script

    out = run_script("proas.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "2", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path)
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1, 2]
    for key in ["proas/re_mean", "proas/pa_mean", "proas/mui_zeroed_frac", "proas/graph_vertices", "proas/graph_edges",
                "proas/graphs", "proas/graph_edges_added", "proas/apr_frac", "losses/policy_loss", "charts/success_rate"]:
        assert key in metrics[2], key
    assert metrics[1]["proas/graphs"] >= 1 and metrics[1]["proas/graph_edges"] >= 1  # replayed walkthroughs

    # resume: the checkpoint's graphs are used as they are (a marker edge survives), not rebuilt
    state_path = run / "checkpoint" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=False)
    graphs = state["method"]["proas_graphs"]
    task = next(t for t, g in graphs.items() if g)
    marker = (frozenset({"marker"}), "xyzzy", frozenset({"marker", "2"}))
    graphs[task]["edges"].add(marker)
    torch.save(state, state_path)
    resumed = run_script("proas.py", "--resume", str(run), "--total-iterations", "3", "--no-gradient-checkpointing")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = torch.load(state_path, weights_only=False)
    assert after["iteration"] == 3 and marker in after["method"]["proas_graphs"][task]["edges"]
    assert set(graphs) <= set(after["method"]["proas_graphs"])
    assert "proas/re_mean" in read_metrics(run)[3]
