"""data.upsample: how often each split of data.train appears per epoch (mt.corpus.Mix)."""

import logging
import random
from collections import Counter

import datasets
import numpy as np
import pytest

from mt.config import PAD_ID, DataConfig, FilterConfig, TokenizerConfig, TrainConfig
from mt.config_checks import check_values
from mt.corpus import Corpus, Mix

WORDS = ["house", "garden", "green", "small", "river", "stone", "light", "water", "tree", "bird"]


def test_a_split_appears_as_often_as_its_factor_says():
    rows = np.array([0, 1, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13])  # rows 2 and 7 were filtered out
    mix = Mix(rows, sizes=[5, 9], factors=[2.0, 0.5])
    assert mix.kept == [4, 8]
    epoch = mix.epoch(seed=1, epoch=0)
    counts = Counter(epoch.tolist())
    assert all(counts[i] == 2 for i in range(4))  # pairs 0-3: rows of the first split
    assert sum(counts[i] for i in range(4, 12)) == 4 and max(counts[i] for i in range(4, 12)) == 1
    assert epoch.tolist() == mix.epoch(seed=1, epoch=0).tolist()  # a resumed run sees the same
    shares = {tuple(sorted(set(mix.epoch(1, e).tolist()) - set(range(4)))) for e in range(8)}
    assert len(shares) > 1  # another half of the second split in another epoch
    # a share below one pair is drawn in some epochs: over many, f pairs per epoch on average
    rare = Mix(np.arange(100), [100], [0.004])
    assert 250 < sum(len(rare.epoch(1, e)) for e in range(1000)) < 550  # 400 expected
    whole = Counter(Mix(rows, [5, 9], [1.5, 1.0]).epoch(3, 2).tolist())
    assert sorted(whole[i] for i in range(4)) == [1, 1, 2, 2] and set(whole) == set(range(12))



@pytest.mark.parametrize("factor, epochs",
                         [(0.25, 4), (0.3, 10), (1.5, 2), (2.3, 10), (0.004, 250)])
def test_a_fractional_share_goes_through_the_whole_split_before_any_pair_comes_again(factor,
                                                                                    epochs):
    """+data.upsample.bt=0.25: "a quarter of bt per epoch, another quarter each epoch". Drawn
    anew each epoch, 4 epochs left about a third of bt unseen and gave another third twice."""
    mix = Mix(np.arange(1000), [1000], [factor])
    seen = Counter()
    for epoch in range(epochs):
        seen.update(mix.epoch(seed=5, epoch=epoch).tolist())
        assert max(seen.values()) - min(seen[i] for i in range(1000)) <= 1  # none comes twice
    assert set(seen.values()) == {round(factor * epochs)}  # before every pair came once
    assert mix.epoch(5, 3).tolist() == Mix(np.arange(1000), [1000], [factor]).epoch(5, 3).tolist()
    assert len(Mix(np.arange(10), [10], [2.3]).epoch(5, 0)) == 23  # not 22: 2.3 - 2 < 0.3


def _sentence(rng: random.Random, suffix: str) -> str:
    return " ".join(rng.choice(WORDS) + suffix for _ in range(rng.randint(2, 8)))


