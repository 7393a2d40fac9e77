"""Word-level views of a translation: Pharaoh ``i-j`` links read from a decoder layer's
cross-attention (``translate --alignment``), and each word's log-probability
(``translate --word-scores``).

Attention alignments are a by-product of translation, not a trained aligner: each target token is
linked to the source token it attends to most, and token links become word links. Word scores
are exact: a word's log-probability is the sum of its pieces'.
"""

from __future__ import annotations

import torch

from mt.batching import budget_batches, pad
from mt.config import EOS_ID
from mt.incremental import first_member
from mt.options import SearchOptions
from mt.results import LineResult, line_texts
from mt.scoring import cross_attention


def layer_mistake(model, layer: int | None, flag: str = "--alignment-layer") -> str | None:
    """Why ``flag`` cannot read ``layer`` of this model's decoder, in words; None if it can
    (None is the default layer)."""
    n_layers = len(first_member(model).decoder_layers)
    if layer is not None and not -n_layers <= layer < n_layers:
        return f"{flag} {layer}: the decoder has {n_layers} layers"
    return None


def _word_index(sp, ids: list[int], first: int = 0, source: bool = False) -> list[int]:
    """Word number (from ``first``) of each token, as the text's whitespace-separated words count
    them: a piece starting with '▁' starts a word, a piece of whitespace alone belongs to no word
    (-1). The unknown piece is a word of its own in a translation (it decodes to ' ⁇ '); in a
    ``source`` it stands for the input's own characters, glued to the word they are in ("man🙂",
    "🐕dog"), so it starts a word only after whitespace. Byte pieces (byte fallback: 🙂 is
    ▁ <0xF0> <0x9F> <0x99> <0x82>) never start with '▁', so they join the word they are in, as
    the character they spell does; but bytes that spell whitespace (<0x20>, <0x0A>, a no-break
    space's <0xC2><0xA0>: a model may write them, sampling does) separate words, as the text
    they decode to does, and belong to none; so does a piece of whitespace other than '▁' (a
    tab, which normalization=identity keeps, is a piece of its own where the text had tabs).
    Whitespace inside a piece separates words too: under identity a tab and the digits or
    punctuation beside it are one Unicode script, so SentencePiece makes pieces such as
    '\t2024\t'; such a piece is a token of its first word, and the words after it count on."""
    spaces = _whitespace_bytes(sp, ids)
    out, word, open_word = [], first - 1, False
    for i, t in enumerate(ids):
        if sp.is_unknown(t):
            if not (source and open_word):
                word += 1
            out.append(word)
            open_word = source
            continue
        piece = sp.id_to_piece(t)
        rest = piece.lstrip("\u2581")
        if not rest.strip() or i in spaces:
            out.append(-1)
            open_word = False
            continue
        if rest != piece or not open_word or rest[0].isspace():
            word += 1
        out.append(word)
        word += len(rest.split()) - 1  # the words after its first, in a piece that spans some
        open_word = not rest[-1].isspace()
    return out


def _whitespace_bytes(sp, ids: list[int]) -> set[int]:
    """Positions in ``ids`` of the byte pieces that spell a whitespace character, as
    SentencePiece decodes them (a run of byte pieces, as UTF-8; a byte that begins no character
    decodes to U+FFFD, no whitespace)."""
    spaces, i = set(), 0
    while i < len(ids):
        if not sp.is_byte(ids[i]):
            i += 1
            continue
        run = i  # the byte pieces from i on, at most 4: one character
        while run < len(ids) and run - i < 4 and sp.is_byte(ids[run]):
            run += 1
        data = bytes(int(sp.id_to_piece(t)[1:-1], 16) for t in ids[i:run])
        for size in range(1, len(data) + 1):
            try:
                char = data[:size].decode("utf-8")
            except UnicodeDecodeError:
                continue
            if char.isspace():
                spaces.update(range(i, i + size))
            i += size
            break
        else:  # no character starts here
            i += 1
    return spaces


