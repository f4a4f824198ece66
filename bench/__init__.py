"""The benchmark: measured ratios of omni-mpo against the baselines a user would otherwise pick (`python -m bench`,
see cli.py for the flags). One module per measure, each importing only the ones listed before it:

    common.py      paths, tolerances, interleaved timing, sections recorded as they end, small checkpoints, memory
    baseline.py    the conventional MPO step (padded pairs, log_softmax + gather, torch Adam)
    workload.py    synthetic MMPR-like lengths and text pairs
    packing.py     item packing      vision.py    item vision      logprobs.py   item logprobs
    train_step.py  item train        shared.py    item shared      data.py       item data      grads.py   item grads
    optim.py       item optimizer
    gpu_step.py    the GPU item's MPO step, ours vs transformers
    scan.py        the GPU item's Mamba-2 scan kernels
    profiling.py   the GPU item's device time by region (--profile)
    ablation.py    the GPU item's kernel ablation (--ablation)
    gpu.py         item gpu: the step sized to the device, then its sections
    cli.py         the items, the results table and the command line (__main__.py runs it)

Results: bench/results.json (a full CPU run) and bench/gpu_results.json (`--gpu`). Product modules never import this
package.
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported by any module of the package
