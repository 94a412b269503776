"""A reward with no in-group variance: every group is uninformative for dynamic sampling."""


def score(data_source, solution_str, ground_truth, extra_info):
    return 1.0
