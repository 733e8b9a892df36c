"""Run by tests/test_distributed.py under `torchrun --nproc-per-node 2`: DAPO's dynamic sampling over both ranks
(grpo.keep_informative, called round by round as grpo.py's main loop calls it) on two hand-built rounds of four
groups, then grpo.py's training_batch and update on the episodes each rank kept. Rank 0 saves the kept groups,
every rank's sample count, the update's metrics and the full updated weights.

Round 0 (groups 0-3): rank 0 plays 0 and 1, both mixed; rank 1 plays 2 (all lost) and 3 (all won).
Round 1 (groups 4-7): rank 0 plays 4 (all lost) and 5 (mixed); rank 1 plays 6 and 7 (both mixed).
With 4 groups to keep: [0, 1] after round 0, then 5 and 6 of [5, 6, 7]: rank 0 trains 3 groups, rank 1 one."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402

NUM_TASKS = 4
OUTCOMES = {0: [True, False], 1: [False, True], 2: [False, False], 3: [True, True],  # group -> its episodes' wins
            4: [False, False], 5: [True, False], 6: [False, True], 7: [True, False]}


def played(group: int) -> list:
    """The two episodes of a group, one or two steps each, every turn with ids of its own (the tiny model's vocabulary)."""
    episodes = []
    for k, won in enumerate(OUTCOMES[group]):
        episode = grpo.Episode(f"task-{group}", group, won=won)
        for t in range(1 + (group + k) % 2):
            i = 5 + 40 * group + 10 * k + 5 * t
            episode.turns.append(grpo.Turn([i, i + 1, i + 2], [i + 3, i + 4], "look", True, f"obs {i}", None))
        episodes.append(episode)
    return episodes


def rounds(rank: int, world_size: int) -> list[list]:
    """What this rank plays in each round: its half of the round's groups (my_groups, as main)."""
    return [[e for g in range(r * NUM_TASKS, (r + 1) * NUM_TASKS) if (g % NUM_TASKS) * world_size // NUM_TASKS == rank
             for e in played(g)] for r in range(2)]


def update(model, episodes: list):
    """grpo.py's batch of these episodes, then one PPO update (one minibatch, SGD lr 1)."""
    torch.manual_seed(0)
    args = grpo.Args(success_reward=10.0, invalid_penalty=0.1, minibatch_size=64, micro_batch_tokens=12, kl_coef=0.0,
                     entropy_coef=0.001, max_grad_norm=1e9)
    prompts, responses, advantages, _ = grpo.training_batch(episodes, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return grpo.update_policy(model, None, optimizer, prompts, responses, advantages, args,
                              lambda: torch.autocast("cpu", enabled=False), torch.Generator().manual_seed(0))


if __name__ == "__main__":
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    model_dir, out = sys.argv[1], sys.argv[2]
    rank, world_size, _ = grpo.init_distributed(grpo.Args(cuda=False))
    kept, mine = [], []
    for new in rounds(rank, world_size):
        mine += new
        kept = grpo.keep_informative(kept, new, NUM_TASKS)
        if len(kept) == NUM_TASKS:
            break
    episodes = [e for e in mine if e.group in kept]
    model = grpo.shard_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), bf16=False)
    metrics = update(model, episodes)
    samples = grpo.all_gather_objects([sum(len(e.turns) for e in episodes)])
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"kept": kept, "samples": samples, "metrics": metrics, "weights": weights}, out)
    torch.distributed.destroy_process_group()
