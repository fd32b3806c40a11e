"""Head training on the tiny seeded model: distillation data, both kinds of
heads, versions, save/load, the accuracy report, and the shipped prompt sets."""

from __future__ import annotations

import torch

from worker.reference.heads import format_report
from worker.reference.heads.data import DistillSet, build_distill_set, draft_vocab
from worker.reference.heads.store import HeadsBundle
from worker.reference.heads.train import TrainConfig, _unroll_mask, evaluate, train
from worker.reference.models import ModelUnavailableError, tiny_llama
from worker.reference.prompts import Prompt, load_prompts, prompt_sets

import pytest


@pytest.fixture(scope="module")
def tiny_ds():
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(30):
        n = int(torch.randint(3, 10, (1,), generator=gen))
        prompts.append(Prompt(f"p{i}", "rand", " ".join(map(str, torch.randint(0, vocab, (n,), generator=gen).tolist()))))
    ds = build_distill_set(model, None, prompts, "tiny", max_new_tokens=20, batch=8, cache=False, show_progress=False,
                           encode=lambda text: [int(x) for x in text.split()])
    return model, vocab, prompts, ds


def test_distill_set_is_the_targets_greedy_output(tiny_ds):
    model, vocab, prompts, ds = tiny_ds
    assert len(ds) == 30 and ds.max_new_tokens == 20
    p = [int(x) for x in prompts[3].text.split()]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20)[0].tolist()
        feats = model.model(torch.tensor([ref])).last_hidden_state[0]
    assert ds.sequences[3] == ref and ds.prompt_lens[3] == len(p)
    torch.testing.assert_close(ds.features[3], feats, atol=1e-4, rtol=1e-4)
    train_idx, test_idx = ds.split(0.2)
    assert sorted(train_idx + test_idx) == list(range(30)) and test_idx and not set(train_idx) & set(test_idx)
    assert ds.split(0.2) == (train_idx, test_idx)  # deterministic


def test_distill_set_save_load_roundtrip(tiny_ds, tmp_path):
    ds = tiny_ds[3]
    ds.save(tmp_path / "d.pt")
    back = DistillSet.load(tmp_path / "d.pt")
    assert back.sequences == ds.sequences and back.data_hash == ds.data_hash
    torch.testing.assert_close(back.features[0], ds.features[0], atol=1e-2, rtol=1e-2)  # stored fp16


def test_draft_vocab_takes_frequent_tokens_and_eos(tiny_ds):
    ds = tiny_ds[3]
    vm = draft_vocab(ds, 16, 128, always=(127,))
    assert len(vm) == 16 and 127 in vm.tolist() and vm.tolist() == sorted(vm.tolist())
    most = max(set(ds.answer_tokens()), key=ds.answer_tokens().count)
    assert most in vm.tolist()
    assert torch.equal(draft_vocab(ds, 0, 128), torch.arange(128))
    # counted on the given sequences only (training passes its split: no held-out leak)
    only3 = ds.answer_tokens([3])
    (top,) = draft_vocab(ds, 1, 128, idx=[3]).tolist()
    assert only3.count(top) == max(map(only3.count, only3))


def test_unroll_mask_reproduces_draft_tree_attention():
    m = _unroll_mask(4, 2)
    # pass-2 query t sees pass-1 keys s <= t-1 and its own pass-2 key
    assert m[:, :4].int().tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert m[:, 4:].int().tolist() == torch.eye(4, dtype=torch.int).tolist()
    m3 = _unroll_mask(4, 3)
    assert m3[3].int().tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]


@pytest.mark.model
def test_train_eagle_learns_saves_and_versions(tiny_ds, tmp_path):
    model, vocab, prompts, ds = tiny_ds
    cfg = TrainConfig(kind="eagle", epochs=12, lr=3e-3, draft_vocab=0, num_heads=3, batch_sequences=8, unroll=2)
    b = train(model, ds, cfg, log=None)
    assert b.version.startswith("eagle-") and len(b.version) == len("eagle-") + 12
    rep = b.meta["report"]
    assert [p["position"] for p in rep["positions"]] == [1, 2, 3, 4, 5]
    assert rep["draft_vocab_coverage"] == 1.0
    train_idx, _ = ds.split(cfg.held_out)
    fit = evaluate(b, model, ds, train_idx[:8], depth=2)
    assert fit["positions"][0]["top1"] > 0.15  # it learnt the training answers (random guess: 1/128)
    assert "position" in format_report(b)

    b.save(tmp_path)
    back = HeadsBundle.load(tmp_path, "eagle")
    assert back.version == b.version and back.meta["data_hash"] == ds.data_hash
    for k, v in b.module.state_dict().items():
        assert torch.equal(back.module.state_dict()[k], v)
    # the version depends on the training data, not only the weights
    back.meta["data_hash"] = "other"
    assert back.seal() != b.version


