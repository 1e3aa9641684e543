"""What CUDA kernels allocate beyond their outputs, read off the caching allocator's recorded history.

The evidence behind ``fxmem/kernels/cuda.py``: for scaled_dot_product_attention's memory-efficient,
flash and cuDNN kernels (float32, bfloat16, float16; head sizes 16, 64, 80, 128; lengths 8, 64, 65,
200, 1000; batch x heads 1, 8, 512; (B, H, L, D) and (B, L, H, D) layouts; causal or not), softmax's
and log_softmax's backward, and cuBLAS matrix products with expanded, strided and transposed operands:
every allocation and free (bytes, in order) of a warmed-up forward and backward. Last, a probe of
the caching allocator: the bytes it counts after a fixed sequence of large allocations and frees.

    python benchmarks/cuda_kernels.py                 # needs a CUDA GPU; writes benchmarks/results/cuda_kernels.json
"""
import argparse
import itertools
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_kernels.json"))
    p.add_argument("--seconds", type=float, default=150, help="stop the attention sweep after this long")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if not torch.cuda.is_available():
        sys.exit("cuda_kernels.py needs a CUDA GPU")
    sys.path.insert(0, str(ROOT))
    from fxmem import _torch_compat as tc

    rows = []

    def trace(fn):
        torch.cuda.synchronize()
        with tc.cuda_memory_history(stacks="python") as take:
            r = fn(); torch.cuda.synchronize()
            snap = take()
        ev = [(e["action"][0], e["size"]) for t in snap["device_traces"] for e in t if e["action"] in ("alloc", "free_completed")]
        return r, ev

    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "sm": f"{props.major}.{props.minor}", "sms": props.multi_processor_count, "torch": torch.__version__}
    backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    t0 = time.time()
    for dt, D, L, (B, H), layout, causal, be in itertools.product(
            (torch.float32, torch.bfloat16, torch.float16), (16, 64, 80, 128), (8, 64, 65, 200, 1000),
            ((1, 1), (2, 4), (16, 32)), ("bhld", "blhd"), (False, True), ("efficient", "flash", "cudnn")):
        if be != "efficient" and dt == torch.float32: continue
        if be == "cudnn" and (layout == "bhld" or B == 16): continue
        cfg = dict(dtype=str(dt)[6:], D=D, L=L, B=B, H=H, layout=layout, causal=causal, backend=be)
        try:
            torch.manual_seed(0)
            shape = (B, H, L, D) if layout == "bhld" else (B, L, H, D)
            q, k, v = (torch.randn(shape, device="cuda", dtype=dt).requires_grad_() for _ in range(3))
            qq, kk, vv = (t if layout == "bhld" else t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(backends[be]):
                F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).sum().backward()  # warm
                q.grad = k.grad = v.grad = None
                out, fwd = trace(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal))
                g = torch.randn_like(out)
                _, bwd = trace(lambda: out.backward(g))
            cfg.update(fwd=fwd, bwd=bwd)
        except Exception as e:
            cfg["error"] = f"{type(e).__name__}: {str(e)[:150]}"
        rows.append(cfg)
        q = k = v = qq = kk = vv = out = g = None
        if time.time() - t0 > args.seconds: break
    meta["sdpa_seconds"] = round(time.time() - t0, 1)
    # softmax backward (same dtype, and half->float), log_softmax backward
    sm = []
    for dt, dtype_arg, shape in ((torch.float32, None, (4, 8, 33, 33)), (torch.float16, torch.float32, (4, 8, 33, 33)),
                                 (torch.bfloat16, None, (3, 1000)), (torch.float32, None, (3, 5000)), (torch.float32, "log", (7, 300))):
        x = torch.randn(shape, device="cuda", dtype=dt, requires_grad=True)
        if dtype_arg == "log":
            y = F.log_softmax(x, -1)
        else:
            y = F.softmax(x, -1, dtype=dtype_arg)
        g = torch.randn_like(y)
        _, ev = trace(lambda: y.backward(g))
        sm.append(dict(dtype=str(dt), arg=str(dtype_arg), shape=shape, bwd=ev))
    # BLAS operand copies
    bl = []
    def case(name, fn):
        try:
            _, ev = trace(fn); bl.append(dict(name=name, ev=ev))
        except Exception as e:
            bl.append(dict(name=name, error=str(e)[:200]))
    a = torch.randn(64, 96, device="cuda"); b = torch.randn(96, 40, device="cuda")
    ones = torch.ones(1, device="cuda").expand(64, 96)
    case("mm contiguous", lambda: a @ b)
    case("mm transposed", lambda: a.t().contiguous().t() @ b)
    case("mm expanded self", lambda: ones @ b)
    case("mm expanded mat2", lambda: a @ torch.ones(1, device="cuda").expand(96, 40))
    case("mm strided cols", lambda: torch.randn(64, 192, device="cuda")[:, ::2] @ b)
    case("mm sliced rows", lambda: torch.randn(64, 200, device="cuda")[:, :96] @ b)
    case("addmm expanded", lambda: torch.addmm(torch.zeros(40, device="cuda"), ones, b))
    A = torch.randn(5, 64, 96, device="cuda"); Bm = torch.randn(5, 96, 40, device="cuda")
    case("bmm contiguous", lambda: torch.bmm(A, Bm))
    case("bmm transposed self", lambda: torch.bmm(A.transpose(1, 2).contiguous().transpose(1, 2), Bm))
    case("bmm expanded self", lambda: torch.bmm(torch.ones(1, 1, 1, device="cuda").expand(5, 64, 96), Bm))
    case("bmm expanded batch", lambda: torch.bmm(torch.randn(1, 64, 96, device="cuda").expand(5, 64, 96), Bm))
    case("bmm strided", lambda: torch.bmm(torch.randn(5, 64, 192, device="cuda")[:, :, ::2], Bm))
    case("bmm permuted 021", lambda: torch.bmm(torch.randn(64, 5, 96, device="cuda").transpose(0, 1), Bm))
    case("bmm N=1", lambda: torch.bmm(A, torch.randn(5, 96, 1, device="cuda")))
    case("matmul 4d expanded grad", lambda: torch.matmul(torch.ones(1, 1, 1, 1, device="cuda").expand(2, 3, 64, 96), torch.randn(2, 3, 96, 40, device="cuda")))
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "sdpa": rows, "softmax": sm, "blas": bl,
                                                  "allocator": allocator_probe(torch)}))
    print(meta, len(rows), sum("error" in r for r in rows))


