"""actguide.py: guidance rendering, the k search, group replacement, the mixed-policy update,
evaluation without guidance, and the script end to end (off = grpo.py, selective and always, exact resume)."""

import contextlib
import copy
import itertools
import socket
import statistics
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

import actguide
import envs
from conftest import REPO, SHARED_DATA

TASK = "train-cook-0"  # walkthrough: inventory, examine cookbook, take carrot from fridge, cook carrot with oven, prepare meal, eat meal
HINT_HEADER = "Reference action trajectory hint:"


def small_args(**kw) -> actguide.Args:
    args = actguide.Args(max_steps=2, history_length=2, max_prompt_tokens=2048, max_new_tokens=8, success_reward=10.0,
                         invalid_penalty=0.1, num_env_workers=1, group_size=2, minibatch_size=8, gradient_checkpointing=False)
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def tiny_generate(tiny_model, max_new_tokens=8):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    seen = []

    def generate(prompts, temperature):
        seen.extend(prompts)
        return actguide.generate_hf(model, tokenizer, prompts, max_new_tokens, temperature, 1.0, contextlib.nullcontext)

    return tokenizer, model, generate, seen


# ---- g_k -----------------------------------------------------------------------------------
def test_guidance_k0_is_exactly_the_unguided_task_and_gk_lists_the_first_k_actions():
    task = "Cook a meal."
    assert actguide.render_guidance(task, []) == task
    guided = actguide.render_guidance(task, ["open fridge", "take carrot from fridge"])
    assert guided.startswith(task + "\n")
    assert guided.endswith(HINT_HEADER + "\n1. open fridge\n2. take carrot from fridge")


def test_guided_prompt_carries_the_hint_and_its_reencoding_is_the_plain_grpo_prompt(tiny_model, cooking_spec):
    import grpo

    tokenizer, _, _, _ = tiny_generate(tiny_model)
    env = cooking_spec.make()
    try:
        obs = env.reset(TASK)
        plan = env.reference_actions(TASK)
    finally:
        env.close()
    args = small_args()
    guided = actguide.Episode(TASK, 0, task=obs.task, hint=plan[:2])
    ids = actguide.build_prompt(cooking_spec, tokenizer, args, guided, obs, [])
    text = tokenizer.decode(ids)
    assert HINT_HEADER in text and "1. inventory\n2. examine cookbook" in text and "3. " not in text
    # the prompt kept for the re-encoding: no hint, token for token grpo.py's prompt of the same turn
    plain = grpo.build_prompt(cooking_spec, tokenizer, args, grpo.Episode(TASK, 0, task=obs.task), obs, [])
    assert guided.unguided_prompts == [plain]
    assert HINT_HEADER not in tokenizer.decode(guided.unguided_prompts[0])
    # an unguided episode (g_0) gets grpo.py's prompt itself
    unguided = actguide.Episode(TASK, 0, task=obs.task)
    assert actguide.build_prompt(cooking_spec, tokenizer, args, unguided, obs, []) == plain == unguided.unguided_prompts[0]


# ---- the search for the smallest k ----------------------------------------------------------
def scripted(successes_per_group):
    """A success oracle: probe((j, k)) succeeds iff k is in group j's set; records every round."""
    rounds = []

    def probe(requests):
        rounds.append(list(requests))
        return [k in successes_per_group[j] for j, k in requests]

    return probe, rounds


def test_search_finds_the_smallest_k_when_success_is_monotone_and_probes_groups_in_lockstep():
    # group 0: K=8, succeeds from k=3 on:  mid 4 ok -> hi 4; mid 2 fail -> lo 3; mid 3 ok -> hi 3: k=3
    # group 1: K=1, succeeds at k>=0:      mid 0 ok -> hi 0: k=0 after one round
    # group 2: K=0 (no plan):              lo = hi = 0, never probed
    probe, rounds = scripted([set(range(3, 9)), {0, 1}, set()])
    assert actguide.search_min_k([8, 1, 0], probe, max_rounds=5) == [3, 0, 0]
    assert rounds == [[(0, 4), (1, 0)], [(0, 2)], [(0, 3)]]


