"""End to end through the console scripts: mt-train -> translate -> mt-eval, as a user runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, cli_env, tiny_train_args


def script(name: str) -> str:
    path = Path(PYTHON).parent / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"console script {name} is not installed (pip install -e .)")
        return found
    return str(path)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus_dir, tokenizer_dir) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    run_dir = tmp / "run"
    cmd = [script("mt-train"), *tiny_train_args(corpus_dir, tokenizer_dir),
           f"hydra.run.dir={run_dir}", "trainer.max_steps=30", "trainer.validate_every=15",
           "trainer.keep_last=2", "trainer.average_last=2"]
    result = subprocess.run(cmd, env=cli_env(tmp), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # stdout carries results only: the test score, the next command, the run directory
    assert "test BLEU = " in result.stdout
    assert f"translate -m {run_dir}" in result.stdout
    assert "parameters" in result.stderr and "d_model: 32" in result.stderr  # logged at start
    return run_dir


def test_train_writes_a_complete_run_directory(trained_run):
    ckpts = trained_run / "checkpoints"
    for name in ("last.pt", "best.pt", "averaged.pt", "step_15.pt", "step_30.pt"):
        assert (ckpts / name).exists(), name
    assert not list(ckpts.glob("*.tmp"))  # atomic writes leave no temporary files
    records = [json.loads(x) for x in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "valid_bleu" in r] == [15, 30]
    assert json.loads((trained_run / "test.json").read_text())["sentences"] == 30


def test_translate_keeps_one_line_per_input_line(trained_run, tmp_path):
    words = ("the big dog sees a small cat in the garden " * 50).split()
    lines = ["A dog sees the cat.", "", "   ", " ".join(words[:500]), "", "The children run."]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    result = subprocess.run([script("translate"), "-m", str(trained_run), "-i", str(src), "-o",
                             str(out), "--beam", "2", "--max-len-b", "5", "--min-len", "3"],
                            env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = out.read_text(encoding="utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(lines)
    assert got[1] == got[2] == got[4] == ""

    # stdin -> stdout gives the same translations
    piped = subprocess.run([script("translate"), "-m", str(trained_run), "--beam", "2",
                            "--min-len", "3", "--max-len-b", "5"], input=src.read_text(),
                           env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert piped.stdout == out.read_text(encoding="utf-8")


def test_mt_eval_json_bleu_equals_sacrebleu(trained_run, corpus_dir, tmp_path):
    hyp = tmp_path / "hyp.txt"
    cmd = [script("mt-eval"), "-m", str(trained_run), "--src", str(corpus_dir / "test.en"),
           "--ref", str(corpus_dir / "test.zz"), "--beam", "2", "--json", "--output", str(hyp)]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    sacre = subprocess.run([script("sacrebleu"), str(corpus_dir / "test.zz"), "-i", str(hyp),
                            "-m", "bleu", "-b", "-w", "4"], capture_output=True, text=True,
                           timeout=120)
    assert sacre.returncode == 0, sacre.stderr
    assert _bleu(report) == pytest.approx(float(sacre.stdout.strip()), abs=1e-4)


def _bleu(report: dict) -> float:
    """BLEU from mt-eval's JSON, whichever layout it uses (flat, or per system / test set)."""
    if "bleu" in report and isinstance(report["bleu"], int | float):
        return report["bleu"]
    for value in report.values():
        if isinstance(value, dict):
            found = _bleu(value)
            if found is not None:
                return found
        if isinstance(value, list):
            for item in value:
                if isinstance(item, dict) and (found := _bleu(item)) is not None:
                    return found
    return None


