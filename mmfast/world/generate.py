"""Write the world as a COCO-format dataset (images, instances, captions, POPE, world.json).

Layout written by :func:`write_world`::

    out_dir/
      images/train/WORLD_train_000000000001.png ...   RGB PNG, image_size x image_size
      images/val/WORLD_val_000000000001.png ...
      labels/train/WORLD_train_000000000001.png ...   label maps, mode "L" PNG (see below)
      annotations/instances_{train,val}.json          COCO instances (+ scene / colour extras)
      annotations/captions_{train,val}.json           COCO captions, 5 per image
      pope/world_pope_{random,popular,adversarial}.json   POPE JSON Lines, version "official" (default)
      pope/world_pope_v1_{random,popular,adversarial}.json   POPE version "v1" (before the official rule)
      pope/world_objects_val.json                     the official POPE builder's input (objects in annotation order)
      world.json                                      protocol record (seed, config, sha256s)

Label-map pixels are ``0`` for background and ``k`` for ``CATEGORIES[k - 1]`` (see
``world.json["label_names"]``). They are written for the splits in ``label_map_splits``
(train by default); any label map can be re-rendered with
:func:`mmfast.world.render_image` or loaded with :func:`mmfast.world.load_label_map`.

Image ids start at 1 in each split. Everything is a pure function of the seed and the
arguments, so re-running gives byte-identical files (no timestamps are written).

CLI: ``python -m mmfast.world.generate --out DIR --seed 0 --n-train 8000 --n-val 500 --workers 2``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from .categories import CATEGORIES, LABEL_NAMES, coco_categories
from .pope_build import (
    DEFAULT_POPE_VERSION,
    POPE_RULES,
    POPE_VERSIONS,
    build_pope,
    verify_pope,
    write_pope,
)
from .pope_official import OBJECTS_FILE, ground_truth_objects, write_objects
from .render import WORLD_VERSION, ImageAnnotation, WorldConfig, file_name_for, render_image
from .scenes import scene_definitions
from .text import captions, text_rng

logger = logging.getLogger(__name__)

MAX_IMAGES = 1_000_000  # per split (COCO train2014 has 83k); more is a typo, not a world that fits on a disk


@dataclass(frozen=True)
class WorldSummary:
    """What :func:`write_world` wrote."""

    out_dir: Path
    n_train: int
    n_val: int
    n_pope_images: int
    seconds: float


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _render_one(task: tuple[int, str, int, WorldConfig, str, bool]) -> ImageAnnotation:
    seed, split, image_id, cfg, out_dir, save_label = task
    r = render_image(seed, split, image_id, cfg)
    root = Path(out_dir)
    r.image.save(root / "images" / split / r.annotation.file_name, format="PNG", compress_level=6)
    if save_label:
        Image.fromarray(r.label_map, "L").save(
            root / "labels" / split / r.annotation.file_name, format="PNG", compress_level=6
        )
    return r.annotation


def _render_split(
    seed: int, split: str, n: int, cfg: WorldConfig, out: Path, save_label: bool, workers: int, progress: bool
) -> list[ImageAnnotation]:
    # a previous world's files of this split that this one does not rewrite (never other files; the same
    # world written twice at once, as data-parallel evaluation workers may, deletes nothing)
    for sub, kept in (("images", n), ("labels", n if save_label else 0)):
        keep = {file_name_for(split, i) for i in range(1, kept + 1)}
        for f in (out / sub / split).glob(f"WORLD_{split}_*.png"):
            if f.name not in keep:
                f.unlink()
    (out / "images" / split).mkdir(parents=True, exist_ok=True)
    if save_label:
        (out / "labels" / split).mkdir(parents=True, exist_ok=True)
    tasks = [(seed, split, i, cfg, str(out), save_label) for i in range(1, n + 1)]
    bar = tqdm(total=n, desc=f"world {split}", unit="img", disable=not progress)
    anns: list[ImageAnnotation] = []
    if workers > 1 and n > 1:
        with mp.get_context("spawn").Pool(workers) as pool:
            for ann in pool.imap(_render_one, tasks, chunksize=16):
                anns.append(ann)
                bar.update(1)
    else:
        for t in tasks:
            anns.append(_render_one(t))
            bar.update(1)
    bar.close()
    return anns


def coco_images(anns: Sequence[ImageAnnotation]) -> list[dict[str, object]]:
    """The ``images`` list of a COCO file."""
    return [
        {"id": a.image_id, "file_name": a.file_name, "width": a.width, "height": a.height, "scene": a.scene}
        for a in anns
    ]


def coco_instances(anns: Sequence[ImageAnnotation], seed: int) -> dict[str, object]:
    """A COCO instances dict; annotations keep the per-image order (visible area, descending)."""
    rows: list[dict[str, object]] = []
    for a in anns:
        for inst in a.instances:
            rows.append(
                {
                    "id": len(rows) + 1,
                    "image_id": a.image_id,
                    "category_id": inst.category_id,
                    "bbox": list(inst.bbox),
                    "area": inst.area,
                    "iscrowd": 0,
                    "segmentation": [],
                    "visible_fraction": inst.visible_fraction,
                    "is_small": inst.is_small,
                    "color": inst.color,
                    "variant": inst.variant,
                }
            )
    return {
        "info": {"description": "mmfast generated world (COCO format)", "version": WORLD_VERSION, "seed": seed},
        "licenses": [],
        "images": coco_images(anns),
        "annotations": rows,
        "categories": coco_categories(),
    }


def coco_captions(anns: Sequence[ImageAnnotation], seed: int, per_image: int = 5) -> dict[str, object]:
    """A COCO captions dict with ``per_image`` reference captions per image."""
    rows: list[dict[str, object]] = []
    for a in anns:
        for cap in captions(a, text_rng(seed, a.split, a.image_id, "captions"), per_image):
            rows.append({"id": len(rows) + 1, "image_id": a.image_id, "caption": cap})
    return {
        "info": {"description": "mmfast generated world captions", "version": WORLD_VERSION, "seed": seed},
        "licenses": [],
        "images": coco_images(anns),
        "annotations": rows,
    }


def _dump(obj: object, path: Path) -> None:
    path.write_text(json.dumps(obj, separators=(",", ":")) + "\n", encoding="utf-8")


def write_world(
    out_dir: str | Path,
    seed: int = 0,
    n_train: int = 8000,
    n_val: int = 500,
    image_size: int = 192,
    *,
    pope_images: int = 500,
    captions_per_image: int = 5,
    workers: int = 1,
    label_map_splits: Sequence[str] = ("train",),
    config: WorldConfig | None = None,
    progress: bool = True,
) -> WorldSummary:
    """Generate and write the whole world (see the module docstring for the layout).

    Args:
        out_dir: Output directory (created; a previous world's images, label maps and POPE files there
            are replaced, other files are kept).
        seed: World seed; the output is a pure function of the arguments.
        n_train: Number of train images.
        n_val: Number of val images.
        image_size: Image side in pixels (ignored when ``config`` is given).
        pope_images: Number of val images drawn for POPE (fewer if not enough are eligible).
        captions_per_image: Reference captions per image.
        workers: Worker processes for rendering (1 = in-process).
        label_map_splits: Splits whose label maps are written under ``labels/``.
        config: Full generator settings (overrides ``image_size``).
        progress: Show tqdm progress bars.

    Returns:
        A :class:`WorldSummary`.

    Raises:
        ValueError: for a negative count, more than :data:`MAX_IMAGES` images in a split, ``workers < 1``,
            or too few val images for POPE.
    """
    counts = {"n_train": n_train, "n_val": n_val, "pope_images": pope_images, "captions_per_image": captions_per_image}
    for name, value in counts.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if max(n_train, n_val) > MAX_IMAGES:
        raise ValueError(f"n_train and n_val must be <= {MAX_IMAGES}, got {n_train}, {n_val}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    t0 = time.perf_counter()
    cfg = config or WorldConfig(image_size=image_size)
    out = Path(out_dir)
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    split_anns: dict[str, list[ImageAnnotation]] = {}
    files: dict[str, str] = {}
    for split, n in (("train", n_train), ("val", n_val)):
        t = time.perf_counter()
        anns = _render_split(seed, split, n, cfg, out, split in label_map_splits, workers, progress)
        logger.info("rendered %d %s images in %.1fs", n, split, time.perf_counter() - t)
        split_anns[split] = anns
        for kind, obj in (
            ("instances", coco_instances(anns, seed)),
            ("captions", coco_captions(anns, seed, captions_per_image)),
        ):
            path = out / "annotations" / f"{kind}_{split}.json"
            _dump(obj, path)
            files[f"annotations/{path.name}"] = _sha256(path)
    n_pope = 0
    pope_info: dict[str, object] = {}
    if n_val == 0 or pope_images == 0:  # no POPE: a previous world's POPE files must not stay
        for f in [*(out / "pope").glob("world_pope_*.json"), out / "pope" / OBJECTS_FILE]:
            f.unlink(missing_ok=True)
    else:
        standard = cfg == WorldConfig() and n_val == 500 and pope_images == 500
        try:
            pope_info, n_pope, pope_sha = _write_pope_versions(out, split_anns["val"], seed, pope_images, standard)
        except ValueError as e:
            raise ValueError(
                f"POPE over {n_val} val images: {e}; generate more val images or pass pope_images=0 (--pope-images 0)"
            ) from e
        files.update(pope_sha)
    val_hash = hashlib.sha256()
    for a in split_anns["val"]:
        val_hash.update((out / "images" / "val" / a.file_name).read_bytes())
    info = {
        "generator": "mmfast.world",
        "version": WORLD_VERSION,
        "seed": seed,
        "config": dataclasses.asdict(cfg),
        "counts": {
            "train": n_train,
            "val": n_val,
            "pope_images": n_pope,
            "instances_train": sum(len(a.instances) for a in split_anns["train"]),
            "instances_val": sum(len(a.instances) for a in split_anns["val"]),
            "captions_per_image": captions_per_image,
        },
        "categories": [
            {"id": c.id, "name": c.name, "supercategory": c.supercategory, "label": i + 1}
            for i, c in enumerate(CATEGORIES)
        ],
        "label_names": list(LABEL_NAMES),
        "label_map_splits": [s for s in ("train", "val") if s in label_map_splits],
        "instance_order": "visible area, descending",
        "annotation_order": "scene model sampling order (Instance.sample_index; pope/world_objects_val.json)",
        "scene_model": scene_definitions(),
        "pope": pope_info,
        "sha256": files,
        "val_images_sha256": val_hash.hexdigest(),
    }
    (out / "world.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    secs = time.perf_counter() - t0
    logger.info("world written to %s in %.1fs", out, secs)
    return WorldSummary(out, n_train, n_val, n_pope, secs)


def _write_pope_versions(
    out: Path, val: list[ImageAnnotation], seed: int, pope_images: int, standard: bool
) -> tuple[dict[str, object], int, dict[str, str]]:
    """Write every POPE version and the official builder's input.

    Returns:
        (the ``pope`` record of world.json, number of POPE images, {relative path: sha256}).
    """
    objects = write_objects(out / "pope" / OBJECTS_FILE, ground_truth_objects(val))
    sha: dict[str, str] = {f"pope/{OBJECTS_FILE}": _sha256(objects)}
    versions: dict[str, object] = {}
    n_pope = 0
    for version in POPE_VERSIONS:
        splits = build_pope(val, version=version, n_images=pope_images, seed=seed)
        paths = write_pope(out / "pope", splits, version)
        n_pope = len(splits["random"]) // 6
        verified = verify_pope(splits, version, seed) if standard else None
        if verified is False:
            logger.warning(
                "world POPE %s files differ from the published checksums of seed %d: results on them "
                "are not comparable with published ones (different Pillow/numpy rendering?)",
                version,
                seed,
            )
        versions[version] = {
            "rule": POPE_RULES[version],
            "files": {s: p.name for s, p in paths.items()},
            "sha256": {s: _sha256(p) for s, p in paths.items()},
            "verified": verified,
        }
        sha.update({f"pope/{p.name}": _sha256(p) for p in paths.values()})
    if n_pope < pope_images:
        logger.warning(
            "only %d val images have >= 3 categories; POPE uses %d images instead of %d", n_pope, n_pope, pope_images
        )
    logger.info("POPE: %d images, %d questions per split, versions %s", n_pope, 6 * n_pope, ", ".join(POPE_VERSIONS))
    default = versions[DEFAULT_POPE_VERSION]
    info = {
        "default_version": DEFAULT_POPE_VERSION,
        "rule": default["rule"],  # type: ignore[index]
        "files": default["files"],
        "sha256": default["sha256"],  # type: ignore[index]
        "objects_file": OBJECTS_FILE,
        "versions": versions,
    }
    return info, n_pope, sha


def pope_versions_present(root: str | Path) -> bool:
    """Whether the world at ``root`` has every POPE version's files (worlds written before the
    ``official`` version have only the v1 files, under the names the official ones now use)."""
    try:
        info = json.loads((Path(root) / "world.json").read_text(encoding="utf-8"))
        versions = info["pope"]["versions"]
        return all(
            (Path(root) / "pope" / name).is_file() for v in POPE_VERSIONS for name in versions[v]["files"].values()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def written_without_pope(root: str | Path) -> bool:
    """Whether the world at ``root`` was written without POPE files on purpose (``pope_images=0`` or no
    val images): there is nothing to upgrade, and tasks other than POPE can use it."""
    try:
        info = json.loads((Path(root) / "world.json").read_text(encoding="utf-8"))
        return not info["pope"] and int(info["counts"]["pope_images"]) == 0
    except (OSError, ValueError, KeyError, TypeError):
        return False


def upgrade_pope(root: str | Path) -> bool:
    """Add the missing POPE versions to a world written before them; True if it was upgraded.

    The val annotations are re-rendered from the seed and config in ``world.json`` (no image is
    rewritten) and must reproduce the recorded ``instances_val.json`` checksum; then every POPE
    version is written and ``world.json`` updated. Raises ``ValueError`` if the re-rendered
    annotations differ (a different renderer: regenerate the world instead).
    """
    from .dataset import load_world_info, world_config

    root = Path(root)
    if pope_versions_present(root):
        return False
    info = load_world_info(root)
    seed, cfg, counts = int(info["seed"]), world_config(info), info["counts"]
    val = [render_image(seed, "val", i, cfg).annotation for i in range(1, int(counts["val"]) + 1)]
    recorded = info["sha256"].get("annotations/instances_val.json")
    rendered = (json.dumps(coco_instances(val, seed), separators=(",", ":")) + "\n").encode()
    if hashlib.sha256(rendered).hexdigest() != recorded:
        raise ValueError(f"{root}: re-rendered val annotations differ from instances_val.json; regenerate the world")
    pope_images = int(counts["pope_images"])
    standard = cfg == WorldConfig() and len(val) == 500 and pope_images == 500
    pope_info, _, sha = _write_pope_versions(root, val, seed, pope_images, standard)
    info["pope"] = pope_info
    info["sha256"].update(sha)
    info["annotation_order"] = "scene model sampling order (Instance.sample_index; pope/world_objects_val.json)"
    (root / "world.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``python -m mmfast.world.generate --out DIR ...``; bad arguments exit 2."""
    ap = argparse.ArgumentParser(prog="python -m mmfast.world.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=8000)
    ap.add_argument("--n-val", type=int, default=500)
    ap.add_argument("--image-size", type=int, default=192)
    ap.add_argument("--pope-images", type=int, default=500)
    ap.add_argument("--workers", type=int, default=1, help="rendering processes")
    ap.add_argument("--val-label-maps", action="store_true", help="also write label maps for val")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for opt, value in (("--n-train", args.n_train), ("--n-val", args.n_val), ("--pope-images", args.pope_images)):
        if value < 0 or (opt != "--pope-images" and value > MAX_IMAGES):
            ap.error(f"{opt} must be in [0, {MAX_IMAGES}], got {value}")
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    try:
        cfg = WorldConfig(image_size=args.image_size)
    except ValueError as e:
        ap.error(f"--image-size: {e}")
    splits = ("train", "val") if args.val_label_maps else ("train",)
    try:
        s = write_world(
            args.out,
            args.seed,
            args.n_train,
            args.n_val,
            pope_images=args.pope_images,
            workers=args.workers,
            label_map_splits=splits,
            config=cfg,
            progress=not args.no_progress,
        )
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 2
    logger.info("done: %d train, %d val, %d POPE images, %.1fs", s.n_train, s.n_val, s.n_pope_images, s.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
