"""Measured performance of omni-mpo against the baselines a user would otherwise pick, side by side, as ratios.

    python -m bench            # everything; prints one table, writes bench/results.json (docs/PERFORMANCE.md's table)
    python -m bench --quick    # reduced sizes, about 1 min (57 s on 2 shared CPU cores; tests/test_bench.py runs it)
    python -m bench --only packing,logprobs --json out.json
    python -m bench --print    # the table of bench/results.json (or --print FILE)
    python -m bench --gpu --profile   # the GPU item alone (CUDA), with the step's device time by region

Items: `bench_<name>(quick) -> dict` of its module, recorded under its name as it ends (a failed one as {"error": ...};
the later ones still run, the exit status is then 1). Where each run writes, the items and how to read the numbers:
docs/PERFORMANCE.md, "The benchmark's command line".
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
from pathlib import Path

import torch

from bench import common
from bench.ablation import ablation_rows
from bench.common import ROOT, _mib, machine, run_section
from bench.data import bench_data
from bench.encoders import bench_encoders
from bench.gpu import bench_gpu
from bench.gpu_step import gpu_step_rows
from bench.grads import bench_grads
from bench.logprobs import MEMORY_GOAL, TIME_GOAL, bench_logprobs, logprobs_worker
from bench.optim import bench_optimizer
from bench.packing import bench_packing
from bench.profiling import profile_table
from bench.scan import scan_rows
from bench.shared import bench_shared
from bench.train_step import bench_train
from bench.vision import bench_vision

ITEMS = {"packing": bench_packing, "vision": bench_vision, "logprobs": bench_logprobs, "train": bench_train,
         "shared": bench_shared, "data": bench_data, "gpu": bench_gpu, "grads": bench_grads,
         "optimizer": bench_optimizer, "encoders": bench_encoders}


def table(res: dict) -> str:
    """The results as one Markdown table: item | metric | ours | baseline | ratio."""
    from mmpr_records import plural

    rows = [(name, "failed", r["error"][:100], "", "") for name, r in res.items() if "error" in r]
    res = {name: r for name, r in res.items() if "error" not in r}
    if "packing" in res:
        p = res["packing"]
        a, b, c = p["ours"], p["round_robin"], p["padded"]
        rows += [
            ("packing (a) vs (b) round-robin", "busiest rank's token share (1/8 ideal)",
             f"{a['busiest_rank_share']:.4f}", f"{b['busiest_rank_share']:.4f}", f"{p['busiest_rank_b_over_a']:.3f}x"),
            ("packing (a) vs (c) padded pairs", "useful-token fraction", f"{a['useful_fraction']:.4f}",
             f"{c['useful_fraction']:.4f}", f"{a['useful_fraction'] / c['useful_fraction']:.3f}x"),
            ("packing (a) vs (c) padded pairs", "tokens computed (padding included)", f"{a['tokens']}",
             f"{c['tokens']}", f"{p['padding_compute_c_over_a']:.3f}x"),
            ("packing (a) vs (c) padded pairs", "busiest rank's tokens (step time)", f"{a['busiest_rank_tokens']}",
             f"{c['busiest_rank_tokens']}", f"{p['busiest_rank_c_over_a']:.3f}x"),
        ]
    if "vision" in res:
        v = res["vision"]
        rows += [
            ("vision once per pair", "ViT+projector fwd+bwd per pair", f"{v['vision_fwd_bwd_s_shared'] * 1e3:.1f} ms",
             f"{v['vision_fwd_bwd_s_per_row'] * 1e3:.1f} ms", f"{v['vision_cost_ratio']:.2f}x"),
            ("vision once per pair", "whole pair fwd+bwd", f"{v['pair_fwd_bwd_s_shared'] * 1e3:.1f} ms",
             f"{v['pair_fwd_bwd_s_per_row'] * 1e3:.1f} ms", f"{v['pair_step_ratio']:.2f}x"),
        ]
    if "encoders" in res:
        e = res["encoders"]
        what = (f"one pair: an image ({e['image_tokens']} tokens), {e['video_frames']} video frames "
                f"({e['video_tokens']}), {e['audio_seconds']:.1f} s of audio ({e['audio_tokens']})")
        rows += [(f"encoders' share of a step, {what}", f"{name} fwd+bwd / the pair's fwd+bwd ({e['clock']})",
                  f"{e[k + '_fwd_bwd_s'] * 1e3:.1f} ms", f"{e['step_fwd_bwd_s'] * 1e3:.1f} ms",
                  f"{e[k + '_share']:.1%}")
                 for k, name in (("vit_images", "ViT on the image"), ("vit_video", "ViT on the video"),
                                 ("vit", "ViT on both (one call)"), ("sound", "sound encoder + projection"))]
    if "logprobs" in res:
        lp = res["logprobs"]
        shape = f"T={lp['T']} V={lp['V']}"
        rows += [
            (f"log-probs {shape}", "peak additional memory, fwd+bwd", _mib(lp["peak_bytes_ours"]),
             _mib(lp["peak_bytes_naive"]), f"{lp['memory_ratio']:.2f}x less"),
            (f"log-probs {shape}", "naive without its [T,V] logits-gradient buffer", _mib(lp["peak_bytes_ours"]),
             _mib(lp["working_bytes_naive"]), f"{lp['working_memory_ratio']:.2f}x less"),
            (f"log-probs {shape}", "time fwd+bwd", f"{lp['seconds_ours']:.3f} s", f"{lp['seconds_naive']:.3f} s",
             f"{lp['time_ratio']:.2f}x the time"),
        ]
    if "train" in res:
        t = res["train"]
        rows += [
            ("MPO step vs transformers", f"pairs/s ({t['pairs']} pairs)", f"{t['pairs_per_s_ours']:.2f}",
             f"{t['pairs_per_s_baseline']:.2f}", f"{t['speed_ratio']:.2f}x the speed"),
            ("MPO step vs transformers", "tokens/s", f"{t['tokens_per_s_ours']:.0f}",
             f"{t['tokens_per_s_baseline']:.0f}", f"{t['speed_ratio']:.2f}x the speed"),
            ("MPO step vs transformers",
             f"step, 8 pairs per bin ({plural(t['microbatches_ours_8_per_bin'], 'microbatch')})",
             f"{t['step_s_ours_8_per_bin']:.3f} s", f"{t['step_s_baseline']:.3f} s",
             f"{t['speed_ratio_8_per_bin']:.2f}x the speed"),
            ("MPO step vs transformers", "step-1 loss", f"{t['loss_ours']:.6f}", f"{t['loss_baseline']:.6f}",
             f"diff {t['loss_abs_diff']:.1e}"),
        ]
        if "pairs_per_s_stored_reference" in t:  # results older than the stored reference lack these
            rows += [
                ("stored reference log-probs vs reference forward", f"MPO step pairs/s ({t['pairs']} pairs, same bins)",
                 f"{t['pairs_per_s_stored_reference']:.2f}", f"{t['pairs_per_s_ours']:.2f}",
                 f"{t['stored_reference_speed_ratio']:.2f}x the speed (goal {t['stored_reference_goal']}x)"),
                ("reference pass vs MPO step", "pairs/s (same bins)", f"{t['pairs_per_s_reference_pass']:.2f}",
                 f"{t['pairs_per_s_ours']:.2f}", f"{t['pass_over_step_speed_ratio']:.2f}x the speed"),
            ]
    if "shared" in res:
        sh = res["shared"]
        rows += [
            ("shared prompt vs separate sequences", f"LM tokens, {sh['count_pairs']} MMPR-like pairs (bins of "
             f"{sh['count_bin_tokens']})", f"{sh['count_tokens_shared']}", f"{sh['count_tokens_separate']}",
             f"{sh['count_token_ratio']:.2f}x fewer"),
            ("shared prompt vs separate sequences", f"MPO step pairs/s ({sh['pairs']} pairs, lengths / "
             f"{sh['length_scale']}, {sh['tokens_shared']} vs {sh['tokens_separate']} tokens)",
             f"{sh['pairs_per_s_shared']:.2f}", f"{sh['pairs_per_s_separate']:.2f}",
             f"{sh['speed_ratio']:.2f}x the speed"),
        ]
    if "data" in res:
        d = res["data"]
        rows += [
            (f"data index, {d['rows']} records", "cache load vs build", f"{d['cache_load_s'] * 1e3:.1f} ms",
             f"{d['build_s']:.2f} s", f"{d['build_over_load']:.1f}x faster"),
            ("data decode + process", "pairs/s, 2 workers vs 0", f"{d['pairs_per_s_workers2']:.1f}",
             f"{d['pairs_per_s_workers0']:.1f}", f"{d['workers2_over_workers0']:.2f}x"),
        ]
    if "grads" in res:
        for n, e in res["grads"]["errors"].items():
            b, f = e["bf16"], e["fp32"]
            ratio = f"{b['rel_l2'] / f['rel_l2']:.2g}x the error" if f["rel_l2"] else "both exact"
            rows.append((f"bf16 vs fp32 gradient buffers, {plural(int(n), 'microbatch')}",
                         "relative L2 error against float64 (max-abs)", f"{b['rel_l2']:.1e} ({b['rel_max']:.1e})",
                         f"{f['rel_l2']:.1e} ({f['rel_max']:.1e})", ratio))
    if "optimizer" in res:
        o = res["optimizer"]
        base = o["state"]["fp32 master (megatron-core's path)"]["bytes_per_param"]
        rows += [(f"optimizer: {k}", "state bytes per trained parameter", f"{v['bytes_per_param']:.2f}",
                  f"{base:.2f}", f"{v['bytes_per_param'] / base:.2f}x") for k, v in o["state"].items()]
        st, gpu = o["step"], o.get("step_cuda")
        for where, t in ((f"CPU, {st.get('threads', '')} threads", st), ("CPU, 1 thread", st.get("one_thread")),
                         ("GPU", gpu)):  # fmt: skip
            torch_s = t["seconds"]["torch AdamW (fp32 master)"] if t else 0
            rows += [(f"optimizer step, {st['numel']} params", f"{k} vs torch AdamW ({where})",
                      f"{t['seconds'][k] * 1e3:.1f} ms", f"{torch_s * 1e3:.1f} ms", f"{r:.2f}x")
                     for k, r in (t["ratio"].items() if t else ())]
        for n, row in o["errors"]["errors"].items():
            ref = row["fp32 moments, fp32 buffers"]["rel_l2"]
            rows += [(f"optimizer update after {plural(int(n), 'step')}", f"{k}: rel. L2 error vs float64",
                      f"{e['rel_l2']:.1e}", f"{ref:.1e}", f"{e['rel_l2'] / ref:.2g}x" if ref else "")
                     for k, e in row.items() if not k.startswith("fp32 moments, fp32")]
    if "gpu" in res and "skipped" in res["gpu"]:
        rows.append(("GPU", "step time, tokens/s, MFU", res["gpu"]["skipped"], "", ""))
    elif "gpu" in res:
        g, st = res["gpu"], res["gpu"].get("step", {"error": "not recorded"})
        if "error" in st:
            rows.append(("MPO step (GPU item)", "failed", st["error"][:100], "", ""))
        else:
            rows += gpu_step_rows(st)
        if "ablation" in g:
            rows += ablation_rows(g["ablation"])
        sc = g.get("scan", {"error": "not recorded"})
        rows += [("Mamba-2 scans", "failed", sc["error"][:100], "", "")] if "error" in sc else scan_rows(sc)
    head = ("item", "metric", "ours", "baseline", "ratio")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced sizes (about 1 min: 57 s on 2 shared CPU cores)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(ITEMS)}")
    ap.add_argument("--gpu", action="store_true", help="only the GPU item (needs CUDA), written to "
                    "bench/gpu_results.json (results/bench_gpu_results.json with --quick) unless --json is given")
    ap.add_argument("--profile", action="store_true", help="with the GPU item: torch.profiler over one MPO step, a "
                    "table of device time by region (profile_step; CPU time when --only gpu runs on the CPU)")
    ap.add_argument("--ablation", action="store_true", help="with the GPU item: the step again with each fast "
                    "kernel of the kernel line swapped for its portable fallback (kernel_ablation)")
    ap.add_argument("--timed-steps", type=int, metavar="N", help="GPU item: timed steps after step 1 and timed "
                    "scans per kernel (default 1 with --quick, else 5)")
    ap.add_argument("--json", help="where to write the results (default: bench/results.json for a full run of every "
                    "item, results/bench_results.json for --quick / --only)")
    ap.add_argument("--print", metavar="JSON", nargs="?", const=str(ROOT / "bench" / "results.json"),
                    help="print the table of a saved results file (default bench/results.json) and exit")
    ap.add_argument("--logprobs-worker", nargs=4, type=int, metavar=("T", "V", "CHUNK", "REPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.logprobs_worker:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        print(json.dumps(logprobs_worker(*args.logprobs_worker)))
        return 0
    if args.print:
        if not Path(args.print).is_file():
            print(f"error: no results file {args.print} (a full `python -m bench` writes bench/results.json, "
                  "--quick / --only runs results/bench_results.json)", file=sys.stderr)
            return 1
        try:
            res = json.loads(Path(args.print).read_text())
            head = (f"omni-mpo bench ({'quick' if res['quick'] else 'full'}), {res['date']}, {res['machine']}: "
                    f"`{res.get('command', 'python -m bench')}`")
            text = table({k: v for k, v in res.items() if k in ITEMS})
            if "profile" in res.get("gpu", {}) and "error" not in res["gpu"]["profile"]:
                text += "\n\n" + profile_table(res["gpu"]["profile"])
        except (ValueError, TypeError, KeyError) as e:  # not JSON, or not a results file of this benchmark
            what = (f"invalid JSON: {e}" if isinstance(e, json.JSONDecodeError) else
                    f"not a bench results file ({type(e).__name__}: {e})")  # fmt: skip
            print(f"error: {args.print}: {what}", file=sys.stderr)
            return 1
        print(head)
        print(text)
        return 0
    if args.gpu:
        if not torch.cuda.is_available():
            print("python -m bench --gpu: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU "
                  "machine", file=sys.stderr)
            return 2
        args.only = "gpu"
        args.json = args.json or str(ROOT / "results" / "bench_gpu_results.json" if args.quick else
                                     ROOT / "bench" / "gpu_results.json")  # fmt: skip
    names = list(ITEMS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    if not names:  # --only "" would otherwise run every item and write over the committed bench/results.json
        ap.error(f"--only {args.only!r} names no item; choose from {list(ITEMS)}")
    unknown = sorted(set(names) - set(ITEMS))
    if unknown:
        ap.error(f"unknown item(s) {unknown}; choose from {list(ITEMS)}")
    if (args.profile or args.ablation or args.timed_steps) and "gpu" not in names:
        ap.error("--profile, --ablation and --timed-steps are the GPU item's: use them with --gpu (or an --only that "
                 "names gpu)")
    if args.timed_steps is not None and args.timed_steps < 1:
        ap.error(f"--timed-steps {args.timed_steps}: at least 1")
    from backend import kernel_selection

    print(kernel_selection.select_kernels().line(), file=sys.stderr, flush=True)
    flags = (" --gpu" if args.gpu else "") + (" --quick" if args.quick else "") + (" --profile" if args.profile else "")
    flags += " --ablation" if args.ablation else ""
    flags += f" --only {args.only}" if args.only and not args.gpu else ""
    flags += f" --timed-steps {args.timed_steps}" if args.timed_steps else ""
    res: dict = {"quick": args.quick, "machine": machine(), "date": datetime.date.today().isoformat(),
                 "command": "python -m bench" + flags}
    out = Path(args.json or (ROOT / "bench" / "results.json" if not args.quick and args.only is None else
                             ROOT / "results" / "bench_results.json"))  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    common._STATE["write"] = lambda: out.write_text(json.dumps(res, indent=1) + "\n")  # after every section
    common.write_results()
    failed = []
    try:
        for name in names:
            fn = ITEMS[name]
            if name == "gpu":  # its sections (step, scans, profile) are written as each ends
                fn = functools.partial(bench_gpu, profile=args.profile, timed=args.timed_steps,
                                       out=res.setdefault("gpu", {}), ablation=args.ablation)
            if not run_section(res, name, fn, args.quick):
                failed.append(name)
            failed += [f"{name}.{k}" for k, v in res[name].items() if isinstance(v, dict) and "error" in v]
    finally:
        common.cleanup()  # the folder and the checkpoints cached in it are gone: a later call in this process makes new
    print(f"wrote {out}")
    print(f"omni-mpo bench ({'quick' if args.quick else 'full'}), {res['date']}, {res['machine']}")
    print(table({k: v for k, v in res.items() if k in ITEMS}))
    if "profile" in res.get("gpu", {}) and "error" not in res["gpu"]["profile"]:
        print("\n" + profile_table(res["gpu"]["profile"]))
    if "logprobs" in res and "error" not in res["logprobs"]:
        lp = res["logprobs"]
        met = lp["memory_ratio"] >= MEMORY_GOAL and lp["time_ratio"] <= TIME_GOAL
        print(f"log-prob goal (>= {MEMORY_GOAL}x less peak memory at <= {TIME_GOAL}x time): "
              f"{'met' if met else 'NOT met'} (total {lp['memory_ratio']:.2f}x, against naive without its logits "
              f"gradient {lp['working_memory_ratio']:.2f}x, time {lp['time_ratio']:.2f}x)")
    if "gpu" in res and "skipped" in res["gpu"]:
        print(f"gpu: skipped ({res['gpu']['skipped']})")
    if failed:
        print(f"bench: failed: {', '.join(failed)} (recorded as errors in {out})", file=sys.stderr)
        return 1
    return 0