@pytest.mark.model
def test_train_medusa_reduced_vocab(tiny_ds, tmp_path):
    model, vocab, prompts, ds = tiny_ds
    cfg = TrainConfig(kind="medusa", epochs=3, draft_vocab=64, num_heads=3, batch_positions=64)
    b = train(model, ds, cfg, log=None)
    assert b.version.startswith("medusa-")
    assert len(b.vocab_map) == 64
    assert len(b.meta["report"]["positions"]) == 3
    assert float(b.module.weight.detach().abs().sum()) > 0  # W1 moved away from its zero init
    b.save(tmp_path)
    assert HeadsBundle.load(tmp_path, "medusa").version == b.version


def test_missing_heads_say_how_to_train(tmp_path):
    with pytest.raises(FileNotFoundError, match="specctl train-heads --drafter eagle"):
        HeadsBundle.load(tmp_path, "eagle")


def test_shipped_prompt_sets():
    assert {"chat", "code", "math", "summarise", "all"} <= set(prompt_sets())
    allp = load_prompts("all")
    assert len(allp) >= 300 and len({p.id for p in allp}) == len(allp)
    for name in ("chat", "code", "math", "summarise"):
        ps = load_prompts(name)
        assert len(ps) >= 60 and all(p.domain == name and p.text for p in ps)


def test_extra_text_trains_but_never_holds_out(tiny_ds, tmp_path):
    from types import SimpleNamespace

    from worker.reference.heads.data import extend_with_text

    model, vocab, prompts, ds = tiny_ds
    (tmp_path / "a.txt").write_text(" ".join(str(i % vocab) for i in range(300)))
    fake_tok = lambda text: SimpleNamespace(input_ids=[int(t) for t in text.split()])  # noqa: E731
    big = extend_with_text(ds, model, fake_tok, [str(tmp_path / "a.txt")], max_tokens=250, chunk_tokens=64,
                           show_progress=False)
    extra = [i for i, pid in enumerate(big.ids) if pid.startswith("extra:")]
    assert len(extra) == 4 and all(big.prompt_lens[i] == 0 for i in extra)
    train_idx, test_idx = big.split(0.5)
    assert set(extra) <= set(train_idx) and not set(extra) & set(test_idx)
    assert big.data_hash != ds.data_hash
    assert big.features[extra[0]].shape == (64, model.config.hidden_size)


def test_sampled_answers_join_their_prompts_split(tiny_ds):
    model, vocab, prompts, ds = tiny_ds
    encode = lambda text: [int(x) for x in text.split()]  # noqa: E731
    train_ids = {ds.ids[i] for i in ds.split(0.2)[0]}
    both = build_distill_set(model, None, prompts, "tiny", max_new_tokens=20, batch=8, cache=False,
                             show_progress=False, encode=encode, samples=2, temperature=1.0,
                             sample_prompts=[p for p in prompts if p.id in train_ids])
    assert both.sequences[: len(ds)] == ds.sequences  # the greedy part is unchanged
    sampled = both.ids[len(ds):]
    assert sorted(sampled) == sorted(f"{pid}~{k}" for pid in train_ids for k in (1, 2))
    # sampled answers really are samples: they differ from the greedy answer of their prompt
    greedy = dict(zip(ds.ids, ds.sequences))
    assert sum(both.sequences[i] != greedy[pid.split("~")[0]] for i, pid in enumerate(both.ids) if "~" in pid) > 20
    train_idx, test_idx = both.split(0.2)
    assert [both.ids[i] for i in test_idx] == [ds.ids[i] for i in ds.split(0.2)[1]]  # greedy held-out answers only
    assert len(train_idx) == len(train_ids) * 3 and both.data_hash != ds.data_hash
    with pytest.raises(ValueError, match="temperature > 0, got samples=1, temperature=0"):
        build_distill_set(model, None, prompts, "tiny", cache=False, show_progress=False, encode=encode, samples=1,
                          temperature=0)


