"""Session-wide settings of the test suite, inherited by every process a test starts: no usage report from vLLM
(each engine build would run py-cpuinfo's probe, about a second of CPU, and post to vLLM's server)."""
import os

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
