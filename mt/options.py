"""The search options that ``translate`` and ``mt-eval`` share: one dataclass, its command-line
flags and their checks, so that both commands search alike and refuse the same mistakes in the
same words. Free of torch, so that ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import math
import numbers
from dataclasses import dataclass

from mt.config import COUNT_MAX, MAX_LENPEN, count_or_off, positive_int
from mt.mbr import UTILITIES


@dataclass
class SearchOptions:
    """How to search; plain values only (mt-eval records them as JSON)."""

    beam: int = 5  # 1 with nbest 1: greedy
    lenpen: float = 0.6  # GNMT alpha; 0 ranks by the raw log-probability sum
    nbest: int = 1  # hypotheses (or samples) returned per line
    max_len_a: float = 1.5  # output budget a * source tokens + b, EOS included
    max_len_b: int = 10
    min_len: int = 0  # no EOS before this many tokens
    no_repeat_ngram: int = 0  # n > 0: no n-gram twice in one output; 0: off
    batch_tokens: int = 4096  # source tokens per batch, padding included
    sampling: bool = False  # draw nbest samples instead of searching (beam is ignored)
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    epsilon: float = 0.0  # 0: no epsilon cut
    seed: int = 0  # the sampling stream (samples depend on the batching as well)
    mbr: str = ""  # chrf | bleu: one translation per line, chosen among mbr_candidates; "": off
    mbr_candidates: int = 16  # samples (sampling) or the beam's n-best that MBR chooses among
    workers: int = 1  # batches searched at once, each on its own core (see translate_ids)
    # The workers are forked processes (Linux), not threads: only where no other thread of the
    # program runs torch while the search forks (mt.workers.worker_processes). translate's way.
    processes: bool = False

    def __post_init__(self) -> None:
        """Refuses what the command line refuses (``search_mistake``, in its words), so that a
        script's ``SearchOptions(beam=0)`` or ``batch_tokens=0`` is an error, not a hang or an
        empty search."""
        ints = [name for name in ("beam", "nbest", "max_len_b", "min_len", "no_repeat_ngram",
                                  "batch_tokens", "top_k", "seed", "mbr_candidates", "workers")
                if not isinstance(getattr(self, name), numbers.Integral)]
        if ints:
            raise TypeError(f"{ints[0]} must be an int, got {getattr(self, ints[0])!r}")
        if self.mbr and self.mbr not in UTILITIES:
            raise ValueError(f"mbr must be one of {UTILITIES} (or '' for none), got {self.mbr!r}")
        mistake = search_mistake(self)
        if mistake:
            raise ValueError(mistake)


def add_search_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                         nbest: bool = True) -> None:
    """The flags of every SearchOptions field but ``workers`` (``--nbest`` where the command
    prints n-best lists); docs/decoding.md describes each."""
    p.add_argument("--beam", type=int, default=SearchOptions.beam,
                   help="beam size; 1 = greedy (default: %(default)s)")
    if nbest:
        p.add_argument("--nbest", type=int, default=SearchOptions.nbest,
                       help="print up to N lines per input line, 'index<TAB>translation<TAB>"
                            "score' (an empty line or one translated in pieces has one); "
                            "default: %(default)s, the translation alone")
    p.add_argument("--lenpen", type=float, default=SearchOptions.lenpen,
                   help="GNMT length penalty alpha (default: %(default)s)")
    p.add_argument("--max-len-a", type=float, default=SearchOptions.max_len_a,
                   help="at most a * source tokens + b output tokens, EOS included "
                        "(default: %(default)s)")
    p.add_argument("--max-len-b", type=int, default=SearchOptions.max_len_b,
                   help="b of --max-len-a (default: %(default)s)")
    p.add_argument("--min-len", type=int, default=SearchOptions.min_len,
                   help="no EOS before this many tokens (default: %(default)s)")
    p.add_argument("--no-repeat-ngram-size", type=count_or_off,
                   default=SearchOptions.no_repeat_ngram, metavar="N",
                   help="no n-gram of N tokens twice in one translation, against the loops of "
                        "an under-trained model (default: %(default)s, off)")
    p.add_argument("--sampling", action="store_true",
                   help="sample translations instead of beam search")
    p.add_argument("--temperature", type=float, default=SearchOptions.temperature,
                   help="sampling temperature (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=SearchOptions.top_k,
                   help="sample from the k best tokens (default: %(default)s, all)")
    p.add_argument("--top-p", type=float, default=SearchOptions.top_p,
                   help="sample from the smallest set of tokens with this much mass "
                        "(default: %(default)s, all)")
    p.add_argument("--epsilon", type=float, default=SearchOptions.epsilon,
                   help="sample no token of probability below this (default: %(default)s, "
                        "all); for --mbr candidates, 0.02 is a good choice (Freitag et al., 2023)")
    p.add_argument("--seed", type=int, default=SearchOptions.seed,
                   help="sampling seed (default: %(default)s)")
    p.add_argument("--mbr", choices=UTILITIES, default=None,
                   help="minimum Bayes risk: of --mbr-candidates translations per line (samples "
                        "with --sampling, else the beam's n-best), the one with the best mean "
                        "chrF or BLEU against the others (default: off)")
    p.add_argument("--mbr-candidates", type=positive_int, default=SearchOptions.mbr_candidates,
                   metavar="N",
                   help="candidates per line for --mbr (default: %(default)s)")
    p.add_argument("--batch-tokens", type=positive_int, default=SearchOptions.batch_tokens,
                   help="source tokens per batch, padding included (default: %(default)s)")


def search_mistake(args: SearchOptions) -> str | None:
    """The first search option out of range or without the option it needs, in the words of
    its command-line flag; None if none."""
    nbest = args.nbest
    counts = {"--beam": args.beam, "--nbest": nbest, "--min-len": args.min_len,
              "--top-k": args.top_k, "--batch-tokens": args.batch_tokens,
              "--mbr-candidates": args.mbr_candidates, "--workers": args.workers,
              "--no-repeat-ngram-size": args.no_repeat_ngram}
    for flag, value in counts.items():
        if value > COUNT_MAX:
            return f"{flag} must be at most {COUNT_MAX}, got {value}"
    if not abs(args.lenpen) <= MAX_LENPEN:  # NaN too
        return (f"--lenpen must be a number between -{MAX_LENPEN:g} and {MAX_LENPEN:g} (GNMT's "
                f"alpha; 0.6-1 is usual), got {args.lenpen}")
    if args.beam < 1:
        return f"--beam must be at least 1, got {args.beam}"
    if not args.sampling and not 1 <= nbest <= args.beam:
        return f"--nbest {nbest} must be between 1 and --beam {args.beam}"
    if args.sampling and nbest < 1:
        return f"--nbest (samples per line) must be at least 1, got {nbest}"
    shaped = [name for name, on in (("--temperature", args.temperature != 1.0),
                                    ("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0),
                                    ("--epsilon", args.epsilon != 0.0)) if on]
    if shaped and not args.sampling:
        return f"{shaped[0]} shapes the sampling distribution; add --sampling"
    if not 0 < args.temperature < math.inf:
        return f"--temperature must be positive and finite, got {args.temperature}"
    if not 0 <= args.top_p <= 1:
        return f"--top-p must be between 0 and 1, got {args.top_p}"
    if args.top_k < 0:
        return f"--top-k must be 0 (off) or positive, got {args.top_k}"
    if not 0 <= args.epsilon < 1:
        return f"--epsilon must be in [0, 1), got {args.epsilon}"
    if args.batch_tokens < 1:
        return f"--batch-tokens must be at least 1, got {args.batch_tokens}"
    if args.min_len < 0:
        return f"--min-len must be at least 0, got {args.min_len}"
    # (the command line's types check these; a SearchOptions made in Python does not have them)
    if args.no_repeat_ngram < 0:
        return f"--no-repeat-ngram-size must be 0 (off) or more, got {args.no_repeat_ngram}"
    if args.mbr_candidates < 1:
        return f"--mbr-candidates must be at least 1, got {args.mbr_candidates}"
    if args.workers < 1:
        return f"--workers must be at least 1, got {args.workers}"
    if args.sampling and not -2**63 <= args.seed < 2**64:  # torch.Generator.manual_seed's
        return f"--seed must be within -2**63 and 2**64 - 1, got {args.seed}"
    if not (args.max_len_a >= 0 and args.max_len_b >= 0):  # nan too; inf: the model's maximum
        return (f"--max-len-a and --max-len-b must be at least 0, got {args.max_len_a:g} and "
                f"{args.max_len_b}")
    if args.mbr and nbest != 1:
        return "--mbr gives one translation per line; it does not combine with --nbest"
    if args.mbr and not args.sampling and args.beam < args.mbr_candidates:
        return (f"--mbr-candidates {args.mbr_candidates} from beam search needs --beam "
                f"{args.mbr_candidates} or more (or --sampling)")
    return None


def flags_mistake(args: argparse.Namespace) -> str | None:
    """The first search flag of ``add_search_arguments`` out of range or without the flag it
    needs (``search_mistake``), in words; None if none."""
    try:
        search_options(args, workers=1)
    except ValueError as err:
        return str(err)
    # The budget counts EOS; the shortest line that is not empty is one piece and EOS. (Not a
    # SearchOptions check: translate --score builds one with any budget, which it does not use.)
    if 2 * args.max_len_a + args.max_len_b < 2 and args.score is None:
        return (f"--max-len-a {args.max_len_a:g} --max-len-b {args.max_len_b} leaves a short line "
                "no room for a token before EOS: its translation would be empty")
    return None


def weights_mistake(weights: list[float], members: int, what: str) -> str | None:
    """What is wrong with an ensemble's ``--weights`` for ``members`` models (``what`` names
    them), in words; None if nothing. Checked before any model is loaded."""
    if len(weights) != members:
        return f"--weights: {len(weights)} weights for {what}; one per model, in their order"
    if not all(0 < w < math.inf for w in weights):
        return f"--weights must be above 0 and finite, got {weights}"
    return None


def unused_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Search flags set away from their defaults that do nothing in this combination, for a
    warning each (a flag the user set and the output ignores reads as a setting that worked).
    With ``--score`` (translate's), a given translation is scored, not searched for."""
    def given(dest: str) -> bool:
        return getattr(args, dest) != parser.get_default(dest)

    scoring = args.score is not None
    aligns = hasattr(args, "alignment")  # translate's --alignment; mt-eval has none
    unused = [("--seed", "without --sampling", given("seed") and not args.sampling),
              ("--mbr-candidates", "without --mbr", given("mbr_candidates") and not args.mbr),
              ("--worker-threads", "with one worker (--workers 1, --sampling or a GPU)",
               args.worker_threads
               and (args.workers == 1 or args.sampling or not args.device.startswith("cpu"))),
              # one random stream, drawn in batch order: its batches are searched one by one
              ("--workers", "with --sampling or on a GPU (one batch is searched at a time)",
               (args.workers or 1) > 1
               and (args.sampling or not args.device.startswith("cpu"))),
              ("--beam", "with --sampling (--mbr-candidates sets the samples per line)"
               if args.mbr else "with --sampling (--nbest sets the samples per line)",
               given("beam") and args.sampling),
              ("--alignment-layer", "without --alignment or --replace-unk" if aligns
               else "without --replace-unk",
               args.alignment_layer is not None
               and not ((aligns and args.alignment) or args.replace_unk))]
    unused += [(flag, "with --score", scoring and given(dest)) for flag, dest in (
        ("--beam", "beam"), ("--min-len", "min_len"), ("--max-len-a", "max_len_a"),
        ("--max-len-b", "max_len_b"), ("--no-repeat-ngram-size", "no_repeat_ngram_size"))]
    return [f"{flag} has no effect {why}" for flag, why, on in unused if on]


