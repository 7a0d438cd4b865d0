import os, time, tempfile, numpy as np, torch
from concurrent.futures import ThreadPoolExecutor
from kvstore.disk import DiskBackend
N, SZ = 256, 16 << 20  # 4 GiB of 16 MiB entries
d = tempfile.mkdtemp(dir=os.environ.get("G3DIR", "/tmp"))
b = DiskBackend(d, N * (SZ + 4096) * 2, b"n" * 16)
keys = [os.urandom(16) for _ in range(N)]
data = np.random.randint(0, 255, SZ, dtype=np.uint8)
t = time.perf_counter(); b.put(keys, [memoryview(data)] * N); print("write GB/s", N * SZ / (time.perf_counter() - t) / 1e9)
outs = [torch.empty(SZ, dtype=torch.uint8, pin_memory=True) for _ in range(32)]
dev = torch.empty(SZ, dtype=torch.uint8, device="cuda")
for rep in range(2):
  for threads in (1, 4, 8, 16):
    ex = ThreadPoolExecutor(threads)
    t = time.perf_counter()
    list(ex.map(lambda i: b.get_into([keys[i]], [memoryview(outs[i % 32].numpy())]), range(N)))
    print(rep, threads, "threads get_into GB/s", round(N * SZ / (time.perf_counter() - t) / 1e9, 2), flush=True)
t = time.perf_counter()
for i in range(N):
    with open(b._path(keys[i]), "rb") as f: f.readinto(memoryview(outs[i % 32].numpy()))
print("readinto 1 thread GB/s", N * SZ / (time.perf_counter() - t) / 1e9)
import xxhash
t = time.perf_counter()
for i in range(64): xxhash.xxh3_128_digest(outs[i % 32].numpy())
print("xxh3 GB/s", 64 * SZ / (time.perf_counter() - t) / 1e9)
t = time.perf_counter()
for i in range(64): dev.copy_(outs[i % 32]); torch.cuda.synchronize()
print("pinned h2d per 16MiB GB/s", 64 * SZ / (time.perf_counter() - t) / 1e9)
os.system(f"df -h {d}; mount | grep -E ' / | /tmp ' ")
