#!/usr/bin/env bash
# Install Princeton WebShop (the `web_agent_site` text env) for `--env webshop`, small setting:
# 1,000 products, synthetic goals, as verl-agent uses it (env.webshop.use_small=True).
#
#   bash scripts/install_webshop.sh [DEST]        # DEST default: $WEBSHOP_ROOT or ~/.cache/agentic-rl/webshop
#   export WEBSHOP_ROOT=DEST                      # or pass --env-data DEST to the scripts
#   python -m envs check --env webshop            # replays reference actions on the eval goals
#
# Needs: the project's Python environment at Python <= 3.10 (pyserini 0.17 and WebShop's pins do
# not install on newer Pythons; create the venv with python3.10 before `pip install -r
# requirements.txt`), git, a Java 11+ JDK (pyserini builds a Lucene index: apt-get install
# openjdk-17-jdk-headless, or conda install -c conda-forge openjdk=11), and network access to
# GitHub, PyPI and Google Drive (gdown; if Drive refuses, download the three files by hand).
# WebShop's own requirements.txt pins an old torch and transformers; we install only what the
# text env imports, so the project's torch stays as it is.
set -euo pipefail

DEST="${1:-${WEBSHOP_ROOT:-$HOME/.cache/agentic-rl/webshop}}"
COMMIT=64fa2a5c15c7daa698b9ac93f5bb5437b634c9bd   # princeton-nlp/WebShop master, 2024-09-05

python - <<'EOF'
import sys
if sys.version_info >= (3, 11):
    sys.exit(f"WebShop needs Python <= 3.10 (this is {sys.version.split()[0]}): create the venv with python3.10")
EOF
command -v java >/dev/null || { echo "WebShop's search index needs Java 11+: apt-get install openjdk-17-jdk-headless" >&2; exit 1; }

if [ ! -d "$DEST/.git" ]; then
  git clone https://github.com/princeton-nlp/WebShop.git "$DEST"
fi
git -C "$DEST" checkout -q "$COMMIT"

# What web_agent_site.envs imports (versions from WebShop's requirements.txt where they matter).
pip install "beautifulsoup4==4.11.1" "cleantext==1.1.4" "Flask==2.1.2" "Werkzeug==2.1.0" "gym==0.24.0" \
  "pyserini==0.17.0" "rank_bm25==0.2.2" "rich==12.4.4" "selenium==4.2.0" "spacy>=3.3,<3.8" \
  "thefuzz==0.19.0" gdown faiss-cpu
python -m spacy download en_core_web_sm   # goal.py loads it
python -m spacy download en_core_web_lg   # WebShop's setup.sh installs it too

# Small-setting data (WebShop's setup.sh -d small): products, attributes, human instructions.
mkdir -p "$DEST/data"
cd "$DEST/data"
[ -f items_shuffle_1000.json ] || gdown "https://drive.google.com/uc?id=1EgHdxQ_YxqIQlvvq5iKlCrkEKR6-j0Ib"
[ -f items_ins_v2_1000.json ] || gdown "https://drive.google.com/uc?id=1IduG0xl544V_A_jv3tHXC0kyFi7PnyBu"
[ -f items_human_ins.json ] || gdown "https://drive.google.com/uc?id=14Kb5SPBk_jfdLZ_CDBNitW98QLDlKR5O"

# The product search index (pyserini / Lucene), as setup.sh builds it.
cd "$DEST/search_engine"
mkdir -p resources resources_100 resources_1k resources_100k indexes
python convert_product_file_format.py
bash run_indexing.sh

echo "WebShop installed in $DEST; export WEBSHOP_ROOT=$DEST, then: python -m envs check --env webshop"
