#!/bin/bash
# Issue 16 point 5 against a real `prefect server start`: the automation and the progress artifact.
set -x
source /work/main/.venv/bin/activate
cd /work/wt-nightly
export PYTHONPATH=/work/wt-nightly HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PREFECT_HOME=/tmp/nm/ops/prefect-home PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
rm -rf /tmp/nm/ops/prefect-home /tmp/nm/ops/store /tmp/nm/ops/alerts.jsonl; mkdir -p /tmp/nm/ops/prefect-home
PREFECT_UI_URL=http://127.0.0.1:4311 prefect server start --host 127.0.0.1 --port 4311 > /tmp/nm/ops/server.log 2>&1 &
SERVER=$!
python /tmp/nm/ops/receiver.py 4312 & RECV=$!
python -m tmem.devtools.scripted_llm --port 4313 > /tmp/nm/ops/llm.log 2>&1 & LLM=$!
export PREFECT_API_URL=http://127.0.0.1:4311/api
until curl -sf $PREFECT_API_URL/health >/dev/null; do sleep 1; done
prefect work-pool create tmem-pool --type process
prefect --no-prompt deploy --all
python deployments/alerts.py --webhook-url http://127.0.0.1:4312/alert
prefect automation inspect tmem-nightly-failed --json > /tmp/nm/ops/automation.json
export TMEM_LLM_BASE_URL=http://127.0.0.1:4313/v1 TMEM_LLM_API_KEY=sk-dev
python -m tmem ingest examples/sample_archive.jsonl --store /tmp/nm/ops/store --json
python -m tmem build --store /tmp/nm/ops/store --json > /tmp/nm/ops/build.json
prefect artifact inspect tmem-build-progress > /tmp/nm/ops/progress-artifact.txt
curl -s -X POST $PREFECT_API_URL/artifacts/filter -H 'content-type: application/json' \
  -d '{"artifacts":{"key":{"any_":["tmem-build-progress"]}}}' > /tmp/nm/ops/progress-artifact.json
prefect deployment run nightly-rebuild/nightly-rebuild --param store=/tmp/nm/ops/store --param keep_snapshots=0
prefect worker start --pool tmem-pool --run-once > /tmp/nm/ops/worker.log 2>&1
for i in $(seq 60); do [ -s /tmp/nm/ops/alerts.jsonl ] && break; sleep 2; done
prefect flow-run ls --limit 5 > /tmp/nm/ops/flow-runs.txt
kill $LLM $RECV $SERVER
wait $SERVER
