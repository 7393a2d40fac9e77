"""Hub corpora (``data.source=hub``): check their names, configs and splits at the start of a
run, and read a split as ``src``/``tgt`` columns (``mt.data`` reads local files and joins splits).

They are in the ``translation`` format (one struct column keyed by language, e.g. ``wmt/wmt14``
with ``hub_config=de-en``; see ``conf/data/wmt14_en_de.yaml``) or have one string column per
language. The first run downloads into the ``datasets`` cache (``HF_DATASETS_CACHE``); later
runs, also with ``HF_HUB_OFFLINE=1``, read the cache. Offline and uncached, loading stops with
one sentence saying so (set ``HF_HUB_OFFLINE=1`` on a machine without internet, or ``datasets``
waits on network timeouts first). A directory written by ``save_to_disk`` or a folder of data
files also works as ``hub_name``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mt.config import DataConfig


def _unreachable(cfg: DataConfig, err: ConnectionError) -> ConnectionError:
    """Offline: also says that no folder has the name, which ``data/corpus`` may have meant."""
    name = cfg.hub_name + (f" ({cfg.hub_config})" if cfg.hub_config else "")
    return ConnectionError(
        f"could not reach the Hugging Face hub for {name} ({err}); download it once with "
        "internet (the datasets cache keeps it; HF_HUB_OFFLINE=1 then reads the cache) or use "
        f"data.source=files{_no_folder(cfg.hub_name)}")


def _no_folder(name: str) -> str:
    return ("" if Path(name).exists() else f"; if data.hub_name={name} meant a folder, there is "
            f"none at {Path(name).absolute()} (a relative folder starts at the directory "
            "mt-train runs in)")


def _config_mistake(cfg: DataConfig, err: ValueError) -> ValueError | None:
    """datasets' refusal of ``data.hub_config`` (``BuilderConfig 'en-de' not found``, ``Config
    name is missing``, neither naming the key) as one naming it, with the configs there are."""
    text = str(err)
    if not re.match(r"BuilderConfig .* not found|Config name is missing", text):
        return None
    import datasets

    try:
        names = list(datasets.get_dataset_config_names(cfg.hub_name))
    except Exception:  # noqa: BLE001 - a list where it can be had (offline: a cached one)
        names = []
    has = f" (its configs: {', '.join(names)})" if names else ""
    if cfg.hub_config is None:
        return ValueError(f"data.hub_config is not set, and {cfg.hub_name} has several "
                          f"configs{has}: set data.hub_config to one")
    unset = "; set data.hub_config=null" if names == ["default"] else ""  # a folder of files
    return ValueError(f"data.hub_config={cfg.hub_config}: {cfg.hub_name} has no such "
                      f"config{has}{unset}")


def _check_hub_name(name: str) -> None:
    """Refuses a ``data.hub_name`` that no folder holds and no hub dataset can be called
    (``./saved``, ``../data/saved``, three parts): a save_to_disk folder given from another
    directory went to the hub, and offline the run said to download it with internet."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name).exists():
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(f"data.hub_name={name}: no such folder ({Path(name).absolute()}), "
                                "nor a hub dataset's name (USER/DATASET); a relative folder "
                                "starts at the directory mt-train runs in") from None


def check_hub_splits(cfg: DataConfig, wanted: dict[str, list[str]]) -> None:
    """Refuses, at the start of a run, a split that the hub dataset lacks, naming the key that
    asks for it (``wanted``: key -> split names): otherwise a missing ``data.valid`` showed only
    after the tokenizer and the encoding, and a missing ``data.test`` after all the training.
    Where the names cannot be had without loading the data (a saved single Dataset, a dataset
    whose metadata lists none), the load says what is wrong, as before."""
    import datasets

    _check_hub_name(cfg.hub_name)
    local = Path(cfg.hub_name)
    try:
        if (local / "dataset_dict.json").exists():  # save_to_disk: its split list
            names = json.loads((local / "dataset_dict.json").read_text())["splits"]
        elif (local / "state.json").exists():
            return
        else:
            names = datasets.get_dataset_split_names(cfg.hub_name, cfg.hub_config)
    except ConnectionError as err:  # offline: said now, as the first load would have
        raise _unreachable(cfg, err) from None
    except Exception as err:  # noqa: BLE001 (unreadable metadata: the load itself will say why)
        if isinstance(err, ValueError) and (mistake := _config_mistake(cfg, err)):
            raise mistake from None
        return
    for key, splits in wanted.items():
        for split in splits:
            if split.split("[", 1)[0] not in names:  # train[:1000]: a slice of train
                raise ValueError(f"{key}: {cfg.hub_name} has splits {sorted(names)}, not "
                                 f"{split!r}")


