"""grpo.py's formulas against numbers computed by hand; the iteration's algorithm (training_batch) and
the update (update_policy) through the code the script runs, against independent computations."""

import copy
import importlib
import itertools
import math
import statistics

import numpy as np
import pytest
import torch

import grpo


def test_invalid_penalty_lands_on_its_own_step_only():
    # episode A won (3 steps, the 2nd malformed); episode B lost (2 steps, the 2nd malformed)
    rewards = np.array([10.0, 10.0, 10.0, 0.0, 0.0])
    invalid = np.array([False, True, False, False, True])
    assert grpo.step_scores(rewards, invalid, 0.1).tolist() == pytest.approx([10.0, 9.9, 10.0, 0.0, -0.1])


def test_grpo_advantage_normalises_over_all_step_samples_of_the_group():
    scores = np.array([10.0, 9.9, 10.0, 0.0, -0.1])
    groups = np.array([0, 0, 0, 0, 0])
    # mean = 29.8 / 5 = 5.96; squared deviations 16.3216 + 15.5236 + 16.3216 + 35.5216 + 36.7236
    # = 120.412; unbiased variance 120.412 / 4 = 30.103; std = 5.486620...
    std = math.sqrt(30.103)
    expected = [(s - 5.96) / (std + 1e-6) for s in scores]
    assert grpo.grpo_advantages(scores, groups).tolist() == pytest.approx(expected, rel=1e-9)
    assert expected[0] == pytest.approx(0.736337, abs=1e-6)


def test_grpo_advantage_groups_are_independent_and_degenerate_groups_are_safe():
    scores = np.array([1.0, 3.0, 7.0, 7.0, 4.0])
    groups = np.array([0, 0, 1, 1, 2])
    adv = grpo.grpo_advantages(scores, groups)
    # group 0: mean 2, unbiased std sqrt(2) -> -+0.7071; group 1: all equal -> 0;
    # group 2 has one sample: mean 0, std 1 (verl-agent) -> 4 / (1 + 1e-6)
    assert adv[:2] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-5)
    assert adv[2:4].tolist() == [0.0, 0.0]
    assert adv[4] == pytest.approx(4.0 / (1 + 1e-6))


def test_ppo_clip_and_dual_clip_by_hand():
    old = torch.zeros(5)
    ratio = torch.tensor([1.5, 0.5, 1.5, 5.0, 1.1])
    logp = torch.log(ratio)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    loss, clipped = grpo.ppo_clip_loss(logp, old, adv, clip_eps=0.2, dual_clip=3.0)
    # A>0, r=1.5: max(-1.5, -1.2) = -1.2 (clipped)   A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=1.5: max(1.5, 1.2) = 1.5                A<0, r=5: max(5, 1.2) = 5 -> dual clip 3
    # A=2, r=1.1 inside the trust region: -2.2
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 1.5, 3.0, -2.2], rel=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_clip_higher_lets_a_positive_ratio_grow_to_one_plus_eps_high_only():
    old = torch.zeros(4)
    ratio = torch.tensor([1.25, 1.4, 0.7, 0.7])
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    loss, clipped = grpo.ppo_clip_loss(torch.log(ratio), old, adv, clip_eps=0.2, dual_clip=3.0, clip_eps_high=0.28)
    # A>0, r=1.25 < 1.28: max(-1.25, -1.25) = -1.25, not clipped (the symmetric clip would give -1.2)
    # A>0, r=1.4: max(-1.4, -1.28) = -1.28 (clipped at 1 + 0.28)
    # A<0, r=0.7: the lower bound stays 1 - 0.2: max(0.7, 0.8) = 0.8 (clipped); A>0, r=0.7: max(-0.7, -0.8) = -0.7
    assert loss.tolist() == pytest.approx([-1.25, -1.28, 0.8, -0.7], rel=1e-6)
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]
    symmetric, _ = grpo.ppo_clip_loss(torch.log(ratio), old, adv, clip_eps=0.2, dual_clip=3.0)
    assert symmetric.tolist() == pytest.approx([-1.2, -1.2, 0.8, -0.7], rel=1e-6)


