"""--lora-rank (issue 40): LoRA adapters on a frozen base, in every script. The merge by hand; the update against
plain-torch SGD on the adapters with the base as the reference; grpo.py end to end (checkpoint = merged model +
adapter, exact resume, optimizer state for the adapters alone); sft.py's LoRA warm start taken by grpo.py; vLLM
served the merged weights; bad flags. Every script trains under LoRA in tests/test_families.py (the Llama runs)."""

import copy
import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import grpo
from test_grpo_e2e import TINY_FLAGS, comparable, logged_lists, only_run, read_metrics, run_script
from test_grpo_math import ADVANTAGES, NO_AUTOCAST, PROMPTS, RESPONSES, sgd_by_hand

REPO = Path(__file__).resolve().parents[1]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--kl-coef", "0.01", "--vllm", "False"]


def test_merged_weights_are_w_plus_scaling_b_a_under_the_plain_names():
    w, a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, -1.0]]), torch.tensor([[2.0], [0.5]])
    named = [  # peft's names, A and B before W for one layer (any order must do)
        ("base_model.model.model.embed_tokens.weight", torch.ones(2)),
        ("base_model.model.model.layers.0.q_proj.lora_A.default.weight", a),
        ("base_model.model.model.layers.0.q_proj.lora_B.default.weight", b),
        ("base_model.model.model.layers.0.q_proj.base_layer.weight", w),
        ("base_model.model.model.layers.0.q_proj.base_layer.bias", torch.tensor([7.0, 8.0])),
    ]
    merged = dict(grpo.merged_weights(named, 2.0))
    # B A = [[2, -2], [0.5, -0.5]]; W + 2 B A = [[5, -2], [4, 3]]
    assert torch.equal(merged["model.layers.0.q_proj.weight"], torch.tensor([[5.0, -2.0], [4.0, 3.0]]))
    assert torch.equal(merged["model.layers.0.q_proj.bias"], torch.tensor([7.0, 8.0]))
    assert sorted(merged) == ["model.embed_tokens.weight", "model.layers.0.q_proj.bias", "model.layers.0.q_proj.weight"]
    plain = [("model.norm.weight", torch.ones(3)), ("lm_head.weight", w)]
    assert list(grpo.merged_weights(plain, 0.0)) == plain  # full fine-tuning: unchanged
    with pytest.raises(RuntimeError, match="LoRA layers left unmerged: .'model.layers.0.q_proj.weight'"):
        list(grpo.merged_weights(named[1:3], 2.0))  # adapters without their base weight are never silently dropped


def lora_model(tiny_model: str, module, **lora):
    """The tiny model wrapped as the scripts wrap it, with B drawn at random (peft starts it at 0, where the policy
    would equal the base and the reference would be indistinguishable from pi_old)."""
    from transformers import AutoModelForCausalLM

    args = module.Args(lora_rank=4, lora_alpha=8.0, **lora)
    torch.manual_seed(0)
    model = module.add_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), args)
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
    return model


