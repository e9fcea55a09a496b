"""bf16 products against FP8 row-wise torch._scaled_mm at admission-sized M, the 0.6B shapes, with the activation
quantization pass timed apart (session 24): python -m qasr.bench.fp8_products on a GPU, one JSON line a product."""
import json, torch, triton, triton.language as tl
import torch.nn.functional as F

@triton.jit
def _quant(X, Q, S, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
    tl.store(Q + row * K + cols, (x / scale).to(tl.float8e4nv), mask=cols < K)
    tl.store(S + row, scale)

def quant(x):
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    b = triton.next_power_of_2(K)
    _quant[(M,)](x, q, s, K, BLOCK=b, num_warps=min(16, max(1, b // 256)))
    return q, s

def timeit(fn, n=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n

SHAPES = {"dec.qkv": (1024, 4096, False), "dec.o": (2048, 1024, False), "dec.gate_up": (1024, 6144, False),
          "dec.down": (3072, 1024, False), "enc.qkv": (896, 2688, True), "enc.o": (896, 896, True),
          "enc.fc1": (896, 3584, True), "enc.fc2": (3584, 896, True)}
dev = "cuda"
rows = []
for M in (512, 8192, 32768, 65536):
    for name, (K, N, bias) in SHAPES.items():
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        bb = torch.randn(N, device=dev, dtype=torch.bfloat16) if bias else None
        ws = (w.abs().amax(1, keepdim=True).float() / 448).clamp(min=1e-12)
        wq = (w.float() / ws).to(torch.float8_e4m3fn)
        ws = ws.t().contiguous()
        q, s = quant(x)
        t_bf16 = timeit(lambda: F.linear(x, w, bb))
        try:
            t_mm = timeit(lambda: torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws, bias=bb, out_dtype=torch.bfloat16))
            bias_in = True
        except Exception as e:
            t_mm = timeit(lambda: torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16) + (bb if bb is not None else 0))
            bias_in = repr(e)[:80]
        t_q = timeit(lambda: quant(x))
        ref = F.linear(x, w, bb).float()
        got = torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16).float() + (bb.float() if bb is not None else 0)
        rel = ((got - ref).norm() / ref.norm()).item()
        tflop = 2 * M * K * N / 1e12
        r = dict(M=M, name=name, bf16_ms=round(t_bf16, 4), fp8_mm_ms=round(t_mm, 4), quant_ms=round(t_q, 4),
                 fp8_total_over_bf16=round((t_mm + t_q) / t_bf16, 3), mm_only_over_bf16=round(t_mm / t_bf16, 3),
                 bf16_tflops=round(tflop / t_bf16 * 1e3), fp8_tflops=round(tflop / t_mm * 1e3), rel_err=round(rel, 4), bias_in=bias_in)
        print(json.dumps(r), flush=True)
