"""Subword regularization (Kudo, 2018): each epoch, each side of each training pair takes one of
its n best SentencePiece segmentations, drawn with probability ~ P(segmentation)^alpha.

The candidates are found once and held in memory as flat numpy arrays (``Segmentations``); the
pairs, their filtering and the batching are ``mt.batching``'s, with the drawn lengths.
"""

from __future__ import annotations

import math
import os
import signal
from array import array
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import repeat
from pathlib import Path

import numpy as np
from torch import Tensor

from mt.batching import EncodedPairs, collate_flat, token_batches
from mt.config import UNK_ID


class SampledPairs:
    """Subword regularization: each epoch, each side of each pair takes one of its n best splits.

    Kudo (2018) trains on a segmentation sampled, per sentence and epoch, from the sentence's l best
    with probability proportional to P(segmentation)^alpha: the model sees the ambiguity of
    subwords instead of one fixed split, which is worth about 1 BLEU on small corpora. The
    candidates of every kept pair of ``pairs`` (same filtering, same pair indices) are found once
    and held in memory as flat arrays (``Segmentations``); an epoch's choice is a Gumbel-max draw
    seeded by (seed, epoch), so a resumed run sees the segmentations it would have seen. The
    lengths ``src_lens``/``tgt_lens`` are those of the epoch last drawn by ``batches``.
    """

    def __init__(self, pairs: EncodedPairs, src_texts: list[str], tgt_texts: list[str], tokenizer,
                 alpha: float, nbest: int, max_tokens: int, symbols: Sequence[int] = (),
                 processes: int = 1) -> None:
        if len(src_texts) != len(pairs) or len(tgt_texts) != len(pairs):
            raise ValueError(f"{len(src_texts)}/{len(tgt_texts)} texts for {len(pairs)} pairs")
        self.report, self.rows, self.alpha = pairs.report, pairs.rows, alpha
        self.src = Segmentations(tokenizer.src, src_texts, nbest, max_tokens, add_eos=True,
                                 symbols=symbols, processes=processes)
        self.tgt = Segmentations(tokenizer.tgt, tgt_texts, nbest, max_tokens, add_eos=False,
                                 processes=processes)
        self._draw(None)

    def __len__(self) -> int:
        return len(self.rows)

    def _draw(self, rng: np.random.Generator | None) -> None:
        self._src_pick, self.src_lens = self.src.pick(self.alpha, rng)
        self._tgt_pick, self.tgt_lens = self.tgt.pick(self.alpha, rng)

    def draw(self, seed: int, epoch: int) -> None:
        """The epoch's segmentations (and so ``src_lens``, ``tgt_lens``)."""
        self._draw(np.random.default_rng([abs(seed), epoch, 1]))  # not token_batches' stream

    def batches(self, max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
        self.draw(seed, epoch)
        return token_batches(self.src_lens, self.tgt_lens, max_tokens, seed, epoch)

    def collate(self, batch: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(src (B, S), tgt_in (B, T), tgt_out (B, T)) for pair indices ``batch``."""
        batch = np.asarray(batch, dtype=np.int64)
        return collate_flat(*self.src.gather(self._src_pick[batch]),
                            *self.tgt.gather(self._tgt_pick[batch]))


class Segmentations:
    """The n best SentencePiece segmentations of each sentence, with their log-probabilities.

    Flat arrays: ``ids`` holds every candidate's ids one after another, candidate ``c`` spanning
    ``ids[offsets[c]:offsets[c + 1]]``; sentence ``i`` owns candidates ``first[i]:first[i + 1]``,
    best first. Candidates longer than ``max_tokens`` (EOS not counted) are dropped, but not the
    best; so are those with other counts of ``<unk>`` and of ``symbols`` (ids of user symbols such
    as the back-translation tag) than the best: SentencePiece's n-best list also spells a user
    symbol in ordinary pieces or as ``<unk>``, and scores ``<unk>`` 0, the likeliest of all, so
    such candidates would be drawn often and would teach the model text it never sees.
    """

    def __init__(self, sp, texts: list[str], nbest: int, max_tokens: int, add_eos: bool,
                 symbols: Sequence[int] = (), processes: int = 1) -> None:
        if nbest < 1:
            raise ValueError(f"data.subword_nbest must be at least 1, got {nbest}")
        try:
            sp.nbest_encode("a", nbest_size=2)
        except RuntimeError:  # a BPE model reused from data.tokenizer.path: no n-best lists
            raise ValueError("data.subword_alpha needs a unigram SentencePiece model "
                             "(data.tokenizer.model_type=unigram); the tokenizer in use is "
                             "another kind") from None
        size = min(4096, max(256, math.ceil(len(texts) / (4 * processes))))
        chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
        if processes > 1 and len(chunks) > 1:
            parts = _in_workers(min(processes, len(chunks)), sp.serialized_model_proto(),
                                chunks, nbest, max_tokens, add_eos)
        else:
            parts = [_candidates(sp, chunk, nbest, max_tokens, add_eos) for chunk in chunks]
        empty = (np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64))
        ids, lens, counts = ([np.concatenate(arrays) for arrays in zip(*parts, strict=True)]
                             if parts else empty)
        owner = np.repeat(np.arange(len(texts)), counts)
        first = np.concatenate([[0], np.cumsum(counts)])
        keep = np.ones(len(lens), bool)
        ends = np.cumsum(lens)
        for marks in ([UNK_ID], symbols):  # as many <unk>s, as many user symbols as the best
            marked = np.concatenate([[0], np.cumsum(np.isin(ids, marks))])
            held = marked[ends] - marked[ends - lens]
            keep &= held == held[first[:-1]][owner]
        ids = ids[np.repeat(keep, lens)]
        lens, owner = lens[keep], owner[keep]
        counts = np.bincount(owner, minlength=len(texts))
        self.ids = ids
        self.offsets = np.concatenate([[0], np.cumsum(lens)])
        self.first = np.concatenate([[0], np.cumsum(counts)])
        self.owner = owner
        piece_scores = np.array([sp.get_score(i) for i in range(sp.get_piece_size())])
        cum = np.concatenate([[0.0], np.cumsum(piece_scores[self.ids])])
        self.scores = cum[self.offsets[1:]] - cum[self.offsets[:-1]]  # log P of each candidate

    def pick(self, alpha: float, rng: np.random.Generator | None) -> tuple[np.ndarray, array]:
        """One candidate per sentence (the best when ``rng`` is None) and its length, EOS included.

        Gumbel-max: the argmax of ``alpha * log P + Gumbel noise`` within each sentence is a draw
        with probability ``P^alpha / sum P'^alpha`` over its candidates.
        """
        if rng is None:
            chosen = self.first[:-1]
        else:
            key = alpha * self.scores + rng.gumbel(size=len(self.scores))
            chosen = np.lexsort((-key, self.owner))[self.first[:-1]]
        lens = (self.offsets[chosen + 1] - self.offsets[chosen]).astype(np.int32)
        return chosen, array("i", lens.tobytes())

    def gather(self, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The flat ids and the lengths of candidates ``chosen``."""
        lens = self.offsets[chosen + 1] - self.offsets[chosen]
        starts = self.offsets[chosen] - np.cumsum(lens) + lens  # where each one's ids begin, minus
        index = np.repeat(starts, lens) + np.arange(lens.sum())  # its position in the output
        return self.ids[index], lens


_SP = None  # a worker process's SentencePiece model (_load)


def _in_workers(processes: int, proto: bytes, chunks: list[list[str]], nbest: int,
                max_tokens: int, add_eos: bool) -> list:
    """``_candidates`` of each chunk, found by worker processes.

    Ctrl-C (or any error) ends the workers at once: the executor's own shutdown waited on the
    chunks already queued, for ever where Ctrl-C had killed a worker, and mt-train hung. A
    worker killed (by the kernel, out of memory) is a one-line error; multiprocessing's Pool,
    which starts a new worker in its place, waited on the lost chunk for ever instead.
    """
    pool = ProcessPoolExecutor(processes, initializer=_start_worker, initargs=(proto,))
    try:
        parts = list(pool.map(_candidates, repeat(None), chunks, repeat(nbest),
                              repeat(max_tokens), repeat(add_eos)))
    except BrokenProcessPool:
        raise ValueError(f"data.subword_alpha: a process finding the subword candidates died "
                         f"(killed, out of memory?); lower data.num_proc (now {processes} "
                         "processes) or data.subword_nbest") from None
    except BaseException:
        end = getattr(pool, "terminate_workers", None)  # Python 3.14; before, by hand
        if end is not None:
            end()
        else:  # (before shutdown, which forgets them)
            for worker in list((getattr(pool, "_processes", None) or {}).values()):
                worker.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return parts


def _start_worker(proto: bytes) -> None:
    """A worker leaves Ctrl-C to its parent, which ends it, and ends on SIGTERM, which the
    pool's end sends (the trainer's own SIGTERM handler, inherited by fork, would ignore it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _load(proto)


def _load(proto: bytes) -> None:
    import sentencepiece

    global _SP
    _SP = sentencepiece.SentencePieceProcessor(model_proto=proto)


def _candidates(sp, texts: list[str], nbest: int, max_tokens: int,
                add_eos: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The n best segmentations of ``texts`` that fit ``max_tokens`` (the best one always):
    their ids one after another, their lengths, and how many each sentence kept. ``sp`` None:
    a worker's own model. Compact arrays, so that a worker's answer pickles fast."""
    chunk = (sp or _SP).nbest_encode(texts, nbest_size=nbest, add_eos=add_eos,
                                     return_type="numpy")
    pieces, counts = [], np.zeros(len(texts), np.int64)
    for i, cands in enumerate(chunk):
        kept = [c for c in cands if len(c) - add_eos <= max_tokens] or cands[:1]
        pieces.extend(kept)
        counts[i] = len(kept)
    lens = np.fromiter((len(c) for c in pieces), np.int64, len(pieces))
    ids = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
    return ids, lens, counts


def candidate_processes(num_proc: int, world: int = 1) -> int:
    """Processes that find the candidates: ``data.num_proc``, or (0) one per core up to 16,
    shared among the run's ``world`` processes. 64 segmentations of a sentence cost some 50
    times its plain encoding, so even Multi30k's 29k pairs gain: 34 s in one process on 2
    cores, 20 s in two; 46 s in one before the first step on the H200 machine's host."""
    if num_proc:
        return num_proc
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, 16) // world)


def model_type(proto: bytes) -> str:
    """The kind of a serialized SentencePiece model, for a message: "unigram", "BPE", "word" or
    "char" (``mt.spm_spec``, which reads the model's own bytes)."""
    from mt.spm_spec import model_settings

    kind = model_settings(proto)["model_type"]
    return "BPE" if kind == "bpe" else kind


def sampling_mistake(state: dict, origin: str, directory: Path, shared: bool) -> str | None:
    """Why data.subword_alpha cannot sample with the tokenizer ``state`` (its serialized models,
    ``Tokenizer.to_state()``, as a checkpoint holds them), None if it can: a BPE model has no
    n-best segmentations. The tokenizer was not trained by this run with the config's
    data.tokenizer.model_type (that is checked before: mt.config_checks), so the message says
    where it comes from: ``origin``, the checkpoint the run starts from ("" if none), else
    ``directory``, data.tokenizer.path (``shared``) or the run's own, reused."""
    kinds = {model_type(p) for p in (state["src"], state.get("tgt")) if p is not None}
    kinds.discard("unigram")
    if not kinds:
        return None
    kind = " and ".join(sorted(kinds))
    if origin:
        where = (f"is the one of {origin}, a {kind} model: a model keeps the tokenizer it was "
                 "trained with, whatever data.tokenizer.model_type says")
        fix = "set data.subword_alpha=0"
    elif shared:
        where = f"is reused from data.tokenizer.path={directory}, a {kind} model"
        fix = ("set data.subword_alpha=0, or point data.tokenizer.path at a new directory to "
               "train a unigram one")
    else:
        where = (f"is reused from {directory} (an earlier attempt's in this run directory), a "
                 f"{kind} model")
        fix = "set data.subword_alpha=0, or start in another run directory"
    return (f"data.subword_alpha samples among a unigram model's segmentations, but the "
            f"tokenizer {where}: {fix}")