def test_search_assumes_monotonicity_and_misses_an_early_success_when_it_is_not():
    # succeeds only at k=2 and k=7 (K=8): mid 4 fail -> lo 5; mid 6 fail -> lo 7; mid 7 ok -> hi 7: k=7, not 2
    probe, rounds = scripted([{2, 7}])
    assert actguide.search_min_k([8], probe, max_rounds=5) == [7]
    assert [r[0][1] for r in rounds] == [4, 6, 7]


def test_search_stops_after_five_rounds_at_the_lower_bound():
    # K=100, success from k=37: mids 50 ok (hi 50), 25 fail (lo 26), 38 ok (hi 38), 32 fail (lo 33),
    # 35 fail (lo 36); the cap leaves [36, 38] open and k = lo = 36
    probe, rounds = scripted([set(range(37, 101))])
    assert actguide.search_min_k([100], probe, max_rounds=5) == [36]
    assert [r[0][1] for r in rounds] == [50, 25, 38, 32, 35]
    # a sixth round would have probed (36 + 38) // 2 = 37 and moved hi to 37
    probe, _ = scripted([set(range(37, 101))])
    assert actguide.search_min_k([100], probe, max_rounds=6) == [36]
    probe, _ = scripted([set(range(37, 101))])
    assert actguide.search_min_k([100], probe, max_rounds=7) == [37]


# ---- hard groups and their replacement ------------------------------------------------------
def test_only_groups_where_no_episode_won_are_hard():
    episodes = [actguide.Episode("t", g, won=w) for g, w in [(0, False), (0, True), (1, False), (1, False), (2, True), (2, True)]]
    assert actguide.hard_groups(episodes) == [1]


def test_replacement_swaps_whole_groups_and_never_mixes_them():
    episodes = [actguide.Episode(f"t{g}", g) for g in (0, 0, 1, 1, 2, 2)]
    guided = [actguide.Episode("t1", 1, hint=["a"]) for _ in range(2)]
    out = actguide.replace_groups(episodes, guided)
    assert [e.group for e in out] == [0, 0, 1, 1, 2, 2]
    assert out[2] is guided[0] and out[3] is guided[1]
    assert out[0] is episodes[0] and out[5] is episodes[5]
    for g in (0, 1, 2):
        assert len({bool(e.hint) for e in out if e.group == g}) == 1  # all guided or all unguided


# ---- the iteration's algorithm: training_batch, as the main loop calls it ------------------------------
_ids = itertools.count(100)


def rolled(group: int, won: bool, valid: list[bool], hint=()) -> actguide.Episode:
    """An episode as the rollout leaves it: with a hint, each turn's prompt holds g_k and its unguided
    prompt does not (made-up ids: [k, 7] guided, [k] unguided); without one they are the same."""
    e = actguide.Episode(f"task-{group}", group, won=won, hint=list(hint))
    for ok in valid:
        k = next(_ids)
        e.turns.append(actguide.Turn([k, 7] if hint else [k], [k], "go", ok, "obs", None))
        e.unguided_prompts.append([k])
    return e


def test_training_batch_trains_guided_groups_on_their_own_baseline_with_their_unguided_prompts():
    episodes = [rolled(0, True, [True, False]), rolled(0, False, [True]),  # an easy group, unguided
                rolled(1, True, [True, True], hint=["a", "b"]), rolled(1, False, [False, True], hint=["a", "b"]),
                rolled(2, False, [True], hint=["c"]), rolled(2, False, [True, True], hint=["c"])]  # still all failed
    prompts, responses, advantages, unguided, metrics = actguide.training_batch(episodes, small_args())
    groups = [[10, 9.9, 0], [10, 10, -0.1, 0], [0, 0, 0]]
    expected = [(s - statistics.mean(g)) / (statistics.stdev(g) + 1e-6) for g in groups for s in g]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-9)
    # the guided group: mean 19.9 / 4 = 4.975, unbiased var 101.0075 / 3, std 5.8025: it is trained, not zeroed
    assert advantages[3:7].tolist() == pytest.approx([0.8660, 0.8660, -0.8746, -0.8574], abs=1e-4)
    turns = [t for e in episodes for t in e.turns]
    assert prompts == [t.prompt_ids for t in turns] and responses == [t.response_ids for t in turns]
    assert unguided == [[t.prompt_ids[0]] for t in turns]  # each sample's own turn, without g_k
    assert [p != u for p, u in zip(prompts, unguided)] == [False] * 3 + [True] * 7


