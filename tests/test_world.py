"""Tests of the generated image world (mmfast.world): determinism, COCO / POPE formats, text."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mmfast.world import (
    CATEGORIES,
    CATEGORY_BY_NAME,
    DETAIL_PROMPT,
    LABEL_NAMES,
    SCENE_BY_NAME,
    SCENES,
    WorldConfig,
    captions,
    detailed_description,
    load_annotations,
    load_captions,
    load_label_map,
    object_question,
    read_pope,
    render_image,
    short_qa,
    text_rng,
    world_corpus,
    write_world,
    yes_no_questions,
)
from mmfast.world.generate import main as generate_main
from mmfast.world.pope_build import POPE_SPLITS, pool_statistics

N_VAL = 60
N_POPE = 40

# CHAIR synonyms (Rohrbach et al. 2018, data/synonyms.txt) for the categories of the world.
_SYNONYMS = """person, girl, boy, man, woman, kid, child, people, adult, children, lady, guy
bicycle, bike
car, automobile, van, minivan, sedan, suv, cab, jeep, taxi
motorcycle, scooter, motorbike, moped
bus, minibus, trolley
truck, pickup, lorry, firetruck
traffic light, street light, traffic signal, stop light, streetlight, stoplight
fire hydrant, hydrant
stop sign
bench, pew
bird, pigeon, sparrow, duck, seagull
cat, kitten, feline, tabby
dog, puppy, pup, doggie, doggy, canine
horse, colt, pony
backpack, knapsack
umbrella
frisbee
sports ball, ball
kite
skateboard
bottle
wine glass
cup
fork
knife, knive
spoon
bowl, container
banana
apple
orange
pizza
donut, doughnut
chair, seat, stool
couch, sofa
potted plant, houseplant
bed
dining table, table, desk
tv, monitor, television
laptop, computer, notebook, laptop computer
mouse
remote
keyboard
cell phone, mobile phone, phone, cellphone, smartphone
microwave
sink
refrigerator, fridge
book
clock
vase
teddy bear, teddybear"""
_INVERSE = {s.strip(): line.split(",")[0] for line in _SYNONYMS.splitlines() for s in line.split(",")}
_ALL_COCO_WORDS = {
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "train",
    "boat",
    "airplane",
    "plane",
    "tie",
    "suitcase",
    "skis",
    "snowboard",
    "surfboard",
    "toilet",
    "oven",
    "stove",
    "toaster",
    "scissors",
    "toothbrush",
    "sandwich",
    "broccoli",
    "carrot",
    "cake",
    "handbag",
    "racket",
    "glove",
    "bat",
}


def _singular(w: str) -> str:
    if w in _INVERSE or w in ("people", "children"):
        return w
    if re.search(r"[^aeiou]ies$", w):
        return w[:-3] + "y"
    if re.search(r"(ses|xes|zes|ches|shes)$", w):
        return w[:-2]
    if w.endswith("s") and not w.endswith("ss"):
        return w[:-1]
    return w


def chair_objects(text: str) -> list[str]:
    """CHAIR-style object extraction (tokenise, singularise, double words, synonyms)."""
    words = [_singular(w) for w in re.findall(r"[a-z]+", text.lower())]
    out: list[str] = []
    i = 0
    while i < len(words):
        two = " ".join(words[i : i + 2])
        if two in _INVERSE and " " in two:
            out.append(_INVERSE[two])
            i += 2
            continue
        if words[i] in _INVERSE:
            out.append(_INVERSE[words[i]])
        assert words[i] not in _ALL_COCO_WORDS, f"{words[i]!r} names a COCO category not in the world: {text}"
        i += 1
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world")
    write_world(out, seed=3, n_train=8, n_val=N_VAL, pope_images=N_POPE, progress=False)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_render_is_deterministic() -> None:
    a, b = render_image(7, "val", 5), render_image(7, "val", 5)
    assert a.image.tobytes() == b.image.tobytes()
    assert np.array_equal(a.label_map, b.label_map) and np.array_equal(a.instance_map, b.instance_map)
    assert a.annotation == b.annotation
    c = render_image(7, "val", 6)
    assert c.image.tobytes() != a.image.tobytes()
    assert render_image(7, "train", 5).image.tobytes() != a.image.tobytes()
    assert a.image.size == (192, 192) and a.image.mode == "RGB"


def test_smallest_image_size_renders() -> None:
    # WorldConfig accepts image_size >= 32, but the living-room rug asked randint(hz + 10, hz + (s - hz) // 2)
    # with a floor under 20 px: ValueError "empty range for randrange()" (ids 2, 8, 15 of seed 0 at 32 px)
    cfg = WorldConfig(image_size=32)
    for iid in (2, 8, 15):
        r = render_image(0, "val", iid, cfg)
        assert r.image.size == (32, 32) and r.annotation.scene == "living room"
    assert render_image(0, "val", 2, WorldConfig(image_size=40)).image.size == (40, 40)


def test_write_world_is_byte_identical(world: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    write_world(again, seed=3, n_train=8, n_val=N_VAL, pope_images=N_POPE, progress=False)
    first, second = _files(world), _files(again)
    assert first.keys() == second.keys()
    assert all(first[k] == second[k] for k in first), [k for k in first if first[k] != second[k]]
    other = tmp_path / "other"
    write_world(other, seed=4, n_train=0, n_val=12, pope_images=5, progress=False)
    assert (other / "images/val/WORLD_val_000000000001.png").read_bytes() != first[
        "images/val/WORLD_val_000000000001.png"
    ]


def test_workers_give_the_same_bytes(tmp_path: Path) -> None:
    write_world(tmp_path / "a", seed=1, n_train=0, n_val=10, pope_images=4, workers=1, progress=False)
    write_world(tmp_path / "b", seed=1, n_train=0, n_val=10, pope_images=4, workers=2, progress=False)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")


def test_coco_instances_roundtrip(world: Path) -> None:
    cat_ids = {
        c["id"]: c["name"] for c in json.loads((world / "annotations/instances_val.json").read_text())["categories"]
    }
    assert cat_ids[1] == "person" and cat_ids[72] == "tv" and cat_ids[73] == "laptop" and cat_ids[18] == "dog"
    assert len(cat_ids) >= 28
    for split, n in (("train", 8), ("val", N_VAL)):
        coco = json.loads((world / f"annotations/instances_{split}.json").read_text())
        images = {im["id"]: im for im in coco["images"]}
        assert len(images) == n and sorted(images) == list(range(1, n + 1))
        assert len({a["id"] for a in coco["annotations"]}) == len(coco["annotations"])
        for a in coco["annotations"]:
            im = images[a["image_id"]]
            assert a["category_id"] in cat_ids and a["iscrowd"] == 0 and isinstance(a["segmentation"], list)
            x, y, w, h = a["bbox"]
            assert x >= 0 and y >= 0 and w > 0 and h > 0 and x + w <= im["width"] and y + h <= im["height"]
            assert 0 < a["area"] <= w * h and 0 < a["visible_fraction"] <= 1
        for im in images.values():
            assert (world / "images" / split / im["file_name"]).is_file()
            assert im["scene"] in SCENE_BY_NAME and re.fullmatch(rf"WORLD_{split}_\d{{12}}\.png", im["file_name"])
    info = json.loads((world / "world.json").read_text())
    assert info["seed"] == 3 and info["label_names"] == list(LABEL_NAMES)
    assert set(info["pope"]["sha256"]) == set(POPE_SPLITS) and info["pope"]["default_version"] == "official"
    assert {v: set(r["sha256"]) for v, r in info["pope"]["versions"].items()} == {
        "official": set(POPE_SPLITS),
        "v1": set(POPE_SPLITS),
    }


def test_captions_file_and_synonyms(world: Path) -> None:
    coco = json.loads((world / "annotations/captions_val.json").read_text())
    assert {"images", "annotations"} <= coco.keys()
    caps = load_captions(world, "val")
    anns = {a.image_id: a for a in load_annotations(world, "val")}
    assert set(caps) == set(anns) and all(len(c) == 5 for c in caps.values())
    words: Counter[str] = Counter()
    for iid, cs in caps.items():
        gt = set(anns[iid].object_names())
        for c in cs:
            assert c[0].isupper() and c.endswith(".") and c[1:] == c[1:].lower()
            found = chair_objects(c)
            assert found, c
            assert set(found) <= gt, (c, gt)  # reference captions never hallucinate
            words.update(re.findall(r"[a-z]+", c.lower()))
    canonical = {c.name for c in CATEGORIES}
    synonyms = {sg for c in CATEGORIES for sg, _ in c.nouns[1:]} | {"man", "woman", "people", "child", "kid"}
    assert sum(words[w] for w in synonyms if w not in canonical) > 10
    assert any(re.match(r"(Two|Three|Four) ", c) or " two " in c for cs in caps.values() for c in cs)


def test_pope_v1_rule(world: Path) -> None:
    """POPE version v1 (area-ordered positives, ties by COCO id); the official version is checked in
    tests/test_world_pope.py."""
    anns = {a.file_name: a for a in load_annotations(world, "val")}
    splits = {s: read_pope(world / f"pope/world_pope_v1_{s}.json") for s in POPE_SPLITS}
    images = None
    for split, qs in splits.items():
        assert len(qs) == 6 * N_POPE and [q["question_id"] for q in qs] == list(range(1, len(qs) + 1))
        assert Counter(q["label"] for q in qs) == {"yes": 3 * N_POPE, "no": 3 * N_POPE}
        order = list(dict.fromkeys(q["image"] for q in qs))
        images = images or order
        assert order == images and len(order) == N_POPE  # same images in all splits
        assert order == sorted(order)  # v1 orders the pool by image id
        pool = [anns[f] for f in order]
        _, by_freq, co = pool_statistics(pool)
        for k, a in enumerate(pool):
            block = qs[6 * k : 6 * k + 6]
            assert [q["label"] for q in block] == ["yes", "no"] * 3
            assert all(q["image"] == a.file_name and q["image_id"] == a.image_id for q in block)
            objs = [re.fullmatch(r"Is there an? (.+) in the image\?", q["text"]).group(1) for q in block]
            assert all(q["text"] == object_question(o) for q, o in zip(block, objs))
            pos, neg = objs[0::2], objs[1::2]
            assert pos == a.object_names()[:3]
            present = set(a.object_names())
            assert len(set(neg)) == 3 and not set(neg) & present
            used: list[str] = []
            for p, n in zip(pos, neg):
                used.append(p)
                valid = [
                    o for o in (by_freq if split == "popular" else co.get(p, [])) if o not in present and o not in used
                ]
                if split == "popular":
                    assert n == valid[0]
                elif split == "adversarial" and valid:
                    assert n == valid[0] and n in co[p]
                used.append(n)
    assert not any("imange" in q["text"] for qs in splits.values() for q in qs)


def test_label_map_matches_instances(world: Path) -> None:
    for iid in range(1, 16):
        r = render_image(3, "val", iid)
        lm, im = r.label_map, r.instance_map
        assert lm.shape == (192, 192) and lm.dtype == np.uint8 and lm.max() < len(LABEL_NAMES)
        assert (lm == 0).any()
        for k, inst in enumerate(r.annotation.instances, start=1):
            assert LABEL_NAMES[inst.label] == inst.name
            ys, xs = np.nonzero(im == k)
            assert len(xs) == inst.area  # never fully occluded: visible_fraction >= min_visible
            assert (xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1) == inst.bbox
            assert (lm[im == k] == inst.label).all()
        assert set(np.unique(lm)) - {0} == {i.label for i in r.annotation.instances}
        areas = [i.area for i in r.annotation.instances]
        assert areas == sorted(areas, reverse=True)
        assert np.array_equal(load_label_map(world, "val", iid), lm)  # re-rendered from world.json
    train_ids = [a.image_id for a in load_annotations(world, "train")]
    assert np.array_equal(load_label_map(world, "train", train_ids[0]), render_image(3, "train", 1).label_map)


def test_scene_cooccurrence_statistics() -> None:
    in_scene = total = 0
    scenes: Counter[str] = Counter()
    n_inst: list[int] = []
    for iid in range(1, 241):
        a = render_image(11, "train", iid).annotation
        scenes[a.scene] += 1
        typ = set(SCENE_BY_NAME[a.scene].typical_names)
        in_scene += sum(i.name in typ for i in a.instances)
        total += len(a.instances)
        n_inst.append(len(a.instances))
        assert len(a.object_names()) >= 3
    assert set(scenes) == {s.name for s in SCENES}
    assert 0.75 <= in_scene / total <= 0.92
    assert np.mean(n_inst) >= 4.5 and max(n_inst) <= 8
    assert np.mean([n >= 4 for n in n_inst]) > 0.6
    small = [i.is_small for iid in range(1, 41) for i in render_image(11, "train", iid).annotation.instances]
    assert 0.15 < np.mean(small) < 0.7


def test_text_generators() -> None:
    for iid in range(1, 30):
        a = render_image(5, "val", iid).annotation
        rng = text_rng(5, "val", iid, "test")
        d = detailed_description(a, rng)
        assert d.endswith(".") and 2 <= len(re.findall(r"\.(?:\s|$)", d)) <= 5
        assert a.scene in d and set(chair_objects(d)) == set(a.object_names())
        qs = yes_no_questions(a, rng)
        assert Counter(q.answer for q in qs) == {"Yes": len(a.object_names()), "No": len(a.object_names())}
        for q in qs:
            name = re.fullmatch(r"Is there an? (.+) in the image\?", q.question).group(1)
            assert (name in a.object_names()) == (q.answer == "Yes")
        for q in short_qa(a, rng, k=5):
            assert q.answer[0].isupper() and not q.answer.endswith(".")
            if q.kind == "count":
                assert q.answer in ("One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight")
        assert len(captions(a, rng)) == 5
    assert object_question("apple") == "Is there an apple in the image?"
    assert object_question("dog") == "Is there a dog in the image?"
    texts = list(world_corpus(seed=0, n_images=5))
    assert DETAIL_PROMPT in texts and "Describe the image briefly." in texts and "Yes" in texts
    assert all(isinstance(t, str) and t for t in texts)
    assert CATEGORY_BY_NAME["dog"].label == LABEL_NAMES.index("dog")


def test_cli_writes_a_world(tmp_path: Path) -> None:
    rc = generate_main(
        ["--out", str(tmp_path), "--seed", "2", "--n-train", "2", "--n-val", "8", "--pope-images", "4", "--no-progress"]
    )
    assert rc == 0
    assert len(read_pope(tmp_path / "pope/world_pope_adversarial.json")) == 24
    assert (tmp_path / "labels/train/WORLD_train_000000000001.png").is_file()


def test_rewriting_a_world_drops_the_previous_worlds_files(tmp_path: Path) -> None:
    # a world re-written into the same directory with fewer images / no val label maps kept the old
    # world's files: load_label_map returned the old seed's label map, the image dir (CHAIR's pool) held
    # images without annotations
    write_world(tmp_path, seed=0, n_train=2, n_val=12, pope_images=4, label_map_splits=("train", "val"), progress=False)
    write_world(tmp_path, seed=1, n_train=1, n_val=8, pope_images=0, progress=False)
    assert np.array_equal(load_label_map(tmp_path, "val", 1), render_image(1, "val", 1).label_map)
    assert len(list((tmp_path / "images/val").iterdir())) == len(load_annotations(tmp_path, "val")) == 8
    assert [p.name for p in (tmp_path / "labels/train").iterdir()] == ["WORLD_train_000000000001.png"]
    assert not list((tmp_path / "pope").iterdir())


def _no_rendering(monkeypatch) -> None:
    """A bad count must be refused before any image is rendered (accepted, 10**9 images would run for days)."""

    def refuse(*args, **kwargs):
        raise AssertionError("rendering started: the bad count was accepted")

    monkeypatch.setattr("mmfast.world.generate._render_one", refuse)


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"n_train": -1}, "n_train"),
        ({"n_val": -2}, "n_val"),
        ({"n_val": 10**9}, "n_val"),
        ({"pope_images": -1}, "pope_images"),
        ({"workers": 0}, "workers"),
    ],
)
def test_write_world_refuses_bad_counts(kwargs: dict, what: str, tmp_path: Path, monkeypatch) -> None:
    _no_rendering(monkeypatch)
    args = {"n_train": 0, "n_val": 4, "pope_images": 2, **kwargs}
    with pytest.raises(ValueError, match=what):
        write_world(tmp_path / "w", seed=0, progress=False, **args)
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--n-train", "-3"],
        ["--n-train", "8000000000"],
        ["--n-val", "-1"],
        ["--pope-images", "-1"],
        ["--workers", "0"],
        ["--image-size", "5000"],
    ],
)
def test_cli_bad_arguments_exit_2(
    args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    _no_rendering(monkeypatch)
    with pytest.raises(SystemExit) as e:
        generate_main(["--out", str(tmp_path / "w"), "--no-progress", *args])
    assert e.value.code == 2 and args[0] in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_cli_unusable_output_or_too_few_val_images_exit_2(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a traceback before: POPE over 1 val image has no absent object for a negative; --out a file
    argv = ["--n-train", "0", "--n-val", "1", "--pope-images", "1", "--no-progress"]
    with caplog.at_level("ERROR"):
        assert generate_main(["--out", str(tmp_path / "w"), *argv]) == 2
    assert "more val images" in caplog.text and "--pope-images 0" in caplog.text
    (tmp_path / "file").write_text("x")
    assert generate_main(["--out", str(tmp_path / "file"), *argv]) == 2
