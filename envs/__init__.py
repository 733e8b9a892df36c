"""Environment adapters shared by every method script.

One small protocol, one module per real environment. A method script only ever does:

    spec = envs.load("cooking", data=None)       # the adapter module + its options
    spec.preset.max_steps                         # per-env defaults (verl-agent where they exist)
    spec.task_ids("train")                        # task ids of a split
    runner = envs.EnvRunner(spec, num_workers=4)  # env instances in worker processes
    steps = runner.reset(task_ids)                # -> list[Step], one per episode
    text = spec.prompt(...); action, valid = spec.parse(response)

Each adapter module (envs/cooking.py, envs/alfworld.py, ...) defines, in this order:
  PRESET                      a Preset
  task_ids(split, **kw)       the task ids of a split (cheap, no engine started)
  class Env(**kw)             reset(task_id) -> Step, step(action) -> Step,
                              reference_actions(task_id) -> list[str] (action data, never an answer),
                              demonstration(task_id) -> list[str] (the expert's whole episode),
                              prepare(task_id), close()
  project_state(state, task, reference_actions) -> frozenset
                              ProAS's task-relevant, order-invariant abstract state
  prompt(task, observation, admissible, history, step_count, history_length) -> str
  parse(response) -> (action, valid)
  answer(thought, action) -> str
                              the env's answer format around an action (sft.py's targets)

Environment packages are imported inside the adapter, so a missing package only fails that
env, with an EnvUnavailable error naming the install command.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Hashable, Optional


class EnvUnavailable(RuntimeError):
    """An env's package or data is missing; the message says how to install it."""


@dataclass
class Step:
    """What reset() and step() return: one observation of one episode."""

    observation: str
    reward: float
    done: bool
    won: bool
    admissible: Optional[list[str]]
    task: str
    task_type: str
    state: Hashable
    score: float = 0.0
    """raw progress score where the env has one (ScienceWorld 0..100, WebShop 0..1)"""
    crashed: bool = False
    """the env raised or its worker died: the episode ends as failed, training goes on"""
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Preset:
    """Per-env defaults; a method script's flags override them when given."""

    max_steps: int
    history_length: int
    max_prompt_tokens: int
    max_new_tokens: int
    success_reward: float
    invalid_penalty: float
    eval_split: str
    train_split: str = "train"


# name -> (module, fixed keyword options). Modules are imported on first use only.
ENVS: dict[str, tuple[str, dict]] = {
    "cooking": ("envs.cooking", {}),
    "cooking-easy": ("envs.cooking", {"level": "easy"}),
    # easy games with a one-line answer example, for ~100M-parameter models (benchmarks/learning.py)
    "cooking-small": ("envs.cooking", {"level": "easy", "template": "oneline"}),
    "alfworld": ("envs.alfworld", {}),
    "sciworld": ("envs.sciworld", {}),
    "search": ("envs.search", {}),
    "webshop": ("envs.webshop", {}),
}


@dataclass
class EnvSpec:
    """An adapter module bound to its options: everything the main process needs."""

    name: str
    module_name: str
    kwargs: dict

    @property
    def module(self):
        return importlib.import_module(self.module_name)

    @property
    def preset(self) -> Preset:
        return self.module.PRESET

    def task_ids(self, split: str) -> list[str]:
        return self.module.task_ids(split, **self.kwargs)

    def make(self):
        return self.module.Env(**self.kwargs)

    def prompt(self, task, observation, admissible, history, step_count, history_length) -> str:
        style = {"template": self.kwargs["template"]} if "template" in self.kwargs else {}  # cooking-small
        return self.module.prompt(task, observation, admissible, history, step_count, history_length, **style)

    def parse(self, response: str) -> tuple[str, bool]:
        return self.module.parse(response)

    def answer(self, thought: str, action: str) -> str:
        return self.module.answer(thought, action)

    def project_state(self, state, task, reference_actions) -> frozenset:
        return self.module.project_state(state, task, reference_actions)


CJK = re.compile(r"[\u4e00-\u9fff]")


def verl_projection(response: str, tail_chars: int) -> tuple[str, bool]:
    """verl-agent's action projection (ALFWorld 30, WebShop 20 tail chars): lowercase; the text
    between <action> and </action> is the action; without both tags the raw tail is sent and the
    step is invalid; missing <think>/</think> (case-sensitive) or CJK text also make it invalid."""
    lowered = response.lower()
    start, end = lowered.find("<action>"), lowered.find("</action>")
    if start != -1 and end != -1:
        action, valid = lowered[start + len("<action>") : end].strip(), True
    else:
        action, valid = lowered[-tail_chars:], False
    if "<think>" not in response or "</think>" not in response or CJK.search(response):
        valid = False
    return action, valid


def verl_answer(thought: str, action: str) -> str:
    """A well-formed answer under verl_projection: the thought in <think> tags, then the action."""
    return f"<think>{thought}</think>\n<action>{action}</action>"


def load(name: str, **kwargs) -> EnvSpec:
    """Resolve an env name; options that are None are dropped so adapters keep their defaults."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; choose one of: {', '.join(ENVS)}")
    module_name, fixed = ENVS[name]
    options = {**fixed, **{k: v for k, v in kwargs.items() if v is not None}}
    spec = EnvSpec(name, module_name, options)
    spec.module  # import now, so a missing package fails before any model is loaded
    return spec


from envs.runner import EnvRunner  # noqa: E402  (the runner needs Step, defined above)
