#!/bin/bash
# A non-Python agent that posts its reward to the endpoint (POST <base_url>/reward) instead of printing it: one chat
# call, a malformed reward (400) and one without the key (401) first, then the reward, 1 when the model answered 7.
# With "mode": "both" in the sample it also prints 0.25: a reward the agent returns wins over the one it posted.
set -eu
sample=$(cat)
key="Authorization: Bearer $OPENAI_API_KEY"
reply=$(curl -sS --fail -H "$key" -H "Content-Type: application/json" \
  -d '{"model": "policy", "messages": [{"role": "user", "content": "b"}], "max_tokens": 16}' \
  "$OPENAI_BASE_URL/chat/completions")
case "$reply" in *'"content": "7"'*) reward=1 ;; *) reward=0 ;; esac
bad=$(curl -sS -o /dev/null -w '%{http_code}' -H "$key" -d '{"reward": "high"}' "$OPENAI_BASE_URL/reward")
nokey=$(curl -sS -o /dev/null -w '%{http_code}' -d '{"reward": 1}' "${OPENAI_BASE_URL%/v1}/reward")
if [ "$bad" != 400 ] || [ "$nokey" != 401 ]; then
  echo "reward posts answered $bad and $nokey" >&2
  exit 3
fi
curl -sS --fail -H "$key" -d "{\"reward\": $reward}" "${OPENAI_BASE_URL%/v1}/reward" > /dev/null
case "$sample" in *'"mode": "both"'*) echo 0.25 ;; esac