def _source_words(sp, text: str, ids: list[int]) -> list[int]:
    """Word number of each source token in ``text`` as its whitespace-separated words count them,
    or -1 for a token of whitespace alone.

    The text the model reads is normalized (NFKC by default), and normalization can make words:
    '´' becomes a space and a combining accent, so "dog´s" reads as two words, and a count of
    '▁' pieces (``_word_index``) would number every word after it one too high. SentencePiece's
    normalizer says which input character each normalized character came from, so each token is
    placed in the input itself. Tokens that are not the line's plain encoding are numbered by
    the '▁' count."""
    placed = _token_chars(sp, text, ids)
    if placed is None:
        return _word_index(sp, ids, source=True)
    _, origin, spans = placed
    word_of, word, spaced = [], -1, True  # each input character's word
    for c in text:
        word += spaced and not c.isspace()
        spaced = c.isspace()
        word_of.append(-1 if spaced else word)
    # A token's word is that of its first character that is not whitespace: '\t2024' (a piece
    # under normalization=identity) is 2024's, not its tab's.
    return [next((w for k in range(start, end) if (w := word_of[origin[k]]) >= 0), -1)
            if start is not None else -1 for start, _, end in spans]


def _token_chars(sp, text: str, ids: list[int]
                 ) -> tuple[str, list[int], list[tuple[int | None, int, int]]] | None:
    """Where each source token sits in ``text``, through SentencePiece's normalizer offsets: the
    normalized text, each normalized character's input character (``origin``), and per token
    its first normalized character after its '▁' (None for a token of '▁' alone), its first and
    the one after its last (a byte piece covers its whole character). None when ``ids`` are not
    the line's plain encoding."""
    pieces = sp.encode(text, out_type=str)  # <unk> as the characters it stands for
    if sp.piece_to_id(pieces) != ids:
        return None
    normalized, origin = sp.normalize(text, with_offsets=True)
    char_of_byte = [i for i, c in enumerate(normalized) for _ in range(len(c.encode()))]
    char_of_byte.append(len(normalized))
    spans, at = [], 0  # at: the token's first byte in the normalized text
    for t, piece in zip(ids, pieces, strict=True):
        size = 1 if sp.is_byte(t) else len(piece.encode())
        skip = 0 if sp.is_byte(t) else len(piece.encode()) - len(piece.lstrip("\u2581").encode())
        spans.append((char_of_byte[at + skip] if skip < size else None, char_of_byte[at],
                      char_of_byte[at + size - 1] + 1))
        at += size
    return normalized, origin, spans


def _entries(r: LineResult) -> range:
    """A line's n-best entries: each of its one piece's, or the one that joins a line's pieces."""
    return range(len(r.hyps[0])) if len(r.hyps) == 1 else range(1)


def _jobs(results: list[LineResult], lines: set[int] | None = None) -> list[tuple[int, int, int]]:
    """(line, entry, piece) of each (source piece, hypothesis) pair of ``lines`` (default all)."""
    return [(li, e, p) for li, r in enumerate(results) if lines is None or li in lines
            for e in _entries(r) for p in range(len(r.hyps))]


def blank_pieces(sp) -> torch.Tensor:
    """(V,) bool: the pieces of SentencePiece model ``sp`` that no word is linked to (control
    pieces such as EOS and padding, and a piece of whitespace alone: '▁', a tab)."""
    return torch.tensor([sp.is_control(i) or (not sp.is_unknown(i)
                                               and not sp.id_to_piece(i).lstrip("\u2581").strip())
                         for i in range(sp.get_piece_size())])


def unlinkable(sp, ids: list[int], blank: torch.Tensor | None = None) -> torch.Tensor:
    """(S,) bool: the tokens of source ``ids`` that no word is linked to: ``blank_pieces`` (given
    or made) and byte pieces that spell whitespace (a tab under byte fallback is <0x09>), which
    belong to no word either, so a target token that attends to one most would lose its link
    instead of taking its best word."""
    blank = blank_pieces(sp) if blank is None else blank
    out = blank[torch.tensor(ids, dtype=torch.long)]
    out[sorted(_whitespace_bytes(sp, ids))] = True
    return out


