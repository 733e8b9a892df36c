"""Search-augmented QA (Search-R1 protocol), as verl-agent runs it: PATS and ActGuide's env.

The agent answers a question in at most 4 turns; each turn is either `<search> query </search>`,
answered by a retrieval server with the top 3 passages inside <information></information>, or
`<answer> ... </answer>`, which ends the episode with reward exact match (EM) in {0, 1}.

The server speaks Search-R1's protocol: `POST {url} {"query", "topk", "return_scores"}` ->
`{"result": [[{"document": {"contents": ...}, "score": s}, ...]]}`, so Search-R1's E5 server
drops in. This module ships a BM25 one (bm25s over a jsonl corpus, loopback by default):

    python -m envs.search serve --corpus wiki.jsonl --port 8000

Questions: `{data}/{split}.parquet|jsonl` (verl-agent's ~/data/searchR1_processed_direct: NQ +
HotpotQA train, and the seven test sets), or a question file, or the shared offline fixture
layout (`questions/flashrag_format/`, `questions/verl_format/`). Task ids are
`{split}/{data source}/{row}`; the data source is the task type, so success is logged per source.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import string
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path

from envs import EnvUnavailable, Preset, Step

# verl-agent's examples/gigpo_trainer/run_search.sh: 4 turns, history 4, EM reward, penalty 0.01.
PRESET = Preset(
    max_steps=4, history_length=4, max_prompt_tokens=4096, max_new_tokens=512,
    success_reward=1.0, invalid_penalty=0.01, eval_split="test",
)

DEFAULT_URL = "http://127.0.0.1:8000/retrieve"
TOPK = 3
SERVE = "python -m envs.search serve --corpus FILE --port 8000"
# The shared offline fixture: one question file per source (the NQ / TriviaQA / PopQA / Bamboogle
# samples are the ones its wiki passages were retrieved for).
FIXTURE = {
    "nq": "flashrag_format/nq_test_subsample.jsonl",
    "triviaqa": "flashrag_format/triviaqa_test_subsample.jsonl",
    "popqa": "flashrag_format/popqa_test_subsample.jsonl",
    "hotpotqa": "verl_format/hotpot_qa_test.jsonl",
    "2wikimultihopqa": "verl_format/2wikimultihop_qa_test.parquet",
    "musique": "verl_format/musique_test.jsonl",
    "bamboogle": "flashrag_format/bamboogle_test_subsample.jsonl",
}


def source_name(raw: str) -> str:
    """'google-research-datasets/nq_open' -> 'nq', 'hotpotqa/hotpot_qa' -> 'hotpotqa', ..."""
    key = raw.lower().replace("_", "").replace("-", "")
    for name, marker in (("2wikimultihopqa", "2wiki"), ("hotpotqa", "hotpot"), ("triviaqa", "trivia"),
                         ("popqa", "popqa"), ("musique", "musique"), ("bamboogle", "bamboogle"), ("nq", "nq")):
        if marker in key:
            return name
    return raw


# ---- load data ----------------------------------------------------------------------------
def data_root(data: str | None = None) -> Path:
    return Path(data or os.environ.get("SEARCH_QA_DATA") or Path.home() / "data" / "searchR1_processed_direct").expanduser()


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise EnvUnavailable(f"reading {path.name} needs pyarrow: pip install pyarrow") from e
        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def question_of(row: dict, source: str) -> dict:
    """One question in any of the formats: FlashRAG, Search-R1 parquet, verl rows."""
    extra, reward = row.get("extra_info") or {}, row.get("reward_model") or {}
    truth = reward.get("ground_truth")
    answers = (row.get("golden_answers") or (truth.get("target") if isinstance(truth, dict) else None)
               or extra.get("answer") or truth)  # verl rows: a list in extra_info, ", "-joined in ground_truth
    question = row.get("question") or extra.get("question") or row["prompt"][-1]["content"]
    answers = [answers] if isinstance(answers, str) else [str(a) for a in answers]
    return {"question": question.strip(), "answers": answers, "source": source}


@lru_cache(maxsize=None)
def questions(root: str, split: str) -> dict[str, list[dict]]:
    """data source -> its questions, in file order."""
    path = Path(root)
    out: dict[str, list[dict]] = {}
    files = [path] if path.is_file() else [path / f"{split}.{ext}" for ext in ("parquet", "jsonl", "json")]
    for file in files:
        if file.is_file():
            for row in read_rows(file):
                source = source_name(row.get("data_source") or file.stem)
                out.setdefault(source, []).append(question_of(row, source))
            return out
    if split == "test" and (path / "questions").is_dir():
        for source, rel in FIXTURE.items():
            out[source] = [question_of(row, source) for row in read_rows(path / "questions" / rel)]
        return out
    raise EnvUnavailable(f"no {split} questions under {path}: put Search-R1's {split}.parquet there "
                         f"(HF dataset PeterJinGo/nq_hotpotqa_train) or pass --env-data QUESTIONS_FILE")


def task_ids(split: str, data: str | None = None, **_) -> list[str]:
    by_source = questions(str(data_root(data)), split)
    return [f"{split}/{source}/{i}" for source, rows in by_source.items() for i in range(len(rows))]


@lru_cache(maxsize=None)
def reference_trajectories(root: str) -> dict[str, list[str]]:
    """question -> the parsed actions of a Search-R1 trajectory that got EM 1 ({root}/trajectories/):
    its searches, then the answer that scored."""
    out: dict[str, list[str]] = {}
    for file in sorted((Path(root) / "trajectories").glob("*.json")):
        for item in json.loads(file.read_text()):
            result = item.get("output") or {}
            if (result.get("metric_score") or {}).get("em") == 1:
                actions = [parse(turn)[0] for turn in model_turns(result["final_response"])]
                answers = [k for k, a in enumerate(actions) if a.startswith("<answer>")]
                if answers:
                    kept = [a for a in actions[: answers[0]] if a.startswith("<search>")] + [actions[answers[0]]]
                    out.setdefault(item["question"].strip(), kept)
    return out


def reference_queries(root: str) -> dict[str, list[str]]:
    """question -> the search actions of a Search-R1 trajectory that got EM 1 (never its answer)."""
    return {q: [a for a in actions if a.startswith("<search>")] for q, actions in reference_trajectories(root).items()}


def model_turns(final_response: str) -> list[str]:
    """Split a Search-R1 rollout into the model's own turns: the env inserted each
    <information> block and, after an unparseable turn, a 'My previous action is invalid' note."""
    invalid = (r"\nMy previous action is invalid\. If I want to search, I should put the query between <search> and "
               r"</search>\. If I want to give the final answer, I should put the answer between <answer> and "
               r"</answer>\. Let me try again\.\n")
    # Generation stops at </search>, so only a block right after one is the env's (base models
    # also write <information> themselves).
    parts = re.split(rf"(?<=</search>)\n\n<information>.*?</information>\n\n|{invalid}", final_response, flags=re.DOTALL)
    return [p for p in parts if p.strip()]


# ---- EM (Search-R1's qa_em.py normalisation) ---------------------------------------------------
def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: list[str]) -> bool:
    return any(normalize_answer(prediction) == normalize_answer(a) for a in answers)


# ---- retrieval client ---------------------------------------------------------------------
def retrieve(url: str, query: str, topk: int = TOPK, timeout: float = 60.0, retries: int = 3) -> list[dict]:
    """POST one query; a server that stays down raises EnvUnavailable naming the URL."""
    body = json.dumps({"query": query, "topk": topk, "return_scores": True}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    for attempt in range(retries):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())["result"][0]
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            error = e
            time.sleep(0.5 * (attempt + 1))
    raise EnvUnavailable(f"retrieval server {url} is not answering ({error}); start one: {SERVE}")


def information(results: list[dict]) -> str:
    """verl-agent's tool output: 'Doc i: contents' lines, JSON-dumped, inside <information>."""
    docs = "".join(f"Doc {i + 1}: {r['document']['contents'].strip()}\n" for i, r in enumerate(results))
    return "<information>" + json.dumps({"result": docs if results else "No search results found."}) + "</information>"


