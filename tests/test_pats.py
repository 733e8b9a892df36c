"""pats.py: evidence cards, review modes and budgets, de-duplication, the reviewers' edits, per-task
context, redundancy removal, no scaffold in evaluation, and the CLI end to end with a resume."""

import contextlib

import pytest
import torch

import pats
from pats import Episode, Turn

def entry(id, plan="", pitfall="", constraint="", kind="skill", general=False, sources=(), created=0):
    return dict(id=id, kind=kind, general=general, when="", plan=plan, pitfall=pitfall, constraint=constraint,
                sources=list(sources), created=created)


def turn(action, valid=True, before="A", after="B", obs="you see a kitchen"):
    return Turn([1], [2], action, valid, obs, before, after)


def hand_made_group(shown=()):
    """Three episodes of train-cut-0: two wins (3 and 2 steps) and a 3-step loss."""
    e1 = Episode("train-cut-0", 0, "cut the carrot", "cut", won=True, score=1.0, shown=list(shown),
                 turns=[turn("take knife", before="A", after="B"), turn("xx", valid=False, before="B", after="B"),
                        turn("slice carrot with knife", before="B", after="C")])
    e2 = Episode("train-cut-0", 0, "cut the carrot", "cut", won=True, score=1.0, shown=list(shown),
                 turns=[turn("take knife", before="A", after="B", obs="kitchen"), turn("slice carrot with knife", before="B", after="C", obs="knife held")])
    e3 = Episode("train-cut-0", 0, "cut the carrot", "cut", won=False, score=0.0, shown=list(shown),
                 turns=[turn("look", before="A", after="A", obs="dark"), turn("zz", valid=False, before="A", after="A", obs="still dark"),
                        turn("go north", before="A", after="D")])
    return [e1, e2, e3]


def test_evidence_card_fields_from_a_hand_made_group():
    card = pats.evidence_card(hand_made_group(shown=[4]), success_reward=10.0, iteration=7)
    assert (card["task_id"], card["task"], card["task_type"], card["iteration"], card["shown"]) == ("train-cut-0", "cut the carrot", "cut", 7, [4])
    # 2 of 3 won: mean reward 10 * 2/3, success 2/3; neither all failed nor all passed
    assert card["mean_reward"] == pytest.approx(20 / 3) and card["success"] == pytest.approx(2 / 3)
    assert (card["all_failed"], card["all_passed"], card["won"]) == (False, False, True)
    # 2 malformed steps (xx, zz) out of 3 + 2 + 3 = 8
    assert card["invalid_rate"] == pytest.approx(0.25)
    # best = the shortest win (e2): both its steps changed the state
    assert card["best_steps"] == [["kitchen", "take knife"], ["knife held", "slice carrot with knife"]]
    # worst = the longest loss (e3): its no-effect and malformed steps; 'go north' changed the state
    assert card["worst_steps"] == [["dark", "look", "no effect"], ["still dark", "zz", "malformed"]]
    assert card["won_actions"] == ["slice carrot with knife", "take knife"]
    assert card["actions"] == ["go north", "look", "slice carrot with knife", "take knife", "xx", "zz"]


def test_competence_ema_by_hand():
    # alpha 0.1 from 0: groups of the type succeeded 1.0 and 0.5 -> obs 0.75 -> 0.075
    assert pats.update_competence(0.0, [1.0, 0.5]) == pytest.approx(0.075)
    # a later iteration with one all-failed group: 0.9 * 0.075 = 0.0675
    assert pats.update_competence(0.075, [0.0]) == pytest.approx(0.0675)


