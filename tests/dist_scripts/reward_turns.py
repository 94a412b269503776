"""A custom reward that takes the multi-turn `trajectory`: one point per turn, half a point for the scripted
answer. It fails loudly when the trajectory is missing or malformed."""


def score(data_source, solution_str, ground_truth, extra_info=None, trajectory=None):
    assert trajectory["messages"][0] == {"role": "user", "content": extra_info["letter"]}, trajectory["messages"][:1]
    assert len(trajectory["messages"]) >= 1 + len(trajectory["turns"])
    return float(len(trajectory["turns"])) / 3 + (0.5 if solution_str == ground_truth else 0.0)
