"""Where the embedded judge's time goes on this CPU, against what the CPU's matrix products allow.

The judge scores a stream of captions it has not seen, as ``oni-train`` asks them (``--batch``
prompts a request, 1 token, its token tree and node cache), with every linear layer of the model
timed. Then each layer shape the judge ran is timed alone, at the judge's median rows per call: in
the judge's dtype, and in PyTorch's int8 (dynamic activations, per-channel weights, the CPU's
quantized engine). Rounds alternate the judge and the layers alone, so the machine's drift falls
on both. From these:

* ``linear_share``: the share of the judge's time spent inside its linear layers;
* ``linear_efficiency``: the layers' time alone over their time inside the judge (1.0: the
  judge's matrix products already run as fast as this CPU runs those shapes);
* ``ceiling_same_dtype``: the most the judge's captions/s could rise without fewer computations
  per caption: its linear layers at their rate alone, everything else as it is;
* ``ceiling_int8``: the same with every linear layer but the vocabulary projection at int8's rate
  alone (what an int8 path could at most bring here);
* with ``--int8-agreement N``: how often the judge with its MLP layers in that int8 gives the
  float judge's label, on the 40 hand-labelled messages, the 13 probe captions and N real ones
  (the labels an int8 path would change).

Usage::

    python benchmarks/judge_ceiling.py --model qwen --seconds 60 --rounds 3 --int8-agreement 300

The last line of stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

Shape = Tuple[int, int]


def judge_benchmark():
    """The judge's benchmark module (this folder's ``annotation_throughput``): its captions, prompt
    and score. Imported once the flags are checked."""
    sys.path.insert(0, str(Path(__file__).parent))
    import annotation_throughput

    return annotation_throughput


class LinearClock:
    """Times every ``torch.nn.Linear`` of a model while ``on``: seconds, rows and FLOPs by
    ``(in_features, out_features)``."""

    def __init__(self, model) -> None:
        import torch

        self.on = False
        self.seconds: Dict[Shape, float] = {}
        self.flops: Dict[Shape, float] = {}
        self.rows: Dict[Shape, List[int]] = {}
        self.modules: Dict[Shape, object] = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                self.modules.setdefault((module.in_features, module.out_features), module)
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(self._stop)

    def _start(self, module, inputs) -> None:
        module._clock_t0 = time.perf_counter()

    def _stop(self, module, inputs, output) -> None:
        if not self.on:
            return
        dt = time.perf_counter() - module._clock_t0
        shape = (module.in_features, module.out_features)
        rows = inputs[0].numel() // module.in_features
        self.seconds[shape] = self.seconds.get(shape, 0.0) + dt
        self.flops[shape] = self.flops.get(shape, 0.0) + 2.0 * rows * module.in_features * module.out_features
        self.rows.setdefault(shape, []).append(rows)

    def reset(self) -> None:
        self.seconds.clear()
        self.flops.clear()
        self.rows.clear()


def int8_linear(module):
    """``module`` in PyTorch's int8: per-channel int8 weights, activations quantized at each call."""
    import torch

    weight = module.weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8)
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    q = torch.ao.nn.quantized.dynamic.Linear(module.in_features, module.out_features,
                                             bias_=module.bias is not None)
    bias = None if module.bias is None else module.bias.detach().float()
    q.set_weight_bias(torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8), bias)
    return q


def int8_available() -> Optional[str]:
    """None when PyTorch's int8 linear runs here, else why not."""
    import torch

    if torch.backends.quantized.engine in (None, "none"):
        return "PyTorch has no quantized engine on this CPU"
    try:
        probe = torch.nn.Linear(8, 8)
        int8_linear(probe)(torch.randn(2, 8))
    except Exception as err:  # noqa: BLE001 - any failure: the int8 column is left out
        return f"{type(err).__name__}: {err}"
    return None


