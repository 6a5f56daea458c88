"""A stand-in for DeepEyes' ``verl/utils/reward_score/vl_agent.py`` (re-implemented from its definition, for tests):
``compute_score`` (V* / chart data) and ``compute_common_reasoning``, with the served LLM judge replaced by an exact
string comparison of the extracted answer with the ground truth (the only part that needs a network)."""


def _judge(answer, ground_truth):
    return 1.0 if answer == ground_truth else 0.0


def _format_error(predict_str):
    error = predict_str.count("<think>") != predict_str.count("</think>")
    opened = predict_str.count("<|vision_start|><|image_pad|>")
    error = error or opened != predict_str.count("<|image_pad|><|vision_end|>")
    tail = predict_str.split("</think>")[-1].strip()
    error = error or tail.count("<answer>") != tail.count("</answer>")
    return error, opened, tail


def compute_score(predict_str, ground_truth, extra_info=None):
    error, opened, _ = _format_error(predict_str)
    answer = predict_str.split("<answer>")[-1].split("</answer>")[0].strip()
    acc = _judge(answer, ground_truth)
    if len(answer) >= 1000:
        acc, error = 0.0, True
    tool = 1.0 if opened > 0 and acc > 0.5 else 0.0
    return 0.8 * acc + 0.2 * (-1.0 if error else 0.0) + 1.2 * tool


def compute_common_reasoning(predict_str, ground_truth, extra_info=None):
    import re

    error, opened, tail = _format_error(predict_str)
    match = re.search(r"<answer>(.*?)</answer>", tail, re.DOTALL)
    answer = match.group(1).strip() if match else None
    if not answer or len(answer) >= 1000:
        acc, error = 0.0, True
    else:
        acc = _judge(answer, ground_truth)
    tool = 1.0 if opened > 0 and acc > 0.5 else 0.0
    return 0.8 * acc + 0.2 * (-1.0 if error else 0.0) + 1.2 * tool
