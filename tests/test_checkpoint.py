"""Checkpoints: atomic writes, finding the model a user means, save -> load, averaging."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, REPO

from mt import checkpoint
from mt.average import average
from mt.config import ModelConfig
from mt.model import build_model
from mt.tokenizer import Tokenizer


def tiny_model(seed: int):
    torch.manual_seed(seed)
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, d_model=16, ffn_dim=32, heads=2,
                      src_vocab_size=200, tgt_vocab_size=200, max_positions=64)
    return build_model(cfg).eval()


@pytest.fixture()
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


def test_save_then_load_gives_identical_logits(tmp_path, tokenizer):
    model = tiny_model(0)
    path = tmp_path / "m.pt"
    checkpoint.save_atomic(checkpoint.model_state(model, tokenizer, {"note": 1}), path)
    loaded, tok, ckpt = checkpoint.load_model(path)
    src = torch.tensor([[5, 6, 7, 3], [8, 9, 3, 0]])
    tgt = torch.tensor([[2, 10, 11], [2, 12, 0]])
    assert torch.equal(model(src, tgt), loaded(src, tgt))
    assert tok.src_proto == tokenizer.src_proto
    assert ckpt["config"] == {"note": 1}


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save_atomic({"format": checkpoint.FORMAT, "v": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full, say")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_atomic({"v": Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["v"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_a_checkpoint_gets_a_new_files_permissions_and_a_directory_is_refused(tmp_path):
    """mkstemp makes 0600 files: the other users of a shared cluster could not read a run's
    checkpoints. They get what open() would give (0666 less the umask)."""
    import os

    old = os.umask(0o022)
    try:
        checkpoint.save_atomic({"v": 1}, tmp_path / "a.pt")
        os.umask(0o027)
        checkpoint.save_atomic({"v": 1}, tmp_path / "b.pt")
    finally:
        os.umask(old)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.pt").stat().st_mode & 0o777 == 0o640
    with pytest.raises(IsADirectoryError, match="is a directory; name the checkpoint file"):
        checkpoint.save_atomic({"v": 1}, tmp_path)


def test_run_directory_resolves_to_best_then_last(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "last.pt").write_bytes(b"x")
    assert checkpoint.resolve(tmp_path / "run") == ckpts / "last.pt"
    (ckpts / "best.pt").write_bytes(b"x")
    assert checkpoint.resolve(tmp_path / "run") == ckpts / "best.pt"
    with pytest.raises(FileNotFoundError, match="no such model"):
        checkpoint.resolve(tmp_path / "missing")


def test_corrupt_or_foreign_file_gives_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="bad.pt: not a readable mt checkpoint") as err:
        checkpoint.load(bad)
    assert "\n" not in str(err.value)
    (tmp_path / "empty.pt").write_bytes(b"")  # torch's words were about mmap and zip files
    for mmap in (False, True):
        with pytest.raises(ValueError, match=r"empty\.pt: an empty file, not an mt checkpoint"):
            checkpoint.load(tmp_path / "empty.pt", mmap=mmap)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ValueError, match="not an mt checkpoint"):
        checkpoint.load(foreign)


def test_average_is_the_mean_of_the_weights(tmp_path, tokenizer):
    paths = []
    for seed in range(3):
        paths.append(tmp_path / f"step_{seed + 1}.pt")
        checkpoint.save_atomic(checkpoint.model_state(tiny_model(seed), tokenizer, None), paths[-1])
    avg = average(paths)
    states = [torch.load(p, weights_only=True)["model"] for p in paths]
    for name, value in avg["model"].items():
        torch.testing.assert_close(value, sum(s[name] for s in states) / 3)


def test_a_tied_model_is_stored_once_and_its_average_too(tmp_path, tokenizer):
    """A tied embedding is three names in the state dict; copied name by name it was stored three
    times in every checkpoint and in mt-average's output (130 MB more for transformer_base at
    32k pieces). The files keep one tensor, and the model loaded from them is tied."""
    paths = []
    for seed in range(2):
        paths.append(tmp_path / f"step_{seed + 1}.pt")
        checkpoint.save_atomic(checkpoint.model_state(tiny_model(seed), tokenizer, None), paths[-1])
    untied = tiny_model(0)
    untied.output_proj.weight = torch.nn.Parameter(untied.output_proj.weight.detach().clone())
    untied.tgt_embed = torch.nn.Embedding(200, 16)
    checkpoint.save_atomic(checkpoint.model_state(untied, tokenizer, None), tmp_path / "three.pt")
    checkpoint.save_atomic(average(paths), tmp_path / "avg.pt")
    one, three = paths[0].stat().st_size, (tmp_path / "three.pt").stat().st_size
    embedding = 200 * 16 * 4
    assert three - one > 1.9 * embedding  # the untied copies: what the tie saves
    assert abs((tmp_path / "avg.pt").stat().st_size - one) < embedding / 2
    for path in (paths[0], tmp_path / "avg.pt"):
        state = torch.load(path, weights_only=True)["model"]
        ptrs = {state[k].data_ptr() for k in ("src_embed.weight", "tgt_embed.weight",
                                              "output_proj.weight")}
        assert len(ptrs) == 1, path
        model, _, _ = checkpoint.load_model(path)
        assert model.output_proj.weight is model.src_embed.weight is model.tgt_embed.weight
        with torch.no_grad():  # training from it moves all three as one
            model.output_proj.weight.add_(1.0)
        assert torch.equal(model.src_embed.weight, model.output_proj.weight)


def test_average_refuses_checkpoints_of_two_runs_unless_asked(tmp_path, tokenizer, capsys):
    """Two runs of one config save step_N.pt files alike: mt-average of one's and the other's
    wrote a broken model without a word. Their run ids tell them apart; --across-runs (a model
    soup) averages them all the same; files saved before runs had an id are averaged as before,
    with a warning."""
    from mt.average import main

    paths = {}
    for name, seed, run in (("a1", 0, "A"), ("a2", 1, "A"), ("b1", 2, "B"), ("old", 3, None)):
        paths[name] = tmp_path / f"{name}.pt"
        checkpoint.save_atomic(checkpoint.model_state(tiny_model(seed), tokenizer, None, run),
                               paths[name])
    assert average([paths["a1"], paths["a2"]])["run_id"] == "A"  # one run's, as its steps
    with pytest.raises(ValueError, match=r"b1\.pt: from another training run than .*a1\.pt;"):
        average([paths["a1"], paths["a2"], paths["b1"]])
    assert "run_id" not in average([paths["a1"], paths["b1"]], across_runs=True)
    said = []
    assert "run_id" not in average([paths["a1"], paths["old"]], warn=said.append)
    assert len(said) == 1 and "old.pt: no run id" in said[0]
    # a soup has no run id either: the warning named only old files and imported models
    checkpoint.save_atomic(average([paths["a1"], paths["b1"]], across_runs=True),
                           tmp_path / "ab.pt")
    said.clear()
    average([paths["a2"], tmp_path / "ab.pt"], warn=said.append)
    assert len(said) == 1 and "ab.pt: no run id" in said[0], said
    assert "an average of several runs' files" in said[0], said
    with pytest.raises(SystemExit, match=r"^mt-average: .*b1\.pt: from another training run "
                                         r"than .*a1\.pt; .*--across-runs"):
        main([str(paths["a1"]), str(paths["b1"]), "-o", str(tmp_path / "soup.pt")])
    main([str(paths["a1"]), str(paths["b1"]), str(paths["old"]), "-o", str(tmp_path / "soup.pt"),
          "--across-runs"])
    # --across-runs asks for files of several runs: that one has no run id checks nothing
    assert "no run id" not in capsys.readouterr().err
    assert len(checkpoint.load(tmp_path / "soup.pt")["averaged_from"]) == 3


def test_an_average_keeps_the_widest_type_whatever_file_comes_first(tmp_path, tokenizer):
    """A checkpoint cast to bfloat16 (to store it smaller) named first made the whole average
    bfloat16: the float32 files' weights rounded to 8 bits of mantissa, and the order of the
    files decided it."""
    full, half = tmp_path / "full.pt", tmp_path / "half.pt"
    checkpoint.save_atomic(checkpoint.model_state(tiny_model(0), tokenizer, None), full)
    state = checkpoint.model_state(tiny_model(1), tokenizer, None)
    state["model"] = {k: v.to(torch.bfloat16) for k, v in state["model"].items()}
    checkpoint.save_atomic(state, half)
    expected = average([full, half])["model"]
    assert {v.dtype for v in expected.values()} == {torch.float32}
    for name, value in average([half, full])["model"].items():
        assert torch.equal(value, expected[name]), name


def test_average_refuses_the_same_weights_twice_and_an_average_beside_its_sources(tmp_path,
                                                                                   tokenizer):
    """best.pt is a copy of a step file, and averaged.pt an average of step files: given among
    them (``mt-average checkpoints/*.pt``), a checkpoint weighed twice, without a word."""
    paths = []
    for seed in range(2):
        paths.append(tmp_path / f"step_{seed + 1}.pt")
        checkpoint.save_atomic(checkpoint.model_state(tiny_model(seed), tokenizer, None), paths[-1])
    (tmp_path / "best.pt").write_bytes(paths[1].read_bytes())
    with pytest.raises(ValueError, match=r"best\.pt: the same weights as .*step_2\.pt"):
        average([*paths, tmp_path / "best.pt"])
    # a run's own step files with the same weights (optim.lr=0): its average at the end stands
    assert average([paths[1], tmp_path / "best.pt"], refuse_copies=False)
    checkpoint.save_atomic(average(paths), tmp_path / "averaged.pt")
    # by the weights, not by the names it was given: moved, copied, or named from elsewhere
    moved = tmp_path / "moved"
    moved.mkdir()
    (tmp_path / "averaged.pt").rename(moved / "avg.pt")
    (moved / "one.pt").write_bytes(paths[0].read_bytes())
    with pytest.raises(ValueError, match=r"avg\.pt: an average of .*one\.pt among others"):
        average([moved / "avg.pt", moved / "one.pt"])
    with pytest.raises(ValueError, match=r"avg\.pt: an average of .*step_1\.pt, .*step_2"):
        average([*paths, moved / "avg.pt"])
    checkpoint.save_atomic(checkpoint.model_state(tiny_model(5), tokenizer, None),
                           tmp_path / "other.pt")
    mixed = average([moved / "avg.pt", tmp_path / "other.pt"])  # allowed
    # an average of step files with equal weights (lr 0) is not "made of" itself
    checkpoint.save_atomic(average([paths[1], tmp_path / "best.pt"],
                                              refuse_copies=False), tmp_path / "flat.pt")
    assert average([tmp_path / "flat.pt", tmp_path / "other.pt"])
    assert mixed["averaged_from"] == [str(moved / "avg.pt"), str(tmp_path / "other.pt")]


def test_average_refuses_other_shapes_and_tokenizers_but_not_other_dropouts(
        tmp_path, tokenizer, corpus_dir):
    from mt.config import TokenizerConfig
    from mt.data import read_lines
    from mt.tokenizer import train_tokenizer

    first = tmp_path / "a.pt"
    checkpoint.save_atomic(checkpoint.model_state(tiny_model(0), tokenizer, None), first)
    # the same shape, but the rows are pieces of another vocabulary of the same size
    other_tok = train_tokenizer(read_lines(corpus_dir / "train.en")[:200],
                                read_lines(corpus_dir / "train.zz")[:200],
                                TokenizerConfig(vocab_size=200), seed=2)
    assert other_tok.src_vocab_size == tokenizer.src_vocab_size
    assert other_tok.to_state() != tokenizer.to_state()
    checkpoint.save_atomic(checkpoint.model_state(tiny_model(1), other_tok, None),
                           tmp_path / "tok.pt")
    with pytest.raises(ValueError, match=r"tok.pt: a different tokenizer from .*a.pt") as err:
        average([first, tmp_path / "tok.pt"])
    assert "\n" not in str(err.value)

    wider = tiny_model(1)
    wider.cfg.heads, wider.cfg.dropout = 4, 0.3
    checkpoint.save_atomic(checkpoint.model_state(wider, tokenizer, None), tmp_path / "heads.pt")
    with pytest.raises(ValueError, match=r"heads.pt: .*a.pt \(heads=4, not 2\); cannot") as err:
        average([first, tmp_path / "heads.pt"])
    assert "dropout" not in str(err.value)

    # fine-tuned with other dropouts: the same weights' meaning, so averaged; the first's kept
    tuned = tiny_model(2)
    tuned.cfg.dropout, tuned.cfg.attention_dropout, tuned.cfg.activation_dropout = 0.3, 0.1, 0.2
    checkpoint.save_atomic(checkpoint.model_state(tuned, tokenizer, None), tmp_path / "drop.pt")
    avg = average([first, tmp_path / "drop.pt"])
    assert avg["model_config"] == vars(tiny_model(0).cfg)
    name = next(iter(avg["model"]))
    torch.testing.assert_close(avg["model"][name], (tiny_model(0).state_dict()[name]
                                                    + tuned.state_dict()[name]) / 2)


def test_average_refuses_a_checkpoint_with_weights_that_are_not_finite(tmp_path, tokenizer):
    """A damaged checkpoint (a NaN in one tensor) was averaged silently: mt-average wrote a model
    whose every average was NaN, and translate then refused that file, not the one at fault."""
    good = tmp_path / "good.pt"
    checkpoint.save_atomic(checkpoint.model_state(tiny_model(0), tokenizer, None), good)
    state = checkpoint.model_state(tiny_model(1), tokenizer, None)
    name = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][name].view(-1)[0] = float("nan")
    checkpoint.save_atomic(state, tmp_path / "nan.pt")
    for paths in ([good, tmp_path / "nan.pt"], [tmp_path / "nan.pt", good]):
        with pytest.raises(ValueError, match=r"nan\.pt: its weights hold 1 values that are not "
                                             f"finite .*first in '{re.escape(name)}'"):
            average(paths)


def test_average_refuses_weights_that_differ_from_the_firsts(tmp_path, tokenizer):
    """A checkpoint lacking a tensor was averaged silently, the tensor halved (the tied
    embedding: another model); given first, it was a KeyError traceback."""
    full = tmp_path / "full.pt"
    checkpoint.save_atomic(checkpoint.model_state(tiny_model(0), tokenizer, None), full)
    state = checkpoint.model_state(tiny_model(1), tokenizer, None)
    name = next(iter(state["model"]))
    state["model"][f"{name}_extra"] = state["model"].pop(name)
    checkpoint.save_atomic(state, tmp_path / "odd.pt")
    for paths in ([full, tmp_path / "odd.pt"], [tmp_path / "odd.pt", full]):
        with pytest.raises(ValueError, match=r"\.pt: its weights differ from .*\.pt's at '"
                                             f"{re.escape(name)}(_extra)?' .*cannot average"):
            average(paths)
    state = checkpoint.model_state(tiny_model(1), tokenizer, None)
    state["model"][name] = state["model"][name][:1]
    checkpoint.save_atomic(state, tmp_path / "short.pt")
    with pytest.raises(ValueError, match=f"short.pt: .* at '{re.escape(name)}' .*another shape"):
        average([full, tmp_path / "short.pt"])
    (tmp_path / "link.pt").symlink_to(full)
    with pytest.raises(ValueError, match="link.pt: given twice \\(as .*full.pt too\\)"):
        average([full, tmp_path / "short.pt", tmp_path / "link.pt"])


def test_a_checkpoint_whose_parts_do_not_belong_together_is_one_line(tmp_path, tokenizer,
                                                                     corpus_dir):
    """Every command loads models through load_model: mt-export and mt-average printed
    KeyError tracebacks for a checkpoint without a tokenizer, and a tokenizer of another size
    than the model translated a whole file before failing on a piece id."""
    from mt.config import TokenizerConfig
    from mt.data import read_lines
    from mt.tokenizer import train_tokenizer

    def saved(name: str, change) -> Path:
        state = checkpoint.model_state(tiny_model(0), tokenizer, None)
        change(state)
        checkpoint.save_atomic(state, tmp_path / name)
        return tmp_path / name

    small = train_tokenizer(read_lines(corpus_dir / "train.en")[:200],
                            read_lines(corpus_dir / "train.zz")[:200],
                            TokenizerConfig(vocab_size=100), seed=2)
    cases = [
        (saved("notok.pt", lambda s: s.pop("tokenizer")), "notok.pt: not an mt model checkpoint "
         "\\(it has no 'tokenizer'\\)"),
        (saved("nocfg.pt", lambda s: s.pop("model_config")), "nocfg.pt: not an mt model "
         "checkpoint \\(it has no 'model_config'\\)"),
        (saved("small.pt", lambda s: s.update(tokenizer=small.to_state())),
         "small.pt: its tokenizer has 100/100 source/target pieces, its model 200/200"),
        (saved("badtok.pt", lambda s: s.update(tokenizer={"src": b"not a model"})),
         "badtok.pt: its tokenizer cannot be read"),
        (saved("gone.pt", lambda s: s["model"].pop("output_proj.weight")),
         "gone.pt: its weights do not fit its model config \\(Missing key\\(s\\) in "
         "state_dict: \"output_proj.weight\""),
        # NaN weights: beam search wrote no line at all and exited 0 (every score NaN, no
        # hypothesis ever finished), greedy wrote "⁇" lines, sampling a traceback
        (saved("nan.pt", lambda s: s["model"]["decoder_layers.0.ffn.fc1.bias"][7:9].fill_(
            float("nan"))), "nan.pt: its weights hold 2 values that are not finite \\(NaN or "
         "infinite\\), first in 'decoder_layers.0.ffn.fc1.bias': a damaged or diverged model"),
        (saved("short.pt", lambda s: s["model_config"].update(max_positions=1)),
         "short.pt: its model config cannot be built \\(model.max_positions must be at least "
         "2 \\(a token and EOS\\), got 1\\)"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=f"^{tmp_path}/{message}") as err:
            checkpoint.load_model(path)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="notok.pt: not an mt model checkpoint"):
        average([tmp_path / "notok.pt"])


def test_best_step_checkpoints_ranks_by_the_recorded_metric():
    paths = [Path(f"step_{n}.pt") for n in (10, 20, 30, 40)]
    history = [{"step": 10, "valid_bleu": 5.0, "valid_loss": 3.0},
               {"step": 20, "valid_bleu": 9.0, "valid_loss": 2.5},
               {"step": 30, "valid_bleu": 7.0, "valid_loss": 2.0}]
    assert [p.name for p in checkpoint.best_step_checkpoints(paths, history, "bleu")] == [
        "step_20.pt", "step_30.pt", "step_10.pt"]
    assert checkpoint.best_step_checkpoints(paths, history, "loss")[0].name == "step_30.pt"
    # chrF can disagree with BLEU: ranked by its own scores
    for record, chrf in zip(history, (50.0, 48.0, 51.0), strict=True):
        record["valid_chrf"] = chrf
    assert [p.name for p in checkpoint.best_step_checkpoints(paths, history, "chrf")] == [
        "step_30.pt", "step_10.pt", "step_20.pt"]
    with pytest.raises(ValueError, match="trainer.best_metric='ter': not one of bleu, chrf, loss"):
        checkpoint.best_step_checkpoints(paths, history, "ter")


def test_average_script_writes_a_loadable_model(tmp_path, tokenizer):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for seed in range(3):
        checkpoint.save_atomic(checkpoint.model_state(tiny_model(seed), tokenizer, None),
                               run / "checkpoints" / f"step_{seed + 1}.pt")
    out = tmp_path / "avg.pt"
    # mt-average, and the script of the same name older commands use; the checkpoints folder
    # or the run directory that holds it, as translate -m takes
    for command, folder in (([PYTHON, "-m", "mt.average"], run / "checkpoints"),
                            ([PYTHON, "-m", "mt.average"], run),
                            ([PYTHON, str(REPO / "scripts" / "average_checkpoints.py")], run)):
        out.unlink(missing_ok=True)
        result = subprocess.run([*command, str(folder), "--last", "2", "-o", str(out)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        model, _, ckpt = checkpoint.load_model(out)
        assert [Path(p).name for p in ckpt["averaged_from"]] == ["step_2.pt", "step_3.pt"]


def test_average_script_best_ranks_by_the_runs_best_metric(tmp_path, tokenizer):
    """--best reads trainer.best_metric from last.pt: chrf ranks by chrF, not by BLEU."""
    for seed in range(3):
        checkpoint.save_atomic(checkpoint.model_state(tiny_model(seed), tokenizer, None),
                               tmp_path / f"step_{seed + 1}.pt")
    history = [{"step": 1, "valid_bleu": 9.0, "valid_chrf": 40.0, "valid_loss": 3.0},
               {"step": 2, "valid_bleu": 5.0, "valid_chrf": 45.0, "valid_loss": 2.9},
               {"step": 3, "valid_bleu": 7.0, "valid_chrf": 44.0, "valid_loss": 2.8}]
    checkpoint.save_atomic({"format": checkpoint.FORMAT, "config": {"trainer": {
        "best_metric": "chrf"}}, "trainer": {"history": history}}, tmp_path / "last.pt")
    out = tmp_path / "avg.pt"
    result = subprocess.run([PYTHON, "-m", "mt.average", str(tmp_path), "--best", "2", "-o",
                             str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ranked by valid chrf (trainer.best_metric): step_2.pt 45.00, step_3.pt 44.00" \
        in result.stderr
    assert [Path(p).name for p in checkpoint.load(out)["averaged_from"]] == ["step_2.pt",
                                                                            "step_3.pt"]


def test_average_script_errors_are_one_line_and_fewer_than_asked_is_said(tmp_path, tokenizer,
                                                                         capsys):
    """In this process (mt.average.main): an exception other than SystemExit, which a traceback
    would show, fails the test as it stands; the console script itself runs in
    test_average_script_writes_a_loadable_model."""
    from mt.average import main

    for seed in range(3):
        checkpoint.save_atomic(checkpoint.model_state(tiny_model(seed), tokenizer, None),
                               tmp_path / f"step_{seed + 1}.pt")

    def run(*args: str, inputs: tuple[str, ...] = (str(tmp_path),),
            out: Path | str = tmp_path / "avg.pt") -> tuple[int, str]:
        """(exit status, stderr) as the console script would give them."""
        try:
            main([*inputs, *args, "-o", str(out)])
            code, said = 0, ""
        except SystemExit as err:  # a message: status 1, printed on stderr; argparse: 2
            code, said = (1, f"{err.code}\n") if isinstance(err.code, str) else (err.code, "")
        return code, capsys.readouterr().err + said

    for args, code, message in ((["--best", "2"], 1, "no last.pt"),  # a folder without last.pt
                                (["--last", "-1"], 2, "--last: .*at least 1"),
                                (["--best", "0"], 2, "--best: .*at least 1")):
        status, stderr = run(*args)
        assert status == code, stderr
        assert re.search(message, stderr.strip().splitlines()[-1]), stderr
    assert not (tmp_path / "avg.pt").exists()
    status, stderr = run("--last", "99")
    assert status == 0, stderr
    assert "--last 99: " in stderr and "averaging 3" in stderr
    assert len(checkpoint.load(tmp_path / "avg.pt")["averaged_from"]) == 3
    # -o is replaced only with --force, and never when it is an input or a run's last.pt (a
    # review replaced last.pt with an average, and the run could not resume)
    status, stderr = run("--last", "2")
    assert status == 1 and "avg.pt exists; choose another -o or pass --force" in stderr
    assert len(checkpoint.load(tmp_path / "avg.pt")["averaged_from"]) == 3
    assert run("--last", "2", "--force")[0] == 0
    assert len(checkpoint.load(tmp_path / "avg.pt")["averaged_from"]) == 2
    state = {**checkpoint.load(tmp_path / "step_1.pt"), "trainer": {"step": 1}}
    checkpoint.save_atomic(state, tmp_path / "last.pt")
    for out, said in (("last.pt", "holds a run's training state"),
                      ("step_3.pt", "is one of the checkpoints averaged")):
        before = (tmp_path / out).read_bytes()
        status, stderr = run("--last", "2", "--force", out=tmp_path / out)
        assert status == 1 and said in stderr, stderr
        assert (tmp_path / out).read_bytes() == before
    # named files are averaged as given: --last would read as a choice among them
    files = (str(tmp_path / "step_1.pt"), str(tmp_path / "step_2.pt"))
    status, stderr = run("--last", "1", inputs=files, out=tmp_path / "two.pt")
    assert status == 1 and "pick from a checkpoints folder" in stderr
    assert not (tmp_path / "two.pt").exists()
    for inputs, out, said in ((files, tmp_path, "is a directory"),
                              (files, f"{tmp_path / 'new'}/", "is a directory"),  # was a file
                              ((*files, str(tmp_path)), tmp_path / "x.pt", "is a folder")):
        status, stderr = run(inputs=inputs, out=out)
        assert status == 1 and said in stderr.strip().splitlines()[-1], stderr
    assert not (tmp_path / "new").exists() and not (tmp_path / "x.pt").exists()


def test_a_ctrl_c_inside_torch_save_does_not_abort_the_process(tmp_path):
    """A Ctrl-C at the start of torch.save's last step leaves its C++ zip writer unfinished;
    freed at exit, the writer writes the zip's end to its file. Given a Python file (closed by
    then), that aborted the whole process (SIGABRT, seen once in 60 interrupted runs); written
    by name, the file is the writer's own, and the interrupted write leaves nothing."""
    script = (
        "import sys, torch, torch.serialization as s\n"
        "from mt.checkpoint import save_atomic\n"
        "def interrupted(self, *args):\n"
        "    raise KeyboardInterrupt\n"
        "s._open_zipfile_writer_file.__exit__ = interrupted\n"
        "s._open_zipfile_writer_buffer.__exit__ = interrupted\n"
        "try:\n"
        f"    save_atomic({{'w': torch.zeros(3)}}, {str(tmp_path / 'last.pt')!r})\n"
        "except KeyboardInterrupt as err:\n"
        "    kept = err  # its traceback keeps the writer alive until the interpreter exits\n"
        "print('done')\n")
    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_save_atomic_refuses_a_device_and_names_the_file_of_a_failed_write(tmp_path):
    """As root, --force -o /dev/null made the device a regular file (a rename over it); a full
    disk inside torch.save was a RuntimeError naming no file, which no command caught."""
    import stat

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileExistsError, match="is not a regular file"):
        checkpoint.save_atomic({"a": 1}, fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    code = ("import resource, torch\nfrom mt.checkpoint import save_atomic\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
            "try:\n    save_atomic({'w': torch.zeros(1_000_000)}, 'x.pt')\n"
            "except OSError as err:\n    print(err.filename, err.strerror)\n")
    out = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.stdout.startswith("x.pt write failed, is the disk full?"), out.stderr[-500:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # no part-file left
    # a folder where no file can be made (/proc): named as the file asked for, not the temporary
    with pytest.raises(OSError) as err:
        checkpoint.save_atomic({"a": 1}, "/proc/x.pt")
    assert err.value.filename == "/proc/x.pt"


def test_running_out_of_memory_while_loading_is_not_called_a_bad_checkpoint(tmp_path,
                                                                            monkeypatch):
    """Under a memory limit a good best.pt was reported "not a readable mt checkpoint
    (RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0)": the cause was cut off."""
    path = tmp_path / "c.pt"
    checkpoint.save_atomic({"format": checkpoint.FORMAT, "v": 1}, path)

    def load(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 104857600 bytes.")

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(ValueError, match=f"^{path}: out of memory while loading it$"):
        checkpoint.load(path)


def test_a_model_path_that_is_no_regular_file_is_said_so(tmp_path):
    """``-m /dev/null`` said "no such model file or run directory" of a path that exists."""
    with pytest.raises(FileNotFoundError, match="^/dev/null: not a regular file; give a "
                                                "checkpoint file or a run directory$"):
        checkpoint.resolve("/dev/null")
    with pytest.raises(FileNotFoundError, match="no such model file or run directory$"):
        checkpoint.resolve(tmp_path / "gone.pt")
