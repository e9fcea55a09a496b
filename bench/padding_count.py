"""What the admissions' buckets pad, counted exactly from a server run's prefill and encoder shapes (no GPU needed).

On the CPU the prefill runs eagerly (no buckets), so the GPU's padding is counted by replaying the shapes a CPU server
saw through the runner's own bucket rules (engine/runner.py: prefill_replays, encoder_replays), against the rules
before session 9 (lengths rounded up to 64, every window run whole, powers of two of windows):

    python -m qasr.bench.padding_count --write-hook /tmp/hook     # a sitecustomize.py that logs the shapes
    PYTHONPATH=/tmp/hook QASR_PADLOG=/tmp/shapes qasr-server --device cpu ...   # then a qasr-bench stream run
    python -m qasr.bench.padding_count /tmp/shapes.*

On a GPU, `--gpu-check MODEL_DIR --json OUT` captures a runner's graphs on a checkpoint (how many, how long) and
compares the graphed encoder at its length buckets, and the graphed prefill at its ladder, with the eager ones.

Each admission's prefill lengths and encoder window sizes are logged as JSON lines. Admissions at 1,000 streams are
larger than a CPU run's: --regroup N also counts the same sequences in admissions of N, in their order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qasr.engine import runner

HOOK = '''# by qasr.bench.padding_count: logs each prefill's lengths and encoder call's window sizes to $QASR_PADLOG
import os
if os.environ.get("QASR_PADLOG"):
    import json
    import qasr.engine.runner as r
    from qasr.model.modeling import window_lengths
    def _log(kind, values):
        with open(f"{os.environ['QASR_PADLOG']}.{os.getpid()}", "a") as f:
            f.write(json.dumps([kind, values]) + "\\n")
    _prefill, _encode = r.ModelRunner.prefill, r.ModelRunner.encode
    def prefill(self, embeds, slots, starts):
        _log("prefill", [e.shape[0] for e in embeds])
        return _prefill(self, embeds, slots, starts)
    def encode(self, clips):
        _log("encode", [n for c in clips for n in window_lengths(c.shape[0], self.window_tokens)])
        return _encode(self, clips)
    r.ModelRunner.prefill, r.ModelRunner.encode = prefill, encode
'''

OLD_PREFILL = ((1, 2, 4, 8), lambda max_len: tuple(range(64, -(-max_len // 64) * 64 + 1, 64)))
OLD_ENCODER = ((104,), (1, 2, 4, 8, 16, 32, 64))


def prefill_count(admissions: list[list[int]], batch: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[int, int]:
    """-> (positions computed, replays) of these admissions' prefills."""
    replays = [r for a in admissions for r in runner.prefill_replays(a, batch, lengths)]
    return sum(b * t for _, b, t in replays), len(replays)


def encoder_count(calls: list[list[int]], lengths: tuple[int, ...], windows: tuple[int, ...]) -> tuple[int, int]:
    """-> (positions computed, replays) of these encoder calls, graphed."""
    replays = [r for c in calls for r in runner.encoder_replays(c, lengths, windows)]
    return sum(n * b for n, _, b in replays), len(replays)


