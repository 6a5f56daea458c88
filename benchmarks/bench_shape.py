"""EasyR1-shaped GRPO steps for ``bench_grpo.py --shape NAME[:key=value,...]``.

EasyR1's geo3k recipe (``examples/config.yaml``) generates 512 prompts x n=5 per rollout over 8 GPUs, i.e. 64
prompts x 5 = 320 samples per GPU, at ``min_pixels`` 512², up to 2,048 response tokens, and updates on 128 prompts
at a time (4 optimizer steps per rollout) in micro-batches of ``micro_batch_size_per_device_for_update`` = 4 rows.
In TRL's terms, per GPU: ``per_device_train_batch_size`` 4 (the micro-batch), ``gradient_accumulation_steps`` 20
(80 rows per optimizer step), ``steps_per_generation`` 80 (320 rows per generation). One *cycle* is one generation
and its 4 optimizer steps; the benchmark reports per cycle.

Completion lengths are the model's own: the LM head gets a bias on the EOS token, calibrated on the random-weight
model so that every sampled token is EOS with probability ``1 / mean_completion``: lengths are geometric with that
mean (median ~0.69 x mean), cut at ``max_completion``; rows finish at different steps, as real rollouts do, and
both trainers sample from the same distribution (no logits processor: nothing either trainer has to honour). The
calibration reads random token ids; the model's own rollouts (a real prompt with its image, then its own samples) stop
at another rate, so after the first generation of a run with a warm-up cycle the bias is corrected from that
generation's lengths (:class:`EosRecalibration`: the stop rate measured, the bias shifted by the log-odds between it
and ``1 / mean_completion``). ``--eos_bias B`` instead fixes the bias (no correction): ``shape_run.sh`` hands the
cold run's corrected bias to the warm and vanilla runs, so all three sample from one distribution. The realised
lengths of the measured cycles, and the biases, are recorded with every result.

EasyR1's update pass packs rows by tokens, not by rows: with ``dynamic_batching`` (on in its geo3k config, with
``padding_free``) its actor cuts each update batch into micro-batches of about
``micro_batch_size_per_device_for_update x (max_prompt_length + max_response_length)`` valid tokens
(``verl/workers/actor/dp_actor.py``, ``verl/utils/seqlen_balancing.py``), e.g. 4 x (2,048 + 2,048) = 16,384, and
normalises the loss by the update batch's tokens. (EasyR1's ``examples/config.yaml``, which its geo3k scripts use,
sets that micro-batch to 1 row, a 4,096-token budget; its actor's default, and this shape's micro-batch, is 4.) Ours
does the equivalent with ``update_chunk_tokens`` at that budget (``dynamic_batching=1``, the default; 0 runs one
forward per micro-batch): the optimizer step's micro-batches share forwards of up to that many tokens, each
micro-batch's loss still TRL's. Vanilla TRL has no such option and runs its micro-batches one by one.

Throughput is counted as EasyR1 counts it (``perf/throughput``): prompt + response tokens of the valid positions
(image tokens included, padding excluded) per second per GPU, over the whole cycle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

TOKENS_NOTE = (
    "tokens/s/GPU counted as EasyR1 counts them: prompt + response tokens (valid positions, image tokens included) "
    "per second of a whole cycle (generation, log-probs, 4 optimizer steps) per GPU"
)
# EasyR1's math/geo3k format prompt (its examples/format_prompt/math.jinja), after the problem.
FORMAT = (
    " You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
# Geometry3K-like problem sentences: a problem is 1-4 of them (about 10-60 words).
CLAUSES = (
    "Find x.",
    "Find the area of the figure. Round to the nearest tenth if necessary.",
    "In the circle shown, chord AB is parallel to chord CD and the measure of arc AC is 40 degrees.",
    "Find the measure of angle 2 if the measure of angle 1 is 3x + 12 and the measure of angle 3 is 5x - 20.",
    "Quadrilateral WXYZ is a rectangle with diagonals that meet at point P.",
    "Use parallelogram ABCD to find the length of segment AD.",
    "Triangle LMN is isosceles with LM = LN and the altitude from L is 8 units long.",
    "Each pair of polygons is similar.",
)


@dataclass(frozen=True)
class Shape:
    """Per-GPU sizes of one EasyR1-shaped cycle (override any field with ``--shape name:field=value``)."""

    name: str
    prompts: int = 64  # prompts per generation per GPU (rollout_batch_size / GPUs)
    generations: int = 5  # n
    image_size: int = 512  # min_pixels 512²
    vary_images: int = 0  # > 0: image sizes vary (see bench_common.write_images), the varied-size variant
    max_completion: int = 2048  # max_response_length
    mean_completion: int = 500  # mean of the geometric completion lengths
    micro_batch: int = 4  # micro_batch_size_per_device_for_update (rows)
    updates: int = 4  # optimizer steps per generation (rollout_batch_size / global_batch_size)
    max_prompt: int = 2048  # max_prompt_length: with max_completion, EasyR1's dynamic_batching token budget
    dynamic_batching: int = 1  # ours: update_chunk_tokens = micro_batch x (max_prompt + max_completion); 0: off

    @property
    def update_tokens(self) -> int | None:
        """EasyR1's update token budget per forward (``dynamic_batching``), None when off."""
        return self.micro_batch * (self.max_prompt + self.max_completion) if self.dynamic_batching else None

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    def check(self) -> None:
        per_update, rest = divmod(self.rows, self.updates)
        if rest or per_update % self.micro_batch:
            raise SystemExit(
                f"error: --shape {self.name}: {self.rows} rows per generation must split into {self.updates} updates "
                f"of whole micro-batches of {self.micro_batch} rows; change prompts, generations, updates or "
                "micro_batch"
            )


