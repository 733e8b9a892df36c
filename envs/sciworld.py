"""ScienceWorld (30 elementary-science tasks in a text simulator, Java): StraTA's third env.

The `scienceworld` package ships its own jar; each Env instance starts one JVM (about 1.5 s)
on first use and reuses it for every later episode (`load` swaps the task in about 20 ms).

Task ids are `{taskName}-{variation}` (e.g. `boil-21`); the train / dev / test splits are the
package's own variation lists (`get_variations_train/dev/test`, about 50/25/25% per task name),
read once from a JVM and cached under ~/.cache/agentic-rl/. The simplification is "easy"
(teleport, open doors, self-watering pots, no electrical actions except for the electrical tasks),
as in the verl-agent forks that add ScienceWorld.

Progress is the task score (0..100): Step.score, and the first part of the state. Success is
the task completed with score 100 (a wrong `focus on` ends the task with a negative score).
Interpretation (the StraTA paper gives no env details): 100 steps, ScienceWorld's own default
step limit and the forks' `envStepLimit`; reward 10 * won as for ALFWorld; the prompt is
verl-agent's ALFWorld template, showing ScienceWorld's own action templates ("focus on OBJ", about
25) instead of the ~1,000 valid action strings the engine can enumerate at a step.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import lru_cache
from pathlib import Path

from envs import EnvUnavailable, Preset, Step, verl_answer, verl_projection

PRESET = Preset(
    max_steps=100, history_length=2, max_prompt_tokens=4096, max_new_tokens=512,
    success_reward=10.0, invalid_penalty=0.1, eval_split="test",
)

SPLITS = ("train", "dev", "test")
SIMPLIFICATION = "easy"
STEP_LIMIT = 100_000  # the trainer enforces max_steps; the engine's own limit would end replays early
HIDDEN_TEMPLATES = {"reset task"}  # restarting the episode from inside it is not an agent action
CACHE = Path.home() / ".cache" / "agentic-rl"


def _scienceworld():
    try:
        import scienceworld
    except ImportError as e:
        raise EnvUnavailable(f"the sciworld env needs scienceworld: pip install scienceworld ({e})") from e
    if shutil.which("java") is None:
        raise EnvUnavailable("ScienceWorld needs Java 11+ on PATH: apt-get install openjdk-17-jre-headless "
                             "(or conda install -c conda-forge openjdk=17)")
    return scienceworld


def parse_task_id(task_id: str) -> tuple[str, int]:
    name, _, variation = task_id.rpartition("-")
    return name, int(variation)


# ---- load data ----------------------------------------------------------------------------
def task_ids(split: str, **_) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"sciworld splits are {list(SPLITS)}, not {split!r}")
    return [f"{name}-{v}" for name, splits in variations().items() for v in splits[split]]


@lru_cache(maxsize=None)
def variations() -> dict[str, dict[str, list[int]]]:
    """taskName -> {train, dev, test} variation lists, as the package defines them (cached on disk)."""
    sw = _scienceworld()
    path = CACHE / f"sciworld-variations-{sw.__version__}.json"
    if path.exists():
        return json.loads(path.read_text())
    env = sw.ScienceWorldEnv("", envStepLimit=STEP_LIMIT)
    try:
        out = {}
        for name in env.get_task_names():
            env.load(name, 0, SIMPLIFICATION)
            out[name] = {"train": env.get_variations_train(), "dev": env.get_variations_dev(),
                         "test": env.get_variations_test()}
    finally:
        env.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(out)}")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)  # atomic: concurrent first calls do not read half a file
    return out


# ---- state ------------------------------------------------------------------------------
def room_of(look: str) -> str:
    match = re.match(r"This room is called the (.+?)\.", look.strip())
    return match.group(1) if match else "unknown"


def inventory_of(inv: str) -> list[str]:
    """'In your inventory, you see:\\n\\tan orange\\n' -> ['orange']"""
    items = [line.strip() for line in inv.splitlines()[1:] if line.strip()]
    return [re.sub(r"^(a|an|the) ", "", item) for item in items]


def science_state(score: int, look: str, inv: str) -> frozenset:
    return frozenset([f"score:{score}", f"location:{room_of(look)}", *(f"inventory:{i}" for i in inventory_of(inv))])


def project_state(state: frozenset, task: str, reference_actions: list[str]) -> frozenset:
    """ProAS's abstract state: the score milestone, the room when the task or gold path names it
    (else 'elsewhere'), and only the carried things they name (by the part before any '(...)')."""
    text = " ".join([task.lower(), *[a.lower() for a in reference_actions]])
    named = lambda thing: re.search(rf"\b{re.escape(thing.lower())}\b", text) is not None  # noqa: E731
    kept = set()
    for fact in state:
        kind, _, value = fact.partition(":")
        if kind == "score":
            kept.add(fact)
        elif kind == "location":
            kept.add(fact if named(value) else "location:elsewhere")
        elif kind == "inventory" and named(value.split(" (")[0].strip()):
            kept.add(fact)
    return frozenset(kept)


class Env:
    def __init__(self, simplification: str = SIMPLIFICATION, **_):
        self.simplification = simplification
        self._sw = None  # the ScienceWorldEnv (one JVM), started on first use
        self.jvm_starts = 0
        self._gold: dict[str, list[str]] = {}
        self._templates: list[str] = []
        self.task = ""
        self.task_type = ""

    def _engine(self):
        if self._sw is None:
            self._sw = _scienceworld().ScienceWorldEnv("", envStepLimit=STEP_LIMIT)
            self.jvm_starts += 1
        return self._sw

    def prepare(self, task_id: str) -> None:
        parse_task_id(task_id)

    # ---- reset ----------------------------------------------------------------------------
    def reset(self, task_id: str) -> Step:
        name, variation = parse_task_id(task_id)
        sw = self._engine()
        sw.load(name, variation, self.simplification)
        observation, info = sw.reset()  # plays "look around"
        self.task = sw.get_task_description().strip()
        self.task_type = name
        self._templates = [t for t in sw.get_possible_actions() if t not in HIDDEN_TEMPLATES]
        return self._step(observation, info, done=False)

    # ---- step -----------------------------------------------------------------------------
    def step(self, action: str) -> Step:
        # ScienceWorldEnv.step also lists every valid action (~20 of its ~25 ms); we need only
        # what it computes besides, so ask the simulator directly (same calls, same rules).
        server = self._sw.server
        observation = server.step(action)
        score = int(round(100 * server.getScore()))
        done = bool(server.getCompleted()) or score < 0
        info = {"score": score, "look": server.freeActionLook(), "inv": server.freeActionInventory()}
        return self._step(observation, info, done)

    def _step(self, observation: str, info: dict, done: bool) -> Step:
        score = int(info["score"])
        won = score >= 100
        return Step(
            observation=observation.strip(),
            reward=PRESET.success_reward * won,
            done=bool(done or won),
            won=won,
            admissible=list(self._templates),
            task=self.task,
            task_type=self.task_type,
            state=science_state(max(score, 0), info["look"], info["inv"]),
            score=float(max(score, 0)),  # a failed task reads -100 in the engine; as progress it is 0
            info={"raw_score": score},
        )

    # ---- reference actions ----------------------------------------------------------------
    def reference_actions(self, task_id: str) -> list[str]:
        """The engine's gold action sequence. Generating it reloads the simulator (a few seconds
        for some tasks), so call it before reset, as the runner does; results are memoised."""
        if task_id not in self._gold:
            name, variation = parse_task_id(task_id)
            sw = self._engine()
            sw.load(name, variation, self.simplification, generateGoldPath=True)
            self._gold[task_id] = list(sw.get_gold_action_sequence())
        return list(self._gold[task_id])

    def demonstration(self, task_id: str) -> list[str]:
        """The expert's whole episode: the reference actions win the game on their own."""
        return self.reference_actions(task_id)

    def close(self) -> None:
        if self._sw is not None:
            self._sw.close()
            self._sw = None


