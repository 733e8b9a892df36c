"""Parallel env runner: many env instances stepped in worker processes.

Episode i lives on worker i % num_workers. Each call (prepare, reset, step) is sent to every
worker that has work and then collected, so workers step their episodes at the same time while
the main process waits once. A worker whose env raises, hangs or dies does not end the run: the
affected episodes come back as crashed (done, not won), the worker is restarted, and the next
reset works again.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import time
import traceback

# Seconds a worker may take over one env call before it counts as frozen: it is restarted and its
# episodes crash. The slowest real calls measured, as CPU s / wall s, at nice 19 on 2 cores that
# two full-priority runs kept busy (a starved worst case: wall up to 100x CPU; a run's own
# processes share the cores at equal priority, about 2-3x CPU on 2 busy cores):
#   reset: ALFWorld first reset of a game 2.5 / 74 (median 2.1 CPU over 10 valid_unseen games);
#          cooking 0.02 / 0.7; ScienceWorld 0.17 / 0.6 (JVM start and first load: 38 wall)
#   setup: cooking compile 4.6 / 134 (511 wall once, starved); ScienceWorld gold path 5.8 / 7.4
#          (mendelian genetics, the slowest of the 30 tasks), 4.1 / 67 (boil)
WORKER_TIMEOUT_S = float(os.environ.get("ENV_WORKER_TIMEOUT_S", "120"))  # reset, step
SETUP_TIMEOUT_S = float(os.environ.get("ENV_SETUP_TIMEOUT_S", "600"))  # per-task calls (build a task)
# Commands about a task rather than an episode: run on a worker's spare env (slot -1), setup timeout.
TASK_CALLS = {"prepare": "prepare", "reference": "reference_actions", "demonstration": "demonstration"}


def _crash_step(message: str, last=None):
    from envs import Step

    return Step(
        observation=f"[env crashed: {message}]",
        reward=0.0,
        done=True,
        won=False,
        admissible=None,
        task=getattr(last, "task", ""),
        task_type=getattr(last, "task_type", ""),
        state=getattr(last, "state", frozenset()),
        crashed=True,
    )


def _worker(conn, module_name: str, kwargs: dict) -> None:
    """Worker loop: holds one env instance per episode slot; never raises on env errors."""
    import importlib

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    module = importlib.import_module(module_name)
    envs: dict[int, object] = {}

    def env_for(slot: int):
        if slot not in envs:
            envs[slot] = module.Env(**kwargs)
        return envs[slot]

    def guarded(slot: int, fn):
        try:
            return fn(env_for(slot))
        except Exception as e:  # the env broke: report, drop the instance, keep serving
            detail = f"{type(e).__name__}: {e}"
            if os.environ.get("ENV_DEBUG"):
                detail += "\n" + traceback.format_exc()
            env = envs.pop(slot, None)
            try:
                env is not None and env.close()
            except Exception:
                pass
            return _crash_step(detail)

    while True:
        try:
            cmd, payload = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        if cmd == "close":
            for env in envs.values():
                try:
                    env.close()
                except Exception:
                    pass
            conn.send(None)
            break
        # one answer per item, sent as soon as it is ready: the trainer's timeout is per env call
        for item in payload:
            if cmd in TASK_CALLS:
                out = guarded(-1, lambda env, t=item: getattr(env, TASK_CALLS[cmd])(t))
            elif cmd == "reset":
                out = guarded(item[0], lambda env, t=item[1]: env.reset(t))
            elif cmd == "step":
                out = guarded(item[0], lambda env, a=item[1]: env.step(a))
            else:
                out = ValueError(f"unknown command {cmd}")
            conn.send(out)


@contextlib.contextmanager
def _main_script_hidden():
    """A spawned process re-runs the imports of the parent's main script when `__main__` names its
    file: torch and the rest of a training script, about 230 MB and seconds of CPU per worker that
    only needs `envs`. Hidden while a worker starts, the file is not re-run there."""
    main = sys.modules["__main__"]
    path = main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        if path is not None:
            main.__file__ = path


class EnvRunner:
    """Steps episodes of one env in `num_workers` processes (spawned: safe beside torch threads)."""

    def __init__(self, spec, num_workers: int = 4, timeout_s: float | None = None):
        self.spec = spec
        self.num_workers = max(1, int(num_workers))
        self.timeout_s = WORKER_TIMEOUT_S if timeout_s is None else timeout_s  # per reset or step
        self.setup_timeout_s = max(SETUP_TIMEOUT_S, self.timeout_s)  # per TASK_CALLS item
        self._ctx = mp.get_context("spawn")
        self._procs: list = [None] * self.num_workers
        self._conns: list = [None] * self.num_workers
        self._last: dict[int, object] = {}
        self._types: dict[int, str] = {}  # episode -> its task's type, for an episode that fails at reset
        self.crashes = 0
        for w in range(self.num_workers):
            self._start(w)

    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_worker, args=(child, self.spec.module_name, self.spec.kwargs), daemon=True
        )
        with _main_script_hidden():
            proc.start()
        child.close()
        self._procs[w], self._conns[w] = proc, parent

    def _restart(self, w: int) -> None:
        self.crashes += 1
        proc = self._procs[w]
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(timeout=5)
        self._start(w)

    def _call(self, cmd: str, per_worker: dict[int, list]) -> dict[int, list]:
        """Send one command to every worker with work, then gather each item's answer as it comes.
        A worker that dies, or answers none of its items in time, is restarted and yields None."""
        limit = self.setup_timeout_s if cmd in TASK_CALLS else self.timeout_s
        waiting: dict[int, int] = {}  # worker -> items it still owes
        failed: set[int] = set()
        for w, payload in per_worker.items():
            if not payload:
                continue
            try:
                self._conns[w].send((cmd, payload))
                waiting[w] = len(payload)
            except (BrokenPipeError, OSError):
                failed.add(w)
        answers: dict[int, list] = {w: [] for w in waiting}
        deadline = {w: time.monotonic() + limit for w in waiting}
        while waiting:
            by_conn = {self._conns[w]: w for w in waiting}
            timeout = max(0.0, min(deadline[w] for w in waiting) - time.monotonic())
            for conn in mp_connection.wait(list(by_conn), timeout):
                w = by_conn[conn]
                try:
                    answer = conn.recv()
                except (EOFError, OSError, ConnectionResetError):
                    answer = ConnectionError("worker died")
                if isinstance(answer, Exception):
                    failed.add(w)
                    del waiting[w]
                    continue
                answers[w].append(answer)
                deadline[w] = time.monotonic() + limit
                waiting[w] -= 1
                if not waiting[w]:
                    del waiting[w]
            for w in [w for w in waiting if time.monotonic() > deadline[w]]:  # frozen: no answer in time
                failed.add(w)
                del waiting[w]
        for w in failed:
            self._restart(w)
        return {w: None if w in failed else answers.get(w) for w in per_worker if per_worker[w]}

    def _episodes_call(self, cmd: str, items: dict[int, object]) -> dict[int, object]:
        per_worker: dict[int, list] = {w: [] for w in range(self.num_workers)}
        order: dict[int, list[int]] = {w: [] for w in range(self.num_workers)}
        for ep, value in items.items():
            w = ep % self.num_workers
            per_worker[w].append((ep // self.num_workers, value))
            order[w].append(ep)
        results = self._call(cmd, per_worker)
        out = {}
        for w, eps in order.items():
            if not eps:
                continue
            got = results.get(w)
            for k, ep in enumerate(eps):
                out[ep] = got[k] if got is not None else _crash_step("worker died", self._last.get(ep))
                if out[ep].crashed:  # keep the episode's task on its failure, so it is logged under its type
                    last = self._last.get(ep)
                    out[ep].task = out[ep].task or getattr(last, "task", "")
                    out[ep].task_type = out[ep].task_type or getattr(last, "task_type", "") or self._types.get(ep, "")
                self._last[ep] = out[ep]
        return out

    def _spread(self, cmd: str, task_ids: list[str]) -> list:
        """Run a per-task command for distinct tasks, spread over the workers."""
        unique = list(dict.fromkeys(task_ids))
        per_worker = {w: unique[w :: self.num_workers] for w in range(self.num_workers)}
        results = self._call(cmd, per_worker)
        by_task = {}
        for w, tasks in per_worker.items():
            got = results.get(w)
            for k, t in enumerate(tasks):
                by_task[t] = got[k] if got is not None else _crash_step("worker died")
        return [by_task[t] for t in task_ids]

    def reset(self, task_ids: list[str]) -> list:
        """Start episode i on task_ids[i]; episodes beyond len(task_ids) are forgotten."""
        self._spread("prepare", task_ids)  # build each distinct task once (e.g. compile a game)
        self._last = {}
        self._types = {i: self.spec.task_type(t) for i, t in enumerate(task_ids)}
        out = self._episodes_call("reset", dict(enumerate(task_ids)))
        return [out[i] for i in range(len(task_ids))]

    def step(self, actions: dict[int, str]) -> dict[int, object]:
        """Step the episodes named in `actions` (episode index -> action text)."""
        return self._episodes_call("step", actions)

    def reference_actions(self, task_ids: list[str]) -> list[list[str]]:
        """Expert action sequences, computed in the workers (engines stay out of the trainer)."""
        out = self._spread("reference", task_ids)
        return [r if isinstance(r, list) else [] for r in out]

    def demonstrations(self, task_ids: list[str]) -> list[list[str]]:
        """The expert's whole action sequence per task (sft.py's data); [] where there is none."""
        out = self._spread("demonstration", task_ids)
        return [r if isinstance(r, list) else [] for r in out]

    def close(self) -> None:
        for w, conn in enumerate(self._conns):
            try:
                conn.send(("close", None))
                conn.poll(10) and conn.recv()
            except Exception:
                pass
            proc = self._procs[w]
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
