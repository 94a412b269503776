"""reward_len's score, plus one line per call in $REWARD_CALL_LOG/<pid>: tests count how often samples are scored."""
import os


def score(data_source, solution_str, ground_truth, extra_info):
    with open(os.path.join(os.environ["REWARD_CALL_LOG"], str(os.getpid())), "a") as f:
        f.write("x\n")
    return {"score": float(len(solution_str) % 3) / 2.0, "n_chars": len(solution_str)}
