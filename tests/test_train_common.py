"""Training plumbing: work directories bound to their weights; the embedded trainer's refine rounds."""

import dataclasses

import pytest
import torch

from mmfast.train.common import bind_work_dir


def test_work_dir_is_bound_to_the_weights(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    bind_work_dir(tmp_path, model)
    bind_work_dir(tmp_path, model)  # same weights: resuming is fine
    with torch.no_grad():
        model.weight.add_(1.0)  # "retrained"
    with pytest.raises(RuntimeError, match="other model weights.*fresh --work"):
        bind_work_dir(tmp_path, model)


def test_refine_rounds_name_their_phases_and_must_pair_up():
    from mmfast.train.embedded import TrainConfig

    cfg = TrainConfig(refine_stage0_epochs=(4.0, 0.0, 2.0), refine_stage2_epochs=(1.0, 0.5, 0.0), refine_fg_weight=3.0)
    rounds = cfg.refine_rounds()
    assert [(v.name, l.name) for v, l in rounds] == [
        ("refine_stage0", "refine_stage2"),
        ("refine2_stage0", "refine2_stage2"),
        ("refine3_stage0", "refine3_stage2"),
    ]
    assert [v.round for v, _ in rounds] == [1, 2, 3] and all(
        v.fg_weight == 3.0 and l.fg_weight == 1.0 for v, l in rounds
    )
    assert [(v.epochs, l.epochs) for v, l in rounds] == [(4.0, 1.0), (0.0, 0.5), (2.0, 0.0)]
    assert TrainConfig(refine_stage0_epochs=(), refine_stage2_epochs=()).refine_rounds() == []
    with pytest.raises(ValueError, match="one entry per refine round"):
        TrainConfig(refine_stage0_epochs=(4.0,), refine_stage2_epochs=(1.0, 1.0))


def test_first_round_takes_its_own_foreground_weight():
    from mmfast.train.embedded import TrainConfig

    (v, l), *rest = TrainConfig(
        stage0_epochs=3.0, stage0_fg_weight=5.0, refine_stage0_epochs=(2.0,), refine_stage2_epochs=(1.0,)
    ).phases()
    assert (v.name, v.epochs, v.fg_weight, v.round) == ("stage0", 3.0, 5.0, 0) and (l.name, l.fg_weight) == (
        "stage2",
        1.0,
    )
    assert [(r.name, r.fg_weight) for r, _ in rest] == [("refine_stage0", 5.0)]
    assert TrainConfig().phases()[0][0].fg_weight == 1.0  # the shipped recipe's first round weighs every patch alike


def test_embedded_trainer_resumes_finished_phases_without_recomputing(tmp_path, monkeypatch):
    """A second run over a finished work dir loads every phase (no features cached again, no step run)
    and writes the same weights; training.json records each phase's steps and device."""
    import json

    from mmfast.train import embedded
    from mmfast.train.embedded import TrainConfig, train_embedded

    cfg = TrainConfig(
        n_train=16,
        shape="world-tiny",  # the same phases on a small architecture: the resume logic, in seconds
        stage0_epochs=2.0,
        stage0_batch=8,
        stage2_epochs=1.0,
        stage2_batch=8,
        refine_stage0_epochs=(2.0, 0.0),
        refine_stage2_epochs=(0.0, 1.0),
        workers=1,
    )
    first = train_embedded(tmp_path / "a", tmp_path / "work", cfg)
    cached = []
    real = embedded.cache_features
    monkeypatch.setattr(embedded, "cache_features", lambda *a, **k: cached.append(k.get("tag")) or real(*a, **k))
    second = train_embedded(tmp_path / "b", tmp_path / "work", cfg)
    assert cached == []
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    phases = json.loads((second / "training.json").read_text())["phases"]
    assert list(phases) == ["stage0", "stage2", "refine_stage0", "refine2_stage2"]
    assert phases["refine2_stage2"] == {"step": 2, "device": "cpu"}
    # round 2 trains the LLaVA on the features of round 1's tower
    assert sorted(p.name for p in (tmp_path / "work").glob("features*.npy")) == [
        "features_16.npy",
        "features_refine_16.npy",
    ]


def test_phase_records_its_device():
    from mmfast.train.common import describe_device

    assert describe_device("cpu") == "cpu" and describe_device(torch.device("cpu")) == "cpu"


# ------------------------------------------------------------------------------------ resume, data caches, scripts


def test_resume_config_check_refuses_changes_but_not_threads(tmp_path):
    from mmfast.errors import InputError
    from mmfast.train.common import check_resume_config

    cfg = {"seed": 0, "steps": 4, "lr": 1e-3, "threads": 0, "checkpoint_every": 2}
    check_resume_config(tmp_path, {"config": cfg}, {**cfg, "threads": 2, "checkpoint_every": 5})
    with pytest.raises(InputError, match=r"lr: 0\.001 -> 0\.5.*fresh --work"):
        check_resume_config(tmp_path, {"config": cfg}, {**cfg, "lr": 0.5})
    with pytest.raises(InputError, match="records no training config"):
        check_resume_config(tmp_path, {"step": 2}, cfg)


def _draft_cfg(**kw):
    from mmfast.train.drafts import DraftTrainConfig

    base = dict(n_images=4, n_text=2, gen_batch=2, max_new_tokens=6, steps=4, batch=2, checkpoint_every=2, warmup=1)
    return DraftTrainConfig(**{**base, **kw})


def test_draft_training_killed_and_resumed_equals_uninterrupted(tiny_dir, tmp_path, monkeypatch):
    """Weights, optimizer, data order and noise survive a kill between checkpoints; a resume under another
    config or a work dir whose cached answers came from another seed is refused."""
    import shutil

    from mmfast.errors import InputError
    from mmfast.train import drafts
    from mmfast.train.drafts import train_draft

    cfg = _draft_cfg()
    full = train_draft(tiny_dir, "msd", tmp_path / "a", tmp_path / "wa", cfg)
    shutil.copytree(tmp_path / "wa" / "data", tmp_path / "wb" / "data")  # the same answers, no checkpoint
    for f in (tmp_path / "wa").glob("*.json"):  # the weights and data stamps
        shutil.copy(f, tmp_path / "wb" / f.name)
    real, calls = drafts.draft_loss, []

    def killed_at_step_2(*a, **k):  # after the step-2 checkpoint
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(drafts, "draft_loss", killed_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        train_draft(tiny_dir, "msd", tmp_path / "b", tmp_path / "wb", cfg)
    monkeypatch.setattr(drafts, "draft_loss", real)
    resumed = train_draft(tiny_dir, "msd", tmp_path / "b", tmp_path / "wb", cfg)
    assert (full / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes()
    with pytest.raises(InputError, match=r"msd_ckpt was written by a run with another config \(lr"):
        train_draft(tiny_dir, "msd", tmp_path / "c", tmp_path / "wb", dataclasses.replace(cfg, lr=0.5))
    with pytest.raises(InputError, match=r"caches data made with another config \(seed: 0 -> 1"):
        train_draft(tiny_dir, "flash", tmp_path / "c", tmp_path / "wb", dataclasses.replace(cfg, seed=1))


def test_draft_data_holds_exactly_n_samples_when_n_changes(tiny_mm, tmp_path):
    from mmfast.train.drafts import generate_data, load_samples

    for n in (3, 4, 2):  # the last shard of n=3 is short: n=4 redoes it; n=2 reads only its first 2
        cfg = _draft_cfg(n_images=n, max_new_tokens=2)
        assert len(load_samples(generate_data(tiny_mm, cfg, tmp_path, "visual", n), n)) == n


def test_draft_loss_ignores_the_image_token_id_inside_an_answer(tiny_mm):
    """A target answer may contain the image token's id: only prompt positions take the visual features."""
    from mmfast.speculative._eagle_model import build_draft
    from mmfast.train.drafts import Sample, draft_loss

    image_id = tiny_mm.adapter.image_token_id
    d = tiny_mm.adapter.text_config.hidden_size
    ids = torch.tensor([1, image_id, image_id, 5, 6, 7, image_id, 8, 9])  # prompt: 4 tokens, 2 image slots
    sample = Sample(ids, torch.randn(ids.numel(), d).half(), torch.randn(2, d).half(), plen=4, eos=False)
    for kind, kw in (("msd", {}), ("flash", {"sar_k": 2, "n_latents": 2})):
        torch.manual_seed(0)
        loss, st = draft_loss(build_draft(tiny_mm, kind, **kw), [sample], image_id, _draft_cfg(**kw))
        assert st["n"] > 0 and torch.isfinite(loss)


def test_work_data_is_bound_to_its_config(tmp_path):
    from mmfast.errors import InputError
    from mmfast.train.common import bind_work_data

    bind_work_data(tmp_path, {"seed": 0, "n_train": 4}, "data.json")
    bind_work_data(tmp_path, {"seed": 0, "n_train": 4}, "data.json")  # same data: resuming is fine
    with pytest.raises(InputError, match="seed: 0 -> 1"):
        bind_work_data(tmp_path, {"seed": 1, "n_train": 4}, "data.json")


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("train_drafts", ["--draft", "msd", "--model", "{missing}"], "does not exist"),
        ("train_hicom", ["--model", "{missing}"], "does not exist"),
        ("train_dynamic_llava", ["--model", "{missing}"], "does not exist"),
        ("train_dynamic_llava", ["--llm-lr", "1e-5"], "pass model_out"),
        (
            "train_drafts",
            ["--draft", "msd", "--model", "{missing}", "--checkpoint-every", "0"],
            "--checkpoint-every must be > 0",
        ),
        ("train_hicom", ["--model", "{missing}", "--batch", "0"], "--batch must be > 0"),
        ("train_dynamic_llava", ["--model", "{missing}", "--epochs", "0"], "--epochs must be > 0"),
    ],
)
def test_training_scripts_exit_2_on_bad_input(script, argv, message, tmp_path, monkeypatch, capsys, caplog):
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{script}.py"
    argv = [a.replace("{missing}", str(tmp_path / "no-model")) for a in argv]
    monkeypatch.setattr(sys, "argv", [str(path), *argv, "--work", str(tmp_path / "work")])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(path), run_name="__main__")
    assert exc.value.code == 2
    assert message in capsys.readouterr().err + caplog.text


def test_object_mentions_follow_each_tokenizer_not_a_reused_id():
    # world_data cached the category nouns' token sequences by id(tokenizer): a tokenizer created after an
    # earlier one was freed often gets its id, and was read with the old vocabulary ("a red dog" -> "cat", "dog")
    import gc
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mmfast.train.world_data import _mentions
    from mmfast.world import CATEGORIES

    dog = [c.name for c in CATEGORIES].index("dog")
    words = ["a", "red", "dog", "cat"]
    for trial in range(40):
        random.Random(trial).shuffle(words)
        t = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")
        ids = tok("a red dog", add_special_tokens=False)["input_ids"]
        assert _mentions(tok, ids) == [(2, dog)], f"tokenizer {trial} with vocabulary {words}"
        del tok, t
        gc.collect()
