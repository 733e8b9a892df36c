"""grpo.py's own flags that tests/test_grpo_math.py leaves unpinned (issue 42), each through the function the main
loop calls with `args`: the Sampler's nucleus and response budget, and the prompt budget's last resort."""

from types import SimpleNamespace

import pytest
import torch

import grpo
from envs import Step

NO_AUTOCAST = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), AutoTokenizer.from_pretrained(tiny_model)


def sample(tiny, temperature: float, **settings) -> list[list[int]]:
    """The main loop's Sampler (HF generate on the trained module), seeded, on three fixed prompts."""
    model, tokenizer = tiny
    args = grpo.Args(cuda=False, max_new_tokens=12, **settings)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("go north", "take the knife", "eat meal")]
    torch.manual_seed(0)
    return grpo.Sampler(None, model, tokenizer, args, NO_AUTOCAST)(prompts, temperature)


def test_top_p_narrows_sampling_to_the_nucleus(tiny):
    """--top-p: with a nucleus smaller than any one token's probability only the most likely token is left, so
    sampling at T = 1 gives greedy decoding's tokens; with the whole distribution (1.0, the default) it does not."""
    greedy = sample(tiny, 0.0)
    assert sample(tiny, 1.0, top_p=1e-6) == greedy
    assert sample(tiny, 1.0, top_p=1.0) != greedy


def test_the_response_budget_is_args_max_new_tokens_unless_the_call_names_one(tiny):
    """--max-new-tokens sizes every response (a random model rarely says EOS: most run to the budget)."""
    lengths = [len(r) for r in sample(tiny, 1.0)]
    assert max(lengths) == 12 and all(0 < n <= 12 for n in lengths)
    model, tokenizer = tiny
    sampler = grpo.Sampler(None, model, tokenizer, grpo.Args(cuda=False, max_new_tokens=12), NO_AUTOCAST)
    assert max(len(r) for r in sampler([[1, 2, 3]], 1.0, max_new_tokens=5)) <= 5


def test_a_prompt_over_budget_with_no_history_keeps_its_last_tokens(tiny, cooking_spec):
    """--max-prompt-tokens: history goes first; when the prompt with no history still exceeds the budget, its last
    max_prompt_tokens tokens are kept (the end holds the observation, the admissible actions and the answer's start)."""
    _, tokenizer = tiny
    episode = grpo.Episode(task_id="train-easy-0", group=0, task="cook")
    obs = Step(observation="a kitchen", reward=0.0, done=False, won=False, admissible=["look"], task="cook", task_type="easy",
               state=frozenset())
    history = [("a hallway", "go north")]
    whole = grpo.build_prompt(cooking_spec, tokenizer, SimpleNamespace(history_length=0, max_prompt_tokens=10**6, response_prefix=""),
                              episode, obs, history)
    assert len(whole) > 20
    cut = grpo.build_prompt(cooking_spec, tokenizer, SimpleNamespace(history_length=2, max_prompt_tokens=20, response_prefix=""),
                            episode, obs, history)
    assert cut == whole[-20:]


# four step samples of equal response length: the dual-clip test's token-mean needs no minibatch split
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
RESPONSES = [[20, 21], [24, 25], [26, 27], [28, 29]]


@pytest.mark.parametrize("dual_clip", [3.0, 1.5])
def test_dual_clip_caps_the_loss_of_negative_steps_whose_ratio_ran_away(tiny, dual_clip, monkeypatch):
    """--dual-clip c through update_policy: every advantage is -1 and the second minibatch's pi_old, from the no-grad
    pass, is made to lie 2 nats below the current policy (ratio e^2 = 7.4 > c). The first minibatch's pi_old is its
    own forward (ratio 1): loss |A| = 1 per token. The second's is capped at |A| c. Both minibatches hold 4 of the 8
    tokens, so policy_loss = (4 * 1 + 4 * c) / 8 = (1 + c) / 2: 2.0 at c = 3, 1.25 at c = 1.5."""
    import copy

    model = copy.deepcopy(tiny[0])
    args = grpo.Args(cuda=False, minibatch_size=2, update_epochs=1, temperature=1.0, micro_batch_tokens=4096,
                     dual_clip=dual_clip, kl_coef=0.0)
    no_grad_pass = grpo.logprobs_no_grad
    monkeypatch.setattr(grpo, "logprobs_no_grad", lambda *a: [logp - 2.0 for logp in no_grad_pass(*a)])
    metrics = grpo.update_policy(model, None, torch.optim.SGD(model.parameters(), lr=1e-3), PROMPTS, RESPONSES,
                                 [-1.0] * 4, args, NO_AUTOCAST, torch.Generator().manual_seed(0))
    assert metrics["losses/policy_loss"] == pytest.approx((1 + dual_clip) / 2, rel=1e-6)


def test_weight_decay_shrinks_each_trained_weight_by_lr_times_decay(tiny_model, tmp_path):
    """--weight-decay through the main loop: one iteration, one optimizer step (a minibatch holds every sample),
    run twice from the same seed, with decay 0 and 0.5. The samples and gradients are the same, so AdamW's
    decoupled decay is the whole difference: p_0.0 - p_0.5 = lr * 0.5 * p_start for every weight. Both run with
    --kl-coef 0, which builds no reference model: no KL is measured."""
    from safetensors.torch import load_file

    from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics, run_script

    flags = list(TINY_FLAGS)
    flags[flags.index("--minibatch-size") + 1] = "64"
    after = {}
    for decay in ("0.0", "0.5"):
        out = run_script("grpo.py", "--model", tiny_model, *flags, "--total-iterations", "1", "--num-eval-tasks", "0",
                         "--bf16", "False", "--save-every", "1", "--kl-coef", "0", "--weight-decay", decay, "--output-dir", str(tmp_path / decay))
        assert out.returncode == 0, out.stderr[-3000:]
        run = only_run(tmp_path / decay)
        assert read_metrics(run)[1]["perf/optimizer_steps"] == 1 and read_metrics(run)[1]["losses/kl"] == 0
        after[decay] = load_file(str(run / "checkpoint" / "model" / "model.safetensors"))
    start = load_file(f"{tiny_model}/model.safetensors")
    for name, p in start.items():
        assert torch.allclose(after["0.0"][name] - after["0.5"][name], 1e-3 * 0.5 * p, rtol=1e-3, atol=1e-8), name


def test_kl_coef_zero_builds_no_reference_model(tiny_model, tmp_path):
    """--kl-coef 0 through the main loop: no reference model is loaded, so no KL is measured, though the policy moves
    away from the start over the iteration's optimizer steps (a reference would have measured that: the KL-on test in
    test_grpo_math.py sees it)."""
    from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics, run_script

    out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--total-iterations", "1", "--num-eval-tasks", "0",
                     "--kl-coef", "0", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(only_run(tmp_path))[1]
    assert metrics["perf/optimizer_steps"] >= 2 and metrics["losses/approx_kl_old"] != 0
    assert metrics["losses/kl"] == 0