def test_review_mode_at_the_thresholds_and_at_full_capacity():
    assert pats.review_mode([], 0.0) == "EXPAND"
    assert pats.review_mode([], 0.2999) == "EXPAND"
    assert pats.review_mode([], 0.3) == "REVISE"
    assert pats.review_mode([], 0.6999) == "REVISE"
    assert pats.review_mode([], 0.7) == "COMPRESS"
    small = [entry(i, plan="go") for i in range(29)]
    assert pats.review_mode(small, 0.9) == "COMPRESS"  # 29 / 30 entries: not full
    assert pats.review_mode(small + [entry(29, plan="go")], 0.9) == "FORCED_PRUNE"  # 30 / 30 entries
    # tokens: "- Plan: " (8 chars) + 7992 chars = 8000 chars = 2000 estimated tokens = the limit
    assert pats.review_mode([entry(0, plan="a" * 7992)], 0.0) == "FORCED_PRUNE"
    # 7996 chars -> 1999 tokens: pressure 0.9995 < 1
    assert pats.review_mode([entry(0, plan="a" * 7988)], 0.0) == "EXPAND"


PROPOSALS = [
    dict(op="add", kind="skill", general=True, plan="open fridge -> take carrot"),       # g1
    dict(op="add", kind="skill", general=True, plan="examine cookbook first"),           # g2
    dict(op="add", kind="skill", general=False, plan="go east -> take knife"),            # s1
    dict(op="add", kind="skill", general=False, plan="slice yellow potato with knife"),   # s2
    dict(op="add", kind="mistake", pitfall="'look' changed nothing"),                     # m1
    dict(op="add", kind="mistake", pitfall="'inventory' wastes turns"),                   # m2
    dict(op="delete", id=0),                                                              # d
    dict(op="update", id=0, plan="cook meal on stove"),                                   # u
]


@pytest.mark.parametrize("mode, kept, rejected", [
    # EXPAND: 2 skills of which 1 general (g1, s1), 1 mistake (m1); g2 (2nd general), s2 (3rd skill),
    # m2, the delete and the update are over budget
    ("EXPAND", [0, 2, 4], 5),
    # REVISE: 1 skill (g1), 1 mistake (m1), 1 delete; the update then names a deleted entry
    ("REVISE", [0, 4, 6], 5),
    # COMPRESS: 1 skill (g1) with its companion delete; no mistakes
    ("COMPRESS", [0, 6], 6),
    # FORCED_PRUNE: only deletes
    ("FORCED_PRUNE", [6], 7),
])
def test_budgets_per_mode(mode, kept, rejected):
    bank = [entry(0, plan="put carrot on counter")]
    accepted, n_rejected = pats.validate_edits(PROPOSALS, bank, mode, pats.BUDGETS[mode])
    assert accepted == [PROPOSALS[k] for k in kept]
    assert n_rejected == rejected


def test_compress_drops_an_add_without_its_companion_update_or_delete():
    accepted, rejected = pats.validate_edits(PROPOSALS[:1], [entry(0, plan="put carrot on counter")], "COMPRESS", pats.BUDGETS["COMPRESS"])
    assert (accepted, rejected) == ([], 1)


def test_jaccard_near_duplicates_are_dropped():
    # {take, the, red, apple} vs {take, the, apple}: 3 / 4 = 0.75 >= 0.7
    assert pats.jaccard("Take the red apple", "take the apple") == pytest.approx(0.75)
    # {open, the, fridge} vs {open, fridge, now}: 2 / 4 = 0.5
    assert pats.jaccard("open the fridge", "open fridge now") == pytest.approx(0.5)
    bank = [entry(0, plan="take the red apple")]
    edits = [dict(op="add", kind="skill", plan="take the apple"),       # duplicates the bank's entry
             dict(op="add", kind="skill", plan="open the fridge"),
             dict(op="add", kind="mistake", pitfall="open fridge now"),  # 0.5 to the previous one: kept
             dict(op="add", kind="mistake", pitfall="open the fridge")]  # duplicates an accepted add (1.0)
    accepted, rejected = pats.validate_edits(edits, bank, "REVISE", dict(skill=5, general=5, mistake=5, update=0, delete=0))
    assert accepted == [edits[1], edits[2]] and rejected == 2