# ---- the rollout side on real cooking games -------------------------------------------------
def test_fixed_k_reroll_uses_the_walkthrough_prefix_and_keeps_the_unguided_prompts(tiny_model, cooking_spec):
    tokenizer, _, generate, _ = tiny_generate(tiny_model)
    args = small_args(guidance="selective", fixed_k=2, max_steps=1)
    runner = envs.EnvRunner(cooking_spec, 1)
    try:
        plan = runner.reference_actions([TASK])[0]
        episodes = [actguide.Episode(TASK, 0) for _ in range(2)]
        timing = actguide.rollout(cooking_spec, runner, tokenizer, generate, args, episodes, 1.0, "test")
        out, metrics = actguide.guide_groups(cooking_spec, runner, tokenizer, generate, args, episodes, timing)
    finally:
        runner.close()
    # the tiny random model never wins: the group is hard and is re-rolled at k = 2, no probes
    assert metrics["actguide/guided_group_frac"] == 1.0 and metrics["actguide/k_mean"] == 2.0
    assert metrics["actguide/probe_episodes"] == 0.0 and metrics["actguide/gen_tokens_probes"] == 0.0
    assert len(out) == 2 and all(e not in episodes for e in out)
    for e in out:
        assert e.hint == plan[:2] and len(e.unguided_prompts) == len(e.turns) == 1
        assert "1. inventory\n2. examine cookbook" in tokenizer.decode(e.turns[0].prompt_ids)
        assert HINT_HEADER not in tokenizer.decode(e.unguided_prompts[0])


def hint_lines(tokenizer, prompt) -> list[str]:
    """The numbered actions of the prompt's g_k (none without a hint)."""
    text = tokenizer.decode(prompt)
    if HINT_HEADER not in text:
        return []
    lines = text.split(HINT_HEADER + "\n", 1)[1].splitlines()
    return [line.split(". ", 1)[1] for line in itertools.takewhile(lambda s: s[:1].isdigit() and ". " in s, lines)]


def test_search_probes_probe_episodes_per_group_each_round_and_stops_after_max_probe_rounds(tiny_model, cooking_spec):
    """--probe-episodes 3, --max-probe-rounds 1: each hard group is probed once, at mid = K // 2, with 3
    episodes (one batch, both groups in lockstep); no episode can win in one step, so the probe fails,
    lo = mid + 1, and the cap ends the search at k = lo. (5 rounds, the default, would reach k = K.)"""
    tokenizer, _, generate, seen = tiny_generate(tiny_model)
    calls = []

    def counted(prompts, temperature):
        calls.append(len(prompts))
        return generate(prompts, temperature)

    args = small_args(guidance="selective", probe_episodes=3, max_probe_rounds=1, max_steps=1)
    tasks = [TASK, "train-easy-0"]  # walkthroughs of K = 6 and K = 5 actions
    runner = envs.EnvRunner(cooking_spec, 1)
    try:
        plans = runner.reference_actions(tasks)
        episodes = [actguide.Episode(t, g) for g, t in enumerate(tasks) for _ in range(2)]
        timing = actguide.rollout(cooking_spec, runner, tokenizer, generate, args, episodes, 1.0, "test")
        assert calls == [] and len(seen) == 4 and not any(e.won for e in episodes)  # both groups hard
        out, metrics = actguide.guide_groups(cooking_spec, runner, tokenizer, counted, args, episodes, timing)
    finally:
        runner.close()
    assert [len(p) for p in plans] == [6, 5]
    # one probe round: 3 episodes of group 0 at mid (0 + 6) // 2 = 3, 3 of group 1 at (0 + 5) // 2 = 2, one batch;
    # then the guided re-roll: 2 episodes per group, at k = 3 + 1 = 4 and k = 2 + 1 = 3
    assert calls == [6, 4]
    assert [hint_lines(tokenizer, p) for p in seen[4:10]] == [plans[0][:3]] * 3 + [plans[1][:2]] * 3
    assert [hint_lines(tokenizer, p) for p in seen[10:]] == [plans[0][:4]] * 2 + [plans[1][:3]] * 2
    assert [e.hint for e in out] == [plans[0][:4]] * 2 + [plans[1][:3]] * 2 and [e.group for e in out] == [0, 0, 1, 1]
    assert metrics["actguide/probe_episodes"] == 6.0 and metrics["actguide/guided_group_frac"] == 1.0
    assert metrics["actguide/k_mean"] == 3.5 and metrics["actguide/k_over_K_mean"] == pytest.approx((4 / 6 + 3 / 5) / 2)
    assert metrics["actguide/gen_tokens_probes"] > 0 and metrics["actguide/guided_success_rate"] == 0.0