@pytest.mark.parametrize("alpha", [0.0, 0.5])  # 0.5: subword regularization, SampledPairs
def test_an_epoch_of_the_corpus_holds_each_split_as_often_as_data_upsample_says(
        tmp_path, monkeypatch, alpha):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rng = random.Random(0)
    d = tmp_path / "d"
    d.mkdir()
    for split, n, suffix in [("train", 120, ""), ("bt", 80, "s"), ("valid", 5, "")]:
        src = [_sentence(rng, suffix) for _ in range(n)]
        (d / f"{split}.en").write_text("".join(s + "\n" for s in src))
        (d / f"{split}.de").write_text("".join(s.upper() + "\n" for s in src))
    cfg = TrainConfig()
    cfg.data = DataConfig(source="files", dir=str(d), src_lang="en", tgt_lang="de",
                          train="train+bt", upsample={"train": 2, "bt": 0.5}, subword_alpha=alpha,
                          tokenizer=TokenizerConfig(vocab_size=120),
                          filter=FilterConfig(max_ratio=0))
    check_values(cfg)
    corpus = Corpus(cfg, tmp_path / "run", rank=0, world=1)
    kept_train, kept_bt = corpus.mix.kept
    batches = corpus.batches(300, seed=1, epoch=0)
    seen = Counter()
    for batch in batches:
        src, _, tgt_out = corpus.collate(batch)
        assert [int((row != PAD_ID).sum()) for row in src] == [corpus.src_lens[i] for i in batch]
        assert [int((row != PAD_ID).sum()) for row in tgt_out] == [corpus.tgt_lens[i] + 1
                                                                   for i in batch]
        seen.update(corpus.tokenizer.src.decode(row[row != PAD_ID].tolist()) for row in src)
    bt = {s: n for s, n in seen.items() if s.split()[0].endswith("s")}
    train = {s: n for s, n in seen.items() if s not in bt}
    assert len(train) == kept_train and set(train.values()) == {2}
    assert len(bt) in (kept_bt // 2, (kept_bt + 1) // 2) and set(bt.values()) == {1}
    assert corpus.batches(300, seed=1, epoch=0) == batches


def test_the_log_says_how_many_pairs_an_epoch_holds_when_a_share_varies(tmp_path, monkeypatch,
                                                                       caplog):
    """+data.upsample.bt=0.3 of 25 kept pairs: 7 or 8 of them an epoch. The log gave epoch 0's
    count as that of every epoch."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rng = random.Random(1)
    d = tmp_path / "d"
    d.mkdir()
    for split, n, suffix in [("train", 40, ""), ("bt", 25, "s"), ("valid", 5, "")]:
        src = [_sentence(rng, suffix) for _ in range(n)]
        (d / f"{split}.en").write_text("".join(s + "\n" for s in src))
        (d / f"{split}.de").write_text("".join(s.upper() + "\n" for s in src))
    cfg = TrainConfig()
    cfg.data = DataConfig(source="files", dir=str(d), src_lang="en", tgt_lang="de",
                          train="train+bt", upsample={"bt": 0.3},
                          tokenizer=TokenizerConfig(vocab_size=100),
                          filter=FilterConfig(max_ratio=0, dedup=False))
    with caplog.at_level(logging.INFO, logger="mt.train"):
        corpus = Corpus(cfg, tmp_path / "run", rank=0, world=1)
    assert corpus.mix.kept == [40, 25]
    sizes = [len(corpus.mix.epoch(cfg.trainer.seed, e)) for e in range(20)]
    assert set(sizes) == {47, 48} and sum(sizes) / 20 == 47.5
    assert ("data.upsample: train x1 (40 pairs), bt x0.3 (25 pairs); 47.50 pairs an epoch on "
            "average (between 47 and 48)") in caplog.text
    assert Mix(np.arange(10), [10], [2.3]).describe_size() == "23 pairs an epoch"  # 2.3 - 2 < 0.3


@pytest.mark.parametrize("upsample, message", [
    ({"extra": 2.0}, r"data\.upsample\.extra: not one of data\.train's splits \(train, bt\)"),
    ({"bt": 0.0}, r"data\.upsample\.bt must be above 0 and finite, got 0\.0"),
])
def test_data_upsample_names_its_mistake(upsample, message):
    cfg = TrainConfig()
    cfg.data.train, cfg.data.upsample = "train+bt", upsample
    with pytest.raises(ValueError, match=message):
        check_values(cfg)


def test_the_training_loop_trains_each_kept_pair_as_often_as_its_split_says_in_every_epoch(
        tmp_path, corpus_dir, fit_here, monkeypatch):
    """What reaches the model, decoded back from the collated batches of two whole epochs: every
    pair the filters keep, once per epoch (twice for data.upsample.bt=2), none they drop (empty
    sides, a duplicate, a pair longer than model.max_positions allows), no batch above
    trainer.max_tokens, padding included, and the loss divided by the step's target tokens."""
    from mt.trainer import Trainer

    en = (corpus_dir / "train.en").read_text().splitlines()
    zz = (corpus_dir / "train.zz").read_text().splitlines()
    train = list(zip(en[:120], zz[:120], strict=True))
    bt = list(zip(en[200:230], zz[200:230], strict=True))
    long = (" ".join(en[300:340]), " ".join(zz[300:340]))  # over model.max_positions - 1
    dropped = [("", zz[340]), (en[341], "  "), long]
    d = tmp_path / "data"
    d.mkdir()
    for split, pairs in (("train", train + [train[5]] + dropped), ("bt", bt + [train[7]])):
        for side, lang in ((0, "en"), (1, "zz")):
            (d / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in pairs))
    for name in ("valid.en", "valid.zz", "test.en", "test.zz"):
        (d / name).write_text((corpus_dir / name).read_text())
    seen: list[tuple[int, str, str]] = []
    tokenizers = []
    step = Trainer.train_step

    def recording(self, micro_batches, step_tokens, weight=1.0):
        tokenizers[:] = [self.corpus.tokenizer]
        targets = 0
        for batch in micro_batches:
            src, _, tgt_out = self.corpus.collate(batch)
            assert src.numel() <= 300 and tgt_out.numel() <= 300  # trainer.max_tokens
            targets += int((tgt_out != PAD_ID).sum())
            for s, t in zip(src.tolist(), tgt_out.tolist(), strict=True):
                seen.append((self.epoch, self.corpus.tokenizer.src.decode(s),
                             self.corpus.tokenizer.tgt.decode(t)))
        assert step_tokens == targets
        return step(self, micro_batches, step_tokens, weight)

    monkeypatch.setattr(Trainer, "train_step", recording)
    log = fit_here("run", "data.train=train+bt", "+data.upsample.bt=2", "trainer.max_epochs=2",
                   "trainer.max_steps=0", "trainer.max_minutes=0", "trainer.validate_every=1000",
                   "trainer.test_at_end=false", corpus=d)
    assert "kept 150 of 155 pairs (dropped: empty 2, too short (< 1 tokens) 0, too long " \
           "(> 127 tokens) 1, length ratio (> 3) 0, duplicate 2)" in log
    [tok] = tokenizers

    def read(pair: tuple[str, str]) -> tuple[str, str]:  # as the model sees it
        return tok.src.decode(tok.src.encode(pair[0])), tok.tgt.decode(tok.tgt.encode(pair[1]))

    wanted = Counter(map(read, train)) + Counter(map(read, bt + bt))
    assert len(wanted) == 150 and read(long)[0] not in {s for s, _ in wanted}
    for epoch in (0, 1):
        assert Counter((s, t) for e, s, t in seen if e == epoch) == wanted