@torch.inference_mode()  # a library caller's align_lines kept every batch's graph
def _attended(model, tokenizer, results: list[LineResult], jobs: list[tuple[int, int, int]],
              layer: int | None, batch_tokens: int) -> dict[tuple[int, int, int], list[int]]:
    """Per job, the source token each target token attends to most (EOS not included) in one
    decoder layer's cross-attention, heads averaged, teacher-forced on the translation; only word
    pieces are candidates: not EOS, padding, a piece or the bytes of whitespace alone."""
    model = first_member(model)
    if layer is None:
        layer = -2 if len(model.decoder_layers) > 1 else -1
    device = next(model.parameters()).device
    blank = blank_pieces(tokenizer.src)
    order = sorted(range(len(jobs)), key=lambda j: -len(results[jobs[j][0]].sources[jobs[j][2]]))
    lengths = [len(results[li].sources[p]) + len(results[li].hyps[p][e].tokens) + 1
               for li, e, p in jobs]
    out = {}
    for batch in budget_batches(lengths, order, batch_tokens):
        src = pad([results[jobs[j][0]].sources[jobs[j][2]] for j in batch]).to(device)
        tgt_ids = [results[li].hyps[p][e].tokens + [EOS_ID]
                   for li, e, p in (jobs[j] for j in batch)]
        tgt = pad(tgt_ids).to(device)
        attn = cross_attention(model, src, tgt, layer)  # (B, T, S)
        unlinked = blank[src.cpu()]  # (B, S), padding included
        for row, j in enumerate(batch):
            ids = results[jobs[j][0]].sources[jobs[j][2]]
            unlinked[row, : len(ids)] = unlinkable(tokenizer.src, ids, blank)
        attn.masked_fill_(unlinked.to(device)[:, None, :], -1.0)
        best = attn.argmax(dim=-1).tolist()  # (B, T)
        for j, row, t in zip(batch, best, tgt_ids, strict=True):
            out[jobs[j]] = row[: len(t) - 1]
    return out


def align_lines(model, tokenizer, results: list[LineResult], layer: int | None = None,
                batch_tokens: int = SearchOptions.batch_tokens,
                copied: bool = False) -> list[list[str]]:
    """Pharaoh word alignments ('i-j': source word i, target word j, from 0) of every n-best entry.

    Each target token is aligned to the source token it attends to most in one decoder layer's
    cross-attention (heads averaged, teacher-forced on the translation); token links become word
    links (words are SentencePiece word starts, i.e. the whitespace-separated words of the text).
    EOS on either side is never linked.

    Args:
        model: a Transformer or an Ensemble (its first member is used).
        results: search_lines' output.
        layer: decoder layer; default the penultimate one (or the only one), which aligns best in
            Garg et al. (2019).
    Returns:
        per line, per n-best entry, the alignment string ("" for an empty line).
    """
    links = _attended(model, tokenizer, results, _jobs(results), layer, batch_tokens)
    out: list[list[str]] = []
    for li, r in enumerate(results):
        if not r.hyps:
            out.append([""])
            continue
        src_words = _source_words(tokenizer.src, r.text, [t for s in r.sources for t in s[:-1]])
        starts = [0]  # each source piece's first token in the line
        for s in r.sources[:-1]:
            starts.append(starts[-1] + len(s) - 1)
        line_out = []
        for e in _entries(r):
            pairs, tgt_offset = set(), 0
            for p in range(len(r.hyps)):
                toks = r.hyps[p][e].tokens
                tgt_words = _word_index(tokenizer.tgt, toks, tgt_offset, source=copied)
                for tj, si in enumerate(links[(li, e, p)]):
                    if si >= len(r.sources[p]) - 1:  # a source of EOS alone has nothing to link
                        continue
                    i, j = src_words[starts[p] + si], tgt_words[tj]
                    if i >= 0 and j >= 0:  # whitespace pieces belong to no word
                        pairs.add((i, j))
                tgt_offset = max([tgt_offset - 1, *tgt_words]) + 1
            line_out.append(" ".join(f"{i}-{j}" for i, j in sorted(pairs)))
        out.append(line_out)
    return out