def test_bench_translate_decodes_what_translate_decodes(trained_run, corpus_dir, tmp_path):
    """scripts/bench_translate.py times the search that translate runs: its mt BLEU on the test
    set equals the one mt-train wrote for the same checkpoint and search (greedy), and the
    CTranslate2 export of those weights is timed beside it."""
    pytest.importorskip("ctranslate2")
    from mt.shortlist import main as shortlist_main

    out = tmp_path / "bench.json"
    model = str(trained_run / "checkpoints" / "averaged.pt")
    shortlist_main(["-m", model, "--src", str(corpus_dir / "train.en"), "--tgt",
                    str(corpus_dir / "train.zz"), "-o", str(tmp_path / "sl.pt")])
    cmd = [PYTHON, str(Path(__file__).resolve().parents[1] / "scripts" / "bench_translate.py"),
           "-m", model, "-i", str(corpus_dir / "test.en"), "-r", str(corpus_dir / "test.zz"),
           "--beam", "1", "--threads", "1", "--repeat", "1", "--systems",
           "mt-float32,ct2-float32,mt-float32+sl,ct2-float32+sl", "--shortlist",
           str(tmp_path / "sl.pt"), "--out", str(out)]
    result = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    expected = json.loads((trained_run / "test.json").read_text())["averaged"]["bleu"]
    assert report["systems"]["mt-float32"]["bleu"] == round(expected, 2)
    assert report["systems"]["ct2-float32"]["seconds"] > 0
    assert all(entry["first_pass_seconds"] > 0 for entry in report["systems"].values())
    assert set(report["ratios"]) == {"mt-float32 / ct2-float32", "mt-float32+sl / mt-float32",
                                     "ct2-float32+sl / ct2-float32",
                                     "mt-float32+sl / ct2-float32+sl"}
    assert 0 <= report["systems"]["mt-float32+sl"]["same_as_mt_float32"] <= 1
    assert report["systems"]["mt-float32"]["same_as_mt_float32"] == 1.0
    assert 0 <= report["systems"]["ct2-float32"]["same_as_mt_float32"] <= 1