def test_policy_reviewer_output_with_one_invalid_edit_drops_it_and_applies_the_rest():
    reply = "\n".join([
        "Here are my edits:",
        '{"op": "add", "kind": "skill", "general": false, "when": "a cut task", "plan": "take knife -> slice carrot with knife", "sources": ["train-cut-0", "train-cut-1"]}',
        '{"op": "delete", "id": 99}',
        '{"op": "add", "kind": "mistake", "when": "a cut task", "pitfall": "\'look\' changed nothing", "sources": ["train-cut-0"]}',
        '{"op": "update", "id": 0, "plan": "open fridge -> take carrot", "sources": ["train-cut-2"]}',
    ])
    edits, unparsed = pats.parse_edits(reply)
    assert len(edits) == 4 and unparsed == 0
    bank = [entry(0, plan="put carrot on counter", sources=["train-cut-5"])]
    accepted, rejected = pats.validate_edits(edits, bank, "REVISE", pats.BUDGETS["REVISE"])
    assert rejected == 1 and [e["op"] for e in accepted] == ["add", "add", "update"]  # delete of unknown id 99 dropped
    entries, next_id = pats.apply_edits(bank, accepted, iteration=3, next_id=5)
    assert next_id == 7
    assert [(e["id"], e["kind"], e["plan"] or e["pitfall"]) for e in entries] == [
        (0, "skill", "open fridge -> take carrot"), (5, "skill", "take knife -> slice carrot with knife"), (6, "mistake", "'look' changed nothing")]
    assert entries[0]["sources"] == ["train-cut-2", "train-cut-5"] and entries[1]["created"] == 3
    # a line that looks like JSON but is broken is counted, prose is ignored
    assert pats.parse_edits('{"op": "add", "kind": \nok then\n{"op": "delete", "id": 1}') == ([{"op": "delete", "id": 1}], 1)


def test_entry_is_dropped_once_the_policy_completes_its_step_unaided():
    plan = entry(3, plan="take knife -> slice carrot with knife", created=1)
    card = pats.evidence_card(hand_made_group(shown=[]), 10.0, iteration=2)
    assert pats.redundant(plan, card)  # not shown, and a win took both steps
    assert not pats.redundant(plan, pats.evidence_card(hand_made_group(shown=[3]), 10.0, iteration=2))  # aided
    assert not pats.redundant(plan, pats.evidence_card(hand_made_group(shown=[]), 10.0, iteration=1))  # same iteration
    assert not pats.redundant(entry(4, plan="take knife -> cook carrot with oven", created=1), card)  # a step not taken
    # a pitfall needs all episodes to win without its action; a general verb plan matches 'take knife'
    assert not pats.redundant(entry(5, kind="mistake", pitfall="'look' changed nothing"), card)
    assert pats.redundant(entry(6, plan="take -> slice"), card)
    # through the review: the redundant entry leaves the bank, the aided one stays
    state = {"bank": {"cut": [plan, entry(7, plan="cook carrot with oven", created=1)]}, "ema": {}, "exemplars": {}, "next_id": 8}
    args = pats.Args(reviewer="rules")
    metrics = pats.review_bank(state, [card], lambda t, c, e, m, b: ([], 0), args, iteration=2)
    assert [e["id"] for e in state["bank"]["cut"]] == [7]
    assert metrics["pats/entries_redundant"] == 1 and metrics["pats/mode_EXPAND"] == 1
    # competence 0.1 * 2/3; the shortest win became the task's exemplar
    assert state["ema"]["cut"] == pytest.approx(0.1 * 2 / 3)
    assert state["exemplars"]["train-cut-0"].endswith("take knife -> slice carrot with knife")
    # --no-adapt never removes anything
    state["bank"]["cut"].append(plan)
    pats.review_bank(state, [card], lambda t, c, e, m, b: ([], 0), pats.Args(no_adapt=True), iteration=2)
    assert [e["id"] for e in state["bank"]["cut"]] == [7, 3]


