"""GPU check, part (a): a Qwen2.5-1.5B-shaped model with random weights, for throughput only.

    python benchmarks/gpu_model.py build --out /tmp/qwen15b              # config -> random weights + tiny tokenizer
    python benchmarks/gpu_model.py bench --model /tmp/qwen15b            # grpo.py's update and HF generation, in process
    python benchmarks/gpu_model.py iteration --model /tmp/qwen15b        # one grpo.py iteration on cooking (CLI), GPU memory sampled
    python benchmarks/gpu_model.py paths --model /tmp/qwen15b            # log-probs with and without --share-prefix

Shape (Qwen2.5-1.5B's config): hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960,
vocab 151936, tied embeddings; 1.54 B parameters. The tokenizer is the tests' tiny one (400 ids):
throughput does not depend on which ids are sampled (ids it cannot decode are dropped from text).

Model FLOPs utilisation = 6 * params * tokens / update time / peak, with peak = 989e12 FLOP/s,
the H200 SXM (= H100 SXM) dense bf16 datasheet figure. 6N counts forward + backward of the
model's matmuls only: attention score FLOPs and the recomputed forward of gradient checkpointing
(on by default in grpo.py, ~+2N) are not counted, as MFU is usually defined; the tokens are every
token of the packed micro-batches (prompt + response, padding excluded). This machine's measured
bf16 matmul ceiling is lower (about 790 TFLOP/s on random data, .library/device/KINDS.md); the
JSON reports MFU against both. `--shape tiny` runs the same code on CPU in seconds (the smoke test).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, machine, read_metrics, run_training, tail, tiny_model, write_json  # noqa: E402

PEAK_BF16 = 989e12  # H200 SXM dense bf16, vendor datasheet (no sparsity)
MEASURED_BF16 = 790e12  # 8192^3 bf16 matmul on random data, measured on this workplace's H200s
SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=151936, max_position_embeddings=8192),
}


@dataclass
class Build:
    """Save a random model of a given shape with the tests' tiny tokenizer."""

    out: Path = Path("/tmp/qwen15b-random")
    shape: Literal["qwen2.5-1.5b", "tiny"] = "qwen2.5-1.5b"
    seed: int = 0


@dataclass
class Bench:
    """grpo.py's update_policy and generate_hf on synthetic batches, in this process."""

    model: Path = Path("/tmp/qwen15b-random")
    samples: int = 128
    """step samples in the synthetic update batch"""
    prompt_tokens: int = 1024
    response_tokens: int = 256
    minibatch_size: int = 64
    micro_batch_tokens: int = 16384
    gradient_checkpointing: bool = True
    gen_batch: int = 64
    gen_prompt_tokens: int = 512
    gen_new_tokens: int = 128
    kl_coef: float = 0.01
    """0: no reference model"""
    out: Path = REPO / "benchmarks" / "results" / "gpu_update.json"


@dataclass
class Iteration:
    """One grpo.py iteration on cooking through its CLI, with GPU memory sampled by nvidia-smi."""

    model: Path = Path("/tmp/qwen15b-random")
    flags: str = ("--env cooking --total-iterations 1 --num-tasks 4 --group-size 4 --max-steps 2 --max-new-tokens 256 "
                  "--num-eval-tasks 1 --num-env-workers 8 --save-every 1000000")
    out: Path = REPO / "benchmarks" / "results" / "gpu_iteration.json"
    runs_dir: Path = Path("/tmp/bench-gpu-runs")


@dataclass
class Paths:
    """grpo.py's two log-prob paths on the same samples, whose prompts share heads: a right-padded batch through the
    model's own attention (--no-share-prefix) and one packed row computing each shared head once (--share-prefix).
    Is the shared path's per-sample attention loop on a GPU as fast as its token count promises, and at what memory?"""

    model: Path = Path("/tmp/qwen15b-random")
    fractions: tuple[float, ...] = (0.55, 0.95)
    """one case each: the fraction of the samples' tokens the shared path computes (the head lengths are solved)"""
    micro_batch_tokens: int = 16384
    """--micro-batch-tokens of both paths; the shared path computes each case in one micro-batch of it (the plain
    path, the same samples with their heads repeated, in as many as grpo.py would cut)"""
    groups: int = 2
    """groups per case: each is one prompt head shared by group_size samples, each with its own tail"""
    group_size: int = 8
    response_tokens: int = 256
    """the end of each sample's own tail: the tokens whose log-probs are computed"""
    repeats: int = 3
    """timed repetitions per pass, after one warm-up (the median is reported)"""
    gradient_checkpointing: bool = True
    out: Path = REPO / "benchmarks" / "results" / "gpu_paths.json"