class Env:
    def __init__(self, data: str | None = None, url: str | None = None, **_):
        self.root = data_root(data)
        self.url = url or DEFAULT_URL
        self._checked = False
        self.task = ""
        self.task_type = ""

    def _question(self, task_id: str) -> dict:
        split, source, index = task_id.split("/")
        return questions(str(self.root), split)[source][int(index)]

    def prepare(self, task_id: str) -> None:
        self._question(task_id)

    # ---- reset ----------------------------------------------------------------------------
    def reset(self, task_id: str) -> Step:
        if not self._checked:  # fail at the start of training, not at the first search
            retrieve(self.url, "ping", topk=1)
            self._checked = True
        q = self._question(task_id)
        self.task, self.task_type, self.answers = q["question"], q["source"], q["answers"]
        self.turns, self.transcript, self.evidence = 0, [], False
        return self._step(self.task, reward=0.0, done=False)

    # ---- step -----------------------------------------------------------------------------
    def step(self, action: str) -> Step:
        """SkyRL's SearchEnv (vendored by verl-agent): done on an answer or at the turn limit;
        reward EM of the last <answer> in the transcript; a turn without a search gets no text."""
        self.turns += 1
        self.transcript.append(action)
        done = self.turns >= PRESET.max_steps or ("<answer>" in action and "</answer>" in action)
        if done:
            answers = re.findall(r"<answer>(.*?)</answer>", "".join(self.transcript), re.DOTALL)
            reward = float(bool(answers) and exact_match(answers[-1].strip(), self.answers))
            return self._step("", reward=reward, done=True)
        query = re.search(r"<search>(.*?)</search>", action, re.DOTALL) if "</search>" in action else None
        results = retrieve(self.url, query.group(1).strip()) if query else []
        observation = information(results) if query else ""
        self.transcript.append(observation)
        passages = normalize_answer(" ".join(r["document"]["contents"] for r in results))
        self.evidence |= any(normalize_answer(a) and normalize_answer(a) in passages for a in self.answers)
        return self._step(observation, reward=0.0, done=False)

    def _step(self, observation: str, reward: float, done: bool) -> Step:
        return Step(
            observation=observation,
            reward=reward,
            done=done,
            won=done and reward >= 1.0,
            admissible=None,
            task=self.task,
            task_type=self.task_type,
            state=search_state(self.evidence, done, reward),
            score=reward,
            info={"data_source": self.task_type},
        )

    # ---- reference actions ----------------------------------------------------------------
    def reference_actions(self, task_id: str) -> list[str]:
        """The searches of a successful Search-R1 trajectory for this question (never its
        answer), when {data}/trajectories/ holds one; else none."""
        return list(reference_queries(str(self.root)).get(self._question(task_id)["question"], []))

    def demonstration(self, task_id: str) -> list[str]:
        """The whole successful Search-R1 trajectory for this question: its searches, then its
        own final answer (which scored EM 1); none when no trajectory is on disk."""
        return list(reference_trajectories(str(self.root)).get(self._question(task_id)["question"], []))

    def close(self) -> None:
        pass