SEARCH_QA = SHARED_DATA / "search_qa"


@contextlib.contextmanager
def search_server(corpus):
    """The BM25 retrieval server, started as users start it (the search env pings it at reset)."""
    pytest.importorskip("bm25s", reason="bm25s not installed: pip install bm25s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "envs.search", "serve", "--corpus", str(corpus), "--port", str(port)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving" in proc.stdout.readline()
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_always_mode_plays_a_group_without_action_data_at_g0_instead_of_dropping_it(tiny_model):
    """--guidance always runs no unguided rollout, so every group must come out of guide_groups played:
    a search question with a Search-R1 trajectory at g_k (k = min(--fixed-k, K)), one without any at g_0
    (unguided). Only --guidance selective drops plan-less groups (they keep their unguided rollout)."""
    from envs import search

    corpus = SEARCH_QA / "corpus" / "flashrag_sample_data_1000.jsonl"
    if not corpus.exists():
        pytest.skip(f"shared search data not found at {SEARCH_QA}")
    tokenizer, _, generate, seen = tiny_generate(tiny_model)
    args = small_args(guidance="always", fixed_k=1, max_steps=1)
    solved = search.reference_queries(str(SEARCH_QA))
    with search_server(corpus) as url:
        spec = envs.load("search", data=str(SEARCH_QA), url=url)
        ids = [t for t in spec.task_ids("test") if t.startswith("test/bamboogle/")]
        rows = search.questions(str(SEARCH_QA), "test")[0]["bamboogle"]
        with_plan = next(t for t in ids if solved.get(rows[int(t.split("/")[2])]["question"]))
        without = next(t for t in ids if not solved.get(rows[int(t.split("/")[2])]["question"]))
        plan = solved[rows[int(with_plan.split("/")[2])]["question"]]
        episodes = [actguide.Episode(t, g) for g, t in enumerate([with_plan, without]) for _ in range(2)]  # as the main loop: unplayed
        runner = envs.EnvRunner(spec, 1)
        try:
            out, metrics = actguide.guide_groups(spec, runner, tokenizer, generate, args, episodes,
                                                 Counter(gen_s=0.0, env_s=0.0, gen_tokens=0))
        finally:
            runner.close()
    assert [e.group for e in out] == [0, 0, 1, 1] and [e.hint for e in out] == [plan[:1]] * 2 + [[]] * 2
    assert all(len(e.turns) == 1 for e in out)  # every group played, the plan-less one too
    assert [hint_lines(tokenizer, p) for p in seen] == [plan[:1]] * 2 + [[]] * 2
    assert metrics["actguide/guided_group_frac"] == 1.0 and metrics["actguide/k_mean"] == 0.5
    assert metrics["actguide/probe_episodes"] == 0.0


def test_evaluation_prompts_carry_no_hint(tiny_model, cooking_spec):
    tokenizer, _, generate, seen = tiny_generate(tiny_model)
    args = small_args(guidance="always", fixed_k=3)
    runner = envs.EnvRunner(cooking_spec, 1)
    try:
        metrics = actguide.evaluate(cooking_spec, runner, tokenizer, generate, args, {"train": [TASK]})
    finally:
        runner.close()
    assert "eval/success_rate" in metrics and len(seen) >= 1
    assert not any(HINT_HEADER in tokenizer.decode(p) for p in seen)


# ---- the mixed-policy update ----------------------------------------------------------------
def test_old_logprobs_come_from_the_hinted_prompt_and_training_and_kl_from_the_unguided_one(tiny_model):
    tokenizer, model, _, _ = tiny_generate(tiny_model)
    model.config.pad_token_id = tokenizer.pad_token_id
    plain = actguide.encode_prompt(tokenizer, "Your task is to: cook a meal.")
    hinted = actguide.encode_prompt(tokenizer, actguide.render_guidance("Your task is to: cook a meal.", ["open fridge", "take carrot"]))
    response = tokenizer("<think> ok </think> <action> open fridge </action>", add_special_tokens=False)["input_ids"]
    other = actguide.encode_prompt(tokenizer, "Your task is to: eat.")
    prompts, unguided, responses = [hinted, other], [plain, other], [response, response[:5]]
    args = small_args(learning_rate=0.0, kl_coef=0.5, entropy_coef=0.0, update_epochs=1)
    null = contextlib.nullcontext
    # by hand, before the update: the guided sample's tokens under both encodings
    lp_guided, lp_other = actguide.logprobs_no_grad(model, [hinted, other], [response, response[:5]], args, null)
    (lp_plain,) = actguide.logprobs_no_grad(model, [plain], [response], args, null)
    assert (lp_guided - lp_plain).abs().max() > 1e-4  # the hint changes the encoding
    ref = copy.deepcopy(model).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    metrics = actguide.update_policy(model, ref, optimizer, prompts, responses, np.array([1.0, -1.0]), args, null,
                                     torch.Generator().manual_seed(0), unguided)
    n_tokens = len(response) + 5
    # lr 0: the trained log-probs are the unguided ones, the old ones the guided ones, so
    # approx_kl_old = sum(old - logp) / tokens = sum(lp_guided - lp_plain) / n (the other sample adds 0)
    assert metrics["losses/approx_kl_old"] == pytest.approx(float((lp_guided - lp_plain).sum()) / n_tokens, rel=1e-4, abs=1e-6)
    # the reference (a copy of the model) is read under the unguided prompt: k3 = 0 exactly there
    assert metrics["losses/kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actguide/guidance_log_ratio_abs"] == pytest.approx(float((lp_plain - lp_guided).abs().mean()), rel=1e-4)
    assert metrics["actguide/guided_sample_frac"] == 0.5
    # without unguided prompts the update is grpo.py's: ratio 1, no guidance metrics
    metrics = actguide.update_policy(model, ref, optimizer, prompts, responses, np.array([1.0, -1.0]), args, null,
                                     torch.Generator().manual_seed(0))
    assert metrics["losses/approx_kl_old"] == pytest.approx(0.0, abs=1e-6)
    assert "actguide/guidance_log_ratio_abs" not in metrics


# ---- end to end through the CLI -------------------------------------------------------------
# TINY_FLAGS shrunk further (the last value of a repeated flag wins): one probe round of one episode
E2E_FLAGS = ["--probe-episodes", "1", "--max-probe-rounds", "1", "--num-eval-tasks", "1", "--eval-every", "2",
             "--max-steps", "2", "--max-new-tokens", "8"]


def test_guidance_off_is_exactly_grpo(tiny_model, tmp_path):
    """--guidance off (the zero-RL comparison): no probe, no guided re-roll, the same iteration as grpo.py's,
    metric for metric; actguide.py adds only its unguided success rate (here every group's own)."""
    from test_grpo_e2e import TINY_FLAGS, comparable, logged_lists, only_run, read_metrics, run_script

    flags = [*TINY_FLAGS, "--num-tasks", "1", "--num-eval-tasks", "1", "--max-steps", "2", "--max-new-tokens", "8",
             "--total-iterations", "1"]
    metrics = {}
    for script, extra in (("grpo.py", []), ("actguide.py", ["--guidance", "off"])):
        out = run_script(script, "--model", tiny_model, *flags, *extra, "--output-dir", str(tmp_path / script))
        assert out.returncode == 0, out.stderr[-3000:]
        metrics[script] = read_metrics(only_run(tmp_path / script))
    grpo_run, off = metrics["grpo.py"], metrics["actguide.py"]
    assert sorted(off) == sorted(grpo_run) == [0, 1]
    assert [k for k in off[1] if k.startswith("actguide/")] == ["actguide/unguided_success_rate"]
    assert off[1].pop("actguide/unguided_success_rate") == off[1]["charts/success_rate"]  # no group was re-rolled
    for it in (0, 1):
        assert comparable(off[it]) == comparable(grpo_run[it])


def test_selective_two_iterations_then_exact_resume_with_the_probe_totals(tiny_model, tmp_path):
    from test_grpo_e2e import TINY_FLAGS, comparable, logged_lists, only_run, read_metrics, run_script

    straight = run_script("actguide.py", "--model", tiny_model, *TINY_FLAGS, *E2E_FLAGS, "--total-iterations", "2", "--output-dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path / "a"))
    assert sorted(metrics) == [0, 1, 2]
    for key in ["charts/success_rate", "losses/policy_loss", "eval/success_rate", "actguide/unguided_success_rate",
                "actguide/guided_group_frac", "actguide/probe_episodes", "actguide/k_over_K_mean",
                "actguide/guided_success_rate", "actguide/guidance_log_ratio_abs", "actguide/extra_gen_frac"]:
        assert key in metrics[2], key
    # the tiny random model never wins: both groups are hard; one round x 1 probe episode each
    assert metrics[1]["actguide/guided_group_frac"] == 1.0
    assert metrics[1]["actguide/probe_episodes"] == 2.0 and metrics[2]["actguide/probe_episodes_total"] == 4.0
    assert metrics[1]["actguide/guided_sample_frac"] > 0  # k >= 1 after the round: the hint was shown

    first = run_script("actguide.py", "--model", tiny_model, *TINY_FLAGS, *E2E_FLAGS, "--total-iterations", "1", "--output-dir", str(tmp_path / "b"))
    assert first.returncode == 0, first.stderr[-3000:]
    run_b = only_run(tmp_path / "b")
    resumed = run_script("actguide.py", "--resume", str(run_b), "--total-iterations", "2", "--no-gradient-checkpointing")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics_b = read_metrics(run_b)
    assert comparable(metrics_b[2]) == pytest.approx(comparable(metrics[2]), rel=1e-5, abs=1e-7)
    assert logged_lists(metrics_b[2]) == logged_lists(metrics[2])


def test_always_mode_two_iterations_guides_every_group_without_an_unguided_rollout(tiny_model, tmp_path):
    from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics, run_script

    out = run_script("actguide.py", "--model", tiny_model, *TINY_FLAGS, *E2E_FLAGS, "--guidance", "always", "--fixed-k", "2",
                     "--total-iterations", "2", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path))
    for it in (1, 2):
        assert metrics[it]["actguide/guided_group_frac"] == 1.0 and metrics[it]["actguide/k_mean"] == 2.0
        assert metrics[it]["actguide/gen_tokens_unguided"] == 0.0 and metrics[it]["actguide/probe_episodes"] == 0.0
        assert "actguide/unguided_success_rate" not in metrics[it]
        assert metrics[it]["actguide/guided_sample_frac"] == 1.0
    assert "eval/success_rate" in metrics[2]


@pytest.mark.parametrize("flags, message", [
    (["--fixed-k", "-1"], "--fixed-k not negative"),
    (["--guidance", "sometimes"], "invalid choice 'sometimes'"),
])
def test_bad_guidance_flags_are_one_clear_error(tiny_model, flags, message):
    from test_grpo_e2e import run_script

    out = run_script("actguide.py", "--model", tiny_model, *flags, timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
