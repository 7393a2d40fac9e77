"""Lines of text in, n-best lists out: what ``translate``, ``mt-eval`` and training's validation
share, apart from the command line.

Lines are encoded; a line longer than the model's maximum is cut into pieces, between sentences
where it can (``_pieces``); the pieces are sorted by length, cut into batches by a token budget,
searched (one batch per worker on a CPU: a forked process or a thread, ``mt.workers``) and put
back in input order, grouped by line (``LineResult``). Empty lines are not searched: those that
encode to EOS alone, whitespace or only what normalization removes (a byte-order mark, a
zero-width space) included.
``score_lines`` does the same for given translations (``translate --score``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from mt.alignment import replace_unknowns
from mt.batching import pad
from mt.config import EOS_ID, UNK_ID
from mt.constraints import constrained_beam_search, encode_phrases, satisfied
from mt.incremental import ensemble_members, first_member, max_positions
from mt.mbr import mbr_lines
from mt.options import SearchOptions, search_mistake
from mt.results import LineResult, line_texts
from mt.scoring import forced_scores
from mt.search import Hypothesis, beam_search, greedy_search, sample_search
from mt.shortlist import Shortlist, restricted_search
from mt.textio import text_list
from mt.tokenizer import Boundaries
from mt.workers import map_batches

log = logging.getLogger("mt.lines")
IN_PIECES = "%d line(s) longer than the model's %d tokens were translated in pieces"
NOT_SCORED = "%d line pair(s) longer than the model's %d tokens were not scored (nan)"
UNUSED_PREFIX = ("%d empty line(s) have a prefix, which goes unused: an empty line gets an "
                 "empty translation")
UNMET = ("%d translation(s) lack a constraint: the output budget ran out first (a larger "
          "--beam or --max-len-b helps), --no-repeat-ngram-size left no way to place it, or the "
          "line was empty or translated in pieces (constraints then go unused)")


def _pieces(ids: list[int], limit: int, marks: Boundaries | None = None) -> list[list[int]]:
    """Splits a source (ending in EOS) into pieces of at most ``limit`` tokens, each with EOS.

    Each cut goes after the last sentence end that fits (Tokenizer.src_boundaries; closing quotes
    after it included, at least a quarter of the limit into the piece, so that "Dr." alone does
    not become a piece), else before the last word start that fits, else where the limit falls
    (without ``marks``, always there), moved back to a character's first byte piece (byte
    fallback spells one character in up to four). A piece is translated on its own, so a cut
    inside a sentence, or a word, costs the translation its context there.
    """
    if len(ids) <= limit:
        return [ids]
    if limit < 2:
        raise ValueError(f"a model of {limit} position(s) has no room for a token and EOS")
    body, eos, step = ids[:-1], ids[-1:], limit - 1
    out, i = [], 0
    while len(body) - i > step:
        cut = _cut(body, i, step, marks) if marks else i + step
        out.append(body[i:cut] + eos)
        i = cut
    return [*out, body[i:] + eos]


def _cut(body: list[int], i: int, step: int, marks: Boundaries) -> int:
    """Where the piece starting at ``body[i]`` ends (see ``_pieces``)."""
    word = None
    for k in range(i + step, i, -1):
        spaced = marks.starts[body[k]]
        word = k if word is None and spaced else word
        j = k - 1
        while j > i and marks.closes[body[j]]:
            j -= 1
        if (marks.ends[body[j]] and (spaced or marks.unspaced[body[j]])
                and k - i >= max(step // 4, 1)):
            return k
    if word:
        return word
    cut = i + step  # inside a word: not between the byte pieces of one character, if it can
    while cut > i + 1 and marks.inside[body[cut]]:
        cut -= 1
    return cut


def translate_ids(model, sources: list[list[int]], opts: SearchOptions,
                  progress: bool | Any = False, prefixes: list[list[int]] | None = None, *,
                  generator: torch.Generator | None = None,
                  constraints: list[list[list[int]]] | None = None,
                  shortlist: Shortlist | None = None) -> list[list[Hypothesis]]:
    """Searches every source (ids ending in EOS); returns n-best lists in input order.

    Batches are formed from length-sorted sources (longest first, so memory peaks early) and each
    holds at most ``opts.batch_tokens`` source tokens, padding included. On CPU, ``opts.workers``
    batches are searched at once, one core each, in threads or (``opts.processes``) forked
    processes (so that many batches' activations and caches are in memory together). With
    several workers the batches are cut to keep them all busy (``mt.workers.balanced_batches``),
    so, as with another ``batch_tokens``, scores can differ in their last bits (and a near-tie,
    rarely, flip); the same options always give the same results, in threads or processes.

    Args:
        model: a Transformer, or an Ensemble.
        sources: token ids per sentence, each ending in EOS.
        opts: the search.
        progress: a tqdm bar on stderr (True), or the caller's bar to advance per sentence.
        prefixes: per sentence, target ids to force before the free search (or None).
        generator: the random stream for sampling (default: a new one from ``opts.seed``).
        constraints: per sentence, target phrases (ids) its translation must contain
            (``mt.constraints``; beam search only).
        shortlist: the target pieces each sentence may use (``mt.shortlist``), or None: all.
    """
    if constraints is not None and any(constraints) and (opts.sampling or opts.beam < 2):
        raise ValueError("constraints need beam search with a beam of 2 or more (a beam of 1 has "
                         "no room for a hypothesis that places a phrase); they do not combine "
                         "with sampling")
    mistake = search_mistake(opts)  # again: a SearchOptions can be changed after it is made
    if mistake:
        raise ValueError(mistake)
    device = next(first_member(model).parameters()).device
    if opts.sampling and generator is None:
        generator = torch.Generator(device=device).manual_seed(opts.seed)
    lens = dict(max_len_a=opts.max_len_a, max_len_b=opts.max_len_b, min_len=opts.min_len,
                no_repeat_ngram=opts.no_repeat_ngram)

    def inputs(batch: list[int]) -> tuple[torch.Tensor, list[list[int]] | None]:
        src = pad([sources[i] for i in batch]).to(device)
        return src, [prefixes[i] for i in batch] if prefixes is not None else None

    def search(batch: list[int]) -> list[list[Hypothesis]]:
        # Sentences with phrases take the constrained search (its bookkeeping is Python); the
        # others the plain one, as fast as without constraints.
        bound = [i for i in batch if constraints[i]] if constraints is not None else []
        if not bound:
            return plain(batch)
        src, pre = inputs(bound)
        found = dict(zip(bound, restricted_search(
            lambda m, pre, phrases: constrained_beam_search(m, src, phrases, opts.beam,
                                                            opts.lenpen, opts.nbest,
                                                            prefixes=pre, **lens),
            model, shortlist, src, pre, [constraints[i] for i in bound]), strict=True))
        free = [i for i in batch if not constraints[i]]
        if free:
            found.update(zip(free, plain(free), strict=True))
        return [found[i] for i in batch]

    def plain(batch: list[int]) -> list[list[Hypothesis]]:
        src, pre = inputs(batch)
        return restricted_search(lambda m, pre, _: unconstrained(m, src, pre), model, shortlist,
                                 src, pre)

    def unconstrained(m, src: torch.Tensor, pre: list[list[int]] | None
                      ) -> list[list[Hypothesis]]:
        if opts.sampling:
            return sample_search(m, src, opts.nbest, opts.lenpen, prefixes=pre,
                                 temperature=opts.temperature, top_k=opts.top_k,
                                 top_p=opts.top_p, epsilon=opts.epsilon, generator=generator,
                                 **lens)
        if opts.beam == 1:
            return [[h] for h in greedy_search(m, src, lenpen=opts.lenpen, prefixes=pre, **lens)]
        return beam_search(m, src, opts.beam, opts.lenpen, opts.nbest, prefixes=pre, **lens)

    # Sampling draws from one random stream in batch order, so it stays on one thread.
    return map_batches(search, [len(s) for s in sources], opts.batch_tokens,
                        1 if opts.sampling else opts.workers, device, progress,
                        opts.processes)


def encode_prefixes(tokenizer, prefixes: list[str], name: str = "prefixes",
                    first_line: int = 1, limit: int | None = None) -> list[list[int]]:
    """Per line, its target prefix as ids. A prefix the target vocabulary cannot spell is refused
    (as ``mt.constraints.encode_phrases`` refuses a phrase), naming ``name``, the line
    (``first_line`` is the number of the first) and the character: forced, it would be <unk>,
    which the translation prints as "⁇". With byte fallback every prefix can be spelled. So is
    one of ``limit`` pieces or more (a model of ``limit`` positions, EOS included): the search
    cut it where the model's output ends, and the translation was that cut prefix alone."""
    out = tokenizer.encode_tgt(prefixes)
    for i, (text, ids) in enumerate(zip(prefixes, out, strict=True)):
        if limit is not None and len(ids) >= limit:
            raise ValueError(f"{name}:{first_line + i}: prefix of {len(ids)} pieces: the model "
                             f"writes at most {limit - 1} before EOS (its maximum is {limit} "
                             "tokens)")
        if UNK_ID in ids:
            lacked = [c for c in dict.fromkeys(text) if UNK_ID in tokenizer.encode_tgt([c])[0]]
            what = f"{lacked[0]!r}" if lacked else "some of its characters"
            raise ValueError(f"{name}:{first_line + i}: prefix {text!r}: the target vocabulary "
                             f"lacks {what}")
    return out


def check_eval(model) -> None:
    """A model in training mode would search with dropout on: another translation at every call,
    and worse ones. Loaded models are in eval mode; a model taken from training code may not be."""
    if any(m.training for member in ensemble_members(model) for m in member.modules()):
        raise ValueError("the model is in training mode (dropout on: every call would translate "
                         "differently): call model.eval() first")


def search_lines(model, tokenizer, lines: list[str], opts: SearchOptions,
                 progress: bool | Any = False, prefixes: list[str] | None = None, *,
                 generator: torch.Generator | None = None, warn: bool = True,
                 constraints: list[list[str]] | None = None,
                 shortlist: Shortlist | None = None) -> list[LineResult]:
    """Encodes, splits over-long lines into pieces, searches them all, and groups them by line
    (with ``opts.mbr``: each piece's ``opts.mbr_candidates`` cut to the one MBR chooses).

    Args:
        model: a Transformer or an Ensemble.
        tokenizer: the model's mt.tokenizer.Tokenizer.
        lines: input sentences; a line that encodes to EOS alone (empty, whitespace, or only
            what normalization removes, such as a byte-order mark) is not searched.
        opts: the search.
        progress: a progress bar on stderr (True), or the caller's tqdm bar to advance per line.
        prefixes: per line, target text to force at the start of its translation ("" = none);
            one the target vocabulary cannot spell, or too long for the model, is a ValueError
            (``encode_prefixes``).
        generator: the random stream for sampling (default: a new one from ``opts.seed``); a
            caller that searches a file in chunks passes one stream for all of them.
        warn: log a warning for lines translated in pieces, and for translations that lack a
            constraint (a caller with chunks sums them: ``unmet``).
        constraints: per line, target phrases its translation must contain (``mt.constraints``).
            A line translated in pieces cannot say which piece a phrase belongs to: its
            constraints go unused.
        shortlist: the target pieces each line may use (``mt.shortlist``), or None: all.
    """
    check_eval(model)
    lines = text_list(lines, "lines")
    prefixes = text_list(prefixes, "prefixes") if prefixes is not None else None
    constraints = phrase_lists(constraints) if constraints is not None else None
    if prefixes is not None and len(prefixes) != len(lines):
        raise ValueError(f"{len(prefixes)} prefixes for {len(lines)} lines")
    if constraints is not None and len(constraints) != len(lines):
        raise ValueError(f"{len(constraints)} constraint lists for {len(lines)} lines")
    limit = max_positions(model)
    encoded = tokenizer.encode_src(lines)
    prefix_ids = (encode_prefixes(tokenizer, prefixes, limit=limit) if prefixes is not None
                  else None)
    phrase_ids = encode_phrases(tokenizer, constraints) if constraints is not None else None
    sources: list[list[int]] = []
    forced: list[list[int]] = []
    wanted: list[list[list[int]]] = []
    owner: list[int] = []  # which line each source piece belongs to
    long_lines = unused_prefixes = 0
    for i, ids in enumerate(encoded):
        if len(ids) == 1:  # EOS alone: searching it would make up a sentence from nothing
            unused_prefixes += bool(prefix_ids and prefix_ids[i])
            continue
        pieces = _pieces(ids, limit, tokenizer.src_boundaries)
        long_lines += len(pieces) > 1
        sources.extend(pieces)
        owner.extend([i] * len(pieces))
        # A prefix belongs to the start of the translation: the first piece only.
        forced.extend([prefix_ids[i] if prefix_ids else []] + [[]] * (len(pieces) - 1))
        wanted.extend([phrase_ids[i] if phrase_ids and len(pieces) == 1 else []] * len(pieces))
    if long_lines and warn:
        log.warning(IN_PIECES, long_lines, limit)
    if unused_prefixes and warn:
        log.warning(UNUSED_PREFIX, unused_prefixes)
    if not isinstance(progress, bool):  # the caller's bar counts lines, the search pieces
        progress.total += len(sources) - len(set(owner))
        progress.update(len(lines) - len(set(owner)))
    # With MBR the search draws the candidates, and each line keeps the one MBR chooses.
    search = replace(opts, nbest=opts.mbr_candidates, mbr="") if opts.mbr else opts
    hyps = (translate_ids(model, sources, search, progress,
                          forced if prefix_ids is not None else None, generator=generator,
                          constraints=wanted if phrase_ids is not None else None,
                          shortlist=shortlist)
            if sources else [])
    out = [LineResult([], [], text) for text in lines]
    for i, src, h in zip(owner, sources, hyps, strict=True):
        out[i].sources.append(src)
        out[i].hyps.append(h)
    if opts.mbr and phrase_ids is not None:  # MBR chooses among the candidates holding them all
        for r, phrases in zip(out, phrase_ids, strict=True):
            if phrases and len(r.hyps) == 1:
                r.hyps[0] = [h for h in r.hyps[0] if satisfied(h.tokens, phrases)] or r.hyps[0]
    out = mbr_lines(tokenizer, out, opts.mbr) if opts.mbr else out
    if phrase_ids is not None and warn and (missed := unmet(out, phrase_ids)):
        log.warning(UNMET, missed)
    return out


def phrase_lists(constraints: Iterable[list[str]]) -> list[list[str]]:
    """Per line, its phrases as a list of str, blank ones dropped (as ``split_phrases`` drops a
    constraints file's blank fields). A list of strings, one per line, would be read as one phrase
    per character, and each letter forced into the translation: a TypeError instead."""
    if isinstance(constraints, str):
        raise TypeError("constraints: a list of phrase lists, one per line, not one string")
    out = []
    for i, phrases in enumerate(constraints):
        if isinstance(phrases, str):
            raise TypeError(f"constraints[{i}] is a str: give each line's phrases as a list "
                            f"([{phrases!r}])")
        if not isinstance(phrases, Iterable):
            raise TypeError(f"constraints[{i}] is {type(phrases).__name__}: give each line's "
                            "phrases as a list ([] for none)")
        out.append([p.strip() for p in text_list(phrases, f"constraints[{i}]") if p.strip()])
    return out


def unmet(results: list[LineResult], constraints: list[list[list[int]]]) -> int:
    """Lines whose (first) translation lacks one of their constraints (ids)."""
    return sum(bool(c) and (len(r.hyps) != 1 or not satisfied(r.hyps[0][0].tokens, c))
               for r, c in zip(results, constraints, strict=True))


def score_lines(model, tokenizer, lines: list[str], targets: list[str], lenpen: float = 0.6,
                batch_tokens: int = SearchOptions.batch_tokens, workers: int = 1,
                progress: bool | Any = False, *, warn: bool = True,
                processes: bool = False) -> list[LineResult]:
    """Scores given translations (``translate --score``) instead of searching for them.

    Every pair is scored by the model, in batches of at most ``batch_tokens`` tokens of the longer
    side, but for an empty line with an empty translation: ``translate_lines`` gives an empty line
    ("", 0.0) without a search, and its score here is that one (a LineResult without sources or
    hypotheses). An empty source with a translation, or a translation of an empty line, is
    scored (an empty side is EOS alone). A pair with a side longer than the model's maximum
    cannot be scored: it keeps its source and gets no hypothesis (one warning for all of them),
    as no piece of it can be scored on its own. ``workers`` and ``processes`` as in
    ``SearchOptions``.

    Returns:
        per line a LineResult whose one hypothesis carries the score (``forced_scores``); the
        result fits ``align_lines`` for forced alignments of given translations.
    """
    check_eval(model)
    # made for the checks its constructor runs: the same refusals, in the same words
    SearchOptions(lenpen=lenpen, batch_tokens=batch_tokens, workers=workers)
    lines, targets = text_list(lines, "lines"), text_list(targets, "targets")
    if len(targets) != len(lines):
        raise ValueError(f"{len(targets)} translations for {len(lines)} lines")
    limit = max_positions(model)
    pairs = [(s, t + [EOS_ID]) for s, t in zip(tokenizer.encode_src(lines),
                                                  tokenizer.encode_tgt(targets), strict=True)]
    empty = {i for i, (s, t) in enumerate(pairs) if s == t == [EOS_ID]}
    fits = [i for i, (s, t) in enumerate(pairs)
            if len(s) <= limit and len(t) <= limit and i not in empty]
    unfit = len(pairs) - len(fits) - len(empty)
    if unfit and warn:
        log.warning(NOT_SCORED, unfit, limit)
    if not isinstance(progress, bool):
        progress.update(len(pairs) - len(fits))
    device = next(first_member(model).parameters()).device

    def score(batch: list[int]) -> list[Hypothesis]:
        src = pad([pairs[fits[j]][0] for j in batch]).to(device)
        tgt = pad([pairs[fits[j]][1] for j in batch]).to(device)
        return forced_scores(model, src, tgt, lenpen)

    lengths = [max(len(s), len(t)) for s, t in (pairs[i] for i in fits)]
    hyps = map_batches(score, lengths, batch_tokens, workers, device, progress, processes)
    out = [LineResult([], [], text) if i in empty else LineResult([s], [], text)  # unfit
           for i, ((s, _), text) in enumerate(zip(pairs, lines, strict=True))]
    for i, h in zip(fits, hyps, strict=True):
        out[i].hyps.append([h])
    return out


def translate_lines(model, tokenizer, lines: list[str], opts: SearchOptions | None = None,
                    progress: bool = False,
                    prefixes: list[str] | None = None,
                    constraints: list[list[str]] | None = None,
                    shortlist: Shortlist | None = None) -> list[list[tuple[str, float]]]:
    """Translates sentences; returns per line its n-best (text, score), best first.

    Empty lines (that encode to EOS alone: whitespace, a byte-order mark...) give ``[("", 0.0)]``
    without being searched. ``model`` may be an Ensemble (its members share ``tokenizer``).
    ``constraints``: per line, target phrases its translation must contain (``mt.constraints``);
    ``shortlist``: the target pieces each line may use (``mt.shortlist``).
    """
    results = search_lines(model, tokenizer, lines, opts or SearchOptions(), progress, prefixes,
                           constraints=constraints, shortlist=shortlist)
    return nbest_texts(model, tokenizer, results)


# What readers take for the end of a line (Python's universal newlines and str.splitlines) and
# the n-best format's field separator. A model with byte fallback can write any of them (the
# pieces <0x0A>, <0x0D>, <0x09>...): never seen in training, they are rare, but sampling draws
# them (an under-trained demo model: 62 lines out for 60 in), and one would shift every later
# line of a file against its source. Each is printed as a space, the whitespace it stands for.
_LINE_BREAKS = str.maketrans(dict.fromkeys("\t\n\x0b\x0c\r\x1c\x1d\x1e\x85\u2028\u2029", " "))


def one_line(text: str) -> str:
    """``text`` with every line break or tab in it a space (``_LINE_BREAKS``)."""
    return text.translate(_LINE_BREAKS)


def nbest_texts(model, tokenizer, results: list[LineResult], replace_unk: bool = False,
                layer: int | None = None,
                batch_tokens: int = SearchOptions.batch_tokens) -> list[list[tuple[str, float]]]:
    """Per line, its n-best (text, score), best first (``line_texts``), each text one line
    (``one_line``); with ``replace_unk`` each <unk> copied from the source piece it attends to
    most in decoder ``layer`` (``mt.alignment.replace_unknowns``), the scores unchanged."""
    nbests = [[(one_line(t), score) for t, score in line_texts(tokenizer, r)] for r in results]
    if not replace_unk:
        return nbests
    texts = replace_unknowns(model, tokenizer, results, layer, batch_tokens)
    return [[(one_line(t), score) for t, (_, score) in zip(line, nbest, strict=True)]
            for line, nbest in zip(texts, nbests, strict=True)]


def best_translations(model, tokenizer, lines: list[str], opts: SearchOptions | None = None, *,
                      constraints: list[list[str]] | None = None,
                      shortlist: Shortlist | None = None, replace_unk: bool = False,
                      layer: int | None = None, progress: bool | Any = False) -> list[str]:
    """Each line's best translation (the first of its ``translate_lines`` n-best), searched under
    ``torch.inference_mode``: what validation, the final test and ``mt-eval`` score.
    ``replace_unk``: each <unk> copied from the source, as ``translate --replace-unk`` (reading
    the cross-attention of decoder ``layer``). ``opts``: None for the defaults, as
    ``translate_lines``. ``progress``: as ``search_lines``'s."""
    opts = opts or SearchOptions()
    with torch.inference_mode():
        results = search_lines(model, tokenizer, lines, opts, progress, constraints=constraints,
                               shortlist=shortlist)
        texts = nbest_texts(model, tokenizer, results, replace_unk, layer, opts.batch_tokens)
    return [nbest[0][0] for nbest in texts]
