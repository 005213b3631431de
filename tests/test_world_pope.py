"""World POPE versions: ``official`` (the RUCAIBox/POPE construction rule) and ``v1`` (the earlier files).

The official rule is re-derived here, independently of mmfast.world.pope_official, from the POPE
release's description: positives = the first 3 listed objects; frequency and co-occurrence lists
sorted by count with ties in first-appearance order; images in drawn order; one random stream.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from pathlib import Path

import pytest

from mmfast.world import render_image, write_world
from mmfast.world.categories import CATEGORY_BY_NAME
from mmfast.world.pope_build import (
    KNOWN_WORLD_POPE,
    POPE_SPLITS,
    build_pope,
    pope_file_name,
    read_pope,
    verify_pope,
)
from mmfast.world.pope_official import (
    GroundTruthObjects,
    build_pope_official,
    object_statistics,
    official_rng,
    read_objects,
)
from mmfast.world.scenes import sample_count, sample_objects, sample_scene
from mmfast.world.text import object_question

REPO = Path(__file__).resolve().parents[1]


def _ranked(counts: list[tuple[str, int]]) -> list[str]:
    """Names by count, descending; equal counts in the order given (first appearance).
    Selection by hand (repeatedly take the first maximum), not a sort."""
    left = list(counts)
    out = []
    while left:
        best = max(c for _, c in left)
        k = next(i for i, (_, c) in enumerate(left) if c == best)
        out.append(left.pop(k)[0])
    return out


def _official_reference(records: list[GroundTruthObjects], n_images: int, seed: int) -> dict[str, list[tuple]]:
    """The official construction, written out step by step; returns split -> [(image, text, label)]."""
    rng = official_rng(seed)  # the seeded stand-in for POPE's global ``random`` state
    eligible = [r for r in records if len(r.objects) >= 3]
    pool = rng.sample(eligible, min(n_images, len(eligible)))
    first_seen: list[str] = []
    count: list[int] = []
    pair_first: dict[str, list[str]] = {}
    pair_count: dict[tuple[str, str], int] = {}
    for r in pool:
        for o in r.objects:
            if o in first_seen:
                count[first_seen.index(o)] += 1
            else:
                first_seen.append(o)
                count.append(1)
            pair_first.setdefault(o, [])
            for x in r.objects:
                if x == o:
                    continue
                if (o, x) not in pair_count:
                    pair_first[o].append(x)
                    pair_count[(o, x)] = 0
                pair_count[(o, x)] += 1
    popular = _ranked(list(zip(first_seen, count)))
    adversarial = {o: _ranked([(x, pair_count[(o, x)]) for x in xs]) for o, xs in pair_first.items()}
    out: dict[str, list[tuple]] = {}
    for split in ("random", "popular", "adversarial"):
        rows = []
        for r in pool:
            history: list[str] = []
            for i in range(3):
                pos = r.objects[i]
                history.append(pos)
                rows.append((r.image, object_question(pos), "yes"))
                cands = [] if split == "random" else popular if split == "popular" else adversarial[pos]
                neg = None
                for c in cands:
                    if c not in history and c not in r.objects:
                        neg = c
                        break
                if neg is None:
                    neg = rng.choice(first_seen)
                    while neg in history or neg in r.objects:
                        neg = rng.choice(first_seen)
                history.append(neg)
                rows.append((r.image, object_question(neg), "no"))
        out[split] = rows
    return out


def _tie_records() -> list[GroundTruthObjects]:
    """12 images over 9 objects with many equal frequencies and co-occurrence counts; object names
    are chosen so that first-appearance order differs from alphabetical and COCO-id order."""
    rnd = random.Random(5)
    names = ["vase", "apple", "tv", "bed", "cup", "bench", "dog", "sink", "kite"]
    recs = []
    for i in range(12):
        objs = rnd.sample(names, rnd.choice([3, 3, 4, 5]))
        recs.append(GroundTruthObjects(f"img{i}.png", i + 1, tuple(objs)))
    recs.append(GroundTruthObjects("two.png", 99, ("dog", "cat")))  # not eligible (2 objects)
    return recs


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_official_builder_equals_the_rule_recomputed(seed: int) -> None:
    recs = _tie_records()
    for n_images in (12, 8):
        got = build_pope_official(recs, n_images=n_images, seed=seed)
        ref = _official_reference(recs, n_images, seed)
        for split in POPE_SPLITS:
            rows = [(q.image, q.text, q.label) for q in got[split]]
            assert rows == ref[split], (seed, n_images, split)
            assert [q.question_id for q in got[split]] == list(range(1, len(rows) + 1))
            assert "two.png" not in {q.image for q in got[split]}


def test_ties_follow_first_appearance_not_id_or_name() -> None:
    """Hand-checked: pool order A, B, C. dog, cat and car each appear in 2 images (a tie), bird
    in 1: popular lists them in first-appearance order dog, cat, car (not cat/car/dog
    alphabetically, nor car(3)/cat(17)/dog(18) by COCO id). For dog, cat and car co-occur twice
    each (tie) and bird once: cat (seen first, in A) before car (in B)."""
    pool = [
        GroundTruthObjects("A", 1, ("dog", "cat", "bird")),
        GroundTruthObjects("B", 2, ("car", "dog", "cat")),
        GroundTruthObjects("C", 3, ("car", "dog", "x")),
    ]
    objects, by_freq, co = object_statistics(pool)
    assert objects == ["dog", "cat", "bird", "car", "x"]
    assert by_freq == ["dog", "cat", "car", "bird", "x"]
    assert co["dog"] == ["cat", "car", "bird", "x"]
    assert co["car"] == ["dog", "cat", "x"]


def test_the_builders_break_ties_differently() -> None:
    """The fixture's ties decide some negatives: v1's COCO-id tie-break would pick other objects."""
    recs = _tie_records()
    pool = official_rng(0).sample([r for r in recs if len(r.objects) >= 3], 12)
    _, by_freq, _ = object_statistics(pool)

    freq = {o: sum(o in r.objects for r in pool) for o in by_freq}
    by_id = sorted(freq, key=lambda o: (-freq[o], CATEGORY_BY_NAME[o].id))
    assert by_freq != by_id


def test_annotation_order_is_the_sampling_order() -> None:
    """``annotated_names`` is the scene model's sampled list (re-drawn here from the image's
    seed), not the area order; the official positives therefore include small objects."""
    from mmfast.world.render import image_seed

    same = checked = 0
    for iid in range(1, 41):
        a = render_image(2, "val", iid).annotation
        rng = random.Random(image_seed(2, "val", iid))  # attempt 0 of render_image
        scene = sample_scene(rng)
        names = sample_objects(scene, sample_count(rng, 3, 8), rng, 0.8, 3)
        placed = {i.name for i in a.instances}
        if scene.name == a.scene and placed <= set(names):
            checked += 1
            same += a.annotated_names() == [n for n in dict.fromkeys(names) if n in placed]
        assert sorted(a.annotated_names()) == sorted(a.object_names())
    assert checked >= 30 and same == checked
    anns = [render_image(0, "val", i).annotation for i in range(1, 61)]
    official = build_pope(anns, version="official", n_images=60, seed=0)["random"]
    by_file = {a.file_name: a for a in anns}
    ranks = [
        by_file[q.image].object_names().index(re.fullmatch(r"Is there an? (.+) in the image\?", q.text).group(1))
        for q in official
        if q.label == "yes"
    ]
    assert max(ranks) >= 3  # some positive is not among the three largest objects (v1's always are)


def test_pinned_checksums_reproduce() -> None:
    """The standard world (seed 0, 500 val images): both versions equal their pinned sha256; the
    pinned v1 files are those every committed benchmark before the official version ran on."""
    anns = [render_image(0, "val", i).annotation for i in range(1, 501)]
    for version in ("v1", "official"):
        assert verify_pope(build_pope(anns, version=version, n_images=500, seed=0), version, 0) is True
    summary = json.loads((REPO / "benchmarks/embedded_eval_full/summary.json").read_text())
    recorded = {s: f["sha256"] for s, f in summary["protocol"]["tasks"]["pope"]["files"].items()}
    # runs from before the official version record no world_version: they ran on v1
    version = summary["protocol"]["recipe"]["eval"]["pope"].get("world_version", "v1")
    assert recorded == KNOWN_WORLD_POPE[(version, 0)]
    assert KNOWN_WORLD_POPE[("official", 0)] != KNOWN_WORLD_POPE[("v1", 0)]


@pytest.fixture(scope="module")
def small_world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wp") / "w"
    write_world(root, seed=4, n_train=0, n_val=16, pope_images=12, progress=False)
    return root


def test_written_files(small_world: Path) -> None:
    """Default files are the official ones, rebuilt exactly from the written objects file; v1 files
    are written beside them; world.json records both."""
    recs = read_objects(small_world / "pope/world_objects_val.json")
    assert [r.image_id for r in recs] == list(range(1, 17))
    ref = _official_reference(recs, 12, 4)
    info = json.loads((small_world / "world.json").read_text())
    for split in POPE_SPLITS:
        qs = read_pope(small_world / "pope" / pope_file_name(split))
        assert [(q["image"], q["text"], q["label"]) for q in qs] == ref[split]
        v1 = (small_world / "pope" / pope_file_name(split, "v1")).read_bytes()
        assert info["pope"]["versions"]["v1"]["sha256"][split] == hashlib.sha256(v1).hexdigest()
    assert info["pope"]["versions"]["official"]["verified"] is None  # not the standard world


@pytest.mark.parametrize(
    "line,message",
    [
        # a string was read letter by letter: positives "p", "e", "r"
        ('{"image": "b.png", "image_id": 2, "objects": "person"}', r"objects\.json:2: expected"),
        ('{"image": "b.png", "objects": ["dog", "cat", "cup"]}', r"objects\.json:2: expected"),
        ('{"image": "b.png", "image_id": 2, "objects": ["dog", "dog", "cup", "cat"]}', r"objects\.json:2: .*\['dog'\]"),
        (
            '{"image": "b.png", "image_id": 1, "objects": ["dog", "cat", "cup"]}',
            r"objects\.json:2: duplicate image_id 1",
        ),
        ('{"image": "b.png", "image_id": 2, "objects": ["dog"', r"objects\.json:2: invalid JSON"),
    ],
)
def test_bad_objects_records_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    """The builder's input file is checked: a repeated object would be asked twice as a positive."""
    path = tmp_path / "objects.json"
    path.write_text('{"image": "a.png", "image_id": 1, "objects": ["bed", "tv", "oven"]}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_objects(path)


def test_old_world_is_upgraded_and_versions_selectable(small_world: Path, tmp_path: Path) -> None:
    """A world written before the official version (v1 content under the default names, no version
    record) gets every version on first eval use; eval.pope.world_version picks the files."""
    from mmfast.config import load_recipe
    from mmfast.eval.data import resolve_data
    from mmfast.eval.pope import generated_by_world, pope_file_info

    old = tmp_path / "old"
    shutil.copytree(small_world, old)
    info = json.loads((old / "world.json").read_text())
    for split in POPE_SPLITS:  # the layout of a world written before the official version
        (old / "pope" / pope_file_name(split, "v1")).replace(old / "pope" / pope_file_name(split))
    (old / "pope/world_objects_val.json").unlink()
    v1 = info["pope"]["versions"]["v1"]
    info["pope"] = {"rule": "old", "files": {s: pope_file_name(s) for s in POPE_SPLITS}, "sha256": v1["sha256"]}
    (old / "world.json").write_text(json.dumps(info))
    f = old / "pope/world_pope_random.json"
    assert "version v1" in generated_by_world(f, pope_file_info(f).sha256)
    for version in ("official", "v1"):
        recipe = load_recipe("world_eval", [f"eval.data.root={old}", f"eval.pope.world_version={version}"])
        data = resolve_data(recipe.eval, ["pope"])
        for split, path in data.files_of("pope").items():
            assert path.read_bytes() == (small_world / "pope" / pope_file_name(split, version)).read_bytes()
    assert "version official" in generated_by_world(f, pope_file_info(f).sha256)


def test_world_generated_at_once_by_two_processes_appears_only_complete(tmp_path: Path, monkeypatch) -> None:
    """Data-parallel workers on a fresh cache all call ensure_world: each wrote the world in place, so the
    first to finish read images the others were rewriting ("cannot identify image file"). A world now
    appears at its path only complete; the first writer wins and the others drop their copy."""
    from mmfast.eval.data import ensure_world
    from mmfast.world import generate

    root = tmp_path / "cache" / "world"
    real = generate.write_world
    writers: list[Path] = []

    def write_world(out_dir, seed=0, n_train=8000, **kw):
        writers.append(Path(out_dir))
        assert Path(out_dir) != root, "the world is written in place, where other processes read it"
        if len(writers) == 1:  # another worker finishes first, while this one is still writing
            ensure_world(root, seed)
            first = {p.name: p.read_bytes() for p in (root / "images/val").iterdir()}
            assert len(first) == 6 and (root / "world.json").is_file()
        return real(out_dir, seed, n_train, n_val=6, pope_images=4, progress=False)

    monkeypatch.setattr(generate, "write_world", write_world)
    assert ensure_world(root, 0) == root
    assert len(writers) == 2
    info = json.loads((root / "world.json").read_text())
    assert info["counts"]["val"] == 6 and info["seed"] == 0
    assert sorted(p.name for p in root.parent.iterdir()) == ["world"]  # no partial copy left behind


def test_world_written_without_pope_serves_chair_and_names_the_missing_pope_files(tmp_path: Path) -> None:
    """A world written with pope_images=0 was taken for one predating the official POPE files: every task,
    CHAIR included, was refused with "no image has 3 distinct categories; cannot build POPE"."""
    from mmfast.config import load_recipe
    from mmfast.errors import InputError
    from mmfast.eval.data import resolve_data

    root = tmp_path / "w"
    write_world(root, seed=0, n_train=0, n_val=6, pope_images=0, progress=False)
    recipe = load_recipe("world_eval", [f"eval.data.root={root}"])
    assert resolve_data(recipe.eval, ["chair"]).image_dir == root / "images" / "val"
    with pytest.raises(InputError, match=r"(?s)missing evaluation data.*world_pope_random\.json"):
        resolve_data(recipe.eval, ["pope"])
    assert not (root / "pope").exists()
