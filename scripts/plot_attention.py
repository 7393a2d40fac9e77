"""Draws one sentence pair's cross-attention as a labelled heatmap (PNG).

The model translates the sentence (beam search, or ``--target`` forces a given translation), then
one decoder layer's cross-attention, heads averaged, is computed teacher-forced on that translation
(``mt.scoring.cross_attention``, the weights ``translate --alignment`` links by). Rows are target
pieces (EOS included), columns source pieces; outlined is what ``--alignment`` links each target
piece to: the arg-max of its row over the source's word pieces (not EOS, not a piece or the
bytes of whitespace alone; none for the target's EOS). Needs the ``plot`` extra (matplotlib).

    python scripts/plot_attention.py -m runs/demo "the red dog runs" -o attention.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # mt without being installed

from mt.alignment import layer_mistake, unlinkable  # noqa: E402
from mt.checkpoint import load_model  # noqa: E402
from mt.config import EOS_ID, positive_int  # noqa: E402
from mt.lines import encode_prefixes  # noqa: E402
from mt.scoring import cross_attention  # noqa: E402
from mt.search import beam_search  # noqa: E402
from mt.textio import utf8_stdout  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", required=True, help="run directory or checkpoint")
    p.add_argument("sentence", help="the source sentence")
    p.add_argument("--target", default=None, help="a translation to force (default: beam search)")
    p.add_argument("--layer", type=int, default=None,
                   help="decoder layer (Python index; default: penultimate)")
    p.add_argument("--beam", type=positive_int, default=5)
    p.add_argument("-o", "--output", default="attention.png")
    args = p.parse_args(argv)
    out = Path(args.output)
    if not out.parent.is_dir():
        p.error(f"-o {args.output}: no such directory {out.parent}")
    if out.is_dir():
        p.error(f"-o {args.output} is a directory; name the image file to write")
    if out.suffix.lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
        p.error(f"-o {args.output}: name the image with .png, .pdf, .svg or .jpg (matplotlib "
                "writes the format the extension says)")
    if not args.sentence.strip():
        p.error("the sentence is empty: translate gives an empty line for it, with nothing to "
                "attend to")

    try:
        import matplotlib
    except ImportError:
        p.exit(1, "plot_attention.py: needs matplotlib, the plot extra: "
                  "pip install -e '.[plot]'\n")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        model, tok, _ = load_model(args.model)
    except (OSError, ValueError) as err:  # a missing or corrupt model: the message names it
        p.exit(1, f"plot_attention.py: {err}\n")
    n = len(model.decoder_layers)
    mistake = layer_mistake(model, args.layer, "--layer")
    if mistake:
        p.error(mistake)
    layer = args.layer if args.layer is not None else (-2 if n > 1 else -1)

    def too_long(pieces: int) -> None:  # translate cuts such a line in pieces; a plot cannot
        if pieces > model.cfg.max_positions:
            p.error(f"{pieces} pieces, beyond the model's maximum of {model.cfg.max_positions}: "
                    "plot a shorter sentence")

    src_ids = tok.encode_src([args.sentence])[0]
    too_long(len(src_ids))
    src = torch.tensor([src_ids])
    if args.target is None:
        tgt_ids = beam_search(model, src, beam_size=args.beam)[0][0].tokens
    else:
        try:  # one the target vocabulary cannot spell: refused as translate --prefix-file does
            tgt_ids = encode_prefixes(tok, [args.target], "--target")[0]
        except ValueError as err:
            p.error(str(err))
    too_long(len(tgt_ids) + 1)
    weights = cross_attention(model, src, torch.tensor([tgt_ids + [EOS_ID]]), layer)[0]  # (T, S)

    src_labels = [tok.src.id_to_piece(t) for t in src_ids]
    tgt_labels = [tok.tgt.id_to_piece(t) for t in tgt_ids + [EOS_ID]]
    fig, ax = plt.subplots(figsize=(1 + 0.45 * len(src_labels), 1 + 0.4 * len(tgt_labels)))
    image = ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(src_labels)), src_labels, rotation=60, ha="right")
    ax.set_yticks(range(len(tgt_labels)), tgt_labels)
    linked = weights.masked_fill(unlinkable(tok.src, src_ids), -1.0)[:-1]  # as --alignment
    for row, col in enumerate(linked.argmax(dim=-1).tolist()):
        ax.add_patch(plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red"))
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.set_title(f"cross-attention, decoder layer {layer % n}, "
                 "heads averaged")
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"translation: {tok.decode_tgt([tgt_ids])[0]}\nwrote {args.output}",
          file=utf8_stdout())  # as translate prints it, whatever the locale


if __name__ == "__main__":
    main()
