"""Training plumbing: work directories bound to their weights; the embedded trainer's refine rounds."""

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
