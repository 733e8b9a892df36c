"""ScienceWorld (30 elementary-science tasks in a text simulator, Java): StraTA's third env.

The `scienceworld` package ships its own jar. A process starts one JVM and each of its Envs runs
its own simulator in it (see JVM), reused for every later episode (`load` swaps the task).

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

import contextlib
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
# Engine commands that are not task actions (found in scienceworld 1.2.3's jar): `reset task`
# wipes the goal progress mid-episode (a listed template, hidden from the prompt); `help` and
# `objects` print every action template and object name. The engine drops the articles a, an and
# the anywhere ("reset the task" resets too), so they are compared without them.
META_COMMANDS = {"reset task", "help", "objects"}
ARTICLES = {"a", "an", "the"}
# SerialGC and a heap that gives memory back keep a JVM near its live data (2 cores, small heaps).
JAVA_OPTS = ["-XX:+UseSerialGC", "-Xmx4g", "-XX:MinHeapFreeRatio=10", "-XX:MaxHeapFreeRatio=30",
             "--add-opens=java.base/java.util=ALL-UNNAMED"]  # to save and restore scala's Random
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


class JVM:
    """This process's ScienceWorld JVM (py4j), shared by its Envs; it stops when the last one closes.

    Memory: ScienceWorldEnv starts a JVM per instance, about 200 MB after a load and 480-720 MB
    after 100 steps (default heap settings, 23 GB machine): the default run's 128 episode slots
    would need more than a 24 GB machine has. One simulator in a shared JVM holds about 12 MB: the
    default run on 4 workers measured 2.5 GB in all (4 JVMs of about 620 MB).

    The engine has two process-wide variables a simulator changes as it plays: the object-id
    counter, which each load resets (object equality is id equality, so another simulator's load
    would hand out ids its objects already hold), and scala's global Random (wandering animals,
    pollination, genes). Each simulator keeps its own copy of both, swapped in around its calls.
    What still crosses simulators is the JVM's history, as it did for the tasks a reused
    ScienceWorldEnv plays in turn: e.g. the order a room lists its objects in."""

    current: JVM | None = None
    starts = 0

    def __init__(self):
        from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway

        constants = _scienceworld().constants
        port, proc = launch_gateway(classpath=constants.JAR_PATH, cwd=constants.BASEPATH, die_on_exit=True,
                                    return_proc=True, javaopts=JAVA_OPTS)
        self.gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port), java_process=proc)
        jvm = self.gateway.jvm
        self.ids = getattr(getattr(jvm.util, "UniqueIdentifier$"), "MODULE$")
        self.random = getattr(getattr(jvm.scala.util, "Random$"), "MODULE$").self()  # a java.util.Random
        self.seed = jvm.java.lang.Class.forName("java.util.Random").getDeclaredField("seed")
        self.seed.setAccessible(True)  # its 48-bit state, read as a number
        self.users = 0
        JVM.starts += 1

    @classmethod
    def acquire(cls) -> JVM:
        if cls.current is None or cls.current.gateway.java_process.poll() is not None:
            cls.current = JVM()
        cls.current.users += 1
        return cls.current

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and JVM.current is self:
            JVM.current = None
            with contextlib.suppress(Exception):  # a JVM that died answers nothing
                self.gateway.shutdown()
            self.gateway.java_process.kill()
            self.gateway.java_process.wait()

    def swapped(self, state: tuple[int, int], call):
        """call() with the process-wide (id counter, Random seed) set to `state`; returns both after."""
        getattr(self.ids, "count_$eq")(state[0])
        self.random.setSeed(state[1] ^ 0x5DEECE66D)  # setSeed(s) sets the state to s ^ 0x5DEECE66D
        out = call()
        return out, (self.ids.count(), self.seed.get(self.random))


def meta_command(action: str) -> bool:
    return " ".join(w for w in action.lower().split() if w not in ARTICLES) in META_COMMANDS


def parse_task_id(task_id: str) -> tuple[str, int]:
    name, _, variation = task_id.rpartition("-")
    return name, int(variation)


# ---- load data ----------------------------------------------------------------------------
def task_ids(split: str, **_) -> list[str]:
    if split not in SPLITS:
        raise ValueError(f"sciworld splits are {list(SPLITS)}, not {split!r}")
    return [f"{name}-{v}" for name, splits in variations().items() for v in splits[split]]


def task_type(task_id: str) -> str:
    return parse_task_id(task_id)[0]


@lru_cache(maxsize=None)
def variations() -> dict[str, dict[str, list[int]]]:
    """taskName -> {train, dev, test} variation lists, as the package defines them (cached on disk)."""
    path = CACHE / f"sciworld-variations-{_scienceworld().__version__}.json"
    if path.exists():
        return json.loads(path.read_text())
    env = Env()
    try:
        sim, out = env.simulator(), {}
        for name in sim.getTaskNames():
            sim.load(name, 0, SIMPLIFICATION, False)
            out[name] = {"train": list(sim.getVariationsTrain()), "dev": list(sim.getVariationsDev()),
                         "test": list(sim.getVariationsTest())}
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
        self._jvm: JVM | None = None
        self._sim = None  # this Env's simulator (a PythonInterface in the process's JVM)
        self._globals = (0, 0)  # its copy of the JVM's id counter and Random seed
        self._gold: dict[str, list[str]] = {}
        self._templates: list[str] = []
        self.task = ""
        self.task_type = ""

    def simulator(self):
        if self._sim is None or self._jvm.gateway.java_process.poll() is not None:
            self.close()
            self._jvm = JVM.acquire()
            self._sim = self._jvm.gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        return self._sim

    def _play(self, call):
        out, self._globals = self._jvm.swapped(self._globals, call)
        return out

    def _load(self, task_id: str, gold_path: bool) -> None:
        name, variation = parse_task_id(task_id)
        sim = self.simulator()
        error = self._play(lambda: sim.load(name, variation, self.simplification, gold_path))
        if error:
            raise RuntimeError(f"ScienceWorld cannot load {task_id}: {error}")

    def prepare(self, task_id: str) -> None:
        parse_task_id(task_id)

    # ---- reset ----------------------------------------------------------------------------
    def reset(self, task_id: str) -> Step:
        self._load(task_id, gold_path=False)  # a fresh load is what ScienceWorldEnv.reset() reloads to
        self.task = self._sim.getTaskDescription().strip()
        self.task_type = task_type(task_id)
        self._templates = [t for t in self._sim.getPossibleActions() if not meta_command(t)]
        return self.step("look around")  # ScienceWorldEnv.reset's first move

    # ---- step -----------------------------------------------------------------------------
    def step(self, action: str) -> Step:
        """One engine step (the simulator's own calls; ScienceWorldEnv.step also lists every valid
        action, ~20 of its ~25 ms). A meta command is not sent: the engine's unknown-action reply."""
        sim = self._sim

        def play():
            observation = "No known action matches that input." if meta_command(action) else sim.step(action)
            score = int(round(100 * sim.getScore()))
            return observation, score, bool(sim.getCompleted()), sim.freeActionLook(), sim.freeActionInventory()

        observation, score, completed, look, inv = self._play(play)
        won = score >= 100
        return Step(
            observation=observation.strip(),
            reward=PRESET.success_reward * won,
            done=completed or score < 0 or won,
            won=won,
            admissible=list(self._templates),
            task=self.task,
            task_type=self.task_type,
            state=science_state(max(score, 0), look, inv),
            score=float(max(score, 0)),  # a failed task reads -100 in the engine; as progress it is 0
            info={"raw_score": score},
        )

    # ---- reference actions ----------------------------------------------------------------
    def reference_actions(self, task_id: str) -> list[str]:
        """The engine's gold action sequence. Generating it reloads the simulator (a few seconds
        for some tasks), so call it before reset, as the runner does; results are memoised."""
        if task_id not in self._gold:
            self._load(task_id, gold_path=True)
            self._gold[task_id] = list(self._sim.getGoldActionSequence())
        return list(self._gold[task_id])

    def demonstration(self, task_id: str) -> list[str]:
        """The expert's whole episode: the reference actions win the game on their own."""
        return self.reference_actions(task_id)

    def close(self) -> None:
        if self._jvm is not None:
            self._jvm.release()
        self._jvm, self._sim = None, None


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
    """verl-agent's ALFWorld projection (ScienceWorld's parser is case-insensitive); an engine
    meta command (`reset task`, `help`, `objects`) is not a task action: invalid (and not played)."""
    action, valid = verl_projection(response, tail_chars=30)
    return action, valid and not meta_command(action)


def answer(thought: str, action: str) -> str:
    """The answer format parse() reads: <think>thought</think> then <action>action</action>."""
    return verl_answer(thought, action)
