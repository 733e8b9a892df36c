"""grpo.py's formulas against numbers computed by hand."""

import math

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
