"""Run by tests/test_vllm.py in a child process (a vLLM engine changes the process it lives in): grpo.py's own
engine (make_vllm) and Sampler sample from a tiny model; each sampled token's log-prob that the engine kept is
compared with grpo.py's recomputation by the training model (logprobs_no_grad, the update's pi_old pass), while
in sync, after the training weights moved, and after Sampler.sync. Writes the gaps as json."""

import contextlib
import io
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402

TEXTS = [f"You are an agent in a TextWorld cooking game. Room {k}: a fridge, a counter, a stove. What do you do?" for k in range(6)]


def gaps(sampler, model, tokenizer, args: grpo.Args, autocast, prompts: list[list[int]]) -> dict:
    """|log p_engine - log p_train| over the response tokens of one batched sampling call."""
    responses = sampler(prompts, args.temperature)
    kept = [sampler.logprobs[(args.temperature, tuple(p), tuple(r))] for p, r in zip(prompts, responses)]
    train = grpo.logprobs_no_grad(model, prompts, responses, args, autocast)
    diff = torch.cat([(k - t).abs() for k, t in zip(kept, train)])
    return {"mean": diff.mean().item(), "max": diff.max().item(), "tokens": len(diff)}


if __name__ == "__main__":
    model_path, out = sys.argv[1], Path(sys.argv[2])
    device = torch.device("cpu")
    args = grpo.Args(model=model_path, vllm=True, max_prompt_tokens=256, max_new_tokens=24, temperature=1.0)
    tokenizer, model = grpo.load_policy(model_path, device)
    use_bf16 = grpo.bf16_is_fast(device)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
    llm = grpo.make_vllm(args, model, tokenizer, device, use_bf16, 1)
    sampler = grpo.Sampler(llm, model, tokenizer, args, autocast)
    sampler.sync(model)
    prompts = [grpo.encode_prompt(tokenizer, text) for text in TEXTS]
    result = {"dtype": str(llm.llm_engine.model_config.dtype), "in_sync": gaps(sampler, model, tokenizer, args, autocast, prompts)}
    torch.manual_seed(0)
    with torch.no_grad():  # a large update: every weight moves by noise of 3x its own spread
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 3 * param.std())
    result["stale"] = gaps(sampler, model, tokenizer, args, autocast, prompts)
    sampler.sync(model)
    result["synced"] = gaps(sampler, model, tokenizer, args, autocast, prompts)

    # The check after every sync: an engine weight that took other values than were sent, or none, stops the run
    reload = llm.collective_rpc

    def sync_altered(alter) -> str:
        """Sampler.sync with the weights the engine receives altered by `alter`; the line the run stops with."""
        llm.collective_rpc = lambda method, *a, kwargs=None, **kw: reload(method, *a, **kw, kwargs=kwargs if method !=
                                                                           "reload_weights" else
                                                                           {"weights_iterator": alter(kwargs["weights_iterator"])})
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                sampler.sync(model)
        except SystemExit:
            return err.getvalue().strip()
        finally:
            llm.collective_rpc = reload
        return "no error"

    target = "model.layers.1.mlp.down_proj.weight"
    result["one_weight_off"] = sync_altered(lambda it: ((n, w + 2 ** -4 if n == target else w) for n, w in it))
    result["one_fused_weight_missing"] = sync_altered(lambda it: ((n, w) for n, w in it if "layers.0.self_attn.k" not in n))
    with torch.no_grad():  # the weights move; a sync that leaves one out leaves the engine stale there
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1 * param.std())
    result["one_weight_left_out"] = sync_altered(lambda it: ((n, w) for n, w in it if "layers.0.self_attn.o_proj" not in n))
    sampler.sync(model)
    result["resynced"] = gaps(sampler, model, tokenizer, args, autocast, prompts)

    # What an order-free sum of each weight could not tell: the same values in other places, or a part never sent
    def renamed(a: str, b: str):
        """The weights of a and b sent under each other's names."""
        return lambda it: ((b if n == a else a if n == b else n, w) for n, w in it)

    def one_unit_up_one_down(w):
        bits = w.clone().view({2: torch.int16, 4: torch.int32}[w.element_size()])
        bits[0] += 1
        bits[1] -= 1
        return bits.view(w.dtype)

    layer = "model.layers.0."
    result["gate_up_swapped"] = sync_altered(renamed(layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"))
    result["k_v_swapped"] = sync_altered(renamed(layer + "self_attn.k_proj.weight", layer + "self_attn.v_proj.weight"))
    result["square_transposed"] = sync_altered(lambda it: ((n, w.t().contiguous() if n == layer + "self_attn.o_proj.weight"
                                                            else w) for n, w in it))
    result["rows_flipped"] = sync_altered(lambda it: ((n, w.flip(0) if n == layer + "mlp.down_proj.weight" else w)
                                                      for n, w in it))
    result["same_sum_other_values"] = sync_altered(lambda it: ((n, one_unit_up_one_down(w) if n == layer +
                                                                "input_layernorm.weight" else w) for n, w in it))
    k = "model.layers.1.self_attn.k_proj.weight"
    gathered = grpo.full_parameters  # a trained model without k: it is neither sent nor counted as sent
    grpo.full_parameters = lambda m: ((n, w) for n, w in gathered(m) if n != k)
    result["fused_part_never_sent"] = sync_altered(lambda it: it)
    grpo.full_parameters = gathered
    sampler.sync(model)
    result["resynced_again"] = gaps(sampler, model, tokenizer, args, autocast, prompts)

    # what the check costs per sync: the sent side's checksums and the engine's
    start = time.perf_counter()
    sent = [grpo.bit_sums(w.detach().to(llm.llm_engine.model_config.dtype)) for _, w in model.named_parameters()]
    middle = time.perf_counter()
    llm.collective_rpc(grpo.engine_bit_sums)
    result["check_seconds"] = {"sent": middle - start, "engine": time.perf_counter() - middle,
                               "parameters": sum(p.numel() for p in model.parameters())}
    out.write_text(json.dumps(result, indent=2))