def test_context_is_most_concrete_first_and_its_amount_follows_competence():
    entries = [entry(0, kind="mistake", pitfall="'look' changed nothing", sources=["train-cut-0"]),
               entry(1, plan="take knife -> slice apple", sources=["train-cut-9"]),
               entry(2, plan="take -> slice", general=True, sources=["train-cut-9"]),
               entry(3, plan="take knife -> slice carrot", sources=["train-cut-0"])]
    text, shown = pats.select_scaffold("train-cut-0", entries, "- Exemplar: take knife", ema=0.0)
    # exemplar, this task's plan, the general plan, another task's plan, then pitfalls
    assert shown == [pats.EXEMPLAR, 3, 2, 1, 0]
    assert text.startswith(pats.SCAFFOLD_HEADER) and text.index("Exemplar") < text.index("slice carrot") < text.index("Pitfall")
    # k = ceil(6 (1 - ema)): ema 0.5 -> 3 items; 0.9 -> ceil(0.6) = 1; 1.0 -> none, no text at all
    assert pats.select_scaffold("train-cut-0", entries, "- Exemplar: take knife", ema=0.5)[1] == [pats.EXEMPLAR, 3, 2]
    assert pats.select_scaffold("train-cut-0", entries, "- Exemplar: take knife", ema=0.9)[1] == [pats.EXEMPLAR]
    assert pats.select_scaffold("train-cut-0", entries, "- Exemplar: take knife", ema=1.0) == ("", [])
    # the token budget: "- Exemplar: take knife" is 22 chars = 6 tokens; the next item does not fit in 10
    assert pats.select_scaffold("train-cut-0", entries, "- Exemplar: take knife", ema=0.0, max_tokens=10)[1] == [pats.EXEMPLAR]
    # --no-adapt: everything, whatever the competence
    assert pats.select_scaffold("train-cut-0", entries, None, ema=1.0, adapt=False)[1] == [3, 2, 1, 0]


def test_unseen_task_gets_its_types_entries_by_the_type_competence():
    entries = [entry(0, kind="mistake", pitfall="'look' changed nothing", sources=["train-cut-0"]),
               entry(1, plan="take knife -> slice apple", sources=["train-cut-9"]),
               entry(2, plan="take -> slice", general=True, sources=["train-cut-9"])]
    # never seen: no exemplar, no entry cites it; general plan first; ema 0.6 -> ceil(2.4) = 3 items
    assert pats.select_scaffold("train-cut-1234", entries, None, ema=0.6)[1] == [2, 1, 0]
    assert pats.select_scaffold("train-cut-1234", entries, None, ema=0.8)[1] == [2, 1]  # ceil(6 x 0.2) = ceil(1.2) = 2


def test_forced_prune_falls_back_to_dropping_the_newest_entries():
    bank = [entry(i, plan=f"step{i}") for i in range(32)]
    kept, pruned = pats.prune_to_capacity(bank)
    # 32 entries -> below 30 means 29: ids 29, 30, 31 (the newest) go
    assert [e["id"] for e in kept] == list(range(29)) and pruned == 3


def test_rules_reviewer_expand_from_cards():
    win = pats.evidence_card(hand_made_group(), 10.0, iteration=1)
    edits = pats.rules_review([win], [], "EXPAND", pats.BUDGETS["EXPAND"])
    # general skill: the verbs of the shortest win; specific skill: its plan; mistake: the most repeated
    # failing step of the worst episode ('look' and the malformed 'zz' once each: the first counted wins)
    assert [(e["kind"], e["general"], e.get("plan") or e.get("pitfall")) for e in edits] == [
        ("skill", True, "take -> slice"), ("skill", False, "take knife -> slice carrot with knife"),
        ("mistake", False, "'look' changed nothing (1 times in failed attempts)")]
    assert pats.validate_edits(edits, [], "EXPAND", pats.BUDGETS["EXPAND"]) == (edits, 0)
    # a weak policy (all malformed, no win): the answer-format constraint and the format pitfall
    lost = pats.evidence_card([Episode("train-cut-1", 0, "t", "cut", turns=[turn("x", valid=False)]) for _ in range(2)], 10.0, 1)
    edits = pats.rules_review([lost], [], "EXPAND", pats.BUDGETS["EXPAND"])
    assert [e["kind"] for e in edits] == ["skill", "mistake"] and "<action>" in edits[0]["constraint"] and "<think>" in edits[1]["pitfall"]


