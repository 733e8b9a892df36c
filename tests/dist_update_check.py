"""Run by tests/test_distributed.py under `torchrun --nproc-per-node 2`: one grpo.py update on a
fixed batch, each rank holding its own samples, then the full updated weights saved by rank 0.
A third argument `lora`: the same update of a LoRA model (frozen base sharded too, adapters trained)."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402

# samples of different lengths; rank r trains on samples r, r+2, r+4 (whole groups stay on one rank)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15], [16, 17, 18], [19, 20, 21, 22, 23]]
RESPONSES = [[30, 31, 32, 33], [34], [35, 36], [37, 38, 39], [40, 41], [42]]
ADVANTAGES = np.array([1.0, -0.5, 2.0, 0.3, -1.2, 0.7])


def update(model, samples: list[int], distributed: bool, lora: bool = False):
    """One PPO update (one minibatch, SGD lr 1: the weight change is minus the gradient). LoRA: the adapters alone are
    trained, against the base as the reference (the model itself with its adapters off, as grpo.py passes it)."""
    torch.manual_seed(0)
    args = grpo.Args(minibatch_size=64, micro_batch_tokens=12, kl_coef=0.5 if lora else 0.0, entropy_coef=0.001,
                     max_grad_norm=1e9, lora_rank=4 * lora)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    return grpo.update_policy(model, model if lora else None, optimizer, [PROMPTS[i] for i in samples],
                              [RESPONSES[i] for i in samples], ADVANTAGES[samples], args,
                              lambda: torch.autocast("cpu", enabled=False), torch.Generator().manual_seed(0))


def lora_model(model_dir: str):
    """The tiny model under grpo.add_lora (rank 4, alpha 8), B drawn nonzero so that the policy is not the base."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = grpo.add_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          grpo.Args(lora_rank=4, lora_alpha=8.0))
    with torch.no_grad():
        for k, (name, p) in enumerate(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
    return model


if __name__ == "__main__":
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    model_dir, out, lora = sys.argv[1], sys.argv[2], sys.argv[3:] == ["lora"]
    rank, world_size, _ = grpo.init_distributed(grpo.Args(cuda=False))
    model = lora_model(model_dir) if lora else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = grpo.shard_model(model, bf16=False)
    metrics = update(model, list(range(rank, len(PROMPTS), world_size)), True, lora)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"weights": weights, "metrics": metrics}, out)
    torch.distributed.destroy_process_group()