def gpu_check(model_dir: str, max_len: int, device: str = "cuda") -> dict:
    """Capture a CUDA runner's graphs on this checkpoint, and compare what its buckets compute with the eager paths
    (device cpu: no graphs, only this code's check)."""
    import time

    import torch

    from qasr.model.checkpoint import load_model

    model = load_model(model_dir, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    t = time.perf_counter()
    graphed = runner.ModelRunner(model, num_slots=64, max_len=max_len, cuda_graphs=device == "cuda")
    result = {"capture_s": time.perf_counter() - t, "encoder_graphs": len(graphed.encoder_graphs),
              "prefill_graphs": len(graphed.prefill_buckets), "decode_graphs": len(graphed.graphs)}
    eager = runner.ModelRunner(model, num_slots=64, max_len=max_len, cuda_graphs=False)
    cfg = model.encoder.cfg
    torch.manual_seed(0)
    sizes = [14, 27, 40, 53, 66, 79, 104, 104, 13, 31, 56, 57, 92, 1] * 12  # 72 whole ones: past the largest bucket
    windows = torch.randn(len(sizes), cfg.window_tokens, cfg.d_model, device=device, dtype=model.dtype)
    lengths = torch.tensor(sizes, device=device)
    with torch.inference_mode():
        whole = eager.encode_windows(windows, lengths)  # every window at 104 positions, eagerly
        bucketed = graphed.encode_windows(windows, lengths, sizes)
        eager_bucketed = eager.encode_windows(windows, lengths, sizes)
    diff = lambda a, b: max(float((a[w, :n].float() - b[w, :n].float()).abs().max()) for w, n in enumerate(sizes))
    result["encoder_max_abs_diff_graphed_buckets_vs_eager_whole"] = diff(bucketed, whole)
    result["encoder_max_abs_diff_eager_buckets_vs_eager_whole"] = diff(eager_bucketed, whole)
    result["encoder_output_max_abs"] = float(whole.float().abs().max())
    # the prefill: prompts of 25-110 tokens in one admission of 11 (one group padded to 16) through the graphs vs
    # eagerly
    prompt_lengths = [25, 31, 47, 52, 60, 64, 70, 88, 97, 103, 110]
    embeds = [torch.randn(n, model.cfg.text.hidden_size, device=device, dtype=model.dtype) * 0.02
              for n in prompt_lengths]
    slots = list(range(len(embeds)))
    first_graphed = graphed.prefill(embeds, slots, [0] * len(embeds))
    first_eager = eager.prefill(embeds, slots, [0] * len(embeds))
    a, b = first_graphed.tolist(), first_eager.tolist()
    result["prefill_first_tokens_equal"] = sum(x == y for x, y in zip(a, b))
    result["prefill_sequences"] = len(a)
    result["prefill_computed"] = first_graphed.computed
    result["prefill_real"] = sum(prompt_lengths)
    return result


def regroup(groups: list[list[int]], size: int) -> list[list[int]]:
    flat = [x for g in groups for x in g]
    return [flat[i : i + size] for i in range(0, len(flat), size)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qasr.bench.padding_count", description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="*", type=Path, help="the shapes logged by the hook (one file per process)")
    parser.add_argument("--write-hook", type=Path, metavar="DIR", help="write the logging sitecustomize.py into DIR")
    parser.add_argument("--max-len", type=int, default=640, help="the server's --max-len (default: 640, the benches')")
    parser.add_argument("--regroup", type=int, nargs="*", default=[16, 32, 64],
                        help="also count admissions of these many sequences (default: 16 32 64)")
    parser.add_argument("--json", type=Path, help="write the counts here too")
    parser.add_argument("--gpu-check", metavar="MODEL_DIR", help="on CUDA: graphs, capture time, buckets vs eager")
    parser.add_argument("--device", default="cuda", help="for --gpu-check (cpu: only a check of this script)")
    args = parser.parse_args(argv)
    if args.gpu_check:
        result = gpu_check(args.gpu_check, args.max_len, args.device)
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    if args.write_hook:
        args.write_hook.mkdir(parents=True, exist_ok=True)
        (args.write_hook / "sitecustomize.py").write_text(HOOK)
    prefills, encodes = [], []
    for path in args.logs:
        for line in path.read_text().splitlines():
            kind, values = json.loads(line)
            (prefills if kind == "prefill" else encodes).append(values)
    if not args.logs:
        return
    rules = {
        "prefill before (64-step)": lambda a: prefill_count(a, OLD_PREFILL[0], OLD_PREFILL[1](args.max_len)),
        "prefill now": lambda a: prefill_count(a, runner.PREFILL_BATCH_BUCKETS,
                                               runner.prefill_length_buckets(args.max_len)),
        "prefill, at most 8 sequences (before session 14)": lambda a: prefill_count(
            a, (1, 2, 4, 8), runner.prefill_length_buckets(args.max_len)),
        "encoder before (whole windows)": lambda c: encoder_count(c, *OLD_ENCODER),
        "encoder now": lambda c: encoder_count(c, runner.ENCODER_LENGTH_BUCKETS, runner.ENCODER_BUCKETS),
    }
    counts = []
    for grouping in ["as run", *args.regroup]:
        for name, count in rules.items():
            groups = prefills if name.startswith("prefill") else encodes
            groups = groups if grouping == "as run" else regroup(groups, grouping)
            if not groups:  # the logs hold no call of this kind
                print(f"{str(grouping):>6} {name:34} no calls logged")
                continue
            real = sum(map(sum, groups))
            computed, replays = count(groups)
            counts.append(dict(admissions=grouping, rule=name, real=real, computed=computed, replays=replays,
                               groups=len(groups)))
            print(f"{str(grouping):>6} {name:34} real {real:7} computed {computed:7} "
                  f"padding {1 - real / computed:4.0%}  replays {replays:5} ({replays / len(groups):.2f} per call)")
    if args.json:
        args.json.write_text(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