def min_len_budget_warning(args: argparse.Namespace) -> str | None:
    """A ``--min-len`` at or past a fixed budget (``--max-len-a 0 --max-len-b N``), in words:
    no translation may stop before the budget ends it, so every one runs to the budget. None
    where it can stop sooner, or under translate's ``--score`` (nothing is searched)."""
    if getattr(args, "score", None) is not None or not (args.max_len_a == 0
                                                        and args.min_len >= args.max_len_b):
        return None
    return (f"--min-len {args.min_len} is not below the budget of --max-len-a 0 --max-len-b "
            f"{args.max_len_b} (EOS included): every translation runs to the budget")


def min_len_model_warning(args: argparse.Namespace, max_positions: int) -> str | None:
    """A ``--min-len`` at or past the model's maximum length (``max_positions``, known once it
    is loaded), in words: every translation runs to that maximum, whatever the budget. None
    where ``min_len_budget_warning`` has said so already, or under ``--score``."""
    if (getattr(args, "score", None) is not None or args.min_len < max_positions
            or min_len_budget_warning(args)):
        return None
    return (f"--min-len {args.min_len} is not below the model's maximum of {max_positions} "
            "tokens (EOS included): every translation runs to it")


def search_options(args: argparse.Namespace, workers: int) -> SearchOptions:
    """SearchOptions from the flags of ``add_search_arguments`` and ``add_worker_arguments``."""
    return SearchOptions(
        beam=args.beam, lenpen=args.lenpen, nbest=args.nbest,
        max_len_a=args.max_len_a, max_len_b=args.max_len_b, min_len=args.min_len,
        no_repeat_ngram=args.no_repeat_ngram_size, batch_tokens=args.batch_tokens,
        sampling=args.sampling, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        epsilon=args.epsilon, seed=args.seed, mbr=args.mbr or "",
        mbr_candidates=args.mbr_candidates, workers=workers,
        processes=not args.worker_threads)


