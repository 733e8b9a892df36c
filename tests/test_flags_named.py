"""A guard against flags that arrive untested: every field of every script's Args is named in some test (as its
command-line flag, `--no-<flag>` for a boolean, a keyword, or an attribute), or is listed below with the reason
it needs no test. Named is not pinned: `tools/flagcheck.py` checks that a test notices a flag's effect.
This only makes sure a new flag cannot arrive without anyone writing a line about it."""

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["grpo.py", "gigpo.py", "proas.py", "strata.py", "actguide.py", "pats.py", "sft.py"]

# field -> why no test names it (every script's field of that name)
NEEDS_NO_TEST = {
    "exp_name": "names the run folder only; the tests find the folder they made whatever its name",
    "run_name": "set by the script itself (env, exp_name, seed, time), not by users",
    "track": "Weights & Biases logging needs the network, which tests do not have; TensorBoard and metrics.jsonl are tested",
    "wandb_project_name": "Weights & Biases only (see track)",
    "wandb_entity": "Weights & Biases only (see track)",
    "vllm_gpu_memory_utilization": "CUDA only: on CPU the scripts size vLLM's KV cache to the run",
}
# field -> the issue that owes it a test (debt, written down so that it is not forgotten; empty now)
NOT_YET_TESTED: dict[str, str] = {}


def args_fields(script: str) -> list[str]:
    # the imported Args, not ast.parse: in a long pytest session CPython 3.11's parser once raised
    # "SystemError: AST constructor recursion depth mismatch" here
    return [f.name for f in dataclasses.fields(importlib.import_module(script[: -len(".py")]).Args)]


def texts_of_tests() -> str:
    return "\n".join(path.read_text() for path in sorted((REPO / "tests").glob("*.py")) if path.name != Path(__file__).name)


def is_named(field: str, text: str) -> bool:
    flag = field.replace("_", "-")
    return any(re.search(pattern, text) for pattern in (
        rf"--(no-)?{re.escape(flag)}(?![\w-])",  # on a command line
        rf"\b{field}\s*=[^=]",  # a keyword: Args(field=...), replace(args, field=...)
        rf"\.{field}\b",  # an attribute: args.field
        rf"[\"']{field}[\"']",  # a name: getattr, parametrize
    ))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_named_in_a_test_or_says_why_not(script):
    text = texts_of_tests()
    unnamed = [f for f in args_fields(script) if not is_named(f, text) and f not in NEEDS_NO_TEST and f not in NOT_YET_TESTED]
    assert not unnamed, f"{script}: no test names {unnamed}; test them, or add each to NEEDS_NO_TEST with the reason"


def test_the_lists_hold_no_stale_entries():
    """An entry whose field is gone, or is now tested, is removed, so the lists stay the true debt."""
    fields = {f for script in SCRIPTS for f in args_fields(script)}
    text = texts_of_tests()
    assert not set(NEEDS_NO_TEST) - fields and not set(NOT_YET_TESTED) - fields
    assert not [f for f in NOT_YET_TESTED if is_named(f, text)], "tested now: remove it from NOT_YET_TESTED"


def test_the_guard_sees_a_new_flag():
    """A field no test mentions is caught, and each way of naming it counts."""
    text = 'run("grpo.py", "--clip-ratio", "0.1", "--no-diverse")\nArgs(kl_coef=0.1)\nassert args.gamma == 1\n"beta"'
    assert not is_named("brand_new_flag", text)
    assert all(is_named(f, text) for f in ("clip_ratio", "diverse", "kl_coef", "gamma", "beta"))
    assert not is_named("clip_ratio_high", text) and not is_named("kl", text)