def test_a_wheel_ships_the_configs_and_trains_from_anywhere(tmp_path):
    """conf/ sits at the top of the repository; a non-editable install must still find it (the
    wheel carries it as mt/conf), from any working directory."""
    import zipfile

    from conftest import REPO

    pytest.importorskip("setuptools")  # torch depends on it: the build needs no download
    src = tmp_path / "src"
    for name in ("mt", "conf"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([PYTHON, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, capture_output=True,
                   timeout=300)
    (wheel,) = (tmp_path / "dist").glob("mt-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    shipped = {p.relative_to(site / "mt" / "conf") for p in (site / "mt" / "conf").rglob("*.yaml")}
    assert shipped == {p.relative_to(REPO / "conf") for p in (REPO / "conf").rglob("*.yaml")}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**cli_env(tmp_path), "PYTHONPATH": str(site)}  # before the editable install's finder
    job = subprocess.run([PYTHON, "-m", "mt.train", "experiment=multi30k_en_de_cpu", "--cfg",
                          "job"], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert job.returncode == 0, job.stderr
    assert "name: multi30k" in job.stdout
    where = subprocess.run([PYTHON, "-c", "import mt.config, mt.testsets; "
                            "print(mt.config.conf_dir(), mt.testsets.TESTSETS_DIR)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.split() == [str(site / "mt" / "conf"),
                                    str(site / "mt" / "conf" / "testsets")]


@pytest.mark.parametrize("script", ["reproduce_multi30k.sh", "simulate_back_translation.sh"])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_the_shell_scripts_print_their_usage(script, flag, tmp_path):
    """--help used to be taken as the experiment name (or a directory to make)."""
    from conftest import REPO

    result = subprocess.run(["bash", str(REPO / "scripts" / script), flag], cwd=tmp_path,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "the repository root with mt installed" in " ".join(result.stdout.split())
    assert not any(line.startswith("#") for line in result.stdout.splitlines())
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing run


def _commands(project: dict) -> dict[str, str]:
    """Each console script's command ("module:function"): every script runs mt.entry's function
    of its name, which imports that module and runs the function."""
    from mt.entry import COMMANDS

    assert project["scripts"] == {name: f"mt.entry:{name.replace('-', '_')}"
                                  for name in COMMANDS}
    return COMMANDS


def test_every_command_prints_the_versions_a_bug_report_needs(tmp_path, capsys):
    """``--version`` on every console script: mt's version (the one pip installed) and the
    versions of the libraries that decide results, on one line, and nothing run."""
    import inspect
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    from importlib import metadata

    from conftest import REPO

    import mt

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert mt.__version__ == project["version"] == metadata.version("mt")
    libraries = ("torch", "sentencepiece", "sacrebleu", "datasets", "hydra-core")
    want = (f"mt {mt.__version__} ("
            + ", ".join(f"{lib} {metadata.version(lib)}" for lib in libraries) + ")")
    for name, entry in _commands(project).items():
        module, func = entry.split(":")
        main = getattr(__import__(module, fromlist=[func]), func)
        if not inspect.signature(main).parameters:  # mt-train (Hydra's), translate's cli
            runs = name.replace("-", "_")  # through mt.entry, as the console script
            result = subprocess.run([PYTHON, "-c", f"from mt.entry import {runs}; {runs}()",
                                     "--version"], cwd=tmp_path, env=cli_env(tmp_path),
                                    capture_output=True, text=True, timeout=120)
            assert (result.returncode, result.stdout) == (0, want + "\n"), result.stderr
            continue
        with pytest.raises(SystemExit) as stop:
            main(["--version"])
        assert stop.value.code == 0
        assert capsys.readouterr().out == want + "\n", name
    assert list(tmp_path.iterdir()) == []  # no run directory made


def test_every_command_runs_as_python_m_its_module(tmp_path):
    """``python -m mt.shortlist`` exited 0 without a word or a file (its module had no
    ``__main__`` block): each command's module runs that command, and ``mt.interop``, which
    holds two, names them and fails."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    from conftest import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    commands: dict[str, list[str]] = {}
    for name, entry in _commands(project).items():
        commands.setdefault(entry.split(":")[0], []).append(name)
    for module, names in commands.items():
        result = subprocess.run([PYTHON, "-m", module, "--version"], cwd=tmp_path,
                                env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
        if len(names) == 1:
            assert (result.returncode, result.stdout[:3]) == (0, "mt "), (module, result.stderr)
        else:
            assert result.returncode == 1 and all(n in result.stderr for n in names), module
    assert list(tmp_path.iterdir()) == []  # nothing run


def test_python_m_of_the_conversion_modules_runs_their_command(tmp_path):
    """``python -m mt.export -m RUN --format hf --out DIR`` (the module named like mt-export)
    exited 0 without a word and wrote nothing, as did ``python -m mt.import_hf``: a script
    that went on after it found no export. Each runs the command it converts for."""
    for module, command in [("mt.export", "mt-export"), ("mt.import_hf", "mt-import")]:
        result = subprocess.run([PYTHON, "-m", module, "--bogus"], cwd=tmp_path,
                                env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (module, result.stderr)
        assert result.stderr.startswith(f"usage: {command} "), (module, result.stderr)
    assert list(tmp_path.iterdir()) == []


def test_python_m_usage_names_a_command_that_runs(tmp_path):
    """``python -m mt.train --bogus`` and ``python -m mt.demo --bogus`` said "usage: train.py",
    "demo.py: error": argparse's name from sys.argv[0], a command nobody can type. Each usage
    names the console script, or ``python -m`` its module."""
    tomllib = pytest.importorskip("tomllib")
    from conftest import REPO

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names: dict[str, list[str]] = {"mt.demo": []}
    for name, entry in _commands(project).items():
        names.setdefault(entry.split(":")[0], []).append(name)
    for module, commands in names.items():
        if len(commands) > 1:  # mt.interop: names its two commands (test above)
            continue
        result = subprocess.run([PYTHON, "-m", module, "--bogus"], cwd=tmp_path,
                                env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
        prog = result.stderr.partition("usage: ")[2]
        assert any(prog.startswith(f"{p} ") for p in [*commands, f"python -m {module}"]), (
            module, result.stderr)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_while_a_command_is_imported_is_one_line(monkeypatch, capsys):
    """Ctrl-C in a command's first seconds (torch's import) printed some forty lines of
    traceback from inside the import, and a SIGTERM or SIGHUP ended it without a word: each
    ends the command in one line, with the status of the signal, and the handlers are put back."""
    import os
    import signal

    import mt.entry

    def ctrl_c(*args):
        raise KeyboardInterrupt  # where Python raises it: anywhere inside the import

    def terminated(signum):
        def importing(module):
            os.kill(os.getpid(), signum)
            raise AssertionError(f"{signal.Signals(signum).name} did not stop the import")
        return importing

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for name, importing, status, said in (
            ("mt-eval", ctrl_c, 130, "\nmt-eval: interrupted\n"),
            ("mt-train", terminated(signal.SIGTERM), 143, "mt-train: terminated (SIGTERM)\n"),
            ("mt-average", terminated(signal.SIGHUP), 129, "mt-average: terminated (SIGHUP)\n")):
        monkeypatch.setattr(mt.entry, "import_module", importing)
        with pytest.raises(SystemExit) as stop:
            getattr(mt.entry, name.replace("-", "_"))()
        assert stop.value.code == status and capsys.readouterr().err == said, name
        assert {s: signal.getsignal(s) for s in before} == before
    # Ctrl-C that the command's own code leaves uncaught (mt-average's, mt-shortlist's): the same
    monkeypatch.setattr(mt.entry, "import_module",
                        lambda module: type("module", (), {"main": staticmethod(ctrl_c)}))
    with pytest.raises(SystemExit) as stop:
        mt.entry.mt_average()
    assert stop.value.code == 130 and capsys.readouterr().err == "\nmt-average: interrupted\n"


def test_ctrl_c_while_translate_is_imported_ends_it_by_the_signal(tmp_path):
    """translate ends by the signal after an interrupt, so that a shell loop running it stops:
    so too while its module is imported."""
    code = ("import os, signal, time\n"
            "import mt.entry\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal\n"
            "def importing(module):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(60)\n"
            "mt.entry.import_module = importing\n"
            "mt.entry.translate()\n")
    result = subprocess.run([PYTHON, "-c", code], cwd=tmp_path, env=cli_env(tmp_path),
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (-2, "\ntranslate: interrupted\n")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_ctrl_c_in_the_first_seconds_of_a_command_is_one_line(tmp_path):
    """As a user presses it: Ctrl-C once torch's library is loaded, while the import goes on (or,
    on a fast machine, while mt-average waits on a named pipe it reads as a checkpoint)."""
    import os
    import signal
    import time

    pipe = tmp_path / "step_1.pt"
    os.mkfifo(pipe)
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal\n"
            "from mt.entry import mt_average\n"
            f"sys.argv[1:] = [{str(pipe)!r}, '-o', 'avg.pt']\n"
            "mt_average()\n")
    proc = subprocess.Popen([PYTHON, "-c", code], cwd=tmp_path, env=cli_env(tmp_path),
                            stderr=subprocess.PIPE, text=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    try:
        while "libtorch" not in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert proc.stderr.read() == "\nmt-average: interrupted\n"
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "avg.pt").exists()


def test_no_command_help_shows_restructuredtext_markup(tmp_path, capsys):
    """mt-average --help began with ``mt-average``, reStructuredText's quotes from the module
    docstring argparse took as its description; every command's help is free of them, and
    ``python -OO`` (no docstrings) still gives mt-average a help instead of an AttributeError."""
    from mt.entry import COMMANDS

    helps = {}
    for name, entry in [*COMMANDS.items(), ("python -m mt.demo", "mt.demo:main")]:
        module, func = entry.split(":")
        if name == "translate":
            func = "main"  # cli() takes no argv
        if name == "mt-train":  # Hydra's help, in its own process
            result = subprocess.run([PYTHON, "-c", "from mt.entry import mt_train; mt_train()",
                                     "--help"], cwd=tmp_path, env=cli_env(tmp_path),
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr
            helps[name] = result.stdout
            continue
        with pytest.raises(SystemExit) as stop:
            getattr(__import__(module, fromlist=[func]), func)(["--help"])
        assert stop.value.code == 0
        helps[name] = capsys.readouterr().out
    assert all(text.strip() for text in helps.values())
    # each names the command as it is run (python -m mt.demo said "usage: demo.py")
    assert [name for name, text in helps.items() if name != "mt-train"
            and not text.startswith(f"usage: {name} ")] == []
    assert [name for name, text in helps.items() if "``" in text] == []
    assert "mt-average: average the weights" in helps["mt-average"]
    result = subprocess.run([PYTHON, "-OO", "-m", "mt.average", "--help"], cwd=tmp_path,
                            env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: mt-average"), result.stderr