@pytest.mark.parametrize("module_name", ["grpo", "strata", "actguide"])
def test_lora_update_equals_sgd_on_the_adapters_with_the_base_as_reference(tiny_model, module_name):
    """update_policy with ref_model = the LoRA model itself (as the scripts pass it) against plain-torch SGD steps on a
    copy whose reference is the base model loaded apart: the same adapters after, the base untouched, the same k3."""
    from test_grpo_math import update
    from transformers import AutoModelForCausalLM

    module = importlib.import_module(module_name)
    model = lora_model(tiny_model, module)
    by_hand = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = dict(minibatch_size=2, max_grad_norm=1e9, kl_coef=0.5, entropy_coef=0.1, temperature=1.0, lora_rank=4)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    metrics = update(module_name, model, model, optimizer, ADVANTAGES, settings, torch.Generator().manual_seed(0))

    generator = torch.Generator().manual_seed(0)
    minibatches = list(np.array_split(torch.randperm(4, generator=generator).numpy(), 2))
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    kl, entropy = sgd_by_hand(by_hand, base, minibatches, 0.2, 0.2, 0.5, 0.1, 1.0)
    assert kl > 1e-3 and metrics["losses/kl"] == pytest.approx(kl, rel=1e-5)  # pi_ref = the base, not the policy
    assert metrics["losses/entropy"] == pytest.approx(entropy, rel=1e-5)
    moved = 0.0
    for (name, a), b in zip(model.named_parameters(), by_hand.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
        if "lora_" in name:
            moved = max(moved, (a - before[name]).abs().max().item())
        else:
            assert torch.equal(a, before[name]), name  # the base is frozen
    assert moved > 1e-3


def test_lora_dropout_takes_every_old_logprob_from_a_no_dropout_pass(tiny_model, monkeypatch):
    """Without dropout the first minibatch's own training pass is pi_old (2 of 4 samples recomputed); with dropout that
    pass is another function, so all 4 are."""
    counts, no_grad_pass = [], grpo.logprobs_no_grad
    monkeypatch.setattr(grpo, "logprobs_no_grad", lambda m, p, *a: counts.append(len(p)) or no_grad_pass(m, p, *a))
    for dropout in (0.0, 0.5):
        model = lora_model(tiny_model, grpo, lora_dropout=dropout)
        args = grpo.Args(minibatch_size=2, max_grad_norm=1e9, kl_coef=0.0, lora_rank=4, lora_dropout=dropout)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        grpo.update_policy(model, None, optimizer, PROMPTS, RESPONSES, ADVANTAGES, args, NO_AUTOCAST,
                           torch.Generator().manual_seed(0))
    assert counts == [2, 4]


def adapter_of(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoint" / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def lora_runs(tiny_model, tmp_path_factory):
    """grpo.py --lora-rank 4: two iterations straight (A), and one iteration then resumed to two (B)."""
    a, b = tmp_path_factory.mktemp("lora-a"), tmp_path_factory.mktemp("lora-b")
    out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, *LORA, "--total-iterations", "2", "--output-dir", str(a))
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, *LORA, "--total-iterations", "1", "--output-dir", str(b))
    assert out.returncode == 0, out.stderr[-3000:]
    out = run_script("grpo.py", "--resume", str(only_run(b)), "--total-iterations", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    return only_run(a), only_run(b)


def test_lora_resume_repeats_the_straight_run(lora_runs):
    straight, resumed = lora_runs
    a, b = read_metrics(straight), read_metrics(resumed)
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for it in a:
        assert comparable(b[it]) == pytest.approx(comparable(a[it]), rel=1e-6, abs=1e-9), it
        assert logged_lists(b[it]) == logged_lists(a[it])
    assert a[2]["losses/kl"] > 0  # the reference (the base) is scored, and the policy has left it
    for name, value in adapter_of(straight).items():
        assert torch.equal(adapter_of(resumed)[name], value), name


def test_lora_checkpoint_is_the_merged_model_plus_the_adapter(lora_runs, tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = lora_runs[0]
    config = json.loads((run / "checkpoint" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    adapter, base = adapter_of(run), load_file(Path(tiny_model) / "model.safetensors")
    merged = load_file(run / "checkpoint" / "model" / "model.safetensors")
    assert sorted(merged) == sorted(base)  # a plain model's names: no peft prefix, no base_layer, no lora_
    adapted = 0
    for name, w in base.items():
        key = f"base_model.model.{name[: -len('.weight')]}.lora_A.weight"
        if key in adapter:  # W + (alpha / r) B A
            expected = w + 2.0 * adapter[key.replace("lora_A", "lora_B")] @ adapter[key]
            assert torch.allclose(merged[name], expected, atol=1e-7), name
            adapted += not torch.equal(merged[name], w)
        else:  # embeddings, norms, biases: frozen and untouched
            assert torch.equal(merged[name], w), name
    assert adapted == 14  # 2 layers x 7 projections, all moved by training
    plain = AutoModelForCausalLM.from_pretrained(run / "checkpoint" / "model")  # what --model and vLLM load
    assert type(plain).__name__ == "Qwen2ForCausalLM"
    assert torch.equal(plain.state_dict()["model.layers.0.mlp.up_proj.weight"], merged["model.layers.0.mlp.up_proj.weight"])


def test_lora_optimizer_state_covers_the_adapters_alone(lora_runs):
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(lora_runs[0] / "checkpoint" / "optimizer")).read_metadata()
    moments = [k for k in metadata.state_dict_metadata if k.endswith(".exp_avg")]
    assert len(moments) == 28 and all(".lora_A." in k or ".lora_B." in k for k in moments)  # 14 layers x (A, B)


def test_sft_lora_warm_start_is_a_model_grpo_takes(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from test_sft import SFT_FLAGS

    out = run_script("sft.py", "--model", tiny_model, *SFT_FLAGS, "--num-eval-tasks", "0", "--epochs", "1", "--lora-rank", "4", "--lora-target-modules", "q_proj,v_proj",
                     "--output-dir", str(tmp_path / "sft"))
    assert out.returncode == 0, out.stderr[-3000:]
    warm = only_run(tmp_path / "sft") / "checkpoint" / "model"
    merged, base = load_file(warm / "model.safetensors"), load_file(Path(tiny_model) / "model.safetensors")
    changed = sorted(k for k in base if not torch.equal(merged[k], base[k]))
    assert changed == [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"]
    out = run_script("grpo.py", "--model", str(warm), *TINY_FLAGS, *LORA, "--total-iterations", "1",
                     "--output-dir", str(tmp_path / "rl"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert read_metrics(only_run(tmp_path / "rl"))[1]["losses/grad_norm"] > 0


def test_vllm_serves_the_merged_weights(vllm_imports, vllm_model, tmp_path):
    """fp32 vLLM on the merged weights against the trainer's LoRA forward: the same log-probs after an update."""
    out = run_script("grpo.py", "--model", vllm_model, *TINY_FLAGS, *LORA[:-2], "--vllm", "True", "--bf16", "False",
                     "--total-iterations", "2", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    run = only_run(tmp_path)
    assert read_metrics(run)[2]["rollout/logprob_abs_diff_max"] < 1e-4  # sampled after the first update
    assert any(v.abs().max() > 0 for k, v in adapter_of(run).items() if "lora_B" in k)


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "4", "--lora-target-modules", "nosuch_proj"], "error: --lora-target-modules nosuch_proj:"),
    (["--lora-rank", "-1"], "error: --lora-rank -1 --lora-dropout 0.0: the rank is 0 or more"),
    (["--lora-rank", "4", "--lora-dropout", "1.0"], "the dropout in [0, 1)"),
    # an embedding's or head's adapter would not be merged into what the sampler and checkpoints get: refused
    (["--lora-rank", "4", "--lora-target-modules", "embed_tokens,q_proj"],
     "error: --lora-target-modules embed_tokens,q_proj: adapters go on linear layers only"),
])
def test_bad_lora_flags_are_one_clear_line(tiny_model, tmp_path, flags, message):
    out = run_script("grpo.py", "--model", tiny_model, *TINY_FLAGS, "--vllm", "False", *flags, "--output-dir", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