def load_hub(cfg: DataConfig, split: str, cache_dir: str | None):
    """A hub dataset (``translation`` column, or one column per language) as src/tgt columns."""
    import datasets

    from mt.data import DataError  # here: mt.data imports this module

    if not cfg.hub_name:
        raise ValueError("data.hub_name must name a dataset when data.source=hub")
    _check_hub_name(cfg.hub_name)
    name = f"{cfg.hub_name}" + (f" ({cfg.hub_config})" if cfg.hub_config else "")
    local = Path(cfg.hub_name)
    try:
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():
            ds = datasets.load_from_disk(str(local))  # written by save_to_disk
            if not isinstance(ds, datasets.DatasetDict):  # train, valid and test all of it
                raise ValueError(f"data.hub_name={local} holds one saved Dataset, without split "
                                 "names, so training, validation and test would all be its "
                                 "pairs; save a DatasetDict with a split for each")
            base = split.split("[", 1)[0]  # train[:1000], as load_dataset reads a slice
            if base not in ds:
                raise ValueError(f"{local} has splits {sorted(ds)}, not {split!r}: set "
                                 "data.train / data.valid / data.test")
            ds = ds[base]
            if base != split:
                try:
                    (part,) = datasets.ReadInstruction.from_spec(split).to_absolute(
                        {base: len(ds)})
                except ValueError as err:
                    raise ValueError(f"{local}: split {split!r}: {err}") from None
                start, stop = min(part.from_, len(ds)), min(part.to, len(ds))
                ds = ds.select(range(start, stop) if start < stop else [])  # none: said later
        else:
            ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=split,
                                       cache_dir=cache_dir)
    except ConnectionError as err:
        raise _unreachable(cfg, err) from None
    except FileNotFoundError as err:  # online, no such hub dataset: a folder may have been meant
        raise FileNotFoundError(f"data.hub_name={cfg.hub_name}: {err}"
                                f"{_no_folder(cfg.hub_name)}") from None
    except ValueError as err:
        if mistake := _config_mistake(cfg, err):
            raise mistake from None
        raise
    s, t = cfg.src_lang, cfg.tgt_lang
    if "translation" in ds.column_names:
        ds = ds.select_columns(["translation"]).flatten()
        s_col, t_col = f"translation.{s}", f"translation.{t}"
    else:
        s_col, t_col = s, t
    missing = [c for c in (s_col, t_col) if c not in ds.column_names]
    if missing:
        raise DataError(f"{name} split {split!r} has columns {ds.column_names}, not {missing}: "
                        "check data.src_lang and data.tgt_lang")
    for col in (s_col, t_col):  # numbers or lists: a traceback in the tokenizer or at validation
        feature = ds.features[col]
        kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
        if kind not in ("string", "large_string"):
            raise DataError(f"{name} split {split!r} column {col!r} holds {kind}, not text")
    ds = ds.select_columns([s_col, t_col]).rename_columns({s_col: "src", t_col: "tgt"})
    for col, lang in (("src", s), ("tgt", t)):  # a missing value; Arrow keeps their count
        column = ds.data.column(col)
        if column.null_count:
            import pyarrow.compute as pc

            row = pc.index(column.is_null(), True).as_py()
            raise DataError(f"{name} split {split!r} row {row} (counting from 0): no {lang} "
                            "text (null; "
                            f"{column.null_count} such rows): drop or fill them")
    return ds