def test_k3_kl_by_hand():
    logp = torch.tensor([0.0, math.log(0.5), -1.0])
    ref = torch.tensor([math.log(0.5), 0.0, -1.0])
    # delta = ref - logp: -ln2 -> 0.5 + ln2 - 1 = 0.193147;  +ln2 -> 2 - ln2 - 1 = 0.306853;  0 -> 0
    assert grpo.kl_k3(logp, ref).tolist() == pytest.approx([0.1931472, 0.3068528, 0.0], abs=1e-6)


def test_pack_micro_batches_longest_first_within_budget():
    lengths = [10, 50, 30, 20]
    batches = grpo.pack_micro_batches(lengths, token_budget=100)
    # 50 and 30 fit 2 x 50 = 100; adding 20 would need 3 x 50 = 150 -> new batch [20, 10]
    assert batches == [[1, 2], [3, 0]]
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert sum(lengths) / padded == pytest.approx(110 / 140)
    # a sample longer than the budget still gets its own micro-batch
    assert grpo.pack_micro_batches([500, 5], token_budget=100) == [[0], [1]]


def test_response_logprobs_are_the_response_tokens_only_and_ignore_padding(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts, responses = [[5, 6, 7, 8], [9, 10]], [[11, 12], [13, 14, 15]]
    ids, attn, resp = grpo.collate(prompts, responses, pad_id=0)
    assert resp.tolist() == [[False] * 4 + [True] * 2, [False] * 2 + [True] * 3 + [False]]
    with torch.no_grad():
        logp, entropy = grpo.response_logprobs(model, ids, attn, resp, chunk_tokens=2)
        # the naive way: full logits of each sample alone, log-softmax, pick the next token
        expected = []
        for p, r in zip(prompts, responses):
            full = torch.tensor([p + r])
            logits = model(full).logits[0].float().log_softmax(-1)
            expected += [logits[len(p) - 1 + k, tok].item() for k, tok in enumerate(r)]
    assert logp.tolist() == pytest.approx(expected, abs=1e-5)
    assert entropy.shape == (5,) and bool((entropy > 0).all())


def test_token_mean_weights_every_response_token_equally(tiny_model):
    """Gradient of the minibatch loss = gradient of the mean over all its response tokens,
    whatever the micro-batch split (a short response does not count more than a long one)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21, 22, 23], [24], [25, 26]]
    advantages = np.array([1.0, -0.5, 2.0])

    def grads(micro_batch_tokens):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        args = grpo.Args(minibatch_size=3, micro_batch_tokens=micro_batch_tokens, kl_coef=0.0, entropy_coef=0.0, max_grad_norm=1e9)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        grpo.update_policy(model, None, opt, prompts, responses, advantages, args, 0, lambda: torch.autocast("cpu", enabled=False), torch.Generator().manual_seed(0))
        return model.model.embed_tokens.weight.grad.clone()

    one_batch, per_sample = grads(10_000), grads(1)
    assert torch.allclose(one_batch, per_sample, atol=1e-7)
    # with old == new (ratio 1, nothing clipped) the loss gradient is -(1/7) sum_t A_t grad logp_t
    # over the 7 response tokens, each token carrying its sample's advantage
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids, attn, resp = grpo.collate(prompts, responses, pad_id=0)
    logp, _ = grpo.response_logprobs(model, ids, attn, resp, chunk_tokens=1024)
    token_adv = torch.tensor([1.0] * 4 + [-0.5] * 1 + [2.0] * 2)
    (-(token_adv * logp).sum() / 7).backward()
    assert torch.allclose(one_batch, model.model.embed_tokens.weight.grad, atol=1e-7)
    assert one_batch.abs().sum() > 0


def test_old_logprobs_are_the_weights_before_the_first_step_for_every_minibatch(tiny_model):
    """Two SGD steps of update_policy equal two steps computed by hand, where every minibatch's
    ratio is taken against the log-probs before any step (the first minibatch's come from its own
    forward, the second's from the no-grad pass: both are pi_old)."""
    from transformers import AutoModelForCausalLM

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    responses = [[20, 21, 22, 23], [24], [25, 26], [27, 28, 29]]
    advantages = np.array([1.0, -0.5, 2.0, -1.0])
    no_autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    lr = 0.5
    args = grpo.Args(minibatch_size=2, kl_coef=0.0, entropy_coef=0.0, max_grad_norm=1e9, clip_eps=10.0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    grpo.update_policy(model, None, torch.optim.SGD(model.parameters(), lr=lr), prompts, responses, advantages, args, 0,
                       no_autocast, torch.Generator().manual_seed(0))

    by_hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    minibatches = np.array_split(torch.randperm(4, generator=torch.Generator().manual_seed(0)).numpy(), 2)
    with torch.no_grad():
        old = {}
        for i in range(4):
            ids, attn, resp = grpo.collate([prompts[i]], [responses[i]], 0)
            old[i] = grpo.response_logprobs(by_hand, ids, attn, resp, 1024)[0]
    for minibatch in minibatches:
        by_hand.zero_grad()
        tokens = sum(len(responses[i]) for i in minibatch)
        for i in minibatch:  # clip_eps 10: no ratio is clipped, so the loss is -A * ratio per token
            ids, attn, resp = grpo.collate([prompts[i]], [responses[i]], 0)
            logp = grpo.response_logprobs(by_hand, ids, attn, resp, 1024)[0]
            (-(advantages[i] * torch.exp(logp - old[i])).sum() / tokens).backward()
        with torch.no_grad():
            for p in by_hand.parameters():
                p -= lr * p.grad
    moved = (by_hand.model.embed_tokens.weight - AutoModelForCausalLM.from_pretrained(tiny_model).model.embed_tokens.weight).abs().max()
    assert moved > 1e-3  # the steps are large enough that a ratio of 1 in the second minibatch would show
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


# ---- the iteration's algorithm: training_batch, as the main loop calls it ------------------------------
_ids = itertools.count(100)


def hand_episode(task_id: str, group: int, won: bool, valid: list[bool]) -> grpo.Episode:
    """An episode as rollout leaves it; every turn gets its own prompt and response ids."""
    episode = grpo.Episode(task_id, group, won=won)
    for ok in valid:
        k = next(_ids)
        episode.turns.append(grpo.Turn([k, k], [k], "look" if ok else "lo", ok, f"obs {k}", None))
    return episode


def by_hand_grpo(scores_per_group: list[list[float]]) -> list[float]:
    """(s - mean) / (unbiased std + 1e-6) within each group, with the statistics module."""
    return [(s - statistics.mean(g)) / (statistics.stdev(g) + 1e-6) for g in scores_per_group for s in g]


def test_training_batch_gives_every_step_sample_its_group_normalised_score():
    episodes = [
        hand_episode("task-a", 0, True, [True, False, True]),  # s = 10, 9.9, 10
        hand_episode("task-a", 0, False, [True, False]),  # 0, -0.1
        hand_episode("task-a", 0, False, [True]),  # 0
        hand_episode("task-b", 1, True, [True, True]),  # 10, 10
        hand_episode("task-b", 1, True, [False]),  # 9.9
        hand_episode("task-b", 1, False, [False, False]),  # -0.1, -0.1
    ]
    args = grpo.Args(success_reward=10.0, invalid_penalty=0.1)
    prompts, responses, advantages, metrics = grpo.training_batch(episodes, args)
    expected = by_hand_grpo([[10, 9.9, 10, 0, -0.1, 0], [10, 10, 9.9, -0.1, -0.1]])
    assert advantages.tolist() == pytest.approx(expected, rel=1e-9)
    assert expected[1] < expected[0] and expected[7] > 0  # the penalty hits its own step; a malformed win is good
    turns = [t for e in episodes for t in e.turns]
    assert prompts == [t.prompt_ids for t in turns] and responses == [t.response_ids for t in turns]
    assert metrics == {}


def test_filter_groups_keeps_the_first_groups_whose_rewards_differ():
    episodes = [
        hand_episode("task-a", 0, True, [True]), hand_episode("task-a", 0, True, [True, True]),  # all won: dropped
        hand_episode("task-b", 1, False, [True]), hand_episode("task-b", 1, True, [False]),  # mixed: kept
        hand_episode("task-c", 2, False, [True]), hand_episode("task-c", 2, False, [False]),  # all lost: dropped
        hand_episode("task-d", 3, True, [True]), hand_episode("task-d", 3, False, [True]),  # mixed: kept
        hand_episode("task-e", 4, False, [True]), hand_episode("task-e", 4, True, [True]),  # mixed, over the share
    ]
    assert grpo.informative_groups(episodes) == [1, 3, 4]
    assert grpo.informative_groups(episodes[:2] + episodes[4:6]) == []  # nothing informative
    # one process: the groups kept so far, then this round's informative ones in play order, cut at num_tasks
    assert grpo.keep_informative([], episodes, num_tasks=2) == [1, 3]
    assert grpo.keep_informative([7], episodes, num_tasks=3) == [7, 1, 3]
    assert grpo.keep_informative([7], episodes, num_tasks=9) == [7, 1, 3, 4]
    assert grpo.keep_informative([], episodes[:2], num_tasks=2) == []
    # at the cap, short of num_tasks: + the whole last round (verl-agent), the kept ones alone, or an error
    assert grpo.groups_at_filter_cap([1], range(4, 8), "last-round") == [1, 4, 5, 6, 7]
    assert grpo.groups_at_filter_cap([1, 5], range(4, 8), "last-round") == [1, 5, 4, 6, 7]
    assert grpo.groups_at_filter_cap([1], range(4, 8), "kept") == [1]
    with pytest.raises(SystemExit):
        grpo.groups_at_filter_cap([1], range(4, 8), "raise")
    # what main then trains on: grpo.py's batch of the kept groups, and no sample at all when none is kept
    assert len(grpo.training_batch(episodes[2:4], grpo.Args(success_reward=10.0, invalid_penalty=0.1))[0]) == 2
    assert grpo.training_batch([], grpo.Args(success_reward=10.0, invalid_penalty=0.1))[0] == []


# ---- the update: one update_policy call against the same steps written with plain torch ---------------
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
RESPONSES = [[20, 21, 22, 23], [24], [25, 26], [27, 28, 29]]
ADVANTAGES = np.array([1.0, -0.5, 2.0, -1.0])
NO_AUTOCAST = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731


def plain_logprobs(model, prompt, response, temperature):
    """log pi(y_k | x, y_<k) and the entropy at each response token, from the model's full logits / T."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    return logp_all[torch.arange(len(response)), torch.tensor(response)], -(logp_all.exp() * logp_all).sum(-1)


def sgd_by_hand(model, ref, minibatches: list, lr, clip_eps, kl_coef, entropy_coef, temperature, clip_eps_high=None):
    """SGD steps on the token-mean of the PPO-clip (dual clip 3) loss + kl_coef * k3(ref) - entropy_coef * H,
    every ratio against the log-probs before the first step. Returns the token-means of k3 and H."""
    with torch.no_grad():
        old = [plain_logprobs(model, p, r, temperature)[0] for p, r in zip(PROMPTS, RESPONSES)]
        ref_logp = [plain_logprobs(ref, p, r, temperature)[0] for p, r in zip(PROMPTS, RESPONSES)]
    kl_sum = entropy_sum = tokens = 0.0
    for minibatch in minibatches:
        model.zero_grad()
        n = sum(len(RESPONSES[i]) for i in minibatch)
        for i in minibatch:
            a = float(ADVANTAGES[i])
            logp, entropy = plain_logprobs(model, PROMPTS[i], RESPONSES[i], temperature)
            ratio = torch.exp(logp - old[i])
            high = clip_eps if clip_eps_high is None else clip_eps_high
            surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_eps, 1 + high))
            if a < 0:
                surrogate = surrogate.clamp(max=-a * 3.0)
            kl = torch.exp(ref_logp[i] - logp) - (ref_logp[i] - logp) - 1
            ((surrogate + kl_coef * kl - entropy_coef * entropy).sum() / n).backward()
            kl_sum, entropy_sum = kl_sum + kl.sum().item(), entropy_sum + entropy.sum().item()
            tokens += len(logp)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:  # a LoRA model's frozen base has none
                    p -= lr * p.grad
    return kl_sum / tokens, entropy_sum / tokens


def update(module_name: str, model, ref, optimizer, advantages, args, generator):
    """update_policy of grpo.py (gigpo, proas and pats hold the same text) or of a method's own copy,
    called as grpo.py would be: StraTA with no strategy samples, ActGuide with no guided ones."""
    module = importlib.import_module(module_name)
    extra = {"strata": ([False] * len(PROMPTS),), "actguide": (PROMPTS,)}.get(module_name, ())
    return module.update_policy(model, ref, optimizer, PROMPTS, RESPONSES, advantages, module.Args(**args), 0,
                                NO_AUTOCAST, generator, *extra)


@pytest.mark.parametrize("module_name", ["grpo", "strata", "actguide"])
@pytest.mark.parametrize("case", [
    dict(kl_coef=0.5, entropy_coef=0.1, temperature=1.0, update_epochs=1),  # both regularisers, pinned
    dict(kl_coef=0.5, entropy_coef=0.1, temperature=0.7, update_epochs=1),  # old, reference and new passes at T
    dict(kl_coef=0.0, entropy_coef=0.0, temperature=1.0, update_epochs=2),  # a 2nd epoch still trains against pi_old
    dict(kl_coef=0.0, entropy_coef=0.0, temperature=1.0, update_epochs=2, clip_eps=0.05, clip_eps_high=0.5),  # DAPO
], ids=["kl-entropy", "temperature", "two-epochs", "clip-higher"])
def test_update_equals_the_same_sgd_steps_written_in_plain_torch(tiny_model, case, module_name):
    from transformers import AutoModelForCausalLM

    lr = 0.2  # big enough steps that some ratios of the 2nd minibatch clip; small enough that k3 stays below its clamp
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ref = copy.deepcopy(model)
    with torch.no_grad():  # a reference that is not the policy, so k3 against it differs from k3 against pi_old
        for k, p in enumerate(ref.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
    settings = dict(minibatch_size=2, max_grad_norm=1e9, eval_temperature=0.4, **case)
    args = grpo.Args(**settings)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    metrics = update(module_name, model, ref if args.kl_coef > 0 else None, optimizer, ADVANTAGES, settings,
                     torch.Generator().manual_seed(0))

    generator = torch.Generator().manual_seed(0)  # update_policy's minibatches: 2 per epoch from one generator
    minibatches = [mb for _ in range(args.update_epochs)
                   for mb in np.array_split(torch.randperm(4, generator=generator).numpy(), 2)]
    by_hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    kl, entropy = sgd_by_hand(by_hand, ref, minibatches, lr, args.clip_eps, args.kl_coef, args.entropy_coef,
                              args.temperature, args.clip_eps_high)
    if args.clip_eps_high is not None:  # the upper bound decides some ratio: a symmetric clip would step elsewhere
        symmetric = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        sgd_by_hand(symmetric, ref, minibatches, lr, args.clip_eps, 0.0, 0.0, args.temperature)
        assert max((p - q).abs().max() for p, q in zip(by_hand.parameters(), symmetric.parameters())) > 1e-3
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert max((p - q).abs().max() for p, q in zip(by_hand.parameters(), base.parameters())) > 1e-2  # big steps
    assert metrics["losses/clipfrac"] > 0 or args.kl_coef == 0  # the clip is exercised too
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert metrics["losses/entropy"] == pytest.approx(entropy, rel=1e-5)
    if args.kl_coef > 0:
        assert kl > 1e-3 and metrics["losses/kl"] == pytest.approx(kl, rel=1e-5)
    assert metrics["perf/optimizer_steps"] == 2 * args.update_epochs and metrics["losses/skipped_steps"] == 0


@pytest.mark.parametrize("module_name", ["grpo", "strata", "actguide"])
def test_a_non_finite_gradient_skips_the_optimizer_step_and_is_counted(tiny_model, module_name):
    from transformers import AutoModelForCausalLM

    args = dict(minibatch_size=2, kl_coef=0.0, entropy_coef=0.0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # nan advantages everywhere: no step at all, not even AdamW's weight decay
    metrics = update(module_name, model, None, optimizer, np.full(4, np.nan), args, torch.Generator().manual_seed(3))
    assert metrics["losses/skipped_steps"] == 2 and metrics["perf/optimizer_steps"] == 0
    assert math.isnan(metrics["losses/grad_norm"])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and not optimizer.state
    # one minibatch of the two is finite: that one steps, with finite weights and moments
    adv = np.array([np.inf, 1.0, -1.0, 0.5])
    minibatches = np.array_split(torch.randperm(4, generator=torch.Generator().manual_seed(0)).numpy(), 2)
    assert sum(0 in mb for mb in minibatches) == 1
    metrics = update(module_name, model, None, optimizer, adv, args, torch.Generator().manual_seed(0))
    assert metrics["losses/skipped_steps"] == 1 and metrics["perf/optimizer_steps"] == 1
    assert math.isfinite(metrics["losses/grad_norm"])
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(v).all() for state in optimizer.state.values() for v in state.values())


def test_generated_responses_end_at_their_first_eos_and_keep_it(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(0)
    prompts = [grpo.encode_prompt(tokenizer, f"task {k}: cook") for k in range(32)]
    responses = grpo.generate_hf(model, tokenizer, prompts, 64, 1.0, 1.0, lambda: torch.autocast("cpu", enabled=False))
    eos = set(grpo.eos_token_ids(tokenizer, model))
    cut = [r for r in responses if r[-1] in eos]
    # a random model over ~400 tokens says EOS now and then: some responses stop early, with the EOS kept
    assert cut and all(len(r) < 64 for r in cut)
    for r in responses:
        assert not eos & set(r[:-1])  # nothing after the first EOS, and no padding
        assert r[-1] in eos or len(r) == 64


def test_response_prefix_ends_every_action_prompt(tiny_model, cooking_spec):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from envs import Step

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    args = SimpleNamespace(history_length=2, max_prompt_tokens=4096, response_prefix="<think>")
    episode = grpo.Episode(task_id="train-easy-0", group=0, task="cook")
    obs = Step(observation="a kitchen", reward=0.0, done=False, won=False, admissible=["look"], task="cook", task_type="easy", state=frozenset())
    with_prefix = grpo.build_prompt(cooking_spec, tokenizer, args, episode, obs, [])
    args.response_prefix = ""
    plain = grpo.build_prompt(cooking_spec, tokenizer, args, episode, obs, [])
    assert tokenizer.decode(with_prefix).endswith("<|im_start|>assistant\n<think>")
    assert with_prefix[: len(plain)] == plain and len(with_prefix) > len(plain)


def test_rollout_puts_the_prefix_back_before_parsing(tiny_model, cooking_spec):
    """A real cooking game, played by a fixed policy that always answers the rest of a
    `<think>`-prefilled answer: valid with the prefix, invalid (no `<think>`) without it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    import envs

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    answer = tokenizer("ok</think><action>look</action>", add_special_tokens=False)["input_ids"]
    runner = envs.EnvRunner(cooking_spec, 1)
    try:
        for prefix, valid in (("<think>", True), ("", False)):
            args = SimpleNamespace(max_steps=2, history_length=2, max_prompt_tokens=4096, response_prefix=prefix)
            episodes = [grpo.Episode("train-easy-0", 0)]
            grpo.rollout(cooking_spec, runner, tokenizer, lambda prompts, temperature: [answer for _ in prompts], args, episodes, 1.0, "test")
            turns = episodes[0].turns
            assert len(turns) == 2 and all(t.response_ids == answer for t in turns)
            assert [t.valid for t in turns] == [valid, valid]
            if valid:
                assert [t.action for t in turns] == ["look", "look"]
    finally:
        runner.close()


@pytest.mark.parametrize("module_name", ["grpo", "gigpo", "proas", "strata", "actguide", "pats", "sft"])
def test_batch_sizes_default_to_the_device_and_a_typed_size_is_kept(module_name):
    # on CPU the update's activations set the run's peak memory: 2048-token micro-batches, 512-token logit chunks
    module = importlib.import_module(module_name)
    cpu = module.Args(cuda=False)
    assert (cpu.micro_batch_tokens, cpu.logprob_chunk_tokens) == (2048, 512)
    typed = module.Args(cuda=False, micro_batch_tokens=16384, logprob_chunk_tokens=2048)
    assert (typed.micro_batch_tokens, typed.logprob_chunk_tokens) == (16384, 2048)
    if torch.cuda.is_available():
        gpu = module.Args()
        assert (gpu.micro_batch_tokens, gpu.logprob_chunk_tokens) == (16384, 2048)


@pytest.mark.parametrize("module_name", ["grpo", "gigpo", "proas", "strata", "actguide", "pats", "sft"])
def test_bf16_counts_as_fast_on_cuda_and_on_a_cpu_with_bf16_matrix_instructions_only(module_name, cpu_has_bf16):
    # without AVX512-BF16 or AMX, bf16 autocast on CPU is emulated: 0.3 against 120 GFLOP/s in fp32 on an AVX2 EPYC
    module = importlib.import_module(module_name)
    assert module.bf16_is_fast(torch.device("cpu")) == cpu_has_bf16
    assert module.bf16_is_fast(torch.device("cuda"))


@pytest.mark.parametrize("module_name", ["grpo", "gigpo", "proas", "strata", "actguide", "pats"])
def test_generation_keeps_the_log_probs_the_update_scores_and_draws_the_same_samples(tiny_model, module_name):
    # at T = 0.7 with top-p 0.9: the kept log-prob is log softmax(logits / T) over the whole vocabulary, the
    # distribution every update pass scores, though top-p truncated the one sampled from
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = importlib.import_module(module_name)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompts = [module.encode_prompt(tokenizer, f"task {k}: cook" + " the apple" * k) for k in range(6)]
    torch.manual_seed(0)
    plain = module.generate_hf(model, tokenizer, prompts, 24, 0.7, 0.9, NO_AUTOCAST)
    kept = {}
    torch.manual_seed(0)
    responses = module.generate_hf(model, tokenizer, prompts, 24, 0.7, 0.9, NO_AUTOCAST, kept)
    assert responses == plain and len(set(map(len, responses))) > 1  # same samples; some stop early at EOS
    args = module.Args(temperature=0.7, micro_batch_tokens=4096, logprob_chunk_tokens=512)
    scored = module.recompute_logprobs(model, prompts, responses, args, tokenizer.pad_token_id, NO_AUTOCAST)
    assert len(kept) == len(set(map(tuple, prompts)))
    for p, r, logp in zip(prompts, responses, scored):
        assert torch.allclose(kept[(0.7, tuple(p), tuple(r))], logp, atol=1e-5)
    at_one = module.recompute_logprobs(model, prompts, responses, module.Args(temperature=1.0), tokenizer.pad_token_id, NO_AUTOCAST)
    assert max((a - b).abs().max() for a, b in zip(at_one, scored)) > 1e-2  # the temperature matters here
    module.generate_hf(model, tokenizer, prompts, 24, 0.0, 1.0, NO_AUTOCAST, kept)  # greedy: no distribution to keep
    assert all(t == 0.7 for t, _, _ in kept)


@pytest.mark.parametrize("module_name", ["grpo", "strata", "actguide"])
def test_the_update_takes_pi_old_of_a_sample_trained_as_sampled_from_its_sampling_pass(tiny_model, module_name):
    from transformers import AutoModelForCausalLM

    settings = dict(minibatch_size=2, kl_coef=0.0, entropy_coef=0.0, temperature=0.7)
    # minibatches of update_policy's generator(0): the 2nd one's samples are the stale ones
    first, second = np.array_split(torch.randperm(4, generator=torch.Generator().manual_seed(0)).numpy(), 2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    module = importlib.import_module(module_name)
    args = module.Args(**settings, micro_batch_tokens=4096)
    true_old = module.recompute_logprobs(model, PROMPTS, RESPONSES, args, 0, NO_AUTOCAST)
    extra = {"strata": ([False] * len(PROMPTS),), "actguide": (PROMPTS,)}.get(module_name, ())

    def run(kept, exact=True):  # the Sampler as the script builds it: HF on the trained module (exact), or not (vLLM)
        m = copy.deepcopy(model)
        sampler = None if kept is None else module.Sampler(None, m, None, args, NO_AUTOCAST, exact=exact)
        if sampler is not None:
            sampler.logprobs.update(kept)
        return module.update_policy(m, None, torch.optim.SGD(m.parameters(), lr=0.2), PROMPTS, RESPONSES, ADVANTAGES, args, 0,
                                    NO_AUTOCAST, torch.Generator().manual_seed(0), *extra, sampler=sampler)

    recomputed = run(None)
    assert (recomputed["perf/old_logprobs_sampled"], recomputed["perf/old_logprobs_recomputed"]) == (0, 2)
    # every sample kept from sampling (at the update's temperature): no second pass, the same update
    kept = {(0.7, tuple(p), tuple(r)): logp for p, r, logp in zip(PROMPTS, RESPONSES, true_old)}
    reused = run(kept)
    assert (reused["perf/old_logprobs_sampled"], reused["perf/old_logprobs_recomputed"]) == (2, 0)
    for key in ["losses/policy_loss", "losses/approx_kl_old", "losses/clipfrac", "losses/grad_norm"]:
        assert reused[key] == pytest.approx(recomputed[key], rel=1e-6, abs=1e-9), key
    # the kept values are what pi_old is: shift them by 0.25 and the mean of (old - new) over all tokens
    # moves by 0.25 x (2nd minibatch's tokens) / (all tokens); the 1st minibatch's own forward is unaffected
    shifted = run({k: v + 0.25 for k, v in kept.items()})
    tokens = sum(len(RESPONSES[i]) for i in second) / sum(map(len, RESPONSES))
    assert shifted["losses/approx_kl_old"] - recomputed["losses/approx_kl_old"] == pytest.approx(0.25 * tokens, rel=1e-4)
    # the sampler's gap to the trained model is measured where the trained model computed pi_old: the 1st minibatch
    assert shifted["rollout/logprob_abs_diff_mean"] == pytest.approx(0.25, abs=1e-5)
    assert shifted["rollout/logprob_abs_diff_max"] == pytest.approx(0.25, abs=1e-5)
    assert "rollout/logprob_abs_diff_mean" not in recomputed  # no sampler, nothing to compare
    # a sampler that is not the trained module (vLLM, torchrun's copy): its log-probs are never pi_old, only compared
    apart = run({k: v + 0.25 for k, v in kept.items()}, exact=False)
    assert (apart["perf/old_logprobs_sampled"], apart["perf/old_logprobs_recomputed"]) == (0, 2)
    assert apart["losses/approx_kl_old"] == pytest.approx(recomputed["losses/approx_kl_old"], rel=1e-6, abs=1e-9)
    assert apart["rollout/logprob_abs_diff_mean"] == pytest.approx(0.25, abs=1e-5)  # over every token now
    # log-probs kept at another temperature, or of another prompt, are not pi_old at this one: recomputed
    elsewhere = {(1.0, p, r): v for (_, p, r), v in kept.items()} | {(0.7, p + (1,), r): v for (_, p, r), v in kept.items()}
    assert run(elsewhere)["perf/old_logprobs_recomputed"] == 2