def test_iteration_review_keeps_a_shown_exemplar_drops_an_unneeded_one_and_skips_crashed_groups():
    """The main loop's review: cards of the iteration's groups (none from a group whose env crashed),
    then review_bank. A group shown its exemplar that all passed keeps it (refreshed from its newest
    win); one that all passed without it loses it."""
    wins = [e for e in hand_made_group() if e.won]

    def group(task_id, number, shown=(), crashed=False, won=True):
        return [Episode(task_id, number, e.task, e.task_type, turns=list(e.turns), won=won, score=float(won),
                        shown=list(shown), crashed=crashed) for e in wins]

    episodes = (group("train-cut-0", 0, shown=[pats.EXEMPLAR]) + group("train-cut-1", 1)
                + group("train-cut-2", 2, crashed=True) + group("train-cut-3", 3, won=False))
    cards = pats.iteration_cards(episodes, 10.0, iteration=5)
    assert [c["task_id"] for c in cards] == ["train-cut-0", "train-cut-1", "train-cut-3"]
    old = {f"train-cut-{k}": "- Exemplar: old" for k in range(3)}
    state = {"bank": {}, "ema": {"cut": 0.5}, "exemplars": old, "next_id": 0}
    metrics = pats.review_bank(state, cards, lambda *_: ([], 0), pats.Args(), iteration=5)
    refreshed = "- Exemplar (a successful attempt at this task): take knife -> slice carrot with knife"
    assert state["exemplars"] == {"train-cut-0": refreshed, "train-cut-2": "- Exemplar: old"}
    # competence: 0.1 * mean(1, 1, 0) + 0.9 * 0.5 (the crashed group is no evidence)
    assert state["ema"]["cut"] == pytest.approx(0.1 * 2 / 3 + 0.45) and metrics["pats/mode_REVISE"] == 1


def test_review_bank_no_adapt_keeps_the_exemplar_of_a_task_solved_without_it():
    """--no-adapt (the full context always): a group that all passed without its exemplar keeps it, refreshed
    from its newest win; adapting drops it (as above)."""
    wins = [e for e in hand_made_group() if e.won]
    episodes = [Episode("train-cut-1", 1, e.task, e.task_type, turns=list(e.turns), won=True, score=1.0) for e in wins]
    cards = pats.iteration_cards(episodes, 10.0, iteration=5)
    assert cards[0]["all_passed"] and pats.EXEMPLAR not in cards[0]["shown"]
    refreshed = "- Exemplar (a successful attempt at this task): take knife -> slice carrot with knife"
    for no_adapt, exemplars in [(True, {"train-cut-1": refreshed}), (False, {})]:
        state = {"bank": {}, "ema": {}, "exemplars": {"train-cut-1": "- Exemplar: old"}, "next_id": 0}
        metrics = pats.review_bank(state, cards, lambda *_: ([], 0), pats.Args(no_adapt=no_adapt), iteration=5)
        assert state["exemplars"] == exemplars and metrics["pats/exemplars"] == len(exemplars)


