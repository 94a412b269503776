"""A custom reward with in-group variance on an untrained model, so a GRPO step really updates the actor."""


def score(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(len(solution_str) % 3) / 2.0, "n_chars": len(solution_str)}