SHAPES = {
    "easyr1_geo3k": Shape("easyr1_geo3k"),
    "easyr1_geo3k_32x8": Shape("easyr1_geo3k_32x8", prompts=32, generations=8),
    # EasyR1's pixel range starts at 512²: images of 532-1008 px a side, each prompt's its own size.
    "easyr1_geo3k_varied": Shape("easyr1_geo3k_varied", image_size=1008, vary_images=17),
}


def parse_shape(spec: str) -> Shape:
    """``name`` or ``name:field=value,...`` -> the shape (values converted to the field's type)."""
    name, _, rest = spec.partition(":")
    if name not in SHAPES:
        raise SystemExit(f"error: --shape {name!r} is not known; choose one of {', '.join(SHAPES)}")
    shape = SHAPES[name]
    changes: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(Shape)} - {"name"}:
            raise SystemExit(f"error: --shape {spec!r}: {key!r} is not a shape field")
        changes[key] = int(value)
    shape = dataclasses.replace(shape, **changes)
    shape.check()
    return shape


def apply_shape(args: Any) -> Shape:
    """Set the run's sizes from ``args.shape``: one scenario, the shape's prompts x G per cycle."""
    shape = parse_shape(args.shape)
    args.prompts_per_step, args.num_generations = shape.prompts, shape.generations
    args.image_sizes, args.images_per_prompt, args.completion_lengths = [shape.image_size], [1], [shape.max_completion]
    args.vary_images = shape.vary_images
    return shape


def config_fields(shape: Shape, vanilla: bool = False) -> dict[str, Any]:
    """The GRPOConfig fields of the shape: micro-batches, accumulation, one generation per cycle, and no forced
    length (the EOS bias ends the rows); for ours also EasyR1's token budget of the update pass (see above)."""
    fields = {
        "per_device_train_batch_size": shape.micro_batch,
        "gradient_accumulation_steps": shape.rows // shape.updates // shape.micro_batch,
        "steps_per_generation": shape.rows // shape.micro_batch,
        "max_completion_length": shape.max_completion,
        "generation_kwargs": {},
    }
    if not vanilla and shape.update_tokens:
        fields["update_chunk_tokens"] = shape.update_tokens
    return fields


