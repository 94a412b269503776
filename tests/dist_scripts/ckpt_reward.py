"""A custom reward with in-group variance that raises on some samples (deterministically, by length), for
reward.on_error = "zero"."""


def score(data_source, solution_str, ground_truth, extra_info):
    if len(solution_str) % 7 == 3:
        raise ValueError(f"cannot score a response of {len(solution_str)} characters")
    return float(len(solution_str) % 3) / 2.0