def rate_alone(fn, flops: float, seconds: float) -> float:
    """FLOPs per second of ``fn`` called back to back for ``seconds`` (after one warm call)."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return flops * calls / elapsed


def layers_alone(clock: LinearClock, vocab: Shape, seconds: float, with_int8: bool) -> Dict[Shape, dict]:
    """Each shape the judge ran, alone at its median rows: FLOPs/s in the model's dtype and in int8
    (not for the vocabulary projection, which an int8 path keeps in float)."""
    import torch
    import torch.nn.functional as F

    out = {}
    with torch.inference_mode():
        for shape, module in clock.modules.items():
            if shape not in clock.rows:
                continue
            rows = max(1, int(statistics.median(clock.rows[shape])))
            x = torch.randn(rows, shape[0], dtype=module.weight.dtype)
            flops = 2.0 * rows * shape[0] * shape[1]
            entry = {"rows": rows, "same_dtype": rate_alone(lambda: F.linear(x, module.weight, module.bias),
                                                            flops, seconds)}
            if with_int8 and shape != vocab:
                q, xf = int8_linear(module), x.float()
                entry["int8"] = rate_alone(lambda: q(xf), flops, seconds)
            out[shape] = entry
    return out


def judge_round(engine, clock: LinearClock, prompts: Sequence[str], start: int, batch: int,
                seconds: float) -> Tuple[dict, int]:
    """The judge on the stream from ``start`` for ``seconds``: its wall time, captions, tokens run
    and the linear layers' seconds and FLOPs by shape."""
    clock.reset()
    clock.on = True
    tokens0, captions, at = engine.tokens_run, 0, start
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            part = prompts[at % len(prompts):at % len(prompts) + batch]
            engine.complete(part, max_tokens=1, top_logprobs=5)
            captions += len(part)
            at += len(part)
    finally:
        clock.on = False
    wall = time.perf_counter() - t0
    return {"wall": wall, "captions": captions, "tokens": engine.tokens_run - tokens0,
            "seconds": dict(clock.seconds), "flops": dict(clock.flops)}, at


def ceilings(judged: dict, alone: Dict[Shape, dict], vocab: Shape) -> dict:
    """A round's figures: the linear layers' share and efficiency, and the two ceilings."""
    wall = judged["wall"]
    t_lin = sum(judged["seconds"].values())
    flops = judged["flops"]
    t_same = sum(f / alone[s]["same_dtype"] for s, f in flops.items())
    row = {"captions_per_s": judged["captions"] / wall,
           "tokens_per_caption": judged["tokens"] / max(1, judged["captions"]),
           "linear_share": t_lin / wall,
           "linear_gflops_in_judge": sum(flops.values()) / t_lin / 1e9 if t_lin else 0.0,
           "linear_gflops_alone": sum(flops.values()) / t_same / 1e9 if t_same else 0.0,
           "linear_efficiency": t_same / t_lin if t_lin else 0.0,
           "vocab_share": judged["seconds"].get(vocab, 0.0) / wall,
           "ceiling_same_dtype": wall / (wall - t_lin + t_same)}
    if all("int8" in alone[s] for s in flops if s != vocab):
        t_int8 = sum(f / (alone[s]["same_dtype"] if s == vocab else alone[s]["int8"]) for s, f in flops.items())
        row["ceiling_int8"] = wall / (wall - t_lin + t_int8)
        body = [s for s in flops if s != vocab]
        body_flops = sum(flops[s] for s in body)
        row["int8_rate_vs_same_dtype"] = (sum(flops[s] / alone[s]["same_dtype"] for s in body)
                                          / sum(flops[s] / alone[s]["int8"] for s in body)) if body_flops else None
    return row


def int8_agreement(bench, engine, model_name: str, dtype: str, threads: int, real: int, batch: int) -> dict:
    """The float judge ``engine`` against the same judge with its MLP layers in int8
    (:func:`int8_linear`): the share of captions given the same label (P(yes) >= 0.5), by set of
    ``bench.agreement_sets``, and the largest score change."""
    import torch
    from torchrl_oni.serve.engines import make_engine

    sets = bench.agreement_sets(real)
    engines = {"float": engine,
               "int8_mlp": make_engine("embedded", model_name, dtype=dtype, threads=threads)}
    quantized = 0
    for module in list(engines["int8_mlp"].model.modules()):
        for name in ("gate_proj", "up_proj", "down_proj", "fc1", "fc2", "c_fc"):
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, int8_linear(child))
                quantized += 1
    if not quantized:
        raise ValueError(f"{model_name} has no MLP layers this benchmark knows to put in int8")

    def scores(engine, captions):
        out = []
        for i in range(0, len(captions), batch):
            done = engine.complete([bench.short_prompt(c) for c in captions[i:i + batch]], max_tokens=1,
                                   top_logprobs=5)
            out.extend(bench.p_yes(dict(c.top_logprobs[0]) if c.top_logprobs else {}) for c in done)
        return out

    result, same, total = {"layers_in_int8": quantized}, 0, 0
    for name, captions in sets.items():
        agree, change = bench.same_labels(scores(engines["float"], captions), scores(engines["int8_mlp"], captions))
        result[f"agreement_{name}"] = round(agree / len(captions), 4)
        result[f"n_{name}"] = len(captions)
        result[f"max_score_change_{name}"] = round(change, 4)
        same, total = same + agree, total + len(captions)
    result["agreement"] = round(same / total, 4)
    return result


