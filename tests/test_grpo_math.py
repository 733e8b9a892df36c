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


def logprobs_alone(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log pi(response token | all before it) from one plain forward of the sample alone."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_k3_kl_by_hand():
    logp = torch.tensor([0.0, math.log(0.5), -1.0])
    ref = torch.tensor([math.log(0.5), 0.0, -1.0])
    # delta = ref - logp: -ln2 -> 0.5 + ln2 - 1 = 0.193147;  +ln2 -> 2 - ln2 - 1 = 0.306853;  0 -> 0
    assert grpo.kl_k3(logp, ref).tolist() == pytest.approx([0.1931472, 0.3068528, 0.0], abs=1e-6)


def test_micro_batches_go_in_token_order_and_count_a_shared_prefix_once():
    seqs = {0: [1, 2, 3, 4], 1: [9, 9], 2: [1, 2, 3, 7, 7], 3: [1, 2, 5]}
    # token order 0, 2, 3, 1; shared with the one before: 0, 3 ([1 2 3]), 2 ([1 2]), 0 -> new tokens 4, 2, 1, 2
    order = grpo.token_order(seqs, share=True)
    assert order == {0: 0, 2: 3, 3: 2, 1: 0} and list(order) == [0, 2, 3, 1]
    assert grpo.micro_batches(seqs, order, budget=7, share=True) == [[0, 2, 3], [1]]
    # without sharing: longest first (5, 4, 3, 2 tokens), rows x the first row's width: 2 x 5, 2 x 4 > 7; 2 x 3 fits
    order = grpo.token_order(seqs, share=False)
    assert list(order) == [2, 0, 3, 1]
    assert grpo.micro_batches(seqs, order, budget=7, share=False) == [[2], [0], [3, 1]]
    long = {0: [1] * 9, 1: [2]}
    assert grpo.micro_batches(long, grpo.token_order(long, True), budget=4, share=True) == [[0], [1]]  # too long: alone


def test_a_packed_row_holds_each_shared_prefix_once_and_every_token_keeps_its_position():
    a, b, c = [1, 2, 3, 4], [1, 2, 3, 7, 7], [9, 1]
    ids, positions, (paths, lengths), where = grpo.pack_samples([a, b, c], [0, 3, 0])
    assert ids.tolist() == [[1, 2, 3, 4, 7, 7, 9, 1]] and positions.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1]]
    assert where == [[0, 1, 2, 3], [0, 1, 2, 4, 5], [6, 7]]
    # each sample's own tokens (4, 2 and 2 query rows, in row order) attend to its whole path (4, 5 and 2 rows of
    # `paths`, in order)
    assert lengths == ([4, 2, 2], [4, 5, 2]) and paths.tolist() == [0, 1, 2, 3, 0, 1, 2, 4, 5, 6, 7]
    ids, positions, tree, where = grpo.pad_samples([b, a, c])  # without sharing: right-padded rows, 5 wide
    assert ids.tolist() == [b, a + [0], c + [0, 0, 0]] and positions is None and tree is None
    assert [list(w) for w in where] == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [10, 11]]