# ---- state ------------------------------------------------------------------------------
def search_state(evidence: bool, done: bool, reward: float) -> frozenset:
    """Progress flags: a gold answer has appeared in retrieved text; the episode answered (right)."""
    return frozenset({"evidence"} if evidence else set()) | ({"correct" if reward >= 1 else "answered"} if done else set())


def project_state(state: frozenset, task: str, reference_actions: list[str]) -> frozenset:
    return frozenset(state)  # already task-relevant and order-invariant


# ---- prompt ---------------------------------------------------------------------------------
# verl-agent's agent_system/environments/prompts/search.py, verbatim.
TEMPLATE_NO_HIS = """
You are an expert agent tasked with answering the given question step-by-step.
Your question: {task_description}

Now it's your turn to respond for the current step.
You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. 
After completing your reasoning, choose only one of the following actions (do not perform both):
(1) If you find you lack some knowledge, you can call a search engine to get more external information using format: <search> your query </search>.
(2) If you have enough knowledge to answer the question confidently, provide your final answer within <answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.
"""

TEMPLATE = """
You are an expert agent tasked with answering the given question step-by-step.
Your question: {task_description}

Prior to this step, you have already taken {step_count} step(s). Below is the interaction history where <search> </search> wrapped your past search queries and <information> </information> wrapped the corresponding search results returned by the external search engine. History:
{memory_context}

Now it's your turn to respond for the current step.
You should first conduct reasoning process. This process MUST be enclosed within <think> </think> tags. 
After completing your reasoning, choose only one of the following actions (do not perform both):
(1) If you find you lack some knowledge, you can call a search engine to get more external information using format: <search> your query </search>.
(2) If you have enough knowledge to answer the question confidently, provide your final answer within <answer> </answer> tags, without detailed illustrations. For example, <answer>Beijing</answer>.
"""


def prompt(task, observation, admissible, history, step_count, history_length) -> str:
    """SearchMemory renders step k as 'Step k:{action} {information it got}\\n'. `history` holds
    (observation before the action, action), so step k's information is the next observation."""
    if step_count == 0 or history_length <= 0 or not history:
        return TEMPLATE_NO_HIS.format(task_description=task)
    first = step_count - len(history) + 1
    results = [o for o, _ in history[1:]] + [observation]
    memory = "\n".join(f"Step {first + k}:{a} {info}\n" for k, ((_, a), info) in enumerate(zip(history, results)))
    return TEMPLATE.format(task_description=task, step_count=step_count, memory_context=memory)