def word_scores(tokenizer, results: list[LineResult], copied: bool = False) -> list[list[str]]:
    """Each word's log-probability in every n-best entry, and EOS's last.

    Words are the whitespace-separated words of the translation, as ``--alignment`` counts them;
    a word's log-probability is the sum of its pieces' (a piece of whitespace alone goes with the
    word after it; a piece that spans words with its first, the others 0). So the numbers of an
    entry sum to its log-probability (the score before the length penalty), and a low one marks
    the word the model was least sure of. A line translated in pieces has its pieces' words in
    turn and the sum of their EOS log-probabilities last.

    Returns:
        per line, per n-best entry (as ``align_lines``), the scores separated by spaces (""
        for an empty line).
    """
    out: list[list[str]] = []
    for r in results:
        if not r.hyps:
            out.append([""])
            continue
        line_out = []
        for e in _entries(r):
            words: list[float] = []
            eos = 0.0
            for piece in r.hyps:
                h = piece[e]
                index = _word_index(tokenizer.tgt, h.tokens, source=copied)
                sums = [0.0] * (max(index, default=-1) + 1)
                carry = 0.0  # whitespace pieces, for the next word
                for w, lp in zip(index, h.token_logprobs, strict=False):
                    if w < 0:
                        carry += lp
                    else:
                        sums[w] += lp + carry
                        carry = 0.0
                words.extend(sums)
                eos += h.token_logprobs[-1] + carry
            line_out.append(" ".join(f"{x:.4f}" for x in [*words, eos]))
        out.append(line_out)
    return out


def replace_unknowns(model, tokenizer, results: list[LineResult], layer: int | None = None,
                     batch_tokens: int = SearchOptions.batch_tokens) -> list[list[str]]:
    """Every n-best entry's text with each ``<unk>`` the model wrote (printed as " ⁇ ") replaced
    by the source piece it attends to most, as the input spells it (before normalization;
    fairseq's and OpenNMT-py's ``--replace-unk``, without a dictionary): a name or symbol the
    target vocabulary lacks is copied through. The attention is ``align_lines``' (the same
    ``layer``; an Ensemble's first member); only lines whose translations hold ``<unk>`` are run
    through the model again. Whitespace and control characters are not copied (a tab would
    break the n-best format), and a copy is put in after decoding, so that text that looks like
    a piece (``<0xE2>``, ``</s>``) stays text.

    Returns:
        per line, per n-best entry (as ``line_texts`` gives them), the text.
    """
    unk = tokenizer.tgt.unk_id()
    lines = {li for li, r in enumerate(results)
             if any(unk in h.tokens for piece in r.hyps for h in piece)}
    links = (_attended(model, tokenizer, results, _jobs(results, lines), layer, batch_tokens)
             if lines else {})
    src_sp, tgt_sp = tokenizer.src, tokenizer.tgt
    out: list[list[str]] = []
    for li, r in enumerate(results):
        if li not in lines:
            out.append([text for text, _ in line_texts(tokenizer, r)])
            continue
        spelled = _spellings(src_sp, r.text, [t for s in r.sources for t in s[:-1]])
        starts = [0]  # each source piece's first token in the line
        for s in r.sources[:-1]:
            starts.append(starts[-1] + len(s) - 1)
        line_out = []
        for e in _entries(r):
            texts = []
            for p in range(len(r.hyps)):
                tokens = r.hyps[p][e].tokens
                pieces, copies = tgt_sp.id_to_piece(tokens), []
                for j, si in enumerate(links[(li, e, p)]):
                    if tokens[j] == unk and si < len(r.sources[p]) - 1:
                        copy = "".join(c for c in spelled[starts[p] + si]
                                       if c.isprintable() and not c.isspace())
                        pieces[j] = _PLACEHOLDER
                        copies.append(copy or "⁇")  # nothing to copy: the unknown mark
                text = tgt_sp.decode_pieces(pieces).split(_PLACEHOLDER)
                texts.append("".join(t + c for t, c in zip(text, [*copies, ""], strict=True)))
            line_out.append(" ".join(texts))
        out.append(line_out)
    return out


_PLACEHOLDER = "\ue000"  # a private-use character: no vocabulary has it as a piece


def _spellings(sp, text: str, ids: list[int]) -> list[str]:
    """Per source token, the input characters it stands for, as ``text`` spells them (before
    normalization, whitespace stripped); a byte piece stands for the whole character it is a
    byte of. Where a token covers no input character of its own (NFKC made 'ﬃ' 'ff' 'i', '½'
    '1⁄2'), the normalized characters it covers; where ``ids`` are not the line's plain
    encoding, the pieces without their '▁'."""
    placed = _token_chars(sp, text, ids)
    if placed is None:
        return [p.lstrip("\u2581") for p in sp.id_to_piece(ids)]
    normalized, origin, spans = placed
    return [text[origin[first]:origin[last]].strip() or normalized[first:last].lstrip("\u2581")
            for _, first, last in spans]
