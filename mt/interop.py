"""The ``mt-export`` and ``mt-import`` command lines: models to and from other toolkits.

- ``mt-export -m MODEL --format hf --out DIR``: a Hugging Face Marian directory (``mt.export``).
- ``mt-export -m MODEL --format ctranslate2 --out DIR [--quantization int8]``: a CTranslate2
  model with the SentencePiece model(s) beside it (``mt.export``).
- ``mt-import --from hf DIR --out FILE [--tgt-lang LANG]``: a Hugging Face Marian directory,
  such as an OPUS-MT download, as an mt checkpoint that ``translate`` and ``mt-eval`` take
  (``mt.import_hf``), with its languages (tokenizer_config.json's, or the options') recorded.

The conversions are exact: the other toolkit computes the same logits and, with the same search
settings, the same outputs (tests/test_interop.py; docs/interop.md says where the searches
differ). They need the ``export`` extra (transformers, safetensors, ctranslate2, protobuf).
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import tempfile
from pathlib import Path

from mt import add_version_flag

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ CLIs

def export_main(argv: list[str] | None = None) -> None:
    """``mt-export -m MODEL --format hf|ctranslate2 --out DIR [--quantization int8]``."""
    from mt.interrupts import terminate_as_interrupt
    from mt.textio import blank_name_mistake, file_in_the_way

    p = argparse.ArgumentParser(prog="mt-export", description=(
        "Export an mt model to a Hugging Face Marian directory or a CTranslate2 model."))
    add_version_flag(p)
    p.add_argument("-m", "--model", required=True, help="checkpoint file or run directory")
    p.add_argument("--format", required=True, choices=["hf", "ctranslate2"])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quantization", default=None,
                   help="ctranslate2 only: int8, int8_float32, int8_float16, float16, ...")
    p.add_argument("--shortlist", metavar="FILE", default=None,
                   help="ctranslate2 only: a shortlist made by mt-shortlist for this model, "
                        "written as the model's vocabulary map (CTranslate2's use_vmap)")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it exists (its whole content is deleted)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    for option in ("quantization", "shortlist"):
        if getattr(args, option) and args.format != "ctranslate2":
            p.error(f"--{option} applies to --format ctranslate2 only")
    if blank := blank_name_mistake("--out", args.out, "directory"):  # else "mt-export:  exists"
        p.error(blank)
    if blocker := file_in_the_way(args.out):  # else "cannot write ... (File exists)"
        sys.exit(f"mt-export: --out {args.out}: {blocker} is a file, not a directory")
    # Resolved: '.' and '..' become the directories they name, and a symlink keeps pointing at
    # the directory that is replaced (as translate -o keeps a symlink).
    out_dir = Path(args.out).resolve()
    taken = out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir()))
    if taken and not args.force:
        sys.exit(f"mt-export: {args.out} exists; choose another --out or pass --force to replace "
                 "it")
    cwd = Path.cwd().resolve()
    if out_dir == cwd or out_dir in cwd.parents:
        sys.exit(f"mt-export: --out {args.out} holds the working directory; give the export a "
                 "directory of its own")
    if taken and _holds_model(out_dir, args.model):
        sys.exit(f"mt-export: --out {args.out} holds the model {args.model}; --force would "
                 "delete it")
    if taken and args.shortlist and Path(args.shortlist).resolve().is_relative_to(out_dir):
        sys.exit(f"mt-export: --out {args.out} holds the shortlist {args.shortlist}; --force "
                 "would delete it")
    try:
        with terminate_as_interrupt():
            _export(args, out_dir)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the temporary folder is gone
        print(f"mt-export: interrupted; {args.out} was not changed", file=sys.stderr)
        raise SystemExit(128 + getattr(err, "signal", signal.SIGINT)) from None
    except ImportError as err:
        sys.exit(f"mt-export: {err}; install the export extra: pip install 'mt[export]'")
    except _CannotWrite as err:  # a full disk, an unwritable parent: the old export is kept
        sys.exit(f"mt-export: cannot write {args.out} ({err}); nothing there was changed")
    except (ValueError, FileNotFoundError) as err:  # a missing model, a bad --quantization
        sys.exit(f"mt-export: {err}")
    log.info("wrote %s (%s)", args.out, args.format)


def _export(args: argparse.Namespace, out_dir: Path) -> None:
    """The export itself. Written beside ``out_dir`` and moved there whole: a failure (a bad
    --quantization, a full disk, Ctrl-C, SIGTERM) leaves the previous export as it was and no
    half directory."""
    from mt.checkpoint import load_model, umask
    from mt.export import check_marian, export_ctranslate2, export_hf
    from mt.textio import first_line

    model, tokenizer, ckpt = load_model(args.model)
    shortlist = None
    if args.format == "hf":
        check_marian(model.cfg)  # before any work
    elif args.shortlist:
        from mt.shortlist import Shortlist

        shortlist = Shortlist.load(args.shortlist, tokenizer)
    # Everything read, from here on a failure is one of writing, said of --out: the temporary
    # folder (or its missing parent, under /proc say) is a name the user never gave.
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as tmp:
            new = Path(tmp) / "export"
            if args.format == "hf":
                export_hf(model, tokenizer, new,
                          languages=(ckpt.get("config") or {}).get("data"))
            else:
                export_ctranslate2(model, tokenizer, new, args.quantization, shortlist)
            # transformers writes model.safetensors 0600; an export is for others to read
            mode = 0o666 & ~umask()
            for f in new.rglob("*"):
                if f.is_file():
                    f.chmod(mode)
            _swap(new, out_dir, Path(tmp) / "old")
    except OSError as err:
        raise _CannotWrite(err.strerror or first_line(err)) from err
    except Exception as err:
        if type(err).__name__ == "SafetensorError":  # safetensors' own kind for a full disk
            raise _CannotWrite(first_line(err)) from err
        raise


class _CannotWrite(Exception):
    """Writing the export failed; the message is why (``No space left on device``)."""


def _holds_model(out_dir: Path, model: str) -> bool:
    """Whether replacing ``out_dir`` (resolved) would delete the model being exported.

    ``-m`` names a run directory or a file; the checkpoint it resolves to is what is lost, and
    it may sit in ``out_dir`` when ``-m`` does not (``-m run --out run/checkpoints``), or be
    ``out_dir`` itself. Both are compared after symlinks are followed, so a link to or from the
    model counts.
    """
    from mt.checkpoint import resolve

    paths = [Path(model).resolve()]
    try:
        paths.append(resolve(model).resolve())
    except FileNotFoundError:
        pass  # no model: loading it says so, before anything is replaced
    return any(p.is_relative_to(out_dir) for p in paths)


def _swap(new: Path, out_dir: Path, aside: Path) -> None:
    """Puts ``new`` at ``out_dir``, the old one moved ``aside`` first (deleted with it later).

    Ctrl-C and SIGTERM wait until both renames are done (they are blocked in between), so an
    interrupt cannot leave the old export aside, where its temporary directory would delete it.
    """
    block = {signal.SIGINT, signal.SIGTERM}
    masked = hasattr(signal, "pthread_sigmask")
    if masked:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, block)
    try:
        if out_dir.exists():  # resolved by the caller: a directory or a file, not a link
            out_dir.rename(aside)
        try:
            new.rename(out_dir)
        except OSError:
            if aside.exists():
                aside.rename(out_dir)
            raise
    finally:
        if masked:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def import_main(argv: list[str] | None = None) -> None:
    """``mt-import --from hf DIR --out FILE``: a Marian (OPUS-MT) directory -> an mt checkpoint."""
    from mt.checkpoint import model_state, save_atomic
    from mt.import_hf import import_hf
    from mt.interrupts import terminate_as_interrupt
    from mt.textio import output_mistake

    p = argparse.ArgumentParser(prog="mt-import", description=(
        "Import a Hugging Face Marian model directory (e.g. OPUS-MT) as an mt checkpoint."))
    add_version_flag(p)
    p.add_argument("--from", dest="source", required=True, choices=["hf"],
                   help="the format of DIR")
    p.add_argument("dir", help="model directory (config.json, weights, *.spm, vocab.json)")
    p.add_argument("--out", required=True, help="checkpoint file to write (.pt)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    for side in ("src", "tgt"):
        p.add_argument(f"--{side}-lang", metavar="LANG", type=_language,
                       help=f"the model's {'source' if side == 'src' else 'target'} language "
                            f"(default: tokenizer_config.json's "
                            f"{'source' if side == 'src' else 'target'}_lang)" + (
                                "; BLEU is tokenized for it (zh, ja, ko have tokenizers of "
                                "their own)" if side == "tgt" else ""))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    # As mt-export: an existing file is replaced only when asked (--out DIR/pytorch_model.bin
    # would otherwise overwrite the very weights being imported).
    from mt.import_hf import READS

    if not Path(args.dir).is_dir():  # a hub name often: said so, not a missing config.json
        hub_name = re.fullmatch(r"[\w.-]+/[\w.-]+", args.dir) is not None
        sys.exit(f"mt-import: {args.dir}: " + (
            "is a file, not a Marian model folder" if Path(args.dir).exists() else
            "no such folder; mt-import reads a Marian model folder on disk" + (
                f" (a hub name: download it first, e.g. hf download {args.dir} --local-dir DIR)"
                if hub_name else "")))
    reads = [Path(args.dir) / name for name in READS]
    if mistake := output_mistake("--out", args.out, args.force, reads,
                                 read_as=f"a file of {args.dir} that it imports",
                                 what="checkpoint file"):
        sys.exit(f"mt-import: {mistake}")
    try:
        with terminate_as_interrupt():  # save_atomic removes its temporary file on an interrupt
            languages = _languages(args)
            model, tokenizer = import_hf(args.dir)
            config: dict = {"imported_from": str(Path(args.dir).resolve())}
            if languages:
                config["data"] = languages
            try:
                save_atomic(model_state(model, tokenizer, config), args.out)
            except OSError as err:  # a folder that cannot be made or written, a full disk
                sys.exit(f"mt-import: cannot write {args.out}: {err.strerror or err}")
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM
        print(f"mt-import: interrupted; {args.out} was not written", file=sys.stderr)
        raise SystemExit(128 + getattr(err, "signal", signal.SIGINT)) from None
    except ImportError as err:
        sys.exit(f"mt-import: {err}; install the export extra: pip install 'mt[export]'")
    except (ValueError, FileNotFoundError, KeyError) as err:
        sys.exit(f"mt-import: {err}")
    n = sum(p.numel() for p in model.parameters())
    log.info("wrote %s (%.1fM parameters, vocabulary %d/%d)", args.out, n / 1e6,
             model.cfg.src_vocab_size, model.cfg.tgt_vocab_size)


def _language(value: str) -> str:
    """A --src-lang / --tgt-lang value: a language code, one word (``zh``, ``zh-Hant``)."""
    if not re.fullmatch(r"\S+", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a language code (such as 'zh')")
    return value


def _languages(args: argparse.Namespace) -> dict[str, str]:
    """``data.src_lang`` / ``data.tgt_lang`` of the imported checkpoint: the command line's,
    else tokenizer_config.json's. Without a target language, BLEU (the evaluation scripts'; an
    mt-eval --test without --langpair) is tokenized with 13a, which keeps a Chinese or Japanese
    line as one token: said here, where it can still be given."""
    from mt.import_hf import marian_languages

    given = {k: v for k in ("src_lang", "tgt_lang") if (v := getattr(args, k))}
    wanted = tuple(k for k in ("src_lang", "tgt_lang") if k not in given)
    languages = {**marian_languages(args.dir, wanted), **given}
    if "tgt_lang" in languages:
        log.info("languages: %s", ", ".join(f"data.{k}={v}" for k, v in languages.items()))
    else:
        log.warning("%s names no target language (tokenizer_config.json's target_lang): BLEU "
                    "of this model is tokenized with 13a; pass --tgt-lang (e.g. zh) for a "
                    "Chinese, Japanese or Korean target", args.dir)
    return languages


if __name__ == "__main__":  # python -m mt.interop exited 0 without a word: it holds two commands
    sys.exit("mt.interop holds two commands: run mt-export or mt-import (or python -c 'from "
             "mt.interop import export_main; export_main()' ...)")
