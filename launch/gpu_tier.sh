#!/usr/bin/env bash
# The one-GPU test tier: every test marked `gpu` (pytest -m gpu), on one CUDA GPU, with each test's time and
# figures. Writes into OUT: junit.xml (pytest's, with the figures each test records as properties),
# summary.txt (one line per test: outcome, seconds, figures; then the totals) and pytest.log.
#   bash launch/gpu_tier.sh OUT
# Needs torch with CUDA, transformers, peft, safetensors and pytest; nothing is downloaded. megatron-core (for the
# Megatron test) comes as wheels in .whl/ when the machine has no network; they are installed into a scratch
# directory first. From a machine with pip access, in the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl megatron-core==0.16.1
# (the GPU machine's Python version; megatron-core needs only numpy, packaging and torch beside it).
# Exit status: pytest's (0 when every gpu test passed), 2 without a CUDA device. The tests stop after
# TIER_TIMEOUT seconds (default 540: the gpu tests' own subprocess limits together, 300 + 180 s, and a minute for
# the rest; tests/test_repo.py checks it) with what finished reported.
set -uo pipefail
OUT=${1:?usage: bash launch/gpu_tier.sh OUT}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/spmdrl-tier-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=$PYTHONPATH:/tmp/spmdrl-tier-site
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: the gpu tier did not run" | tee "$OUT/summary.txt"
  exit 2
fi
# the files holding gpu tests (tests/test_repo.py checks the list is complete); collecting the whole suite would
# import modules a GPU machine may lack (vLLM)
TIER_FILES="tests/gpu tests/test_host_syncs.py tests/test_fused_logprob.py"
START=$(date +%s)
# SIGINT at the limit: pytest stops, reports what ran and writes the junit file
timeout -s INT "${TIER_TIMEOUT:-540}" python3 -m pytest -m gpu -p no:cacheprovider -rA --durations=0 --continue-on-collection-errors \
  --junitxml "$OUT/junit.xml" $TIER_FILES 2>&1 | tee "$OUT/pytest.log"
RC=${PIPESTATUS[0]}
python3 - "$OUT" "$RC" "$(( $(date +%s) - START ))" <<'PY' | tee "$OUT/summary.txt"
import sys
import xml.etree.ElementTree as ET

import torch

out, rc, wall = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
try:
    cases = list(ET.parse(f"{out}/junit.xml").getroot().iter("testcase"))
except (OSError, ET.ParseError) as e:
    print(f"no junit report ({e}); pytest exit status {rc}: see pytest.log")
    sys.exit(0)
counts = {}
for c in cases:
    kind = next((ch.tag for ch in c if ch.tag in ("failure", "error", "skipped")), "passed")
    counts[kind] = counts.get(kind, 0) + 1
    props = {p.get("name"): p.get("value") for p in c.iter("property")}
    name = f"{c.get('classname', '').split('.')[-1]}::{c.get('name')}"
    print(f"{kind.upper():8s} {float(c.get('time', 0)):7.1f}s  {name}" + "".join(f"\n           {k}: {v}" for k, v in props.items()))
    if kind != "passed":
        msg = next(ch for ch in c if ch.tag == kind).get("message", "")
        print(f"           {msg.splitlines()[0][:300] if msg else ''}")
print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f"; {wall} s in all; pytest exit status {rc}")
PY
exit "$RC"