def test_the_scaffold_counts_against_the_budget_and_never_pushes_out_the_prompt(tiny_model, cooking_spec):
    """A scaffold (e.g. --no-adapt's whole bank) keeps the lines that fit beside grpo.py's prompt of the turn
    (template head, history, observation all kept); the prompt never exceeds --max-prompt-tokens."""
    from transformers import AutoTokenizer

    import grpo
    from envs import Step

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    obs = Step(observation="a kitchen with a knife", reward=0.0, done=False, won=False,
               admissible=["look", "take knife"], task="cut the carrot", task_type="cut", state=None)
    history = [("a dark room", "go north"), ("a kitchen", "look")]
    scaffold = pats.SCAFFOLD_HEADER + "".join(f"- Plan: take knife -> slice carrot, variant {k}\n" for k in range(12))

    def build(budget, text):
        args = pats.Args(history_length=2, max_prompt_tokens=budget, response_prefix="<think>")
        episode = Episode("train-cut-0", 0, task="cut the carrot", scaffold=text)
        return pats.build_prompt(cooking_spec, tokenizer, args, episode, obs, history), episode.scaffold_fit

    def grpo_prompt(budget):
        args = pats.Args(history_length=2, max_prompt_tokens=budget, response_prefix="<think>")
        episode = grpo.Episode("train-cut-0", 0, task="cut the carrot")
        return tokenizer.decode(grpo.build_prompt(cooking_spec, tokenizer, args, episode, obs, history))

    head = "<|im_start|>user\n"
    plain, _ = build(4096, "")
    assert tokenizer.decode(plain) == grpo_prompt(4096)
    full, fit = build(4096, scaffold)
    assert tokenizer.decode(full) == tokenizer.decode(plain).replace(head, head + scaffold, 1)
    assert fit == [(len(full) - len(plain), False)]
    # half the scaffold's tokens of room: its first lines, all of the plain prompt, within the budget
    budget = len(plain) + (len(full) - len(plain)) // 2
    cut, fit = build(budget, scaffold)
    text = tokenizer.decode(cut)
    kept = [k for k in range(12) if f"variant {k}\n" in text]
    assert len(cut) <= budget and 1 <= len(kept) < 12 and kept == list(range(len(kept)))
    assert text.startswith(head + pats.SCAFFOLD_HEADER) and text.endswith(tokenizer.decode(plain)[len(head):])
    assert fit == [(len(cut) - len(plain), True)]
    # no room left: grpo.py's prompt, its history included
    assert build(len(plain), scaffold) == (plain, [(0, True)])
    # less room than that: grpo.py's own choice for this budget (the oldest pair dropped) comes first
    short, _ = build(len(plain) - 1, scaffold)
    grpo_short = grpo_prompt(len(plain) - 1)
    assert "a dark room" not in grpo_short and "a kitchen" in grpo_short
    assert len(short) <= len(plain) - 1 and tokenizer.decode(short).endswith(grpo_short[len(head):])


def test_rollout_prompts_carry_the_frozen_group_scaffold_and_evaluation_prompts_none(tiny_model, cooking_spec):
    """The ratio is computed on the prompt the policy saw: every training turn's prompt ids hold the
    group's scaffold, chosen once per group; evaluation (deployment) prompts hold none."""
    import envs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    seen = []

    def generate(prompts, temperature):
        seen.extend(tokenizer.decode(p) for p in prompts)
        return pats.generate_hf(model, tokenizer, prompts, 4, temperature, 1.0, contextlib.nullcontext)

    calls = []

    def scaffold(e):
        calls.append((e.task_id, e.task_type))
        return pats.SCAFFOLD_HEADER + "- Plan: take knife\n", [7]

    args = pats.Args(max_steps=2, history_length=2, max_prompt_tokens=2048, max_new_tokens=4, success_reward=10.0, invalid_penalty=0.1)
    episodes = [Episode("train-cut-0", 0) for _ in range(2)]
    with envs.EnvRunner(cooking_spec, num_workers=1) as runner:
        pats.rollout(cooking_spec, runner, tokenizer, generate, args, episodes, 1.0, "rollout", scaffold)
        assert calls == [("train-cut-0", "cut")]  # once per group, after reset (the type is known)
        turns, *_ = pats.flatten_turns(episodes, 10.0)
        assert turns and all("- Plan: take knife" in tokenizer.decode(t.prompt_ids) for t in turns)
        assert all(e.scaffold == episodes[0].scaffold and e.shown == [7] for e in episodes)
        seen.clear()
        pats.evaluate(cooking_spec, runner, tokenizer, generate, args, {"train": ["train-cut-0"]})
    assert seen and not any("Training guidance" in p or "take knife" in p.split("Your task")[0] for p in seen)


