"""Load an exported model directory with vLLM (one plain process) and print the log-probs of given sequences
as JSON on the last stdout line: argv = model_dir, a JSON file with "prompts" and "responses"."""
import json
import sys


def main() -> int:
    from spmdrl.rollout.vllm_engine import VLLMEngine

    model, spec = sys.argv[1], json.load(open(sys.argv[2]))
    engine = VLLMEngine(model, max_model_len=64, seed=0, kv_cache_gb=0.1, dtype="float32")
    print(json.dumps(engine.compute_logprobs(spec["prompts"], spec["responses"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
