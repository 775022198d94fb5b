"""Why V4.1's device decode is host-bound: the CUDA kernel launches, memcpy/sync calls and GPU-busy time of one
decode step at batch 1 of bench/v41_gpu.py's Flash-shaped model (context 2,048), from torch.profiler.

    python3 bench/investigations/v41_decode_launches.py      # on a GPU machine
"""
import sys, torch
sys.path.insert(0, '.')
import bench.v41_gpu as b
from torch.profiler import profile, ProfilerActivity
with torch.inference_mode():
    m = b.build(b.FLASH_SHAPES, torch.device('cuda'))
    st = m.make_state('cuda'); m.forward(list(range(3, 2051)), st)
    ids = torch.tensor([5]); m.forward_decode(ids, [st]); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        m.forward_decode(ids, [st]); torch.cuda.synchronize()
    ev = prof.key_averages()
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in ev if "Synchronize" in e.key or e.key in ("cudaMemcpyAsync", "cudaStreamSynchronize"))
    gpu_us = sum(e.self_device_time_total for e in ev) if hasattr(ev[0], "self_device_time_total") else None
    print("kernel launches per decode step (batch 1):", launches, "memcpy/sync calls:", syncs, "GPU busy us:", gpu_us)