def search_failure_said(err: BaseException, args: argparse.Namespace) -> str | None:
    """What translate and mt-eval say, in one line, of a search that failed for a reason the
    user can act on: a worker killed (the out-of-memory killer, mostly), scores that are not
    numbers (mt.search.NOT_A_NUMBER), out of memory (what to lower: a beam multiplies a batch's
    memory as its tokens do, so --beam 100000 ran out at any batch size). None for a bug."""
    from mt.checkpoint import out_of_memory
    from mt.search import nan_hint
    from mt.workers import WorkerDied

    if isinstance(err, WorkerDied):
        return str(err)
    if isinstance(err, FloatingPointError):
        return f"{err}{nan_hint(args.dtype)}"
    if not out_of_memory(err):
        return None
    beam = f" or --beam (now {args.beam})" if args.beam > 1 and not args.sampling else ""
    return (f"out of memory: a smaller --batch-tokens (now {args.batch_tokens}){beam}, or fewer "
            "--workers")


# mt.inference.DTYPES's names, here so that --help does not import torch (a test keeps the two
# the same).
DTYPE_NAMES = ("bfloat16", "float16", "float32", "int8")


def add_device_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--device`` and ``--dtype``, as translate and mt-eval both take them."""
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default: cpu)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32",
                   help="weights and activations; bfloat16 is the fast path on CPUs with "
                        "AVX512-BF16/AMX and on GPUs; int8: int8 linear layers (CPU only) "
                        "(default: float32)")


def add_worker_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--workers`` and ``--worker-threads``, as translate and mt-eval both take them."""
    p.add_argument("--workers", type=positive_int, default=None,
                   help="batches searched at once, one core each (CPU; --sampling searches "
                        "one at a time); default: one per core torch may use on CPU, 1 on a GPU. "
                        "Batches are cut to keep every worker busy, so scores may differ in "
                        "their last bits between worker counts")
    p.add_argument("--worker-threads", action="store_true",
                   help="run the workers as threads of this process instead of forked "
                        "processes (the default on Linux; elsewhere always threads): 0.1-0.4 GB "
                        "less memory, about 1.1x slower in bfloat16")