def test_response_logprobs_are_the_response_tokens_of_each_sample_as_a_plain_forward_gives_them(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts, responses = [[5, 6, 7, 8], [5, 6, 7, 9], [9, 10]], [[11, 12], [11], [13, 14, 15]]
    expected = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):  # the naive way: full logits of each sample alone, pick the next token
            logits = model(torch.tensor([p + r])).logits[0].float().log_softmax(-1)
            expected.append([logits[len(p) - 1 + k, tok].item() for k, tok in enumerate(r)])
        for share in (True, False):
            args = grpo.Args(cuda=False, share_prefix=share, logprob_chunk_tokens=2)
            got = grpo.logprobs_no_grad(model, prompts, responses, args, NO_AUTOCAST)
            assert [g.tolist() for g in got] == [pytest.approx(e, abs=1e-5) for e in expected]


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
        grpo.update_policy(model, None, opt, prompts, responses, advantages, args, lambda: torch.autocast("cpu", enabled=False), torch.Generator().manual_seed(0))
        return model.model.embed_tokens.weight.grad.clone()

    one_batch, per_sample = grads(10_000), grads(1)
    assert torch.allclose(one_batch, per_sample, atol=1e-7)
    # with old == new (ratio 1, nothing clipped) the loss gradient is -(1/7) sum_t A_t grad logp_t
    # over the 7 response tokens, each token carrying its sample's advantage
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    (-sum(a * logprobs_alone(model, p, r).sum() for p, r, a in zip(prompts, responses, advantages)) / 7).backward()
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
    grpo.update_policy(model, None, torch.optim.SGD(model.parameters(), lr=lr), prompts, responses, advantages, args,
                       no_autocast, torch.Generator().manual_seed(0))

    by_hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    minibatches = np.array_split(torch.randperm(4, generator=torch.Generator().manual_seed(0)).numpy(), 2)
    with torch.no_grad():
        old = {i: logprobs_alone(by_hand, prompts[i], responses[i]) for i in range(4)}
    for minibatch in minibatches:
        by_hand.zero_grad()
        tokens = sum(len(responses[i]) for i in minibatch)
        for i in minibatch:  # clip_eps 10: no ratio is clipped, so the loss is -A * ratio per token
            logp = logprobs_alone(by_hand, prompts[i], responses[i])
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
    return module.update_policy(model, ref, optimizer, PROMPTS, RESPONSES, advantages, module.Args(**args),
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
        assert torch.allclose(a, b, atol=1e-5), name  # 4 steps of lr 0.2 grow float rounding to 2e-6
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


@pytest.mark.parametrize("module_name", ["grpo", "strata", "actguide"])
def test_pi_old_is_the_policy_before_the_first_step_and_the_samplers_log_probs_are_only_compared(tiny_model, module_name,
                                                                                                 monkeypatch):
    """The one rule for pi_old: the first minibatch's samples read it off their own forward, every other sample gets
    it from one no-grad pass before the first step; log-probs the sampler kept (vLLM's) never replace it: they only
    feed the rollout/train gap, measured over every sample."""
    from transformers import AutoModelForCausalLM

    settings = dict(minibatch_size=2, kl_coef=0.0, entropy_coef=0.0, temperature=0.7)
    # minibatches of update_policy's generator(0): the 2nd one's samples are the ones the no-grad pass scores
    _, second = np.array_split(torch.randperm(4, generator=torch.Generator().manual_seed(0)).numpy(), 2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    module = importlib.import_module(module_name)
    args = module.Args(**settings, micro_batch_tokens=4096)
    true_old = module.logprobs_no_grad(model, PROMPTS, RESPONSES, args, NO_AUTOCAST)
    extra = {"strata": ([False] * len(PROMPTS),), "actguide": (PROMPTS,)}.get(module_name, ())
    scored, no_grad_pass = [], module.logprobs_no_grad
    monkeypatch.setattr(module, "logprobs_no_grad", lambda m, p, r, *a: scored.append(p) or no_grad_pass(m, p, r, *a))

    def run(kept):
        m = copy.deepcopy(model)
        sampler = None if kept is None else module.Sampler(None, m, None, args, NO_AUTOCAST)
        if sampler is not None:
            sampler.logprobs.update(kept)
        scored.clear()
        metrics = module.update_policy(m, None, torch.optim.SGD(m.parameters(), lr=0.2), PROMPTS, RESPONSES, ADVANTAGES,
                                       args, NO_AUTOCAST, torch.Generator().manual_seed(0), *extra, sampler=sampler)
        return metrics, [p for p in scored if p]  # (actguide's pass over its guided samples: none here)

    plain, passes = run(None)
    assert passes == [[PROMPTS[i] for i in sorted(second)]]  # one no-grad pass, over the 2nd minibatch only
    assert "rollout/logprob_abs_diff_mean" not in plain  # no sampler, nothing to compare
    # a sampler's log-probs 0.25 nats off: the same update (never pi_old), a gap of 0.25 over every sample
    kept = {(0.7, tuple(p), tuple(r)): logp + 0.25 for p, r, logp in zip(PROMPTS, RESPONSES, true_old)}
    compared, passes = run(kept)
    assert passes == [[PROMPTS[i] for i in sorted(second)]]
    for key in ["losses/policy_loss", "losses/approx_kl_old", "losses/clipfrac", "losses/grad_norm"]:
        assert compared[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-9), key
    assert compared["rollout/logprob_abs_diff_mean"] == pytest.approx(0.25, abs=1e-5)
    assert compared["rollout/logprob_abs_diff_max"] == pytest.approx(0.25, abs=1e-5)
    # log-probs kept at another temperature are of another distribution: not compared
    elsewhere, _ = run({(1.0, p, r): v for (_, p, r), v in kept.items()})
    assert "rollout/logprob_abs_diff_mean" not in elsewhere


def test_the_engine_check_stops_on_a_weight_that_differs_or_that_nothing_was_sent_to(capsys):
    """check_engine_weights on hand-made checksums (elements, sum, index sum): q (2 elements), k (1) and v (3) sent
    apart make the engine's fused qkv, k's indices offset by q's 2 elements and v's by 3; a fused weight whose sums
    are off, one with a part's elements missing, and an engine weight nothing was sent to each stop the run."""
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    sent = {"l.v_proj.weight": (3, 5, 4), "l.q_proj.weight": (2, 3, 1), "l.k_proj.weight": (1, -1, 0),
            "norm.weight": (4, 7, 9)}
    # sum 3 - 1 + 5 = 7; index sum 1 + (0 + 2 x -1) + (4 + 3 x 5) = 18
    grpo.check_engine_weights({"l.qkv_proj.weight": (6, 7, 18), "norm.weight": (4, 7, 9)}, packed, sent)
    for engine, message in [({"l.qkv_proj.weight": (6, 6, 18), "norm.weight": (4, 7, 9)}, "qkv_proj.weight differs"),
                            ({"l.qkv_proj.weight": (6, 7, 17), "norm.weight": (4, 7, 9)}, "qkv_proj.weight differs"),
                            ({"l.qkv_proj.weight": (7, 7, 18), "norm.weight": (4, 7, 9)}, "holds 7 values, but 6"),
                            ({"l.qkv_proj.weight": (6, 7, 18), "head.weight": (0, 0, 0)}, "head.weight received no")]:
        with pytest.raises(SystemExit):
            grpo.check_engine_weights(engine, packed, sent)
        assert message in capsys.readouterr().err


def test_bit_sums_see_one_rounding_step_and_every_change_of_order_but_not_the_sign_of_zero():
    """(elements, sum of bit patterns, sum of pattern x row-major index): on a 2 x 2 of 1.0, 2.0, 3.0, 4.0 in bf16
    (patterns 0x3F80, 0x4000, 0x4040, 0x4080 = 16256, 16384, 16448, 16512), 65600 and 16384 + 2 x 16448 + 3 x 16512."""
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    assert grpo.bit_sums(w) == (4, 65600, 16384 + 2 * 16448 + 3 * 16512)
    assert grpo.bit_sums(torch.tensor([-0.0, 1.0])) == grpo.bit_sums(torch.tensor([0.0, 1.0]))
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    nudged = w.clone()
    nudged[3, 5] = (w[3, 5].view(torch.int16) + 1).view(torch.bfloat16)  # bf16's next value: one unit in the last place
    assert grpo.bit_sums(nudged)[1] == grpo.bit_sums(w)[1] + 1
    swapped = nudged.clone()  # one unit up here, one down elsewhere: the plain sum cannot tell, the index sum can
    swapped[7, 1] = (w[7, 1].view(torch.int16) - 1).view(torch.bfloat16)
    assert grpo.bit_sums(swapped)[:2] == grpo.bit_sums(w)[:2] and grpo.bit_sums(swapped) != grpo.bit_sums(w)
    for moved in (w.t(), w.flip(0), w.roll(1, 1)):  # transposed, rows flipped, columns rotated: same values
        assert grpo.bit_sums(moved)[:2] == grpo.bit_sums(w)[:2] and grpo.bit_sums(moved) != grpo.bit_sums(w)
    # blocks of rows (the sent side) and blocks of columns (the engine's kernel reads W^T) give the same sums
    big = torch.randn(3000, 1500, generator=torch.Generator().manual_seed(1))
    by_columns = [grpo.block_bit_sums(big[:, c : c + 1024], 0, c, 1500) for c in (0, 1024)]
    assert tuple(map(sum, zip(*by_columns))) == grpo.bit_sums(big)
    patterns = w.view(torch.int16).reshape(-1).tolist()  # and both as Python's integers give them, element by element
    assert grpo.bit_sums(w) == (4096, sum(patterns), sum(k * b for k, b in enumerate(patterns)))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_sharing_prefixes_gives_the_update_the_same_log_probs_and_gradients(tiny_model, checkpointing):
    """--share-prefix through update_policy itself, on a batch where prefixes nest: a group of three at step 0 (one
    prompt, three responses), the same group at step 1 (the step-0 prompt's head, then its own history), and a
    sample that shares nothing. In fp32 the losses agree to 1e-6 and every parameter's gradient to 1e-5 relative,
    while the shared row computes 40% fewer tokens. Detaching the prefix's keys and values fails this test."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(5, 300, (n,), generator=g).tolist()  # noqa: E731
    task = rand(30)
    step0 = task + rand(8)
    prompts = [step0] * 3 + [task + rand(6), task + rand(6), rand(20)]
    responses = [rand(5), rand(4), rand(6), rand(3), rand(5), rand(4)]
    advantages = np.array([1.0, -0.5, 0.7, 2.0, -1.0, 0.3])
    out = {}
    for share in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        args = grpo.Args(cuda=False, share_prefix=share, minibatch_size=64, micro_batch_tokens=10_000, kl_coef=0.0,
                         entropy_coef=0.01, max_grad_norm=1e9)
        metrics = grpo.update_policy(model, None, torch.optim.SGD(model.parameters(), lr=0.0), prompts, responses,
                                     advantages, args, NO_AUTOCAST, torch.Generator().manual_seed(0))
        out[share] = metrics, {n: p.grad.clone() for n, p in model.named_parameters()}
    (plain, plain_grads), (shared, shared_grads) = out[False], out[True]
    for key in ["losses/policy_loss", "losses/entropy", "losses/clipfrac", "losses/grad_norm"]:
        assert shared[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-9), key
    for name, grad in plain_grads.items():
        assert (shared_grads[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-12, name
    whole = sum(map(len, prompts)) + sum(map(len, responses))
    assert whole == 233 and plain["tokens/computed"] == 6 * 44  # one padded batch: six rows of the longest sample
    # computed once: step 0's prompt (38 + 15 response tokens), the task head's two continuations (6 + 3, 6 + 5),
    # and the lone sample (24)
    assert shared["tokens/computed"] == 38 + 15 + 9 + 11 + 24 and shared["tokens/computed"] < 0.6 * whole


def test_group_minibatches_keep_a_tasks_samples_together_and_default_to_the_random_split(tiny_model):
    """--group-minibatches: two tasks' four samples each (a 20-token task head, then their own token); minibatches of
    4 hold one task each, so each head is computed once per minibatch: 2 x (20 + 4 x 3) = 64 tokens. Off (verl-agent's
    draw), the split is update_policy's generator's permutation, as before the flag existed."""
    from transformers import AutoModelForCausalLM

    prompts = [[h] * 20 + [k] for h in (11, 12) for k in (21, 22, 23, 24)]
    responses = [[30, 31]] * 8
    samples = [p + r for p, r in zip(prompts, responses)]
    off = grpo.draw_minibatches(samples, 2, grpo.Args(), torch.Generator().manual_seed(0))
    expected = np.array_split(torch.randperm(8, generator=torch.Generator().manual_seed(0)).numpy(), 2)
    assert [m.tolist() for m in off] == [m.tolist() for m in expected]
    on = grpo.draw_minibatches(samples, 2, grpo.Args(group_minibatches=True), torch.Generator().manual_seed(0))
    assert sorted(sorted(m.tolist()) for m in on) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    computed = {}
    for flag in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        args = grpo.Args(cuda=False, minibatch_size=4, micro_batch_tokens=10_000, kl_coef=0.0, group_minibatches=flag)
        computed[flag] = grpo.update_policy(model, None, torch.optim.SGD(model.parameters(), lr=0.0), prompts, responses,
                                            np.linspace(-1, 1, 8), args, NO_AUTOCAST,
                                            torch.Generator().manual_seed(0))["tokens/computed"]
    assert computed[True] == 64 < computed[False]  # seed 0's random split mixes the two tasks


ATTENTION_FEATURES = {  # a tiny model whose attention has what --share-prefix does not compute, and the line it stops with
    "qwen2-sliding-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
                             "a sliding window"),
    "gemma2-softcap": ("Gemma2Config", dict(head_dim=16, layer_types=["full_attention"] * 2,
                                            attn_logit_softcapping=50.0, final_logit_softcapping=None),
                       "soft-capped logits"),
    "gpt-oss-sinks": ("GptOssConfig", dict(head_dim=16, intermediate_size=64, num_local_experts=4,
                                           num_experts_per_tok=2, layer_types=["full_attention"] * 2),
                      "attention sinks"),
}


@pytest.mark.parametrize("family", list(ATTENTION_FEATURES))
def test_attention_the_shared_path_cannot_compute_stops_it_and_the_plain_path_is_the_models_own(family, capsys):
    """A sliding window (8 tokens, on 26-token samples), soft-capped attention logits and attention sinks: with
    --no-share-prefix the response log-probs are those of the model's own forward of each sample alone; with
    --share-prefix the first forward stops with one line naming the feature and the way out."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, extra, feature = ATTENTION_FEATURES[family]
    config = getattr(transformers, config_class)(**{**dict(vocab_size=300, hidden_size=64, intermediate_size=128,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2), **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (20,), generator=g).tolist() for _ in range(3)]
    responses = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (6, 4, 6)]

    def alone(m):  # each sample's own forward, the next token picked from the full logits
        with torch.no_grad():
            logits = [m(torch.tensor([p + r])).logits[0].float().log_softmax(-1) for p, r in zip(prompts, responses)]
        return [[lp[len(p) - 1 + k, y].item() for k, y in enumerate(r)] for lp, p, r in zip(logits, prompts, responses)]

    expected = alone(model)
    got = grpo.logprobs_no_grad(model, prompts, responses, grpo.Args(cuda=False, share_prefix=False), NO_AUTOCAST)
    assert [g.tolist() for g in got] == [pytest.approx(e, abs=1e-5) for e in expected]
    if family == "qwen2-sliding-window":  # the window matters here: without it the same weights give other log-probs
        config.use_sliding_window, config.layer_types = False, ["full_attention"] * 2
        unwindowed = AutoModelForCausalLM.from_config(config).eval()
        unwindowed.load_state_dict(model.state_dict())
        assert max(abs(a - b) for e, u in zip(expected, alone(unwindowed)) for a, b in zip(e, u)) > 0.01
    with pytest.raises(SystemExit):
        grpo.logprobs_no_grad(model, prompts, responses, grpo.Args(cuda=False, share_prefix=True), NO_AUTOCAST)
    assert capsys.readouterr().err.strip() == (f"error: this model's attention has {feature}, which --share-prefix does "
                                               "not compute: run with --no-share-prefix (the model's own attention)")
