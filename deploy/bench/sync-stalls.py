#!/usr/bin/env python3
"""How a snapshot-sized file write stalls small synced appends on the same disk.

Three threads append 400 bytes and fdatasync in a loop (as three replicas'
logs do) while an 85 MB file is written ROUNDS times by each method, with a
10-second phase with nothing written as the baseline. Prints, per method, the longest
append sync and how many took over 10 ms.

    deploy/bench/sync-stalls.py DIR [ROUNDS]
"""
import ctypes
import os
import sys
import threading
import time

SIZE = 85 << 20
SFR_WRITE, SFR_WAIT_ALL = 2, 7
RENAME_EXCHANGE = 2
libc = ctypes.CDLL("libc.so.6", use_errno=True)


def paced_write(path, data, chunk, truncate):
    """Write `data` to `path` handing each chunk to the disk as it is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0))
    previous = None
    for off in range(0, len(data), chunk):
        os.pwrite(fd, data[off:off + chunk], off)
        libc.sync_file_range(fd, ctypes.c_longlong(off), ctypes.c_longlong(chunk), SFR_WRITE)
        if previous is not None:
            libc.sync_file_range(fd, ctypes.c_longlong(previous), ctypes.c_longlong(chunk), SFR_WAIT_ALL)
        previous = off
    if os.fstat(fd).st_size > len(data):
        os.ftruncate(fd, len(data))
    os.fsync(fd)
    os.close(fd)


def replace(d, data, chunk):
    paced_write(f"{d}/writing", data, chunk, truncate=True)
    os.rename(f"{d}/writing", f"{d}/current")


def exchange(d, data, chunk):
    paced_write(f"{d}/writing", data, chunk, truncate=False)
    if libc.renameat2(-100, f"{d}/writing".encode(), -100, f"{d}/current".encode(), RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")


def main():
    d = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    os.makedirs(d, exist_ok=True)
    samples, stop = [], threading.Event()

    def appender(k):
        fd = os.open(f"{d}/log-{k}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        while not stop.is_set():
            began = time.perf_counter()
            os.write(fd, b"x" * 400)
            os.fdatasync(fd)
            samples.append(time.perf_counter() - began)

    threads = [threading.Thread(target=appender, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    data = os.urandom(SIZE)
    methods = [
        ("nothing written for 10 s (baseline)", lambda: time.sleep(10)),
        ("fresh file, 4 MiB chunks, renamed over the old", lambda: replace(d, data, 4 << 20)),
        ("fresh file, 1 MiB chunks, renamed over the old", lambda: replace(d, data, 1 << 20)),
        ("spare overwritten, 4 MiB chunks, exchanged", lambda: exchange(d, data, 4 << 20)),
        ("spare overwritten, 1 MiB chunks, exchanged", lambda: exchange(d, data, 1 << 20)),
    ]
    results = {}
    for _ in range(rounds):
        for name, run in methods:
            time.sleep(0.3)
            first = len(samples)
            run()
            time.sleep(0.3)
            window = samples[first:]
            results.setdefault(name, []).append((max(window) * 1000, sum(s > 0.01 for s in window)))
    stop.set()
    for t in threads:
        t.join()
    for name, runs in results.items():
        longest = " / ".join(f"{m:.1f}" for m, _ in runs)
        over = " / ".join(str(n) for _, n in runs)
        print(f"{name}: longest append sync {longest} ms; over 10 ms {over}")
    for f in os.listdir(d):
        os.unlink(f"{d}/{f}")


if __name__ == "__main__":
    main()