def build(a: Build) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tiny_model(a.out)  # tokenizer (+ a tiny model that is overwritten below)
    tok = AutoTokenizer.from_pretrained(a.out)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(**SHAPES[a.shape], tie_word_embeddings=True, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tok.pad_token_id
    for f in a.out.glob("model*.safetensors*"):
        f.unlink()
    model.to(torch.bfloat16).save_pretrained(a.out)  # bf16 on disk; grpo.py loads fp32 master weights
    n = sum(p.numel() for p in model.parameters())
    print(f"built {a.shape}: {n / 1e9:.3f} B parameters -> {a.out}")


def bench(a: Bench) -> dict:
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO))
    import grpo

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_bf16 = device.type == "cuda"
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
    tokenizer, model = grpo.load_policy(str(a.model), device)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = None
    if a.kl_coef > 0:
        _, ref = grpo.load_policy(str(a.model), device)
        ref.requires_grad_(False).eval()
        if use_bf16:
            ref.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    args = grpo.Args(minibatch_size=a.minibatch_size, micro_batch_tokens=a.micro_batch_tokens, kl_coef=a.kl_coef, learning_rate=1e-6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    rng = np.random.default_rng(0)
    vocab = len(tokenizer)
    # lengths vary around the targets (as real turns do), so packing and padding are exercised
    prompts = [rng.integers(0, vocab, int(a.prompt_tokens * rng.uniform(0.75, 1.0))).tolist() for _ in range(a.samples)]
    responses = [rng.integers(0, vocab, int(a.response_tokens * rng.uniform(0.25, 1.0)) + 1).tolist() for _ in range(a.samples)]
    advantages = rng.standard_normal(a.samples)
    gen = torch.Generator().manual_seed(0)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # warm-up update on a small slice (CUDA context, cuBLAS/attention kernels, optimizer state)
    grpo.update_policy(model, ref, optimizer, prompts[:4], responses[:4], advantages[:4], args, autocast, gen)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = grpo.update_policy(model, ref, optimizer, prompts, responses, advantages, args, autocast, gen)
    sync()
    wall = time.perf_counter() - t0
    real_tokens = m["perf/train_tokens_per_s"] * m["perf/update_s"]
    update_peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None

    # HF generation (grpo.py's generate_hf: the training model's fp32 weights under bf16 autocast)
    gen_prompts = [rng.integers(0, vocab, a.gen_prompt_tokens).tolist() for _ in range(a.gen_batch)]
    grpo.generate_hf(model, tokenizer, gen_prompts[:2], 4, 1.0, 1.0, autocast)  # warm-up
    sync()
    t0 = time.perf_counter()
    outs = grpo.generate_hf(model, tokenizer, gen_prompts, a.gen_new_tokens, 1.0, 1.0, autocast)
    sync()
    gen_s = time.perf_counter() - t0
    gen_tokens = sum(len(o) for o in outs)
    flops = 6 * params * real_tokens
    result = {
        "benchmark": "gpu_update",
        "model": str(a.model),
        "params": params,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "bf16_autocast": use_bf16,
        "gradient_checkpointing": a.gradient_checkpointing,
        "kl_coef": a.kl_coef,
        "samples": a.samples,
        "update_tokens": real_tokens,
        "response_tokens": sum(map(len, responses)),
        "optimizer_steps": m["perf/optimizer_steps"],
        "logprob_s": m["perf/logprob_s"],
        "update_s": m["perf/update_s"],
        "update_plus_logprob_s": wall,
        "update_tokens_per_s": m["perf/train_tokens_per_s"],
        "computed_tokens": m["tokens/computed"],
        "mfu_definition": "6 * params * update_tokens / update_s / peak (forward+backward matmuls; no attention scores, no checkpoint recompute)",
        "peak_flops_assumed": PEAK_BF16,
        "mfu": flops / m["perf/update_s"] / PEAK_BF16,
        "mfu_vs_measured_matmul_ceiling": flops / m["perf/update_s"] / MEASURED_BF16,
        "peak_gpu_memory_update_gib": update_peak,
        "generation": {"batch": a.gen_batch, "prompt_tokens": a.gen_prompt_tokens, "max_new_tokens": a.gen_new_tokens,
                       "generated_tokens": gen_tokens, "seconds": gen_s, "tokens_per_s": gen_tokens / gen_s},
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "machine": machine(),
        "command": "python benchmarks/gpu_model.py " + " ".join(sys.argv[1:]),
    }
    write_json(a.out, result)
    print(f"update: {result['update_tokens_per_s']:.0f} tokens/s, MFU {result['mfu']:.1%} (peak {PEAK_BF16 / 1e12:.0f} TFLOP/s); "
          f"generation: {result['generation']['tokens_per_s']:.0f} tokens/s (batch {a.gen_batch}); "
          f"peak GPU memory {result['peak_gpu_memory_gib']} GiB")
    return result


def shared_head_samples(rng, vocab: int, a: Paths, fraction: float):
    """`groups` x `group_size` samples of one length: per group a prompt head, then per sample its own tail (the
    prompt's rest, then the response). The shared path computes head + group_size * tail tokens per group: the
    lengths are solved for that to be `fraction` of the group's tokens, all groups in one micro-batch. Distinct first
    tokens make groups share nothing and a group's samples exactly their head (random ids could share more)."""
    per_group = a.micro_batch_tokens // a.groups
    length = round(per_group / (fraction * a.group_size))
    tail = (per_group - length) // (a.group_size - 1)
    head = length - tail
    if head < 1 or not 0 < a.response_tokens < tail:
        raise SystemExit(f"fraction {fraction}: head {head} and tail {tail} tokens per sample; need head >= 1 and "
                         f"0 < --response-tokens ({a.response_tokens}) < tail")
    prompts, responses = [], []
    for first in rng.choice(vocab, a.groups, replace=False):
        shared = [int(first)] + rng.integers(0, vocab, head - 1).tolist()
        for start in rng.choice(vocab, a.group_size, replace=False):
            own = [int(start)] + rng.integers(0, vocab, tail - 1).tolist()
            prompts.append(shared + own[: -a.response_tokens])
            responses.append(own[-a.response_tokens :])
    return prompts, responses, {"head_tokens": head, "tail_tokens": tail, "sample_length": length}


def time_pass(run, repeats: int, device) -> tuple[dict, object]:
    """One warm-up, then `repeats` timed calls of `run`: median seconds and the peak memory they reached (CUDA:
    allocated; CPU: growth of the process's peak RSS, which rises only past every earlier peak). (stats, last output)"""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    out = run()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss0, times = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        sync()
        times.append(time.perf_counter() - t0)
    stats = {"seconds": statistics.median(times), "seconds_all": times}
    if device.type == "cuda":
        stats["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        stats["peak_rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return stats, out


def paths(a: Paths) -> dict:
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO))
    import grpo

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_bf16 = device.type == "cuda"  # as bench: fp32 master weights + bf16 autocast on CUDA, fp32 on CPU
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
    tokenizer, model = grpo.load_policy(str(a.model), device)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rng = np.random.default_rng(0)
    cases = {}
    for fraction in a.fractions:
        prompts, responses, shape = shared_head_samples(rng, len(tokenizer), a, fraction)
        rows, case = list(range(len(prompts))), {"target_fraction": fraction, "samples": len(prompts), **shape}
        logps = {}
        for name, share in (("plain", False), ("shared", True)):
            args = grpo.Args(share_prefix=share, micro_batch_tokens=a.micro_batch_tokens, cuda=device.type == "cuda")
            tokens = Counter()

            def forward_backward():  # update_policy's micro-batch loop, the loss reduced to the sum of log-probs
                model.train()
                model.zero_grad(set_to_none=True)
                tokens.clear()
                for _, logp, _ in grpo.micro_batch_logprobs(model, prompts, responses, rows, args, autocast, tokens):
                    logp.sum().backward()
                    tokens["micro_batches"] += 1

            grad, _ = time_pass(forward_backward, a.repeats, device)
            no_grad, out = time_pass(lambda: grpo.logprobs_no_grad(model, prompts, responses, args, autocast),
                                     a.repeats, device)
            logps[name] = torch.cat(out)
            case[name] = {"share_prefix": share, "micro_batches": tokens["micro_batches"],
                          "tokens_computed": tokens["computed"], "sample_tokens": tokens["samples"],
                          "forward_backward": grad, "no_grad": no_grad}
            model.zero_grad(set_to_none=True)
        plain, shared = case["plain"], case["shared"]
        diff = (logps["plain"] - logps["shared"]).abs()
        case.update({
            "computed_fraction": shared["tokens_computed"] / shared["sample_tokens"],
            "token_bound": plain["tokens_computed"] / shared["tokens_computed"],
            "speedup_forward_backward": plain["forward_backward"]["seconds"] / shared["forward_backward"]["seconds"],
            "speedup_no_grad": plain["no_grad"]["seconds"] / shared["no_grad"]["seconds"],
            "logprob_max_abs_diff": diff.max().item(), "logprob_mean_abs_diff": diff.mean().item()})
        cases[f"{fraction:g}"] = case
        print(f"fraction {case['computed_fraction']:.3f} ({len(prompts)} samples x {shape['sample_length']} tokens): "
              f"shared/plain speedup {case['speedup_forward_backward']:.2f} forward+backward, "
              f"{case['speedup_no_grad']:.2f} no-grad (token bound {case['token_bound']:.2f}); "
              f"log-prob max diff {case['logprob_max_abs_diff']:.2g}")
    result = {
        "benchmark": "gpu_paths",
        "model": str(a.model),
        "params": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "bf16_autocast": use_bf16,
        "gradient_checkpointing": a.gradient_checkpointing,
        "micro_batch_tokens": a.micro_batch_tokens,
        "logprob_chunk_tokens": grpo.Args(cuda=device.type == "cuda").logprob_chunk_tokens,
        "repeats": a.repeats,
        "definitions": "per path: median seconds of `repeats` passes after a warm-up, forward+backward (train mode, "
                       "backward of the log-probs' sum per micro-batch) and no-grad (logprobs_no_grad); "
                       "computed_fraction = shared tokens_computed / sample_tokens; token_bound = plain "
                       "tokens_computed / shared tokens_computed (equal lengths: the plain path pads nothing); "
                       "speedup = plain s / shared s; logprob diffs from the no-grad passes",
        "cases": cases,
        "machine": machine(),
        "command": "python benchmarks/gpu_model.py " + " ".join(sys.argv[1:]),
    }
    write_json(a.out, result)
    return result


