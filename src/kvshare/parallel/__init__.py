"""Tensor and expert parallelism over torch.distributed (phase2_design.md B.4).

- `group`: process group set-up (gloo on CPU, NCCL on CUDA, a free port) and the fp32 collectives;
- `layers`: row-parallel hook, vocab-parallel embedding and head;
- `shard`: which rank holds which slice (`ShardPlan`), divisibility checks, `apply_tp`;
- `loader`: a rank's shard from safetensors, reading only its slices;
- `control`: rank 0 broadcasts each step, workers replay it; cache digests;
- `launch`: spawning (or torchrun), failure detection, shutdown;
- `plan`: per-rank weight and cache bytes for `kvshare plan`.
"""