def _median(rows: List[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="packaged model, folder or file")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="the judge's dtype (auto: as oni-serve picks it for this CPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (oni-train's judge runs 1)")
    parser.add_argument("--batch", type=int, default=32, help="prompts a request")
    parser.add_argument("--seconds", type=float, default=60.0, help="the judge's time a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--alone-seconds", type=float, default=None,
                        help="time per layer shape alone, per dtype (default: a twentieth of --seconds, at least 0.2)")
    parser.add_argument("--int8-agreement", type=int, default=0, metavar="N",
                        help="also compare the labels of the judge with int8 MLP layers on the 53 built-in "
                             "captions and N real ones (0: skip)")
    args = parser.parse_args(argv)
    for flag, value, least in (("--threads", args.threads, 1), ("--batch", args.batch, 1),
                               ("--rounds", args.rounds, 1), ("--int8-agreement", args.int8_agreement, 0)):
        if value < least:
            print(f"error: {flag} must be at least {least}, not {value}", file=sys.stderr)
            return 2
    if args.seconds <= 0 or (args.alone_seconds is not None and args.alone_seconds <= 0):
        print("error: --seconds and --alone-seconds must be positive", file=sys.stderr)
        return 2
    alone_s = args.alone_seconds if args.alone_seconds is not None else max(0.2, args.seconds / 20)

    import torch
    from torchrl_oni.serve.engines import make_engine
    from torchrl_oni.serve.models import ModelNotInstalledError, ModelSourceError

    torch.set_num_threads(args.threads)
    try:
        engine = make_engine("embedded", args.model, dtype=args.dtype, threads=args.threads)
    except (ModelNotInstalledError, ModelSourceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    head = engine.model.get_output_embeddings()
    vocab = (head.in_features, head.out_features)
    no_int8 = int8_available()
    clock = LinearClock(engine.model)
    bench = judge_benchmark()
    prompts = [bench.short_prompt(c) for c in bench.stream_captions(exclude=[])]
    if not prompts:
        print("error: no captions to stream: the shipped labels file is missing", file=sys.stderr)
        return 2
    engine.complete(prompts[:args.batch], max_tokens=1, top_logprobs=5)  # the prefix's keys, once
    at, rows = args.batch, []
    print(f"{engine.model_name}, {engine.model.dtype}, {args.threads} thread(s), {args.batch} prompts a request, "
          f"layout {engine.layout}", flush=True)
    for r in range(args.rounds):
        judged, at = judge_round(engine, clock, prompts, at, args.batch, args.seconds)
        alone = layers_alone(clock, vocab, alone_s, with_int8=no_int8 is None)
        rows.append(ceilings(judged, alone, vocab))
        row = rows[-1]
        print(f"[round {r + 1}] {row['captions_per_s']:.2f} captions/s, linear layers {row['linear_share']:.1%} "
              f"of the time at {row['linear_efficiency']:.2f} of their rate alone", flush=True)

    print()
    print("round  captions/s  tokens/caption  linear share  GFLOP/s in judge  alone  efficiency  "
          "ceiling same dtype  ceiling int8")
    for r, row in enumerate(rows, 1):
        int8 = f"{row['ceiling_int8']:.2f}x" if "ceiling_int8" in row else "-"
        print(f"{r:>5}  {row['captions_per_s']:>10.2f}  {row['tokens_per_caption']:>14.2f}  {row['linear_share']:>12.1%}  "
              f"{row['linear_gflops_in_judge']:>16.1f}  {row['linear_gflops_alone']:>5.1f}  "
              f"{row['linear_efficiency']:>10.2f}  {row['ceiling_same_dtype']:>17.2f}x  {int8:>12}")
    result = {"benchmark": "judge_ceiling", "model": engine.model_name, "dtype": str(engine.model.dtype).split(".")[-1],
              "threads": args.threads, "batch": args.batch, "layout": engine.layout, "seconds": args.seconds,
              "rounds": args.rounds,
              "captions_per_s": [round(r["captions_per_s"], 2) for r in rows],
              **{key: _median(rows, key) for key in ("tokens_per_caption", "linear_share", "vocab_share",
                                                     "linear_gflops_in_judge", "linear_gflops_alone",
                                                     "linear_efficiency", "ceiling_same_dtype", "ceiling_int8",
                                                     "int8_rate_vs_same_dtype")},
              "int8_unavailable": no_int8}
    if args.int8_agreement and no_int8 is None:
        agreement = int8_agreement(bench, engine, args.model, args.dtype, args.threads, args.int8_agreement, args.batch)
        result["int8_mlp_agreement"] = agreement
        print(f"\nint8 MLP layers ({agreement['layers_in_int8']}) against the float judge: the same label on "
              + ", ".join(f"{100 * agreement['agreement_' + k]:.1f} % of {agreement['n_' + k]} {k.replace('_', ' ')}"
                          for k in ("hand_labelled", "judge_probe", "real_captions") if f"n_{k}" in agreement))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