# ---- prompt ---------------------------------------------------------------------------------
# verl-agent's ALFWorld template with the env named and ScienceWorld's action templates listed.
TEMPLATE_NO_HIS = """
You are an expert agent operating in the ScienceWorld text-based science environment. {task_description}
Your current observation is: {current_observation}
Your admissible actions of the current situation follow these templates: [{admissible_actions}], where OBJ is an object, container or place you have observed.

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""

TEMPLATE = """
You are an expert agent operating in the ScienceWorld text-based science environment. {task_description}
Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} observations and the corresponding actions you took: {action_history}
You are now at step {current_step} and your current observation is: {current_observation}
Your admissible actions of the current situation follow these templates: [{admissible_actions}], where OBJ is an object, container or place you have observed.

Now it's your turn to take an action.
You should first reason step-by-step about the current situation. This reasoning process MUST be enclosed within <think> </think> tags. 
Once you've finished your reasoning, you should choose an admissible action for current step and present it within <action> </action> tags.
"""


def prompt(task, observation, admissible, history, step_count, history_length) -> str:
    actions = "\n ".join(f"'{a}'" for a in (admissible or []))
    if step_count == 0 or history_length <= 0 or not history:
        return TEMPLATE_NO_HIS.format(task_description=task, current_observation=observation, admissible_actions=actions)
    first = step_count - len(history) + 1
    action_history = "\n".join(
        f"[Observation {first + k}: '{o}', Action {first + k}: '{a}']" for k, (o, a) in enumerate(history)
    )
    return TEMPLATE.format(task_description=task, step_count=step_count, history_length=len(history),
                           action_history=action_history, current_step=step_count + 1,
                           current_observation=observation, admissible_actions=actions)


# ---- parse ----------------------------------------------------------------------------------
def parse(response: str) -> tuple[str, bool]:
    """verl-agent's ALFWorld projection (ScienceWorld's parser is case-insensitive)."""
    return verl_projection(response, tail_chars=30)


def answer(thought: str, action: str) -> str:
    """The answer format parse() reads: <think>thought</think> then <action>action</action>."""
    return verl_answer(thought, action)