def allocator_probe(torch) -> list:
    """When the caching allocator counts more than the 512-byte-rounded request: allocated and
    requested bytes (memory_stats) after each step of a fixed sequence of allocations and frees."""
    mb = 2**20
    keys = ("allocated_bytes.all.current", "requested_bytes.all.current", "reserved_bytes.all.current")
    out = []

    def note(tag):
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        out.append({"tag": tag, **{k.split(".")[0]: stats.get(k) for k in keys}})

    torch.cuda.empty_cache()
    note("start")
    x = torch.empty(int(13.5 * mb), dtype=torch.uint8, device="cuda"); note("13.5MiB fresh")
    y = torch.empty(int(12.5 * mb), dtype=torch.uint8, device="cuda"); note("12.5MiB fresh")
    z = torch.empty(3 * mb, dtype=torch.uint8, device="cuda"); note("3MiB fresh (20MiB seg)")
    a = torch.empty(4 * mb, dtype=torch.uint8, device="cuda"); b = torch.empty(4 * mb, dtype=torch.uint8, device="cuda")
    note("a,b 4MiB")
    del z; note("free 3MiB")
    c = torch.empty(int(2.5 * mb), dtype=torch.uint8, device="cuda"); note("2.5MiB into freed 3MiB hole?")
    del a; d = torch.empty(int(3.5 * mb), dtype=torch.uint8, device="cuda"); note("3.5MiB after freeing a 4MiB")
    del x, y, b, c, d
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
