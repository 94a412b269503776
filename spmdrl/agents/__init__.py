"""Black-box agents: an OpenAI-compatible endpoint per rollout group (endpoint.py), token-in/token-out capture of
each session's calls (capture.py), agent sessions in worker processes (worker.py, sessions.py). docs/agents.md."""
