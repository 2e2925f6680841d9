"""The KV formats' quantize and dequantize rates on this CPU, which the sweep charges (issue 31).

Measured once per sweep and format on one layer-sized tensor of the workload (``[prompt_len, B*H, D]`` in the
model's dtype), median of ``reps`` timed runs after a warm-up, with torch's threads as the inference process
would have them: quantize into preallocated rows (``SlotTensors.put``), dequantize into a preallocated tensor
(``SlotTensors.take``). Rates are GB/s of decoded input (fp16 bytes for an fp16 model).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bladed.kvformat import kv_format
from bladed_bench.workload import WorkloadSpec

_TORCH_DTYPES = {2: "float16", 4: "float32"}


def measure(fmt: str, spec: WorkloadSpec, reps: int = 7) -> dict[str, Any]:
    """``{"quantize_gbps", "dequantize_gbps", "tensor", ...}`` of ``fmt`` on ``spec``'s layer shape (plain formats:
    no cost, rates 0)."""
    import torch

    f = kv_format(fmt)
    shape = (spec.prompt_len, spec.batch * spec.kv_heads, spec.head_dim)
    out: dict[str, Any] = {"format": f.name, "tensor": list(shape), "threads": torch.get_num_threads(),
                           "reps": reps, "device": "cpu"}
    if f.plain:
        return out | {"quantize_gbps": 0.0, "dequantize_gbps": 0.0, "note": "plain rows: no codec"}
    dtype = getattr(torch, _TORCH_DTYPES.get(spec.dtype_bytes, "float16"))
    x = torch.randn(shape, dtype=torch.float32).mul_(2.0).to(dtype)
    rows = f.encode(x)
    back = torch.empty_like(x)      # decoded into a tensor the client holds, as SlotTensors.take does
    nbytes = x.numel() * x.element_size()
    q, d = [], []
    for i in range(reps + 1):
        t = time.perf_counter()
        f.encode(x, out=rows)
        t1 = time.perf_counter()
        f.decode(rows, out=back)
        t2 = time.perf_counter()
        if i:                      # the first is the warm-up
            q.append(t1 - t)
            d.append(t2 - t1)
    qs, ds = statistics.median(q), statistics.median(d)
    return out | {"decoded_bytes": nbytes, "stored_bytes": rows.numel(), "quantize_s": qs, "dequantize_s": ds,
                  "quantize_gbps": nbytes / qs / 1e9, "dequantize_gbps": nbytes / ds / 1e9}
