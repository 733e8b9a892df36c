"""strata.py: StraTA's pieces against numbers computed by hand, the strategy in every step prompt of a
real cooking rollout, and the script end to end through its CLI."""

import contextlib
import itertools
import math
import statistics

import numpy as np
import pytest
import torch

import strata
from test_grpo_e2e import TINY_FLAGS, read_metrics, only_run, run_script

# N=2 strategies (from sigma*N = 4 candidates) x M=2 episodes on 1 task; short prompts keep CPU time low
STRATA_FLAGS = [*TINY_FLAGS, "--num-tasks", "1", "--num-eval-tasks", "1", "--max-prompt-tokens", "400",
                "--num-strategies", "2", "--episodes-per-strategy", "2", "--oversample", "2"]


# ---- farthest-point selection ------------------------------------------------------------------
def test_farthest_point_sampling_uses_cosine_not_euclidean_distance():
    emb = np.array([[1.0, 0.0], [5.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    # cosine distances from z0: z1 = 0 (same direction, though 4 away in Euclidean terms), z2 = 1, z3 = 2
    # -> z3 is added first. Then min distance to {z0, z3}: z1 = min(0, 2) = 0, z2 = min(1, 1) = 1 -> z2; z1 last.
    assert strata.farthest_point_sampling(emb, 2) == [0, 3]
    assert strata.farthest_point_sampling(emb, 3) == [0, 3, 2]
    assert strata.farthest_point_sampling(emb, 4) == [0, 3, 2, 1]


def test_farthest_point_sampling_breaks_ties_by_lowest_index_and_caps_at_pool_size():
    emb = np.ones((4, 3))  # all identical: every distance 0 -> 0, then 1, 2 in order
    assert strata.farthest_point_sampling(emb, 3) == [0, 1, 2]
    assert strata.farthest_point_sampling(emb[:2], 5) == [0, 1]


def test_diversity_of_chosen_set_beats_the_first_n_candidates():
    emb = np.array([[1.0, 0.0], [5.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    # chosen {0, 3, 2}: d03 = 2, d02 = 1, d32 = 1 -> 4/3; first three {0, 1, 2}: d01 = 0, d02 = 1, d12 = 1 -> 2/3
    assert strata.mean_pairwise_distance(emb[[0, 3, 2]]) == pytest.approx(4 / 3)
    assert strata.mean_pairwise_distance(emb[:3]) == pytest.approx(2 / 3)
    assert strata.mean_pairwise_distance(emb[:1]) == 0.0


# ---- strategy reward --------------------------------------------------------------------------
def test_top_delta_mean_trusts_only_the_best_episodes():
    returns = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    # delta 0.5 of M=8: top 4 = [1, 1, 1, 0] -> 0.75 (the plain mean would be 3/8)
    assert strata.top_delta_mean(returns, 0.5) == pytest.approx(0.75)
    # delta 0.3: ceil(2.4) = 3 -> [1, 1, 1] -> 1.0;  delta 0.25: exactly 2 -> 1.0
    assert strata.top_delta_mean(returns, 0.3) == pytest.approx(1.0)
    assert strata.top_delta_mean(returns, 0.25) == pytest.approx(1.0)
    # at least one episode: delta 0.1 of 3 -> ceil(0.3) = 1 -> the best one
    assert strata.top_delta_mean(np.array([0.0, 1.0, 0.0]), 0.1) == 1.0
    # delta 1.0 is the plain mean
    assert strata.top_delta_mean(returns, 1.0) == pytest.approx(0.375)


def test_strategy_reward_length_and_format_penalties_then_clip():
    returns = np.array([1.0, 0.0, 0.0, 0.0])  # top-0.5 = mean(1, 0) = 0.5
    kw = dict(delta=0.5, token_budget=128, length_penalty=0.5, format_penalty=0.5)
    assert strata.strategy_reward(returns, n_tokens=100, tagged=True, **kw) == pytest.approx(0.5)
    assert strata.strategy_reward(returns, n_tokens=128, tagged=True, **kw) == pytest.approx(0.5)  # at the budget: free
    # 192 tokens: 0.5 * (192 - 128) / 128 = 0.25 -> 0.25; untagged: - 0.5 -> -0.25
    assert strata.strategy_reward(returns, n_tokens=192, tagged=True, **kw) == pytest.approx(0.25)
    assert strata.strategy_reward(returns, n_tokens=192, tagged=False, **kw) == pytest.approx(-0.25)
    # all lost, 640 tokens: 0 - 0.5 * 512 / 128 = -2 -> clipped to -1
    assert strata.strategy_reward(np.zeros(4), n_tokens=640, tagged=False, **kw) == -1.0
    assert strata.strategy_reward(np.ones(4), n_tokens=10, tagged=True, **kw) == 1.0


def test_strategy_advantage_is_normalised_over_the_strategies_of_each_task():
    rewards = np.array([0.75, 0.25, 0.5, 0.5])  # N=2: tasks (0, 1)
    adv = strata.grpo_advantages(rewards, np.arange(4) // 2)
    # task 0: mean 0.5, unbiased std sqrt(2 * 0.25^2 / 1) = 0.353553 -> +-0.707105; task 1: equal -> 0
    assert adv.tolist() == pytest.approx([0.25 / (math.sqrt(0.125) + 1e-6), -0.25 / (math.sqrt(0.125) + 1e-6), 0.0, 0.0])


# ---- action level: judged step scores and (task x strategy) groups ----------------------------
def test_judgment_reward_enters_the_step_score_before_normalisation():
    rewards = np.array([10.0, 10.0, 10.0, 0.0, 0.0])
    invalid = np.array([False, True, False, False, True])
    flagged = np.array([False, False, True, True, False])
    scores = strata.action_scores(rewards, invalid, flagged, success_reward=10.0, invalid_penalty=0.1, kappa=0.1)
    # R/10 - 0.1 * invalid - 0.1 * flagged = [1, 0.9, 0.9, -0.1, -0.1]
    assert scores.tolist() == pytest.approx([1.0, 0.9, 0.9, -0.1, -0.1])
    adv = strata.grpo_advantages(scores, np.zeros(5, dtype=int))
    # mean 2.6 / 5 = 0.52; squared deviations .2304 + .1444 + .1444 + .3844 + .3844 = 1.288; var 0.322
    std = math.sqrt(0.322)
    assert adv.tolist() == pytest.approx([0.48 / std, 0.38 / std, 0.38 / std, -0.62 / std, -0.62 / std], rel=1e-5)
    # the flagged step of the won episode gets less than its unflagged sibling; kappa = 0 removes that
    assert adv[2] < adv[0]
    no_judge = strata.action_scores(rewards, invalid, flagged, 10.0, 0.1, 0.0)
    assert no_judge[2] == no_judge[0] == 1.0


def _episode(task_id, group, task_group, won, n_steps, flagged=()):
    e = strata.Episode(task_id, group, task_group=task_group, won=won, flagged=set(flagged))
    e.turns = [strata.Turn([1], [2], "go", True, "obs", None) for _ in range(n_steps)]
    return e


def test_action_advantages_are_grouped_by_task_and_strategy():
    N = 2
    episodes = [
        _episode("a", 0 * N + 0, 0, True, 2), _episode("a", 0 * N + 0, 0, False, 1),  # task a, strategy 0
        _episode("a", 0 * N + 1, 0, True, 1), _episode("a", 0 * N + 1, 0, True, 1),  # task a, strategy 1
    ]
    turns, groups, rewards, invalid = strata.flatten_turns(episodes, 10.0)
    assert groups.tolist() == [0, 0, 0, 1, 1]
    flagged = np.zeros(len(turns), dtype=bool)
    adv = strata.grpo_advantages(strata.action_scores(rewards, invalid, flagged, 10.0, 0.1, 0.1), groups)
    # group (a, z0): scores [1, 1, 0], mean 2/3, unbiased var (1/9 + 1/9 + 4/9) / 2 = 1/3 -> +-(1/3)/0.57735
    s = math.sqrt(1 / 3) + 1e-6
    assert adv.tolist() == pytest.approx([(1 / 3) / s, (1 / 3) / s, (-2 / 3) / s, 0.0, 0.0])
    # grouping by task alone (grpo.py) would give strategy 1's won steps (1 - 0.8) / std > 0
    by_task = strata.grpo_advantages(strata.action_scores(rewards, invalid, flagged, 10.0, 0.1, 0.1), np.zeros(5, dtype=int))
    assert by_task[3] > 0


# ---- the iteration's algorithm: training_batch, as the main loop calls it ------------------------------
_ids = itertools.count(100)


def played(task_group: int, strategy_index: int, z, won: bool, valid: list[bool], flagged=()) -> strata.Episode:
    """An episode of task `task_group` under its `strategy_index`-th strategy z (N = 2), as rollout and
    self_judge leave it; every turn gets its own token ids."""
    e = strata.Episode(f"task-{task_group}", task_group * 2 + strategy_index, strategy=z, task_group=task_group,
                       won=won, flagged=set(flagged))
    for ok in valid:
        k = next(_ids)
        e.turns.append(strata.Turn([k, k], [k], "go", ok, "obs", None))
    return e


def two_tasks_batch():
    """2 tasks x N=2 strategies x M=3 episodes: the strategies (3, 2, 3 and 6 tokens; z2 untagged) and the episodes."""
    z = [strata.Strategy([1, 0], [9] * 3, "z0", True), strata.Strategy([1, 1], [9] * 2, "z1", True),
         strata.Strategy([1, 2], [9] * 3, "z2", False), strata.Strategy([1, 3], [9] * 6, "z3", True)]
    episodes = [
        played(0, 0, z[0], True, [True, True]), played(0, 0, z[0], False, [True, False]),
        played(0, 0, z[0], True, [False]),
        played(0, 1, z[1], False, [True]), played(0, 1, z[1], False, [True, True, True], flagged={2}),
        played(0, 1, z[1], True, [True, True], flagged={1}),
        played(1, 0, z[2], False, [True]), played(1, 0, z[2], False, [False, True]), played(1, 0, z[2], False, [True]),
        played(1, 1, z[3], False, [True]), played(1, 1, z[3], True, [True, True], flagged={1, 2}),
        played(1, 1, z[3], False, [True]),
    ]
    return z, episodes


def test_training_batch_trains_actions_per_task_and_strategy_and_strategies_per_task():
    z, episodes = two_tasks_batch()
    args = strata.Args(success_reward=10.0, invalid_penalty=0.1, judge_penalty=0.1, num_strategies=2,
                       episodes_per_strategy=3, top_delta=0.5, strategy_token_budget=4, strategy_length_penalty=0.5,
                       strategy_format_penalty=0.5)
    prompts, responses, advantages, is_strategy, metrics = strata.training_batch(episodes, args)
    # action level, s = won - 0.1 invalid - 0.1 flagged, normalised within each (task x strategy) group
    groups = [[1, 1, 0, -0.1, 0.9],  # task 0, z0
              [0, 0, -0.1, 0, 0.9, 1],  # task 0, z1 (step 2 of its 2nd episode and step 1 of its 3rd flagged)
              [0, -0.1, 0, 0],  # task 1, z2
              [0, 0.9, 0.9, 0]]  # task 1, z3
    actions = [(s - statistics.mean(g)) / (statistics.stdev(g) + 1e-6) for g in groups for s in g]
    # strategy level, top ceil(0.5 * 3) = 2 of each strategy's 3 returns: z0 (1, 1) -> 1; z1 (1, 0) -> 0.5;
    # z2 (0, 0) - 0.5 untagged -> -0.5; z3 (1, 0) - 0.5 * (6 - 4) / 4 too long -> 0.25; normalised per task
    rewards = [[1.0, 0.5], [-0.5, 0.25]]
    strategies = [(r - statistics.mean(t)) / (statistics.stdev(t) + 1e-6) for t in rewards for r in t]
    assert advantages.tolist() == pytest.approx(actions + strategies, rel=1e-9)
    assert is_strategy.tolist() == [False] * 19 + [True] * 4
    turns = [t for e in episodes for t in e.turns]
    assert prompts == [t.prompt_ids for t in turns] + [s.prompt_ids for s in z]
    assert responses == [t.response_ids for t in turns] + [s.response_ids for s in z]
    assert metrics["strata/strategy_reward"] == pytest.approx(1.25 / 4)
    assert metrics["strata/strategy_format_ok"] == 0.75
    assert metrics["strata/strategy_tokens"] == 3.5


def test_training_batch_takes_the_methods_reward_knobs():
    """--judge-penalty 0.3, --top-delta 1.0, --strategy-length-penalty 1.0, --strategy-format-penalty 0.25 (none
    the default) on the batch above; each knob moves the step scores or the strategy rewards by hand."""
    z, episodes = two_tasks_batch()
    args = strata.Args(success_reward=10.0, invalid_penalty=0.1, judge_penalty=0.3, num_strategies=2,
                       episodes_per_strategy=3, top_delta=1.0, strategy_token_budget=4, strategy_length_penalty=1.0,
                       strategy_format_penalty=0.25)
    _, _, advantages, _, metrics = strata.training_batch(episodes, args)
    # s = won - 0.1 invalid - 0.3 flagged
    groups = [[1, 1, 0, -0.1, 0.9], [0, 0, -0.3, 0, 0.7, 1], [0, -0.1, 0, 0], [0, 0.7, 0.7, 0]]
    actions = [(s - statistics.mean(g)) / (statistics.stdev(g) + 1e-6) for g in groups for s in g]
    # delta 1: the mean of all 3 returns. z0 (1, 0, 1) 2/3; z1 (0, 0, 1) 1/3; z2 0 - 0.25 untagged;
    # z3 (0, 1, 0) 1/3 - 1.0 * (6 - 4) / 4 = -1/6
    rewards = [[2 / 3, 1 / 3], [-0.25, -1 / 6]]
    strategies = [(r - statistics.mean(t)) / (statistics.stdev(t) + 1e-6) for t in rewards for r in t]
    assert advantages.tolist() == pytest.approx(actions + strategies, rel=1e-9)
    flat = [r for t in rewards for r in t]
    assert metrics["strata/strategy_reward"] == pytest.approx(7 / 48)  # (2/3 + 1/3 - 1/4 - 1/6) / 4
    assert metrics["strata/strategy_reward_std"] == pytest.approx(float(np.std(flat)))


# ---- self-judgment -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response, steps, flagged, ok",
    [
        ("<think>x</think><judgment>3, 7</judgment>", 8, {3, 7}, True),  # good
        ("<JUDGMENT>\n[1,2]\n</JUDGMENT>", 4, {1, 2}, True),  # tags are case-insensitive, list syntax ok
        ("<judgment>none</judgment>", 5, set(), True),  # nothing flagged, parsed
        ("<judgment></judgment>", 5, set(), True),  # empty, parsed
        ("I think step 3 was bad", 5, set(), False),  # no tags: garbage
        ("<judgment>the bad ones</judgment>", 5, set(), False),  # tags without numbers: garbage
        ("<judgment>0, 2, 9</judgment>", 5, {2}, True),  # 0 and 9 are outside 1..5: they flag nothing
    ],
)
def test_judgment_parsing(response, steps, flagged, ok):
    assert strata.parse_judgment(response, steps) == (flagged, ok)


def test_strategy_parsing_keeps_untagged_text_and_marks_it():
    assert strata.parse_strategy("<think>a</think><strategy> open fridge, take apple </strategy>") == ("open fridge, take apple", True)
    assert strata.parse_strategy("  just go north ") == ("just go north", False)


# ---- prompts on real cooking games ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.padding_side = "left"
    return tok, AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def test_strategy_is_in_every_step_prompt_of_its_episode(tiny, cooking_spec):
    import envs

    tok, model = tiny
    args = strata.resolve_args(strata.Args(max_steps=3, max_new_tokens=8, max_prompt_tokens=4096, num_strategies=2, episodes_per_strategy=2), cooking_spec)
    gen = lambda prompts, temperature, max_new_tokens=None: strata.generate_hf(model, tok, prompts, max_new_tokens or 8, temperature, 1.0, contextlib.nullcontext)  # noqa: E731
    plans = ["PLAN-ALPHA take the knife first", "PLAN-BETA open the fridge first"]
    episodes = [strata.Episode("train-easy-0", j, strategy=strata.Strategy([], [], plans[j], True)) for j in range(2) for _ in range(2)]
    runner = envs.EnvRunner(cooking_spec, 2)
    try:
        strata.rollout(cooking_spec, runner, tok, gen, args, episodes, 1.0, "test")
        # the judge sees each step's observation and action, and the strategy
        judge_text = tok.decode(strata.judge_prompt(tok, args, episodes[0]))
    finally:
        runner.close()
    for e in episodes:
        assert len(e.turns) == 3  # the tiny model never wins: every step is played
        for t in e.turns:
            text = tok.decode(t.prompt_ids)
            assert e.strategy.text in text
            assert plans[1 - e.group] not in text
    assert "PLAN-ALPHA" in judge_text
    for k, t in enumerate(episodes[0].turns, 1):
        assert f"Step {k}: observation: '{t.observation[:300]}', action: '{t.action}'" in judge_text


def test_strategy_embeddings_are_mean_pooled_and_ignore_padding(tiny):
    tok, model = tiny
    seqs = [[5, 6, 7], [9]]
    emb = strata.strategy_embeddings(model, seqs, contextlib.nullcontext, token_budget=4096)
    with torch.no_grad():
        alone = model.model(input_ids=torch.tensor([[5, 6, 7]])).last_hidden_state[0].mean(0)
    # the padded batch gives the same mean over the real tokens as the sequence encoded alone
    assert emb.shape == (2, model.config.hidden_size)
    assert emb[0] == pytest.approx(alone.numpy(), abs=1e-5)


# ---- the loss: action token-mean + lambda * strategy token-mean ---------------------------------
def test_strategy_loss_coef_scales_only_the_strategy_term(tiny):
    tok, base = tiny
    args = strata.Args(minibatch_size=8, kl_coef=0.0, entropy_coef=0.0, max_grad_norm=1e9)
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    advantages = np.array([1.0, -2.0])

    def step(samples, is_strategy, coef):
        import copy

        model = copy.deepcopy(base)
        args.strategy_loss_coef = coef
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        strata.update_policy(model, None, opt, [prompts[i] for i in samples], [responses[i] for i in samples], advantages[samples],
                             args, contextlib.nullcontext, torch.Generator().manual_seed(0), is_strategy)
        return torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), base.parameters())])

    action_only = step([0], [False], 0.5)
    d0, d_half, d1 = (step([0, 1], [False, True], c) for c in (0.0, 0.5, 1.0))
    # lambda = 0: the strategy sample adds nothing, and the action term is its own token-mean
    assert torch.allclose(d0, action_only, atol=1e-6)
    # the update is linear in lambda: d(0.5) - d(0) = 0.5 (d(1) - d(0)), and the strategy term is not zero
    assert (d1 - d0).abs().max() > 1e-4
    assert torch.allclose(d_half - d0, 0.5 * (d1 - d0), atol=1e-5)


# ---- the method's flags, each through the function the main loop calls with args (issue 42) ----------------
def play(spec, task_id: str, actions: list[str], strategy) -> strata.Episode:
    """An Episode of the real game played with the given actions, under strategy z (as rollout leaves it)."""
    env = spec.make()
    try:
        obs = env.reset(task_id)
        episode = strata.Episode(task_id, 0, task=obs.task, task_type=obs.task_type, strategy=strategy)
        for a in actions:
            result = env.step(a)
            episode.turns.append(strata.Turn([], [], a, True, obs.observation, None))
            obs = result
    finally:
        env.close()
    return episode


def recording(tok, model, args, calls):
    """The main loop's sampler (HF generate on the policy), recording each call's (rows, temperature, budget)."""
    sampler = strata.Sampler(None, model, tok, args, contextlib.nullcontext)

    def generate(prompts, temperature, max_new_tokens=None):
        calls.append((len(prompts), temperature, max_new_tokens))
        return sampler(prompts, temperature, max_new_tokens)
    return generate


@pytest.mark.parametrize("strategy_max_new_tokens, budget", [(5, 5), (64, 16)])  # capped by --max-new-tokens 16
def test_sample_strategies_stays_within_strategy_max_new_tokens(tiny, cooking_spec, strategy_max_new_tokens, budget):
    """--strategy-max-new-tokens: the strategy generation's budget, min(it, --max-new-tokens); the tiny model
    never writes EOS this early, so every strategy is exactly that long."""
    import envs

    tok, model = tiny
    args = strata.resolve_args(strata.Args(max_new_tokens=16, strategy_max_new_tokens=strategy_max_new_tokens,
                                           max_prompt_tokens=4096, num_strategies=2, episodes_per_strategy=2), cooking_spec)
    calls = []
    torch.manual_seed(0)
    with envs.EnvRunner(cooking_spec, 1) as runner:
        z = strata.sample_strategies(cooking_spec, runner, tok, recording(tok, model, args, calls), args,
                                     ["train-easy-0", "train-cut-0"], 3, 1.0)
    assert calls == [(6, 1.0, budget)]  # 2 tasks x 3 candidates in one call
    assert [[len(s.response_ids) for s in zs] for zs in z] == [[budget] * 3] * 2


@pytest.mark.parametrize("judge_max_new_tokens, budget", [(6, 6), (64, 16)])  # capped by --max-new-tokens 16
def test_self_judge_shows_judge_obs_chars_and_stays_within_judge_max_new_tokens(tiny, cooking_spec, judge_max_new_tokens,
                                                                                  budget):
    """--judge-obs-chars 40: each step's observation in the judge prompt is cut to its first 40 characters (the
    real game's observations are longer); --judge-max-new-tokens: the judgment's budget, min(it, --max-new-tokens),
    at the eval temperature. An episode without turns is not judged."""
    tok, model = tiny
    args = strata.Args(max_new_tokens=16, judge_max_new_tokens=judge_max_new_tokens, judge_obs_chars=40,
                       max_prompt_tokens=4096, eval_temperature=0.4)
    z = strata.Strategy([], [], "PLAN-ALPHA take the knife first", True)
    episodes = [play(cooking_spec, "train-cut-0", ["examine cookbook", "take red potato from counter", "take knife from table"], z),
                strata.Episode("train-cut-0", 1, strategy=z)]
    observations = [t.observation for t in episodes[0].turns]
    assert all(len(o) > 40 for o in observations)
    calls, prompts = [], []
    generate = recording(tok, model, args, calls)
    torch.manual_seed(0)
    judged = strata.self_judge(tok, lambda p, *rest: (prompts.extend(p), generate(p, *rest))[1], args, episodes)
    assert calls == [(1, 0.4, budget)]
    assert (judged["judged"], judged["steps"], judged["tokens"]) == (1, 3, budget)
    text = tok.decode(prompts[0])
    for k, (o, t) in enumerate(zip(observations, episodes[0].turns), 1):
        assert f"Step {k}: observation: '{o[:40]}', action: '{t.action}'" in text
        assert f"observation: '{o[:41]}" not in text


# The main loop as the CLI runs it, every HF `generate` call of the policy logged (rows, sampling, budget, first
# prompt); the calls themselves run unchanged.
SPY = """
import json, os, runpy, sys
from transformers.generation.utils import GenerationMixin
calls, real = [], GenerationMixin.generate
def generate(self, *args, **kw):
    ids, mask, config = kw["input_ids"], kw["attention_mask"], kw["generation_config"]
    calls.append(dict(rows=ids.shape[0], do_sample=config.do_sample, max_new_tokens=config.max_new_tokens,
                      first=ids[0][mask[0].bool()].tolist()))
    return real(self, *args, **kw)
GenerationMixin.generate = generate
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    with open(os.environ["GENERATE_LOG"], "w") as f:
        json.dump(calls, f)
"""


def run_logging_generate(tiny_model, log, *flags):
    """strata.py's CLI through SPY; returns the run and its generate calls as (kind, rows, do_sample, budget),
    kind read off the first prompt: strategy, judge or action."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from test_grpo_e2e import REPO

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GENERATE_LOG": str(log)}
    out = subprocess.run([sys.executable, "-c", SPY, "strata.py", "--model", tiny_model, *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=env)
    tok = AutoTokenizer.from_pretrained(tiny_model)

    def kind(ids):
        text = tok.decode(ids)
        if "Present the strategy within <strategy> </strategy> tags." in text:  # the templates' ends: prompts keep their tails
            return "strategy"
        return "judge" if "Which steps neither follow the strategy nor make progress on the task?" in text else "action"
    calls = json.loads(log.read_text()) if log.exists() else []
    return out, [(kind(c["first"]), c["rows"], c["do_sample"], c["max_new_tokens"]) for c in calls]


def test_cli_no_diverse_samples_n_strategies_and_no_judgment_judges_nothing(tiny_model, tmp_path):
    """`--no-diverse --no-judgment` (the paper's Vanilla ablation), one iteration of the main loop on 1 task, N=2,
    sigma=2: the iteration samples N = 2 strategies (not sigma*N = 4 candidates for farthest-point selection), and
    no judge prompt is ever generated for; the evaluations before and after sample 1 strategy for their 1 task.
    The chosen strategies are the sampled ones: their diversity is the first N's."""
    out, calls = run_logging_generate(tiny_model, tmp_path / "generate.json", *STRATA_FLAGS, "--max-steps", "1",
                                      "--max-new-tokens", "4", "--strategy-max-new-tokens", "3", "--num-env-workers", "1",
                                      "--total-iterations", "1", "--no-diverse", "--no-judgment",
                                      "--output-dir", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    # eval (1 task, at --eval-temperature 0.4: sampled), training (1 task x N = 2), eval again; min(3, 4) tokens
    assert [c for c in calls if c[0] == "strategy"] == [("strategy", 1, True, 3), ("strategy", 2, True, 3), ("strategy", 1, True, 3)]
    assert not [c for c in calls if c[0] == "judge"]
    metrics = read_metrics(only_run(tmp_path / "out"))[1]
    assert not {"strata/judge_flagged_frac", "strata/judge_parse_fail_frac", "strata/judge_tokens"} & set(metrics)
    assert metrics["strata/diversity_chosen"] == metrics["strata/diversity_random"]


# ---- end to end ----------------------------------------------------------------------------------
def test_two_iterations_on_cooking_log_strata_metrics(tiny_model, tmp_path):
    out, calls = run_logging_generate(tiny_model, tmp_path / "generate.json", *STRATA_FLAGS, "--total-iterations", "2",
                                      "--output-dir", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    # --oversample 2: each iteration samples sigma * N = 4 candidates for its 1 task (each evaluation 1), within
    # min(--strategy-max-new-tokens 256, --max-new-tokens 16); the judge then reads the iteration's N * M = 4 episodes
    assert [c for c in calls if c[0] != "action"] == [("strategy", 1, True, 16), ("strategy", 4, True, 16), ("judge", 4, True, 16),
                                                      ("strategy", 1, True, 16), ("strategy", 4, True, 16), ("judge", 4, True, 16),
                                                      ("strategy", 1, True, 16)], calls
    run = only_run(tmp_path / "out")
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1, 2]
    for key in ["strata/strategy_reward", "strata/strategy_advantage_abs_mean", "strata/strategy_tokens", "strata/diversity_chosen",
                "strata/diversity_random", "strata/judge_flagged_frac", "strata/judge_parse_fail_frac", "strata/strategy_time_frac",
                "strata/judge_time_frac", "strata/strategy_policy_loss", "losses/policy_loss", "charts/success_rate", "eval/success_rate"]:
        assert key in metrics[2], key
    # 1 task x N=2 strategies x M=2 episodes of 1..3 steps: 4..12 step samples, + 2 strategy samples trained
    assert 6 <= metrics[1]["tokens/samples"] <= 14
    assert metrics[1]["strata/strategy_tokens"] <= 16
    # FPS keeps the farther pair of the 4 candidates: at least as diverse as the first 2
    assert metrics[1]["strata/diversity_chosen"] >= metrics[1]["strata/diversity_random"] - 1e-9
    assert -1.0 <= metrics[1]["strata/strategy_reward"] <= 1.0
    assert (run / "checkpoint" / "trainer_state.pt").exists()


def test_num_strategies_below_two_is_one_clear_line(tiny_model):
    out = run_script("strata.py", "--model", tiny_model, "--num-strategies", "1", timeout=120)
    assert out.returncode == 2
    assert "--num-strategies and --episodes-per-strategy must be at least 2" in out.stderr
    assert "Traceback" not in out.stderr