@pytest.fixture(scope="module")
def first_iteration(tiny_model, tmp_path_factory):
    """Iteration 1 of a CLI run on cooking (rules reviewer; --seed 1 draws train-cut-946 and train-open-1023), its
    run directory checkpointed. Tests resume copies of it."""
    from test_grpo_e2e import TINY_FLAGS, only_run, run_script

    out_dir = tmp_path_factory.mktemp("pats-first")
    flags = [*TINY_FLAGS, "--num-eval-tasks", "1", "--eval-every", "100", "--reviewer", "rules"]
    out = run_script("pats.py", "--model", tiny_model, *flags, "--total-iterations", "1", "--output-dir", str(out_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    return only_run(out_dir)


# ---- the method's flags, through the main loop (the scaffold is built there, per group, from args) (issue 42) -----
def planted_bank(run):
    """Iteration 2 (--seed 1) draws train-open-69 (X) and train-open-1900 (Y), both of type open. Their type's bank,
    competence 0.5 (k = ceil(K / 2) items) and exemplars are set in the checkpoint, by hand: three short plans citing
    another task (ids 0-2, 4 estimated tokens each) and a long one citing X (id 3, over 300 tokens): X's context
    ranks [3, 0, 1, 2], Y's [0, 1, 2, 3]; Y alone has an exemplar, over 1024 tokens; X none."""
    import numpy as np

    import envs

    spec = envs.load("cooking")
    train, rng = spec.task_ids(spec.preset.train_split), np.random.default_rng(1)  # the main loop's task_rng
    draws = [[train[k] for k in rng.choice(len(train), 2, replace=False)] for _ in range(2)]
    assert draws[1] == ["train-open-69", "train-open-1900"]
    short = [entry(i, plan=f"step {i}", sources=["train-open-5"], created=1) for i in range(3)]
    long = entry(3, plan="open the fridge, then look at every shelf before taking anything. " * 20,
                 sources=["train-open-69"], created=1)
    exemplar = "- Exemplar (a successful attempt at this task): " + " -> ".join(["open fridge", "take carrot"] * 200)
    assert [pats.est_tokens(pats.render_entry(e)) for e in short] == [4, 4, 4]
    assert 300 < pats.est_tokens(pats.render_entry(long)) <= 1024 - 8 and pats.est_tokens(exemplar) > 1024
    path = run / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    state["method"]["pats"]["bank"]["open"] = short + [long]
    state["method"]["pats"]["ema"]["open"] = 0.5
    state["method"]["pats"]["exemplars"] = {"train-open-1900": exemplar}
    torch.save(state, path)


@pytest.mark.parametrize("flags, items", [
    # K = 2 -> k = ceil(2 x 0.5) = 1: X [3] is over 300 tokens -> 0 items; Y (no exemplar: --no-cards) [0] -> 1.
    # (K = 6: Y 3 items; 1024 tokens: X 1; cards: Y's exemplar is over 300 tokens -> 0)
    (["--no-cards", "--scaffold-max-items", "2", "--scaffold-max-tokens", "300"], (0 + 1) / 2),
    # the exemplar and the whole bank, whatever k and the token budget: X 4, Y 5 (adapting: X [3, 0, 1] fits
    # 1024 tokens -> 3; Y's exemplar alone does not -> 0)
    (["--no-adapt"], (4 + 5) / 2),
])
def test_cli_scaffold_flags_size_each_groups_context(first_iteration, tmp_path, flags, items):
    """--no-cards, --scaffold-max-items, --scaffold-max-tokens, --no-adapt: iteration 2 of the main loop, resumed
    from a checkpoint whose bank is set by hand; pats/scaffold_items is the mean number of items shown to an episode
    (2 episodes per group)."""
    import shutil

    from test_grpo_e2e import read_metrics, run_script

    run = shutil.copytree(first_iteration, tmp_path / first_iteration.name)
    planted_bank(run)
    out = run_script("pats.py", "--resume", str(run), "--total-iterations", "2", "--max-steps", "1",
                     "--no-gradient-checkpointing", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    assert read_metrics(run)[2]["pats/scaffold_items"] == items


def test_cli_two_iterations_on_cooking_across_a_resume_keep_the_bank(first_iteration, tmp_path):
    """Iteration 1 in one process, iteration 2 in a resumed one (one CLI run of each kind, to fit CI)."""
    import shutil

    from test_grpo_e2e import TINY_FLAGS, read_metrics, run_script

    run = shutil.copytree(first_iteration, tmp_path / first_iteration.name)
    metrics = read_metrics(run)
    # iteration 1 starts from an empty bank: no scaffold; the tiny model writes malformed steps only, so
    # the rules reviewer (EXPAND at competence 0) adds the format constraint and the format pitfall
    assert metrics[1]["pats/scaffold_tokens"] == 0 and metrics[1]["pats/mode_EXPAND"] >= 1
    assert metrics[1]["pats/edits_accepted"] >= 2
    assert any(k.startswith("pats/bank_entries_") and v > 0 for k, v in metrics[1].items())
    state = torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)["method"]["pats"]
    assert state["bank"] and all(e["sources"] for entries in state["bank"].values() for e in entries)

    resumed = run_script("pats.py", "--resume", str(run), "--total-iterations", "2", *TINY_FLAGS[-1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at iteration 1" in resumed.stdout
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1, 2] and "eval/success_rate" in metrics[2]
    for key in ["pats/scaffold_tokens", "pats/scaffold_items", "tokens/prompt", "pats/edits_accepted", "pats/edits_rejected",
                "pats/entries_redundant", "pats/exemplars", "losses/policy_loss", "charts/success_rate"]:
        assert key in metrics[2], key
    # iteration 2's task is of a type seen in iteration 1: its prompts carry the restored bank's entries
    assert metrics[2]["pats/scaffold_tokens"] > 0 and metrics[2]["pats/scaffold_items"] > 0


def test_cli_policy_reviewer_tokens_count_in_the_iterations_tokens(tiny_model, tmp_path):
    """The policy reviewer's generation is part of the iteration's cost: one-token training responses
    make tokens/response exactly the samples plus the reviewer's answer."""
    from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics, run_script

    flags = [*TINY_FLAGS, "--num-tasks", "1", "--max-steps", "1", "--max-new-tokens", "1", "--num-eval-tasks", "1",
             "--eval-every", "100", "--reviewer", "policy", "--reviewer-max-new-tokens", "16", "--total-iterations", "1",
             "--max-prompt-tokens", "600"]
    out = run_script("pats.py", "--model", tiny_model, *flags, "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    row = read_metrics(only_run(tmp_path))[1]
    assert row["tokens/samples"] == 2 and 1 <= row["pats/reviewer_response_tokens"] <= 16
    assert row["tokens/response"] == row["tokens/samples"] + row["pats/reviewer_response_tokens"]
    assert row["tokens/prompt"] > row["pats/reviewer_prompt_tokens"] > 0 and row["pats/review_s"] > 0
    # the reviewer's prompt leaves its answer room: at most 600 + 1 - 16 = 585 tokens (of its tail); with
    # --reviewer-max-new-tokens 512 that room would be 89 tokens, less than this prompt
    assert 89 < row["pats/reviewer_prompt_tokens"] <= 585