@pytest.mark.model
def test_parts_answered_in_processes_equal_parts_answered_in_one(tiny_ds, tmp_path, monkeypatch):
    import worker.reference.engine.engine as engine_module
    from worker.reference.heads.data import ModelLoader, distill_cache_dir

    model, vocab, prompts, ds = tiny_ds
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model.save_pretrained(tmp_path / "tiny")  # the children load their own copy of the target from here
    encode = lambda text: [int(x) for x in text.split()]  # noqa: E731
    some = prompts[:12]
    args = dict(max_new_tokens=20, batch=8, show_progress=False, encode=encode, samples=2, temperature=1.0)
    alone = build_distill_set(model, None, some, "tiny", cache=False, **args)

    class NoEngineHere:  # the parent only reads the parts the children cached
        def __init__(self, *a, **k):
            raise AssertionError("the parent process generated a part")

    monkeypatch.setattr(engine_module, "Engine", NoEngineHere)
    apart = build_distill_set(model, None, some, "tiny", jobs=2, loader=ModelLoader(str(tmp_path / "tiny")), **args)
    assert len(list(distill_cache_dir().glob("tiny-*.pt"))) == 3  # greedy + two sampled parts
    assert apart.ids == alone.ids and apart.sequences == alone.sequences and apart.data_hash == alone.data_hash
    for a, b in zip(apart.features, alone.features):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)  # stored fp16
    with pytest.raises(ValueError, match="jobs must be >= 1, got jobs=0"):
        build_distill_set(model, None, some, "tiny", jobs=0, **args)
    # a child that cannot load the target fails the build with the loader's error (no endless respawning)
    with pytest.raises(ModelUnavailableError, match="nowhere"):
        build_distill_set(model, None, some, "tiny", jobs=2, loader=ModelLoader(str(tmp_path / "nowhere")),
                          **{**args, "samples": 4})


def test_first_use_data_is_chosen_per_kind(tmp_path, monkeypatch):
    from worker.reference.heads import DEFAULT_DATA, DistillData, default_heads_dir, ensure_heads

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # EAGLE keeps gaining from more sampled answers, Medusa does not: each trains on its own data, in its own directory
    assert DEFAULT_DATA["eagle"].samples > DEFAULT_DATA["medusa"].samples
    assert default_heads_dir("m", DEFAULT_DATA["eagle"]) != default_heads_dir("m", DEFAULT_DATA["medusa"])
    assert default_heads_dir("m", DEFAULT_DATA["medusa"]) == default_heads_dir("m", DistillData(samples=2))
    with pytest.raises(ValueError, match="unknown drafter 'lookahead'"):
        ensure_heads("lookahead", "m")


@pytest.mark.model
def test_train_heads_end_to_end_trains_on_its_own_threads(tiny_ds, tmp_path, monkeypatch):
    """``train_heads`` on a checkpoint directory (the tiny target with a word-level
    tokenizer over its ids): distils, trains at ``train_threads`` torch threads,
    gives the caller its own thread count back, saves a loadable bundle."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import worker.reference.heads.train as train_module
    from worker.reference.heads import train_heads

    model, vocab, prompts, _ = tiny_ds
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    words = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    target = tmp_path / "tiny"
    model.save_pretrained(target)
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="0").save_pretrained(target)
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": p.id, "domain": p.domain, "prompt": p.text}) + "\n"
                                   for p in prompts[:12]))
    threads_in_training = []
    real_train = train_module.train

    def spy(*args, **kwargs):
        threads_in_training.append(torch.get_num_threads())
        return real_train(*args, **kwargs)

    monkeypatch.setattr(train_module, "train", spy)
    torch.set_num_threads(1)
    bundle = train_heads("medusa", str(target), str(prompt_file), tmp_path / "heads",
                         config=TrainConfig(kind="medusa", epochs=1, num_heads=2), max_new_tokens=6, gen_batch=4,
                         samples=0, tune_kernels=False, jobs=1, train_threads=2, log=lambda *_: None)
    assert threads_in_training == [2] and torch.get_num_threads() == 1
    assert HeadsBundle.load(tmp_path / "heads", "medusa").version == bundle.version
