#!/bin/bash
# A non-Python agent: one chat call with curl to the endpoint it was given; prints 1 when the model answers 7.
# The sample arrives as JSON on stdin (and in SPMDRL_SAMPLE); this agent asks its own question.
set -eu
cat > /dev/null
reply=$(curl -sS --fail -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "policy", "messages": [{"role": "user", "content": "b"}], "max_tokens": 16}' \
  "$OPENAI_BASE_URL/chat/completions")
case "$reply" in
  *'"content": "7"'*) echo 1 ;;
  *) echo 0 ;;
esac