def geo3k_questions(n: int, seed: int) -> list[str]:
    """``n`` problem texts of Geometry3K-like lengths, each followed by EasyR1's format prompt."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(1, 5, (1,), generator=rng))
        picks = torch.randint(0, len(CLAUSES), (k,), generator=rng).tolist()
        out.append(" ".join(CLAUSES[i] for i in picks) + FORMAT)
    return out


# The positions the EOS bias is calibrated at: where the shape's completions decode (prompts of ~500 tokens).
CALIBRATION_START, CALIBRATION_END = 480, 1536


@torch.no_grad()
def install_eos_bias(model: Any, eos_id: int, mean: int, seed: int = 0, bias: float | None = None) -> float:
    """Give the LM head a bias on ``eos_id`` so that a sampled token (temperature 1) is EOS with probability about
    ``1 / mean``. Calibrated on random token ids through the model's own decoder: the bias makes the EOS probability
    averaged over those positions ``1 / mean`` (a geometric length's mean is 1 / the average stop probability; the
    median log-odds would overshoot it, as the probability is convex in them). The positions are those a completion
    decodes at (after a prompt of ~500 tokens, up to ~1,500): in a random-weight model the logits spread less as the
    context grows, so EOS gets likelier with position (calibrated on positions 16-128, lengths averaged 339 for an
    asked 500). ``bias``: install this value instead of calibrating. The head keeps its (possibly tied) weight; the
    bias does not train. Returns the bias."""
    from vlm_grpo.utils import peft_base

    base = peft_base(model)
    head, decoder = base.get_output_embeddings(), base.get_decoder()
    vocab = head.weight.size(0)
    if bias is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(0, vocab, (2, CALIBRATION_END), generator=gen).to(head.weight.device)
        hidden = decoder(input_ids=ids).last_hidden_state[:, CALIBRATION_START:].float()
        logits = hidden @ head.weight.float().T
        eos = logits[..., eos_id].clone()
        logits[..., eos_id] = -math.inf
        log_odds = eos - torch.logsumexp(logits, dim=-1)
        bias = calibrated_bias(log_odds.flatten(), 1.0 / mean)
    bias_value = float(bias)
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True, device=head.weight.device)
    biased.weight = head.weight  # the same Parameter: a tie with the input embedding stays a tie
    biased.bias = torch.nn.Parameter(torch.zeros(vocab, dtype=head.weight.dtype, device=head.weight.device))
    biased.bias[eos_id] = bias_value
    biased.bias.requires_grad_(False)
    base.set_output_embeddings(biased)
    return bias_value


def calibrated_bias(log_odds: torch.Tensor, p: float) -> float:
    """The bias b with mean(sigmoid(b + log_odds)) = p (bisection: the mean rises with b)."""
    lo, hi = -100.0, 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(torch.sigmoid(log_odds.double() + mid).mean()) < p else (lo, mid)
    return (lo + hi) / 2


def stop_rate(completion_ids: torch.Tensor, eos_ids: set[int], max_completion: int) -> tuple[float, list[int]]:
    """The stop probability per token that best explains a generation's lengths (maximum likelihood for geometric
    lengths cut at ``max_completion``: the rows that ended over the tokens sampled), and the lengths. A row ends at
    its first EOS (the padding after it may be an EOS id too); a row without one ran to ``max_completion``."""
    lengths, ended = [], 0
    for row in completion_ids.tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), None)
        ended += end is not None
        lengths.append(end if end is not None else max_completion)
    return max(ended, 0.5) / max(sum(lengths), 1), lengths


class EosRecalibration:
    """Corrects the EOS bias once, after the first generation (see the module's docstring): the bias moves by
    ``logit(1 / mean) - logit(measured stop rate)``, which scales the stop odds of every position by the same factor.
    The bias is changed in place, so every trainer and compiled or captured decode step reads the new value."""

    def __init__(self, model: Any, eos_ids: set[int], eos_id: int, mean: int, max_completion: int) -> None:
        from vlm_grpo.utils import peft_base

        self.bias = peft_base(model).get_output_embeddings().bias
        self.eos_ids, self.eos_id, self.mean, self.max_completion = eos_ids, eos_id, mean, max_completion
        self.record: dict[str, float] = {"installed": float(self.bias[eos_id])}

    @torch.no_grad()
    def observe(self, completion_ids: torch.Tensor) -> None:
        if "corrected" in self.record:
            return
        rate, lengths = stop_rate(completion_ids, self.eos_ids, self.max_completion)
        shift = torch.logit(torch.tensor(1.0 / self.mean)) - torch.logit(torch.tensor(min(rate, 0.5)))
        self.bias[self.eos_id] += float(shift)
        self.record.update(first_mean=sum(lengths) / len(lengths), corrected=float(self.bias[self.eos_id]))


def recalibrating_trainer_class(base: type, recalibration: EosRecalibration) -> type:
    """A subclass of ``base`` that hands its first generation's completions to ``recalibration``."""

    class Recalibrating(base):  # type: ignore[misc, valid-type]
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            recalibration.observe(out["completion_ids"])
            return out

    Recalibrating.__name__ = base.__name__
    return Recalibrating


def length_stats(lengths: list[float]) -> dict[str, float]:
    """Mean, quantiles and maximum of the realised completion lengths (tokens)."""
    if not lengths:
        return {}
    t = torch.tensor(lengths, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"n": len(lengths), "mean": float(t.mean()), "p50": q[0], "p90": q[1], "p99": q[2], "max": float(t.max())}


def cycles(per_step: list[dict[str, float]], updates: int) -> list[dict[str, float]]:
    """Optimizer steps summed in consecutive runs of ``updates``: one entry per generation cycle (complete ones)."""
    out = []
    for start in range(0, len(per_step) - updates + 1, updates):
        total: dict[str, float] = {}
        for step in per_step[start : start + updates]:
            for key, value in step.items():
                total[key] = total.get(key, 0.0) + value
        out.append(total)
    return out


class TimeLimit(Exception):
    """SIGTERM (``timeout``) reached a shaped run: it reports the cycles it finished instead of nothing."""


@contextlib.contextmanager
def stopped_by_sigterm(enabled: bool = True) -> Iterator[None]:
    """Turn SIGTERM into :class:`TimeLimit` inside the block (the run's finished cycles are then still reported)."""

    def handler(signum, frame):
        raise TimeLimit

    previous = signal.signal(signal.SIGTERM, handler) if enabled else None
    try:
        yield
    finally:
        if enabled:
            signal.signal(signal.SIGTERM, previous)


class CyclePrinter(TrainerCallback):
    """Prints every optimizer step's wall time (with the generation in it) and each cycle's as they end: a run cut
    short by a time limit still shows how far it got."""

    def __init__(self, label: str, updates: int, per_step: list[dict[str, float]]) -> None:
        self.label, self.updates, self.per_step, self.start = label, updates, per_step, time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step = self.per_step[-1] if self.per_step else {}
        print(
            f"[step] {self.label} {state.global_step}: {step.get('_wall', 0):.1f} s, generation "
            f"{step.get('generation', 0):.1f} s, completion tokens {step.get('_completion_tokens', 0):.0f}",
            flush=True,
        )
        if state.global_step % self.updates == 0:
            now = time.perf_counter()
            print(f"[cycle] {self.label} {state.global_step // self.updates}: {now - self.start:.1f} s", flush=True)
            self.start = now


def merge(cold: dict | None, warm: dict | None, vanilla: dict | None, command: str = "") -> dict[str, Any]:
    """One result file from ``shape_run.sh``'s three runs: the cold run's second (steady) cycle as ``ours``, vanilla
    TRL's cycle (or why there is none), and the warm start: the first cycle with an empty compile cache, the first
    with the cache filled by the cold run, and the steady one."""
    base = cold or warm or vanilla
    if base is None:
        raise SystemExit("error: no run finished: nothing to merge")
    ours = (cold or warm or {}).get("results", [])
    rows = list((vanilla or {}).get("results", []))
    if not rows:
        scenario = ours[0]["scenario"] if ours else ""
        rows = [{"trainer": "vanilla", "scenario": scenario, "status": "did not start (no time left)"}]
    payload = {k: v for k, v in base.items() if k != "results"}
    payload["command"] = command
    payload["results"] = rows + ours

    def cycle_times(data: dict | None) -> list[float]:
        return ((data or {}).get("results") or [{}])[0].get("cycle_times_s") or []

    cold_cycles, warm_cycles = cycle_times(cold), cycle_times(warm)
    payload["warm_start"] = {
        "cold_first_cycle_s": cold_cycles[0] if cold_cycles else None,
        "warm_first_cycle_s": warm_cycles[0] if warm_cycles else None,
        "steady_cycle_s": cold_cycles[1] if len(cold_cycles) > 1 else None,
    }
    return payload


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description="Merge shape_run.sh's cold, warm and vanilla runs into one result file")
    p.add_argument("--cold", type=Path)
    p.add_argument("--warm", type=Path)
    p.add_argument("--vanilla", type=Path)
    p.add_argument("--command", default="", help="the command that produced the runs (RESULTS.md shows it)")
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--bias_of", type=Path, default=None,
        help="print the EOS bias a run corrected (its first result's eos_bias.corrected; nothing if none) and exit",
    )  # fmt: skip
    args = p.parse_args(argv)

    def load(path: Path | None) -> dict | None:
        return json.loads(path.read_text()) if path is not None and path.exists() else None

    if args.bias_of is not None:
        corrected = ((load(args.bias_of) or {}).get("results") or [{}])[0].get("eos_bias", {}).get("corrected")
        if corrected is not None:
            print(repr(corrected))
        return
    if not (args.cold and args.warm and args.vanilla and args.out):
        p.error("--cold, --warm, --vanilla and --out are required to merge")

    payload = merge(load(args.cold), load(args.warm), load(args.vanilla), args.command)
    args.out.write_text(json.dumps(payload, indent=2))
    print(json.dumps(payload["warm_start"]), args.out)


if __name__ == "__main__":
    main()
