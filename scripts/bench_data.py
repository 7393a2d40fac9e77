"""Benchmark the training-data path at WMT scale: read, SentencePiece, encode, filter, batch.

Generates a synthetic parallel corpus with a WMT14-like shape (lognormal sentence lengths with a
mean of ~25 words, words drawn from a Zipfian vocabulary of ~50k pseudo-words per language, target
length correlated with the source), then runs the same steps as ``mt.corpus.Corpus`` and prints one
JSON object: time of each step, encoding throughput, batching time per epoch, padding overhead and
the memory of each step, two ways: ``rss`` is this process's peak RSS (``VmHWM``, reset between
steps) and ``ru_maxrss`` of its largest child (an encoding worker); ``pss`` is the peak of the
proportional set size summed over this process and its children, sampled twice a second, which
counts a page shared by forked workers once (``peak_pss_mb`` is the job's true peak). Arrow files
are memory-mapped: their pages count in RSS and PSS but are file-backed and can be dropped by the
kernel at any time; ``anon_mb`` is the part that cannot.

    python scripts/bench_data.py --pairs 100000            # a quick run
    python scripts/bench_data.py --pairs 4500000           # WMT14 en-de scale (minutes)

The corpus and the ``datasets`` cache live under ``--workdir`` (reused by a second run with the
same ``--pairs`` and ``--seed``; ``--fresh`` deletes the caches first, so encoding is timed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mt without being installed

from mt.batching import EncodedPairs, encode_split  # noqa: E402
from mt.config import (  # noqa: E402
    DataConfig,
    FilterConfig,
    TokenizerConfig,
    count_or_off,
    positive_int,
)
from mt.data import load_split, sample_texts  # noqa: E402
from mt.tokenizer import load_or_train  # noqa: E402

LETTERS = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))


def pseudo_words(n: int, rng: np.random.Generator, suffix: str) -> np.ndarray:
    """n distinct pseudo-words (UTF-8 bytes); frequent ranks get shorter words, as in Zipf."""
    lengths = np.clip((2 + np.log2(np.arange(n) + 2) * 0.7 + rng.normal(0, 1.2, n)).astype(int),
                      1, 14)
    words, seen = [], set()
    for length in lengths:
        while True:
            w = "".join(rng.choice(LETTERS, length)) + suffix
            if w not in seen:
                seen.add(w)
                words.append(w.encode())
                break
    return np.array(words, dtype=object)


def write_side(path: Path, lengths: np.ndarray, vocab: np.ndarray, rng: np.random.Generator,
               zipf_s: float = 1.05, chunk: int = 100_000) -> None:
    """One sentence per line: ``lengths[i]`` words drawn from a Zipf(s) law over ``vocab``."""
    ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -zipf_s)
    cdf /= cdf[-1]
    with open(path, "wb") as f:
        for start in range(0, len(lengths), chunk):
            lens = lengths[start : start + chunk]
            ids = np.searchsorted(cdf, rng.random(int(lens.sum())))
            seps = np.full(len(ids), b" ", dtype=object)
            seps[np.cumsum(lens) - 1] = b"\n"
            tokens = np.empty(2 * len(ids), dtype=object)
            tokens[0::2], tokens[1::2] = vocab[ids], seps
            f.write(b"".join(tokens.tolist()))


def make_corpus(directory: Path, pairs: int, seed: int) -> dict:
    """train.{en,de} with ``pairs`` lines, and a 3,000-pair valid split; kept if already there."""
    stamp = directory / "corpus.json"
    info = {"pairs": pairs, "seed": seed, "version": 1}
    if stamp.exists() and json.loads(stamp.read_text()) == info:
        return {"generated_s": 0.0}
    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    src_vocab, tgt_vocab = pseudo_words(50_000, rng, ""), pseudo_words(50_000, rng, "en")
    for split, n in (("train", pairs), ("valid", 3000)):
        # lognormal(mu, sigma) has mean exp(mu + sigma^2 / 2) = 25 words
        sigma = 0.6
        src_len = np.maximum(1, rng.lognormal(np.log(25) - sigma**2 / 2, sigma, n).astype(int))
        tgt_len = np.maximum(1, (src_len * rng.lognormal(0.05, 0.15, n)).astype(int))
        write_side(directory / f"{split}.en", src_len, src_vocab, rng)
        write_side(directory / f"{split}.de", tgt_len, tgt_vocab, rng)
    stamp.write_text(json.dumps(info))
    return {"generated_s": round(time.perf_counter() - start, 1)}


def reset_peak() -> None:
    """Resets this process's peak RSS (Linux >= 4.0), so each step reports its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> dict:
    """Peak RSS of this process since ``reset_peak`` and of its largest child (encoding worker)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            own = int(line.split()[1]) / 1024
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"self_mb": round(own), "largest_child_mb": round(child)}


class MemorySampler(threading.Thread):
    """Samples the proportional set size (PSS) of this process plus its children twice a second.

    PSS splits shared pages among the processes that map them, so the sum is the memory the job
    really holds (RSS would count pages a forked worker shares with its parent twice). ``anon`` is
    heap and stack; ``file`` is memory-mapped files (Arrow), which the kernel can drop and re-read.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"pss_mb": 0, "anon_mb": 0}
        self.running = True
        self.lock = threading.Lock()  # take() resets the peak while run() may be raising it

    @staticmethod
    def _pss(pid: int) -> tuple[int, int]:
        try:
            fields = dict(line.split(":", 1) for line in
                          Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        except (OSError, ValueError):
            return 0, 0
        return int(fields["Pss"].split()[0]), int(fields["Pss_Anon"].split()[0])

    @staticmethod
    def _children(pid: int) -> list[int]:
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                pass
        return out

    def sample(self) -> None:
        pids = [os.getpid(), *self._children(os.getpid())]
        pss, anon = (sum(v) / 1024 for v in zip(*(self._pss(p) for p in pids), strict=True))
        with self.lock:
            self.peak = {"pss_mb": max(self.peak["pss_mb"], round(pss)),
                         "anon_mb": max(self.peak["anon_mb"], round(anon))}

    def run(self) -> None:
        while self.running:
            self.sample()
            time.sleep(0.5)

    def take(self) -> dict:
        """The peak since the last call, and a fresh start."""
        self.sample()
        with self.lock:
            peak, self.peak = self.peak, {"pss_mb": 0, "anon_mb": 0}
        return peak


def padding_overhead(pairs: EncodedPairs, batches: list[list[int]]) -> float:
    """Padded cells / real tokens - 1, over source and target tensors of every batch."""
    src = np.frombuffer(pairs.src_lens, np.int32).astype(np.int64)
    tgt = np.frombuffer(pairs.tgt_lens, np.int32).astype(np.int64) + 1
    cells = real = 0
    for b in batches:
        idx = np.asarray(b)
        cells += len(b) * (src[idx].max() + tgt[idx].max())
        real += src[idx].sum() + tgt[idx].sum()
    return float(cells / real - 1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=positive_int, default=100_000)
    ap.add_argument("--workdir", default="/tmp/mt_bench_data")
    ap.add_argument("--seed", type=count_or_off, default=1)
    ap.add_argument("--vocab-size", type=positive_int, default=32000)
    ap.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    ap.add_argument("--sentences", type=positive_int, default=1_000_000,
                    help="SentencePiece training sample (data.tokenizer.input_sentence_size)")
    ap.add_argument("--num-proc", type=positive_int, default=None,
                    help="encoding processes (default: the cores)")
    ap.add_argument("--max-tokens", type=positive_int, default=4096)
    ap.add_argument("--epochs", type=positive_int, default=2, help="epochs of batches to time")
    ap.add_argument("--fresh", action="store_true", help="delete the caches (not the corpus) first")
    args = ap.parse_args(argv)
    if args.vocab_size < 5:  # else SentencePiece's refusal, after the corpus was made and read
        ap.error(f"--vocab-size must be at least 5 (4 special ids and a piece of text), got "
                 f"{args.vocab_size}")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")

    work = Path(args.workdir) / f"p{args.pairs}_s{args.seed}"
    cache, tok_dir = work / "hf_cache", work / f"tok_{args.model_type}_{args.vocab_size}"
    if args.fresh:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(tok_dir, ignore_errors=True)
    out: dict = {"pairs": args.pairs, "cpus": len(os.sched_getaffinity(0)),
                 "load_average": round(os.getloadavg()[0], 1),
                 **make_corpus(work / "corpus", args.pairs, args.seed)}
    reset_peak()  # the generator's memory is not the pipeline's
    sampler = MemorySampler()
    sampler.take()
    sampler.start()
    cfg = DataConfig(source="files", dir=str(work / "corpus"), src_lang="en", tgt_lang="de",
                     tokenizer=TokenizerConfig(model_type=args.model_type,
                                               vocab_size=args.vocab_size,
                                               input_sentence_size=args.sentences))

    start = time.perf_counter()
    train = load_split(cfg, "train", cache_dir=str(cache))
    out["read"] = {"seconds": round(time.perf_counter() - start, 1), "rss": peak_rss_mb(),
                   "pss": sampler.take()}
    reset_peak()

    start = time.perf_counter()
    tok = load_or_train(tok_dir, lambda: sample_texts(train, args.sentences, args.seed, True),
                        cfg.tokenizer, args.seed)
    out["sentencepiece"] = {"train_s": round(time.perf_counter() - start, 1),
                            "sentences": args.sentences, "type": args.model_type,
                            "vocab": tok.src_vocab_size, "rss": peak_rss_mb(),
                            "pss": sampler.take()}
    reset_peak()

    start = time.perf_counter()
    encoded = encode_split(train, tok, args.num_proc)
    seconds = time.perf_counter() - start
    out["encode"] = {"seconds": round(seconds, 1), "pairs_per_s": round(args.pairs / seconds),
                     "cached_arrow_mb": round(sum(os.path.getsize(f["filename"])
                                                  for f in encoded.cache_files) / 2**20)}
    start = time.perf_counter()
    encode_split(train, tok, args.num_proc)
    out["encode"]["second_call_s"] = round(time.perf_counter() - start, 2)  # from the cache

    start = time.perf_counter()
    pairs = EncodedPairs(encoded, FilterConfig())
    out["filter"] = {"seconds": round(time.perf_counter() - start, 1), "report": str(pairs.report)}
    out["encode"]["rss"] = peak_rss_mb()  # encoding and filtering
    out["encode"]["pss"] = sampler.take()
    reset_peak()

    times, batches = [], []
    for epoch in range(args.epochs):
        start = time.perf_counter()
        batches = pairs.batches(args.max_tokens, args.seed, epoch)
        times.append(time.perf_counter() - start)
    out["batching"] = {"max_tokens": args.max_tokens, "batches": len(batches),
                       "seconds_per_epoch": round(min(times), 2),
                       "padding_overhead": round(padding_overhead(pairs, batches), 4)}
    start = time.perf_counter()
    tokens = 0
    for b in batches[:500]:
        src, tgt_in, _ = pairs.collate(b)
        tokens += src.numel() + tgt_in.numel()
    seconds = time.perf_counter() - start
    out["collate"] = {"batches_per_s": round(min(500, len(batches)) / seconds),
                      "padded_tokens_per_s": round(tokens / seconds)}
    out["batching"]["rss"] = peak_rss_mb()  # batching and collating
    out["batching"]["pss"] = sampler.take()
    sampler.running = False
    steps = [v for v in out.values() if isinstance(v, dict) and "pss" in v]
    out["peak_pss_mb"] = max(v["pss"]["pss_mb"] for v in steps)
    out["peak_anon_pss_mb"] = max(v["pss"]["anon_mb"] for v in steps)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
