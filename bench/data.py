"""Benchmark data preparation: throughput (MB/s of input text) and peak memory.

    python bench/data.py [--big_mb 200] [--workers N]

    python bench/data.py --records_mb 1100 --skip_text   # the >= 1 GB Parquet and JSONL.gz cases only

Cases: the bundled 1.1 MB tiny-shakespeare with gpt2, char and bpe:4096 (the last includes
training the BPE, which is also timed alone); a generated corpus of >= --big_mb MB (Shakespeare
copies with rotated lines and numbered tags, so no two copies are byte-identical, in 25 MB files)
with gpt2 and char, each on a spawn process pool (the default), a thread pool and inline
(one worker); with --records_mb, generated Parquet and JSONL.gz corpora of that many MB of text
(documents of 0.2-8 KB cut from the same text, 100 MB of text per file) with gpt2 on the default
pool. The 1.1 MB cases run inline (too small to be worth starting workers). Every prepare runs
in a fresh subprocess so its peak RSS (shows that preparation streams) is its own; "peak RSS" is
the largest sum of the resident memory of the main process and its workers (sampled every 50 ms).
MB/s are MB of text (uncompressed) per second. Prints a table, then one JSON line with all figures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, {repo!r})
from gpt.data import prepare

def rss_kb(pid):
    try:
        with open(f"/proc/{{pid}}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0

def children(pid):  # of every thread: a pool may start its workers from another thread
    found = []
    for tid in os.listdir(f"/proc/{{pid}}/task"):
        try:
            found += [int(c) for c in open(f"/proc/{{pid}}/task/{{tid}}/children").read().split()]
        except OSError:
            pass
    return found

peak = [0]
def watch():  # the largest total resident memory of this process and its workers, every 50 ms
    me = os.getpid()
    while True:
        peak[0] = max(peak[0], rss_kb(me) + sum(rss_kb(c) for c in children(me)))
        time.sleep(0.05)

threading.Thread(target=watch, daemon=True).start()
t0 = time.perf_counter()
meta = prepare({inputs!r}, {tokenizer!r}, {out!r}, workers={workers!r}, backend={backend!r})
dt = time.perf_counter() - t0
mb = sum(meta["splits"][s]["bytes"] for s in ("train", "val")) / 1e6
tokens = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
# VmHWM, not ru_maxrss: the latter survives exec and would report the parent's peak.
main = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps({{"seconds": dt, "mb": mb, "tokens": tokens, "main_rss_mb": main,
                  "peak_rss_mb": max(peak[0] / 1024, main)}}))
"""


def run_prepare(inputs: list[str], tokenizer: str, out: Path, workers: int | None, backend: str = "auto",
                repeat: int = 1) -> dict:
    """Best of `repeat` runs (throughput on a shared machine is noisy; the best is the least noisy)."""
    code = CHILD.format(repo=str(REPO), inputs=inputs, tokenizer=tokenizer, out=str(out), workers=workers,
                        backend=backend)
    runs = []
    for _ in range(repeat):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    res = min(runs, key=lambda r: r["seconds"])
    res["mb_per_s"] = res["mb"] / res["seconds"]
    return res


