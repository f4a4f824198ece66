"""The benchmark: measured ratios of omni-mpo against the baselines a user would otherwise pick (`python -m bench`, see
cli.py for the flags). One module per measure, each importing only the ones listed before it (common, baseline,
workload; the CPU items packing, vision, logprobs, train_step, shared, data, grads, optim; the GPU item's gpu_step,
scan, profiling, ablation, then gpu; cli): docs/MODULES.md, "bench/". Results: bench/results.json (a full CPU run) and
bench/gpu_results.json (`--gpu`). Product modules never import this package.
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # before torch is imported by any module of the package