# ---- parse ----------------------------------------------------------------------------------
def parse(response: str) -> tuple[str, bool]:
    """verl-agent's search projection: cut after the first </search> or </answer>; the first
    <search> block, else the first <answer> block, re-wrapped; invalid without one, with both
    kinds of tag, or with a tag twice."""
    cut = response
    for tag in ("</search>", "</answer>"):
        if tag in cut:
            cut = cut.split(tag, 1)[0] + tag
            break
    action, valid = "", True
    for tag in ("search", "answer"):
        match = re.search(rf"<{tag}>(.*?)</{tag}>", cut, re.IGNORECASE | re.DOTALL)
        if match:
            action = f"<{tag}>{match.group(1).strip()}</{tag}>"
            break
    n_search = len(re.findall(r"<search>", response, re.IGNORECASE))
    n_answer = len(re.findall(r"<answer>", response, re.IGNORECASE))
    if not action or (n_search and n_answer) or n_search > 1 or n_answer > 1:
        valid = False
    return action, valid


def answer(thought: str, action: str) -> str:
    """The answer format parse() reads: <think>thought</think>, then the action, which already
    carries its own <search> or <answer> tags."""
    return f"<think>{thought}</think>\n{action}"


# ---- retrieval server (BM25) ---------------------------------------------------------------
class BM25Index:
    """bm25s over the `contents` of a jsonl corpus (defaults: English stopwords, no stemming)."""

    def __init__(self, corpus: str | Path):
        try:
            import bm25s
        except ImportError as e:
            raise EnvUnavailable(f"the search server needs bm25s: pip install bm25s ({e})") from e
        self._bm25s = bm25s
        self.docs = [json.loads(line) for line in Path(corpus).read_text().splitlines() if line.strip()]
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([d["contents"] for d in self.docs], show_progress=False), show_progress=False)
        self._lock = threading.Lock()  # bm25s is not documented as thread-safe

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        k = max(1, min(topk, len(self.docs)))
        with self._lock:
            ids, scores = self.index.retrieve(self._bm25s.tokenize(queries, show_progress=False), k=k, show_progress=False)
        return [[{"document": self.docs[i], "score": float(s)} for i, s in zip(row_ids, row_scores)]
                for row_ids, row_scores in zip(ids.tolist(), scores.tolist())]


def make_server(index: BM25Index, host: str, port: int, default_topk: int = TOPK):
    """POST /retrieve with {"query": str} (verl-agent) or {"queries": [str]} (Search-R1)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path.rstrip("/") != "/retrieve":
                return self.send_error(404, "POST /retrieve")
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                queries = request["queries"] if "queries" in request else [request["query"]]
                results = index.search([str(q) for q in queries], int(request.get("topk") or default_topk))
                if not request.get("return_scores", False):
                    results = [[r["document"] for r in row] for row in results]
                status, body = 200, {"result": results}
            except (ValueError, KeyError, TypeError) as e:
                status, body = 400, {"error": f"bad request: {e}"}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # one line per query would flood training logs
            pass

    return ThreadingHTTPServer((host, port), Handler)


# ---- check (`python -m envs check --env search`) ----------------------------------------------
def check(spec, split: str, num_tasks: int) -> int:
    """The server answers a search for each question, and answering with a gold answer scores
    EM 1 (reference searches alone cannot win a QA episode). Exit code 0 when all do."""
    env, failures, seconds = spec.make(), 0, []
    try:
        for task_id in spec.task_ids(split)[:num_tasks]:
            env.reset(task_id)
            start = time.perf_counter()
            found = "evidence" in env.step(f"<search>{env.task}</search>").state
            seconds.append(time.perf_counter() - start)
            env.reset(task_id)
            won = env.step(f"<answer>{env.answers[0]}</answer>").won
            failures += not won
            print(f"{task_id}: search answered ({'gold answer retrieved' if found else 'no gold answer in top 3'}), "
                  f"gold answer EM {int(won)}")
    except EnvUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        env.close()
    print(f"{len(seconds) - failures}/{len(seconds)} gold answers scored EM 1; "
          f"{1000 * sum(seconds) / max(len(seconds), 1):.1f} ms per search turn")
    return 0 if failures == 0 and seconds else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.search")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="BM25 retrieval server speaking Search-R1's /retrieve protocol")
    serve.add_argument("--corpus", required=True, help='jsonl, one {"id", "contents"} passage per line')
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1", help="loopback by default; 0.0.0.0 serves the network")
    serve.add_argument("--topk", type=int, default=TOPK, help="when a request gives none")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    index = BM25Index(args.corpus)
    server = make_server(index, args.host, args.port, args.topk)
    host, port = server.server_address[:2]
    print(f"indexed {len(index.docs)} passages in {time.perf_counter() - start:.1f}s; "
          f"serving http://{host}:{port}/retrieve", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
