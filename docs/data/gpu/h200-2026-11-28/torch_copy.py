"""torch's device copy of 64M float32 on the GPU (the floor of docs/results/device.md):
CUDA events around y.copy_(x), 12 copies, the first two dropped, the 6th of the 10
sorted (the upper median). These statements ran on the H200 as one `python -c` in the
venv built as ./dev.sh gpu builds one, before that call's tests (torch-copy.txt)."""
import torch

x = torch.randn(2**26, device="cuda")
y = torch.empty_like(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
t = []
for i in range(12):
    s.record()
    y.copy_(x)
    e.record()
    e.synchronize()
    t.append(s.elapsed_time(e))
t = sorted(t[2:])
print("torch copy 64M f32: median %.3f ms, %.0f GB/s of input" % (t[5], 2**28 / t[5] / 1e6))