def iteration(a: Iteration) -> dict:
    import shlex

    peak = {"mib": 0.0, "samples": 0}
    stop = threading.Event()

    def sample():  # whole-device memory in use (the trainer is the only GPU process), every 0.5 s
        while not stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout.split()
                if out:
                    peak["mib"] = max(peak["mib"], float(out[0]))
                    peak["samples"] += 1
            except (OSError, subprocess.SubprocessError, ValueError):
                return
            stop.wait(0.5)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    flags = ["--model", str(a.model), *shlex.split(a.flags)]
    info = run_training("grpo.py", flags, a.runs_dir, a.runs_dir.with_suffix(".log"))
    stop.set()
    thread.join(timeout=15)
    metrics = read_metrics(info["run_dir"])
    row = metrics.get(1, {})
    result = {
        "benchmark": "gpu_iteration",
        "ok": info["returncode"] == 0 and bool(row),
        "run": {k: info[k] for k in ("command", "returncode", "wall_s", "peak_rss_mb", "run_dir")},
        "perf": {k: v for k, v in row.items() if k.startswith(("perf/", "tokens/"))},
        "peak_gpu_memory_used_mib_nvidia_smi": peak["mib"] if peak["samples"] else None,
        "machine": machine(),
    }
    if not result["ok"]:
        result["error"] = tail(info["log"], 3000)
        print(result["error"], file=sys.stderr)
    write_json(a.out, result)
    print(json.dumps(result["perf"], indent=1))
    return result


if __name__ == "__main__":
    cmd = tyro.extras.subcommand_cli_from_dict({"build": Build, "bench": Bench, "paths": Paths, "iteration": Iteration})
    if isinstance(cmd, Build):
        build(cmd)
    elif isinstance(cmd, Bench):
        bench(cmd)
    elif isinstance(cmd, Paths):
        paths(cmd)
    else:
        sys.exit(0 if iteration(cmd)["ok"] else 1)
