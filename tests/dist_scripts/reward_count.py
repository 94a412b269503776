"""reward_len's score, plus one line per call in $REWARD_CALL_LOG/<pid> (the row's split and the
n_chars it returned): tests count how often samples are scored and average the extra key independently."""
import os


def score(data_source, solution_str, ground_truth, extra_info):
    with open(os.path.join(os.environ["REWARD_CALL_LOG"], str(os.getpid())), "a") as f:
        f.write(f"{(extra_info or {}).get('split', '?')} {len(solution_str)}\n")
    return {"score": float(len(solution_str) % 3) / 2.0, "n_chars": len(solution_str)}
