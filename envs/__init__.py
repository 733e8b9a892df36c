"""Environment adapters shared by every method script.

One small protocol, one module per real environment. A method script only ever does:

    spec = envs.load("cooking", data=None)       # the adapter module + its options
    spec.preset.max_steps                         # per-env defaults (verl-agent where they exist)
    train_tasks = spec.task_ids("train")          # task ids of a split
    print(spec.probe(train_tasks))                # start one env now: a broken env fails before the model loads
    runner = envs.EnvRunner(spec, num_workers=4)  # env instances in worker processes
    steps = runner.reset(task_ids)                # -> list[Step], one per episode
    text = spec.prompt(...); action, valid = spec.parse(response)
    envs.most_crashed([s.crashed for s in ...])   # the line to stop with when most episodes crashed

Each adapter module (envs/cooking.py, envs/alfworld.py, ...) defines, in this order:
  PRESET                      a Preset
  task_ids(split, **kw)       the task ids of a split (cheap, no engine started)
  task_type(task_id)          the task's type, read off its id (success is logged per type)
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

import contextlib
import importlib
import re
import time
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
    minibatch_size: int = 256  # verl-agent's ppo_mini_batch_size
    step_norm: str = "mean_std"  # GiGPO's advantage normalisation (verl-agent's `mode`)


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

    def task_type(self, task_id: str) -> str:
        return self.module.task_type(task_id)

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

    def project_action(self, action: str) -> str:
        """An action as a progress graph names it (WebShop: every search is one action); else as it is."""
        return getattr(self.module, "project_action", lambda a: a)(action)

    def reference_variants(self, transitions: list[tuple]) -> list[tuple]:
        """Transitions a reference graph holds besides the replayed (projected) ones: WebShop's option
        clicks in every order; none for the other envs."""
        return getattr(self.module, "reference_variants", lambda t: [])(transitions)

    def probe(self, task_ids: list[str]) -> str:
        """Start one env on the first task (of the train split) in this process, then close it, so a
        run whose env cannot start (no retrieval server, missing data, Java broken) stops with one
        line before any model loads. Any error becomes EnvUnavailable; returns the line to print."""
        if not task_ids:
            raise EnvUnavailable(f"env {self.name} has no training tasks")
        start, env = time.perf_counter(), None
        try:
            env = self.make()
            env.prepare(task_ids[0])
            env.reset(task_ids[0])
        except EnvUnavailable:
            raise
        except Exception as e:
            raise EnvUnavailable(f"env {self.name} cannot start task {task_ids[0]}: {type(e).__name__}: {e}") from e
        finally:
            with contextlib.suppress(Exception):
                env is not None and env.close()
        return f"env {self.name}: started {task_ids[0]} in {time.perf_counter() - start:.1f}s ({len(task_ids)} tasks)"


def most_crashed(crashed: list[bool]) -> str | None:
    """When most episodes of an iteration crashed (their env failed, not the policy), the line the
    run stops with: their rewards say nothing about the policy. None otherwise."""
    if 2 * sum(crashed) > len(crashed):
        return (f"{sum(crashed)} of {len(crashed)} episodes of this iteration crashed (see the warnings above): "
                f"the env is failing; stopping rather than training on them")
    return None


CJK = re.compile(r"[\u4e00-\u9fff]")


def verl_projection(response: str, tail_chars: int) -> tuple[str, bool]:
    """verl-agent's action projection (ALFWorld 30, WebShop 20 tail chars): lowercase; the text
    between <action> and </action> is the action; without both tags the raw tail is sent and the
    step is invalid; missing <think>/</think> (case-sensitive) or CJK text also make it invalid.

    Where this differs from verl-agent: it reads from the first <action> to the first </action>
    whatever else the response holds, so `</action>x<action>` gave an empty valid action and
    `<action><action>x</action>` a valid `<action>x`. Here the action tags must be exactly one
    <action> before one </action>, and the first <think> must come before the first </think>;
    any other tag structure (reversed, nested, repeated) is malformed and treated as missing
    tags: the raw tail is sent and the step is invalid."""
    lowered = response.lower()
    start, end = lowered.find("<action>"), lowered.find("</action>")
    well_formed = lowered.count("<action>") == lowered.count("</action>") == 1 and start < end
    if well_formed:
        action, valid = lowered[start + len("<action>") : end].strip(), True
    else:
        action, valid = lowered[-tail_chars:], False
    think, unthink = response.find("<think>"), response.find("</think>")
    if think == -1 or unthink == -1 or unthink < think or CJK.search(response):
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
