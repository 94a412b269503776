#!/bin/bash
# A non-Python agent: one chat call with curl to the endpoint it was given. Its reward: 1 when the model answers 7,
# plus 0.5 for each later session of the same prompt (the sample's "sample"), so a GRPO group's rewards differ.
# With the argument "branch" it then makes a second call that does not extend the first conversation (another
# question): a second branch of the session. The sample arrives as JSON on stdin (and in SPMDRL_SAMPLE); this agent
# asks its own questions.
set -eu
cat > /dev/null
j=$(printf '%s' "$SPMDRL_SAMPLE" | sed -n 's/.*"sample": \([0-9][0-9]*\).*/\1/p')
ask() {
  curl -sS --fail -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
    -d "{\"model\": \"policy\", \"messages\": [{\"role\": \"user\", \"content\": \"$1\"}], \"max_tokens\": 64}" \
    "$OPENAI_BASE_URL/chat/completions"
}
reply=$(ask b)
case "$reply" in
  *'"content": "7"'*) right=1 ;;
  *) right=0 ;;
esac
if [ "${1:-}" = branch ]; then
  ask a > /dev/null
fi
echo "$right ${j:-0}" | awk '{print $1 + 0.5 * $2}'