def make_big_corpus(folder: Path, target_mb: int, file_mb: int = 25) -> int:
    """Write >= target_mb MB of varied Shakespeare into folder/*.txt; returns bytes written."""
    lines = (REPO / "data" / "shakespeare.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    written, copy, part, f = 0, 0, 0, None
    while written < target_mb * 1e6:
        if f is None or f.tell() >= file_mb * 1e6:
            if f is not None:
                f.close()
            f = open(folder / f"part{part:03d}.txt", "w", encoding="utf-8")
            part += 1
        k = (copy * 7919) % len(lines)
        body = lines[k:] + lines[:k]
        tagged = "".join(line if i % 40 else f"[{copy}.{i}] {line}" for i, line in enumerate(body))
        f.write(tagged)
        written += len(tagged.encode())
        copy += 1
    f.close()
    return written


def make_record_corpus(folder: Path, target_mb: int, fmt: str, file_mb: int = 100) -> int:
    """Write >= target_mb MB of text as documents of 0.2-8 KB into folder/*.parquet or *.jsonl.gz
    (a "text" column/key plus an "id"); returns the text bytes written."""
    import gzip
    import random
    import pyarrow as pa
    import pyarrow.parquet as pq
    text = (REPO / "data" / "shakespeare.txt").read_text(encoding="utf-8")
    rng, written, part = random.Random(0), 0, 0
    while written < target_mb * 1e6:
        docs, size = [], 0
        while size < file_mb * 1e6:
            n, at = rng.randint(200, 8000), rng.randrange(len(text) - 8000)
            docs.append(f"[{part}.{len(docs)}] " + text[at:at + n])
            size += len(docs[-1].encode())
        if fmt == "parquet":
            pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), folder / f"part{part:03d}.parquet",
                           row_group_size=1024)  # as FineWeb and nanochat shards
        else:
            with gzip.open(folder / f"part{part:03d}.jsonl.gz", "wt", encoding="utf-8", compresslevel=1) as f:
                f.writelines(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
        written += size
        part += 1
    return written


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def text_cases(tmp: Path, args, rows: list) -> dict:
    """The shakespeare and generated plain-text cases; returns the extra timings."""
    small = str(REPO / "data" / "shakespeare.txt")
    for tok in ["gpt2", "char", "bpe:4096"]:
        rows.append((f"shakespeare 1.1 MB, {tok}", run_prepare([small], tok, tmp / tok.replace(":", ""),
                                                                args.workers, repeat=args.repeat)))
    from gpt.tokenizer import build_tokenizer
    text = Path(small).read_text(encoding="utf-8")
    t0 = time.perf_counter()
    build_tokenizer("bpe:4096", (text[i:i + (1 << 20)] for i in range(0, len(text), 1 << 20)), tmp / "bpe_only")
    bpe_train_s = time.perf_counter() - t0
    big = tmp / "big"
    big.mkdir()
    t0 = time.perf_counter()
    nbytes = make_big_corpus(big, args.big_mb)
    gen_s = time.perf_counter() - t0
    w = args.workers
    for tok, n, backend in [("gpt2", w, "process"), ("gpt2", w, "thread"), ("gpt2", 1, "inline"),
                            ("char", w, "process"), ("char", w, "thread"), ("char", 1, "inline")]:
        out = tmp / f"big_{tok}_{n}_{backend}"
        res = run_prepare([str(big)], tok, out, n, "auto" if backend == "inline" else backend, args.repeat)
        rows.append((f"generated {nbytes / 1e6:.0f} MB, {tok}, {backend} x{n}", res))
        shutil.rmtree(out)  # keep /tmp small
    return {"bpe4096_train_seconds": round(bpe_train_s, 3), "generate_seconds": round(gen_s, 1)}


def record_cases(tmp: Path, args, rows: list) -> None:
    """Parquet and JSONL.gz corpora of --records_mb MB of text, gpt2 on the default pool; kept in
    --corpus_dir if given (generated once, so a second run times only the preparation)."""
    for fmt in ("parquet", "jsonl.gz"):
        folder = Path(args.corpus_dir or tmp) / f"{fmt}-{args.records_mb}"
        if not folder.is_dir():
            folder.mkdir(parents=True)
            make_record_corpus(folder, args.records_mb, fmt)
        disk = sum(f.stat().st_size for f in folder.iterdir())
        res = run_prepare([str(folder)], "gpt2", tmp / f"out_{fmt}", args.workers, "auto", args.repeat)
        rows.append((f"{fmt} {res['mb']:.0f} MB text ({disk / 1e6:.0f} MB on disk), gpt2", res))
        shutil.rmtree(tmp / f"out_{fmt}")
        if not args.corpus_dir:
            shutil.rmtree(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big_mb", type=int, default=200)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=1, help="report the best of this many runs per case")
    ap.add_argument("--records_mb", type=int, default=0, help="also Parquet and JSONL.gz corpora of this many MB")
    ap.add_argument("--skip_text", action="store_true", help="only the --records_mb cases")
    ap.add_argument("--corpus_dir", default="", help="keep the generated record corpora here, and reuse them")
    args = ap.parse_args()
    rows: list[tuple[str, dict]] = []
    extra: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_text:
            extra = text_cases(Path(tmp), args, rows)
        if args.records_mb:
            record_cases(Path(tmp), args, rows)
    print(f"{'case':<52} {'MB/s':>7} {'seconds':>8} {'tokens':>13} {'peak RSS MB':>12}")
    for name, r in rows:
        print(f"{name:<52} {r['mb_per_s']:>7.1f} {r['seconds']:>8.2f} {r['tokens']:>13,} {r['peak_rss_mb']:>12.0f}")
    print(json.dumps({"machine": cpu_model(), "cores": os.cpu_count(), "workers": args.workers,
                      "repeat": args.repeat, "python": platform.python_version(), **extra,
                      "cases": {name: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                                for name, r in rows}}))


if __name__ == "__main__":
    main()
