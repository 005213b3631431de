"""POPE: question files, known file versions, answer parsers and metrics.

POPE (Li et al., EMNLP 2023; code RUCAIBox/POPE) asks "Is there a {object} in the image?" with
balanced yes/no labels, in three splits (random, popular, adversarial). The number depends on the
question-file version and on the rule that maps a free-form answer to yes/no, so this module:

* reads the official files (JSON Lines, and the pretty-printed JSON arrays of the A-OKVQA/GQA
  variants) with errors that name the file and line;
* identifies a file by checksum against ``KNOWN_POPE_FILES`` (every COCO version in the
  RUCAIBox/POPE history plus the copies that VCD/DAMRO/OPERA ship), so a result can say which
  version it used, and ``strict=True`` refuses anything else;
* implements the four answer rules seen in published code as named parser modes (``PARSER_MODES``),
  with an explicit count of answers that the rule could only map by default (``n_unknown``);
* computes accuracy/precision/recall/F1 with "yes" as the positive class and ``yes_ratio`` from the
  *predictions* (lmms-eval computes it from the ground truth, which is always 0.5).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

from ..errors import InputError

logger = logging.getLogger(__name__)

Label = Literal["yes", "no"]
ParserMode = Literal["pope", "opera", "vcd", "lmms"]
PARSER_MODES: tuple[str, ...] = ("pope", "opera", "vcd", "lmms")
_REQUIRED_KEYS = ("question_id", "image", "text", "label")


class PopeFormatError(InputError):
    """A POPE question or answer file is malformed; the message names the file and line/item."""


class UnknownPopeFileError(InputError):
    """``strict=True`` and the file's checksum is not in ``KNOWN_POPE_FILES``."""


# ---------------------------------------------------------------------------------------------
# Known file versions (checksums only; the files themselves are not shipped)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KnownPopeFile:
    """One published POPE question file, identified by the md5 of its exact bytes.

    ``md5_lf`` is the md5 after converting CRLF to LF (equal to ``md5`` for LF files): the
    RUCAIBox/POPE COCO files are mostly CRLF while VCD/DAMRO ship LF copies of the same content.
    ``commit`` is the commit that introduced these bytes in ``repo``; ``n_typos`` counts the
    generator's "imange" typo; ``users`` lists the evaluation code known to read this file.
    """

    md5: str
    sha256: str
    md5_lf: str
    dataset: str
    split: str
    repo: str
    commit: str
    path: str
    n_lines: int
    n_yes: int
    n_no: int
    n_typos: int
    line_endings: Literal["crlf", "lf"]
    users: tuple[str, ...] = ()
    note: str = ""

    @property
    def n_questions(self) -> int:
        return self.n_yes + self.n_no


_POPE = "RUCAIBox/POPE"
_VCD = "DAMO-NLP-SG/VCD"
_C_E3E = "e3e39262c85a6a83f26cf5094022a782cb0df58d"  # 2023-08-10 "Upload MSCOCO POPE dataset"
_C_7EF = "7ef3026faa9a89ed11fd508385fad652fdc6349f"  # 2023-08-04 "Update original pope dataset"
_C_EDE = "edebdda36a969afac02bc49972c48c38e24dc6fe"  # 2023-10-09 "Fix spelling errors"
_C_109 = "109985c74a00a88ba5341f9b0c1d4900f2a1f789"  # 2023-11-16 "Fix spelling errors" (last data change)
_C_9B5 = "9b5410653a70098c433574841a1804b89f573575"  # 2023-10-26 SEEM-based A-OKVQA and GQA
_C_VCD_COCO = "039af55ecd68005ea767b8579a5766f038a780ad"  # 2023-11-28
_C_VCD_SEEM = "1bb047819da691320474cc0d2d3dd1c3e247ec4a"  # 2023-11-28
_OLD_USERS = (
    "LLaVA-1.5 official eval (commit cited in LLaVA#626)",
    "OPERA (byte-identical copy in shikiw/OPERA pope_coco/)",
)
_VCD_USERS = (
    "VCD (byte-identical copy)",
    "DAMRO (byte-identical copy in coder-gx/DAMRO)",
    "RITUAL (scripts point at VCD's copy)",
)
_E3E_NOTE = (
    "identical to the initial commit 28f884a; random has 2910 questions (1500 yes/1410 no) and the 'imange' typo"
)


def _coco(
    split: str,
    md5: str,
    sha256: str,
    md5_lf: str,
    commit: str,
    n_no: int,
    typos: int,
    users: tuple[str, ...],
    note: str,
    *,
    repo: str = _POPE,
    endings: str = "crlf",
    path: str | None = None,
) -> KnownPopeFile:
    return KnownPopeFile(
        md5=md5,
        sha256=sha256,
        md5_lf=md5_lf,
        dataset="coco",
        split=split,
        repo=repo,
        commit=commit,
        path=path or f"output/coco/coco_pope_{split}.json",
        n_lines=1500 + n_no,
        n_yes=1500,
        n_no=n_no,
        n_typos=typos,
        line_endings=endings,  # type: ignore[arg-type]
        users=users,
        note=note,
    )


def _seem(dataset: str, split: str, md5: str, sha256: str, *, vcd: bool) -> KnownPopeFile:
    pope = KnownPopeFile(
        md5=md5,
        sha256=sha256,
        md5_lf=md5,
        dataset=dataset,
        split=split,
        repo=_POPE,
        commit=_C_9B5,
        path=f"output/seem/{dataset}/{dataset}_pope_seem_{split}.json",
        n_lines=18001,
        n_yes=1500,
        n_no=1500,
        n_typos=0,
        line_endings="lf",
        users=(),
        note="pretty-printed JSON array (SEEM-based objects)",
    )
    if not vcd:
        return pope
    return replace(
        pope,
        repo=_VCD,
        commit=_C_VCD_SEEM,
        path=f"experiments/data/POPE/{dataset}/{dataset}_pope_{split}.json",
        n_lines=3000,
        users=_VCD_USERS,
        note=f"JSON Lines copy of the same records as RUCAIBox/POPE@{_C_9B5[:7]}",
    )


#: Every known POPE question file. Computed from the git history of RUCAIBox/POPE and the copies in
#: DAMO-NLP-SG/VCD, coder-gx/DAMRO and shikiw/OPERA (see docs of ``KnownPopeFile``).
KNOWN_POPE_FILES: tuple[KnownPopeFile, ...] = (
    # --- RUCAIBox/POPE e3e3926 (== initial 28f884a): LLaVA-1.5 and OPERA --------------------
    _coco(
        "random",
        "b635b20061b1262cba65ed5bef7660a2",
        "c16b65d2df6d70bb0814c8a4375833d39cdb09928fd936d3fc546491efa37f35",
        "3ff600ad39bace65e90909c89d3602f0",
        _C_E3E,
        1410,
        144,
        _OLD_USERS,
        _E3E_NOTE,
    ),
    _coco(
        "popular",
        "8233e15e9bb7587b03a624b38a1cee74",
        "5b16653023bf4f64d57eb0d168259de6627f5cde7538b85ebed3cc33034aa6cc",
        "94918b930ef97a756e43b35570e528bf",
        _C_E3E,
        1500,
        44,
        _OLD_USERS,
        _E3E_NOTE,
    ),
    _coco(
        "adversarial",
        "b3f9df71709d436462611d7e88ce1447",
        "1d8f0906a9b50c05640f6f23abfac97523be2a1bed28f7eadc63b811699b2d26",
        "8901ed64eabb1bb582cd543eb98b6e84",
        _C_E3E,
        1500,
        58,
        _OLD_USERS,
        _E3E_NOTE,
    ),
    # --- RUCAIBox/POPE 7ef3026: short-lived version with image_id, replaced 6 days later ------
    _coco(
        "random",
        "d6611531e83a0f13ff2437ae8a0f697c",
        "cb8dec967727fbee4b9cfadf9ba1ea9968515b12063efd313d0cf8b2b4230c86",
        "7b40f5f716ee18ef5d23628b2186f9f3",
        _C_7EF,
        1500,
        0,
        (),
        "has image_id; other images than e3e3926; reverted by e3e3926",
    ),
    _coco(
        "popular",
        "294855d4cbd5215a80e7653db6cf71f5",
        "eafca6ceff32c7bbb5b2845a00c6828ec8cbaf5e04f890d6902dc46b92f96076",
        "04224876ad174055afce20b6280d8a53",
        _C_7EF,
        1500,
        0,
        (),
        "has image_id; other images than e3e3926; reverted by e3e3926",
    ),
    _coco(
        "adversarial",
        "a44d2b8249f92d287335469afe9bdda3",
        "412efc6fe25eb2604f2386d536bcf713dc88327cb20c36489b1f689f89617d04",
        "e2230daecf59910a35346acde1fcd4e7",
        _C_7EF,
        1500,
        0,
        (),
        "has image_id; other images than e3e3926; reverted by e3e3926",
    ),
    # --- RUCAIBox/POPE edebdda (random/popular unchanged at 109985c = HEAD) -------------------
    _coco(
        "random",
        "dc9b6c41ad832c48da758cfa85b37d2c",
        "ac25245170b975a5bdf9080b23fd431dfe6be458bc038259c1f4f09a6bef7994",
        "dc9b6c41ad832c48da758cfa85b37d2c",
        _C_EDE,
        1500,
        0,
        _VCD_USERS,
        "unchanged through 109985c (HEAD); VCD and DAMRO ship byte-identical copies",
        endings="lf",
    ),
    _coco(
        "popular",
        "64902313fb995e09fa478de9741910d7",
        "72c1a8ad45d0c13514f5f22598261df41d3b533854d29682e924db50ed8aa753",
        "196378cf4eed618c51a814dba75ba410",
        _C_EDE,
        1500,
        0,
        (),
        "unchanged through 109985c (HEAD); VCD/DAMRO ship this content with LF endings",
    ),
    _coco(
        "adversarial",
        "d7e0cec9b2ea24bed9614eec4b28a50f",
        "207273ac3b7fdd04df206c6809b77a4e7f60360a730ade6b7e32804e8dd5602f",
        "18fb002e51fc2fb8bff4ccd4469661b2",
        _C_EDE,
        1500,
        57,
        (),
        "57 'imange' typos left; VCD/DAMRO ship this content with LF endings",
    ),
    _coco(
        "adversarial",
        "3b1a278f8d61acd21b27020d0af817cb",
        "420b3407db1fa9f1187a805dca41cb7b97fd91504e6c2179706188c107fb8ef8",
        "c8578669d91c5e1216c483a55f019f24",
        _C_109,
        1500,
        0,
        (),
        "all typos fixed (HEAD)",
    ),
    # --- DAMO-NLP-SG/VCD LF copies of edebdda popular/adversarial (also in coder-gx/DAMRO) ---
    _coco(
        "popular",
        "196378cf4eed618c51a814dba75ba410",
        "fa3a986eb3d586ceb527371112ad7170f398835cbe0a3f08a7e888771dbd8bd6",
        "196378cf4eed618c51a814dba75ba410",
        _C_VCD_COCO,
        1500,
        0,
        _VCD_USERS,
        f"LF copy of RUCAIBox/POPE@{_C_EDE[:7]}",
        repo=_VCD,
        endings="lf",
        path="experiments/data/POPE/coco/coco_pope_popular.json",
    ),
    _coco(
        "adversarial",
        "18fb002e51fc2fb8bff4ccd4469661b2",
        "185d7eb49958c882f15d46c51d5c0456fbd5efbf24c57ff8b7adc6648870c6ac",
        "18fb002e51fc2fb8bff4ccd4469661b2",
        _C_VCD_COCO,
        1500,
        57,
        _VCD_USERS,
        f"LF copy of RUCAIBox/POPE@{_C_EDE[:7]} (57 typos)",
        repo=_VCD,
        endings="lf",
        path="experiments/data/POPE/coco/coco_pope_adversarial.json",
    ),
    # --- SEEM-based A-OKVQA and GQA: RUCAIBox JSON arrays and VCD JSONL copies --------------
    _seem(
        "aokvqa",
        "random",
        "fefaa62a6a849aa5d219c0dfc8fbbdac",
        "f06eecde6d6ef4a00b95a7bbb510490708a09a6a67d952b59b8bdd33ac2c7200",
        vcd=False,
    ),
    _seem(
        "aokvqa",
        "popular",
        "a2ead7d2a8e19ad7b570f3bcfd1d279a",
        "2ae5bedee3450cda52f9b033942c7b04a3917a86a110e859a66c1e41934c6ffd",
        vcd=False,
    ),
    _seem(
        "aokvqa",
        "adversarial",
        "93a94c763f52c9108678616e92ce47ac",
        "2ddd3bdfa0df7a77a2cb1765ed06ac5ed190b5a093aa405b96986e862e8cdac1",
        vcd=False,
    ),
    _seem(
        "gqa",
        "random",
        "fb7febb7630ea7c16870ed744e81815d",
        "6ce488eade3770185034939fabfe742fa32ed369011c8d9c3ac77bc0c85abd94",
        vcd=False,
    ),
    _seem(
        "gqa",
        "popular",
        "d70bdec01a590524073e371819566c7d",
        "dd03f06a458dd216e83233160fbf6628af9c63c84b11e99599f4fc0304b3361d",
        vcd=False,
    ),
    _seem(
        "gqa",
        "adversarial",
        "c92e5e77da5ecec97e3f626580d7e8ad",
        "74e01b41d8308e2392e3b8d961167496ff3901c01100265d931a7a392f138a7a",
        vcd=False,
    ),
    _seem(
        "aokvqa",
        "random",
        "f3096df532efd2d9b6d472a07a67c1f8",
        "900c244605e8d43626b9579a110e3631e534cddc2aff27fe91e3f080e15d4446",
        vcd=True,
    ),
    _seem(
        "aokvqa",
        "popular",
        "d8ea7a741e0b043cd365c97b4b586a8e",
        "792d586a875c197362256b25e9252cc97df6fa1dca5aca72a53eba560414d6b7",
        vcd=True,
    ),
    _seem(
        "aokvqa",
        "adversarial",
        "b110000c34a3b768995cfdfb77ae6d98",
        "87f9acb460fcb690f9120c6d69eb05cfedadab5af5eb385b5201fd48bfc6670c",
        vcd=True,
    ),
    _seem(
        "gqa",
        "random",
        "2d41cf60dde63a52d6d93ba088eb6a93",
        "1c1117ce33df2eae0d7b04827896caff1f79dac7b99b9e1b0c87a415066cff98",
        vcd=True,
    ),
    _seem(
        "gqa",
        "popular",
        "68eeb1b64295b5900dd970bd9544f113",
        "e48e138bd61dd3bc4ec35cc8d4357b4dbfc68f0e704283a92217325585a17653",
        vcd=True,
    ),
    _seem(
        "gqa",
        "adversarial",
        "6b7860069bcc85069e91424c72fd8255",
        "64a3bdeb8d24c02d175eafa5e1b24bc7fd611efa95bb87a031c880e548aef094",
        vcd=True,
    ),
)

_BY_MD5: dict[str, KnownPopeFile] = {f.md5: f for f in KNOWN_POPE_FILES}
# Fallback after CRLF->LF normalisation; where an LF copy has its own row, that row is returned.
_BY_MD5_LF: dict[str, KnownPopeFile] = {}
for _row in KNOWN_POPE_FILES:
    _BY_MD5_LF.setdefault(_row.md5_lf, _BY_MD5.get(_row.md5_lf, _row))
del _row


@dataclass(frozen=True)
class PopeFileInfo:
    """Checksums of one question file and the known version it matches (``None`` if unknown).

    ``byte_exact`` is False when the file matched only after CRLF->LF normalisation (same
    questions, different line endings).
    """

    path: str
    md5: str
    sha256: str
    known: KnownPopeFile | None
    byte_exact: bool


def pope_file_info(path: str | Path) -> PopeFileInfo:
    """Hash ``path`` (md5 and sha256) and look it up in ``KNOWN_POPE_FILES``."""
    return _file_info(path, Path(path).read_bytes())


def _file_info(path: str | Path, data: bytes) -> PopeFileInfo:
    md5 = hashlib.md5(data).hexdigest()
    sha256 = hashlib.sha256(data).hexdigest()
    known = _BY_MD5.get(md5)
    byte_exact = known is not None
    if known is None:
        known = _BY_MD5_LF.get(hashlib.md5(data.replace(b"\r\n", b"\n")).hexdigest())
        if known is not None:
            logger.info(
                "%s matches %s/%s@%s only after CRLF->LF normalisation",
                path,
                known.dataset,
                known.split,
                known.commit[:7],
            )
    return PopeFileInfo(str(path), md5, sha256, known, byte_exact)


def identify_pope_file(path: str | Path) -> KnownPopeFile | None:
    """The known published version of a POPE question file, or ``None`` (e.g. our own files)."""
    return pope_file_info(path).known


# ---------------------------------------------------------------------------------------------
# Question files
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PopeQuestion:
    """One POPE question; ``image_id`` is present only in some files (RUCAIBox 7ef3026)."""

    question_id: int | str
    image: str
    text: str
    label: Label
    image_id: int | None = None


def _parse_records(p: Path, data: bytes) -> tuple[bool, list[tuple[int, dict[str, Any]]]]:
    """(is_json_array, records) of a JSON Lines / JSON array file given as bytes."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PopeFormatError(f"{p}: not UTF-8 text ({exc})") from exc
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PopeFormatError(f"{p}:{exc.lineno}: invalid JSON array: {exc.msg}") from exc
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise PopeFormatError(f"{p}: item {i}: expected a JSON object, got {type(item).__name__}")
            out.append((i, item))
        return True, out
    out = []
    # Lines end at \n, \r\n or \r only (Python's universal newlines, how the official scripts iterate
    # a file): str.splitlines also splits at U+2028, U+0085, \x0c ..., which a JSON string may hold raw.
    for lineno, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PopeFormatError(f"{p}:{lineno}: invalid JSON: {exc.msg}") from exc
        if not isinstance(item, dict):
            raise PopeFormatError(f"{p}:{lineno}: expected a JSON object, got {type(item).__name__}")
        out.append((lineno, item))
    return False, out


def _where(path: Path, pos: int, is_array: bool) -> str:
    return f"{path}: item {pos}" if is_array else f"{path}:{pos}"


def _check_image_name(name: str, where: str) -> None:
    """An image is a relative path inside the image directory: no absolute path, no ``..``."""
    pure = PurePosixPath(name.replace("\\", "/"))
    if not name.strip() or pure.is_absolute() or ".." in pure.parts or PureWindowsPath(name).drive:
        raise PopeFormatError(
            f"{where}: image {name!r} is not a file name inside the image directory (absolute paths and '..' "
            "are refused); give the image's path relative to the data's image directory"
        )


def _check_label(value: Any, where: str) -> Label:
    label = value.strip().lower() if isinstance(value, str) else value
    if label not in ("yes", "no"):
        raise PopeFormatError(f"{where}: bad label {value!r} (expected 'yes' or 'no')")
    return label  # type: ignore[return-value]


def generated_by_world(path: Path, sha256: str) -> str | None:
    """ "POPE split S of the mmfast world vV, seed N, POPE version P (generated)" when ``path`` is a
    question file that ``mmfast.world`` wrote (its ``world.json`` two folders up records this very
    checksum), else None."""
    meta = path.parent.parent / "world.json"
    try:
        world = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(world, dict) or world.get("generator") != "mmfast.world":
        return None
    pope = world.get("pope") or {}
    # worlds written before the official version record one unnamed set (version v1)
    versions = pope.get("versions") or {"v1": {"sha256": pope.get("sha256", {})}}
    for version, rec in versions.items():
        for split, digest in (rec.get("sha256") or {}).items():
            if digest == sha256:
                return (
                    f"POPE {split} split of the mmfast world v{world.get('version')}, seed {world.get('seed')}, "
                    f"POPE version {version} (generated)"
                )
    return None


def load_pope_questions(path: str | Path, *, strict: bool = False) -> list[PopeQuestion]:
    """Load a POPE question file (JSON Lines or JSON array) in file order.

    Requires ``question_id``, ``image``, ``text`` and ``label`` ("yes"/"no", case and surrounding
    space ignored); ``image_id`` is optional. Question ids must be unique. With ``strict=True`` a
    file that is not a known published version (``identify_pope_file``) is refused.
    """
    p = Path(path)
    if p.is_dir():
        raise PopeFormatError(f"{p} is a directory, not a POPE question file (JSON Lines or a JSON array)")
    data = p.read_bytes()
    info = _file_info(p, data)
    generated = generated_by_world(p, info.sha256) if info.known is None else None
    if info.known is None:
        if strict:
            raise UnknownPopeFileError(
                f"{p}: md5 {info.md5} is not a known POPE question file; pass strict=False to use "
                "it anyway (e.g. a locally generated file) and report its sha256"
            )
        if generated:
            logger.debug("%s: %s", p, generated)
        else:
            logger.info("%s: unknown POPE file version (sha256 %s)", p, info.sha256)
    else:
        k = info.known
        logger.info("%s: POPE %s/%s from %s@%s", p, k.dataset, k.split, k.repo, k.commit[:7])
    is_array, records = _parse_records(p, data)
    questions: list[PopeQuestion] = []
    seen: dict[str, int] = {}
    for pos, rec in records:
        where = _where(p, pos, is_array)
        missing = [k for k in _REQUIRED_KEYS if k not in rec]
        if missing:
            raise PopeFormatError(f"{where}: missing key(s) {missing}; a POPE question needs {list(_REQUIRED_KEYS)}")
        qid = rec["question_id"]
        if isinstance(qid, bool) or not isinstance(qid, (int, str)):
            raise PopeFormatError(f"{where}: question_id must be an int or a string, got {qid!r}")
        if str(qid) in seen:  # 1 and "1" are one doc_id (pope_<split>/1), so one question id
            raise PopeFormatError(
                f"{where}: duplicate question_id {qid!r} (first at {seen[str(qid)]}); give each question its own id"
            )
        seen[str(qid)] = pos
        for key in ("image", "text"):
            if not isinstance(rec[key], str):
                raise PopeFormatError(f"{where}: {key} must be a string, got {rec[key]!r}")
        _check_image_name(rec["image"], where)
        image_id = rec.get("image_id")
        if image_id is not None and (isinstance(image_id, bool) or not isinstance(image_id, int)):
            raise PopeFormatError(f"{where}: image_id must be an int, got {image_id!r}")
        questions.append(PopeQuestion(qid, rec["image"], rec["text"], _check_label(rec["label"], where), image_id))
    if not questions:
        raise PopeFormatError(
            f"{p} holds no questions; a POPE file has one question per line (or a JSON array of them)"
        )
    return questions


# ---------------------------------------------------------------------------------------------
# Answer parsing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedAnswer:
    """The prediction a rule assigns to one answer.

    ``pred`` is None only in ``"lmms"`` mode, for an answer that is neither "yes" nor "no" (lmms-eval
    scores it wrong and leaves it out of precision/recall). ``unknown`` is True when the answer
    holds neither a yes-word nor a no-word in the part the rule reads, so the rule's output is a
    default, not a reading (see ``parse_answer``).
    """

    pred: Label | None
    unknown: bool


_YES_WORD = re.compile(r"\byes\b", re.IGNORECASE)
_POPE_NO_WORDS = frozenset({"No", "not", "no"})
_OPERA_NO_WORDS = frozenset({"No", "no", "NO", "not"})


def _parse_pope(text: str) -> ParsedAnswer:
    # RUCAIBox/POPE evaluate.py == LLaVA llava/eval/eval_pope.py.
    first = text.split(".")[0]  # the official "keep the text before the first '.'"
    words = first.replace(",", "").split(" ")
    if any(w in _POPE_NO_WORDS for w in words):
        return ParsedAnswer("no", False)
    return ParsedAnswer("yes", _YES_WORD.search(first) is None)


def _parse_opera(text: str) -> ParsedAnswer:
    # shikiw/OPERA pope_eval.py recorder() == sangminwoo/RITUAL recorder() for one-line answers.
    flat = text.replace(".", "").replace(",", "")
    words = flat.split(" ")
    if any(w in _OPERA_NO_WORDS for w in words) or any(w.endswith("n't") for w in words):
        return ParsedAnswer("no", False)
    return ParsedAnswer("yes", _YES_WORD.search(flat) is None)


def _parse_vcd(text: str, label: Label) -> ParsedAnswer:
    # DAMO-NLP-SG/VCD experiments/eval/eval_pope.py == coder-gx/DAMRO evaluation/eval_pope/eval_pope.py
    low = text.lower().strip()
    unknown = "yes" not in low and "no" not in low
    if label == "yes":
        return ParsedAnswer("yes" if "yes" in low else "no", unknown)
    return ParsedAnswer("no" if "no" in low else "yes", unknown)


def _parse_lmms(text: str) -> ParsedAnswer:
    # lmms-eval tasks/pope/utils.py pope_process_results: exact match after lower().strip().
    low = text.lower().strip()
    if low in ("yes", "no"):
        return ParsedAnswer(low, False)  # type: ignore[arg-type]
    return ParsedAnswer(None, True)


def parse_answer(text: str, mode: ParserMode = "pope", *, label: Label | None = None) -> ParsedAnswer:
    """Map a model answer to "yes"/"no" with one of the published rules.

    Modes (source in brackets):

    * ``"pope"`` (default) [RUCAIBox/POPE ``evaluate.py``; identical in LLaVA
      ``llava/eval/eval_pope.py``]: keep the text before the first "."; drop ","; split on single
      spaces; "no" if a token is exactly "No", "not" or "no", else "yes". So "No!" and
      "There isn't a dog." are "yes". ``unknown``: the rule fell through to "yes" and that first
      sentence has no word "yes" (case-insensitive, word-bounded): empty answers, "I don't know",
      "nothing", "There isn't ...", "No!" are all counted.
    * ``"opera"`` [shikiw/OPERA and sangminwoo/RITUAL ``pope_eval*.py`` ``recorder``]: drop every
      "." and ","; split on single spaces; "no" if a token is "No", "no", "NO" or "not" or ends
      with "n't"; else "yes". The whole answer is read (all sentences). ``unknown`` as above, on
      the whole answer. RITUAL applies the rule per line of a multi-line answer and appends one
      prediction per line (misaligning later questions); we read the whole answer once, which is
      identical for one-line answers.
    * ``"vcd"`` [DAMO-NLP-SG/VCD and coder-gx/DAMRO ``eval_pope.py``]: lower-case and strip; a
      yes-labelled question is TP if the substring "yes" occurs (else FN); a no-labelled question
      is TN if the substring "no" occurs (else FP): "not", "know", "snow", "nothing" all count as
      "no". The rule depends on the label, so ``label`` is required and ``pred`` is the prediction
      these counts imply. ``unknown``: neither substring occurs.
    * ``"lmms"`` [lmms-eval ``tasks/pope/utils.py``]: exact match of ``answer.lower().strip()``
      against "yes"/"no"; anything else ("Yes.", "no, there is not") gives ``pred=None``
      (``unknown``): wrong for accuracy and absent from precision/recall, as lmms-eval does.
    """
    if not isinstance(text, str):
        raise TypeError(f"answer must be a string, got {type(text).__name__}")
    if mode == "pope":
        return _parse_pope(text)
    if mode == "opera":
        return _parse_opera(text)
    if mode == "vcd":
        if label not in ("yes", "no"):
            raise ValueError("parse_answer(mode='vcd') needs label='yes' or 'no': VCD's rule depends on it")
        return _parse_vcd(text, label)
    if mode == "lmms":
        return _parse_lmms(text)
    raise ValueError(f"unknown POPE parser mode {mode!r}; choose from {PARSER_MODES}")


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PopeRecord:
    """A question's ground-truth label and the model's raw answer."""

    question_id: int | str
    label: Label
    answer: str


@dataclass(frozen=True)
class PopeCounts:
    """Confusion counts with "yes" as the positive class.

    ``n_unscored`` answers are in no cell (lmms mode: neither "yes" nor "no"); ``n_unknown`` counts
    answers flagged ``unknown`` by the parser (in lmms mode these are the unscored ones; in the
    other modes they are also in a cell).
    """

    tp: int = 0
    fp: int = 0
    tn: int = 0
    fn: int = 0
    n_unknown: int = 0
    n_unscored: int = 0

    @property
    def n(self) -> int:
        return self.tp + self.fp + self.tn + self.fn + self.n_unscored

    @property
    def n_pred_yes(self) -> int:
        return self.tp + self.fp


@dataclass(frozen=True)
class PopeMetrics:
    """POPE metrics of one split. All ratios are fractions in [0, 1].

    accuracy = (tp+tn)/n, precision = tp/(tp+fp), recall = tp/(tp+fn), f1 = 2PR/(P+R),
    yes_ratio = predicted-yes/n. An undefined ratio is reported as 0.0 and explained in ``notes``.
    """

    mode: str
    n: int
    accuracy: float
    precision: float
    recall: float
    f1: float
    yes_ratio: float
    counts: PopeCounts
    unknown_ids: tuple[int | str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, float | int]:
        """The split's entry in ``summarize_pope``: accuracy, precision, recall, f1, yes_ratio, n,
        tp, fp, tn, fn, n_unknown, n_unscored."""
        c = self.counts
        return {
            "accuracy": self.accuracy,
            "precision": self.precision,
            "recall": self.recall,
            "f1": self.f1,
            "yes_ratio": self.yes_ratio,
            "n": self.n,
            "tp": c.tp,
            "fp": c.fp,
            "tn": c.tn,
            "fn": c.fn,
            "n_unknown": c.n_unknown,
            "n_unscored": c.n_unscored,
        }


def _ratio(num: int, den: int, name: str, why: str, notes: list[str]) -> float:
    if den == 0:
        notes.append(f"{name} undefined ({why}); reported as 0.0")
        return 0.0
    return num / den


def metrics_from_counts(counts: PopeCounts, mode: str = "pope", unknown_ids: Sequence[int | str] = ()) -> PopeMetrics:
    """Compute accuracy, precision, recall, F1 and yes-ratio from confusion counts."""
    notes: list[str] = []
    n = counts.n
    acc = _ratio(counts.tp + counts.tn, n, "accuracy", "no records", notes)
    prec = _ratio(counts.tp, counts.tp + counts.fp, "precision", "no answer predicted yes", notes)
    rec = _ratio(counts.tp, counts.tp + counts.fn, "recall", "no scored yes-labelled question", notes)
    if prec + rec == 0:
        notes.append("f1 undefined (precision + recall = 0); reported as 0.0")
        f1 = 0.0
    else:
        f1 = 2 * prec * rec / (prec + rec)
    yes_ratio = _ratio(counts.n_pred_yes, n, "yes_ratio", "no records", notes)
    if counts.n_unknown:
        notes.append(
            f"{counts.n_unknown} of {n} answers had no yes/no word ({mode} rule default used"
            + (", left unscored)" if mode == "lmms" else ")")
        )
    return PopeMetrics(mode, n, acc, prec, rec, f1, yes_ratio, counts, tuple(unknown_ids), tuple(notes))


def _as_record(item: PopeRecord | Mapping[str, Any], index: int) -> PopeRecord:
    if isinstance(item, PopeRecord):
        rec = item
    elif isinstance(item, Mapping):
        missing = [k for k in ("label", "answer") if k not in item]
        if missing:
            raise PopeFormatError(f"record {index}: missing key(s) {missing}")
        rec = PopeRecord(item.get("question_id", index), item["label"], item["answer"])
    else:
        raise TypeError(f"record {index}: expected PopeRecord or mapping, got {type(item).__name__}")
    if rec.label not in ("yes", "no"):
        raise PopeFormatError(f"record {index} (question {rec.question_id!r}): bad label {rec.label!r}")
    if not isinstance(rec.answer, str):
        raise PopeFormatError(f"record {index} (question {rec.question_id!r}): answer must be a string")
    return rec


def score_pope(records: Iterable[PopeRecord | Mapping[str, Any]], mode: ParserMode = "pope") -> PopeMetrics:
    """Score one split: parse every answer with ``mode`` and compute ``PopeMetrics``.

    ``records`` are ``PopeRecord`` objects or mappings with "label" and "answer" (and optionally
    "question_id"). Counting follows the source of each mode (see ``parse_answer``).
    """
    if mode not in PARSER_MODES:
        raise ValueError(f"unknown POPE parser mode {mode!r}; choose from {PARSER_MODES}")
    cells = {"tp": 0, "fp": 0, "tn": 0, "fn": 0, "unscored": 0}
    n_unknown = 0
    unknown_ids: list[int | str] = []
    for i, item in enumerate(records):
        rec = _as_record(item, i)
        parsed = parse_answer(rec.answer, mode, label=rec.label)
        if parsed.unknown:
            n_unknown += 1
            unknown_ids.append(rec.question_id)
        cells[_cell(parsed.pred, rec.label)] += 1
    counts = PopeCounts(cells["tp"], cells["fp"], cells["tn"], cells["fn"], n_unknown, cells["unscored"])
    return metrics_from_counts(counts, mode, unknown_ids)


def _cell(pred: Label | None, label: Label) -> str:
    if pred is None:
        return "unscored"
    if pred == "yes":
        return "tp" if label == "yes" else "fp"
    return "tn" if label == "no" else "fn"


def pope_cell(answer: str, label: Label, mode: ParserMode = "pope") -> str:
    """The confusion cell (``tp``, ``fp``, ``tn``, ``fn`` or ``unscored``) :func:`score_pope` counts
    this answer in (what :mod:`mmfast.eval.intervals` resamples)."""
    return _cell(parse_answer(answer, mode, label=label).pred, label)


def summarize_pope(per_split: Mapping[str, PopeMetrics]) -> dict[str, Any]:
    """``{"<split>": PopeMetrics.as_dict(), ..., "mean_f1": ..., "mean_accuracy": ...}``.

    The means are unweighted over splits (as LLaVA and VHR report the three-split mean F1). All
    splits must have been scored with the same parser mode.
    """
    if not per_split:
        raise ValueError("summarize_pope needs at least one split")
    reserved = {"mean_f1", "mean_accuracy"} & set(per_split)
    if reserved:
        raise ValueError(f"split names {sorted(reserved)} clash with summary keys")
    modes = {m.mode for m in per_split.values()}
    if len(modes) > 1:
        raise ValueError(f"splits were scored with different parser modes {sorted(modes)}")
    out: dict[str, Any] = {name: m.as_dict() for name, m in per_split.items()}
    out["mean_f1"] = math.fsum(m.f1 for m in per_split.values()) / len(per_split)
    out["mean_accuracy"] = math.fsum(m.accuracy for m in per_split.values()) / len(per_split)
    return out


# ---------------------------------------------------------------------------------------------
# Joining answers to questions
# ---------------------------------------------------------------------------------------------


def load_pope_answers(
    path: str | Path, *, answer_key: str = "text", question_id_key: str = "question_id"
) -> dict[int | str, str]:
    """Read model answers (JSON Lines or JSON array) as ``{question_id: answer}``.

    Defaults match LLaVA's answer files (``{"question_id", "text", ...}``).
    """
    p = Path(path)
    is_array, records = _parse_records(p, p.read_bytes())
    answers: dict[int | str, str] = {}
    for pos, rec in records:
        where = _where(p, pos, is_array)
        for key in (question_id_key, answer_key):
            if key not in rec:
                raise PopeFormatError(f"{where}: missing key {key!r}")
        qid, ans = rec[question_id_key], rec[answer_key]
        if isinstance(qid, bool) or not isinstance(qid, (int, str)):
            # as load_pope_questions: a bool or float id would join a question silently (True == 1, 2.0 == 2)
            raise PopeFormatError(f"{where}: {question_id_key} must be an int or a string, got {qid!r}")
        if not isinstance(ans, str):
            raise PopeFormatError(f"{where}: {answer_key} must be a string, got {ans!r}")
        if qid in answers:
            raise PopeFormatError(f"{where}: duplicate answer for question_id {qid!r}")
        answers[qid] = ans
    return answers


def join_answers(questions: Sequence[PopeQuestion], answers: Mapping[int | str, str]) -> list[PopeRecord]:
    """Pair each question (in question-file order) with its answer; every question must be answered. Ids
    match as the question loader reads them: ``1`` and ``"1"`` are one question."""
    by_id: dict[str, str] = {}
    given: dict[str, int | str] = {}  # the id as the answers wrote it
    for k, text in answers.items():
        if str(k) in by_id:
            raise PopeFormatError(f"answer ids {given[str(k)]!r} and {k!r} name one question; keep one answer for it")
        by_id[str(k)], given[str(k)] = text, k
    missing = [q.question_id for q in questions if str(q.question_id) not in by_id]
    if missing:
        raise PopeFormatError(f"{len(missing)} question(s) have no answer, e.g. {missing[:5]}")
    extra = set(by_id) - {str(q.question_id) for q in questions}
    if extra:
        logger.warning("%d answer(s) match no question and are ignored, e.g. %s", len(extra), sorted(extra)[:5])
    return [PopeRecord(q.question_id, q.label, by_id[str(q.question_id)]) for q in questions]


def score_pope_files(
    questions_path: str | Path,
    answers_path: str | Path,
    mode: ParserMode = "pope",
    *,
    answer_key: str = "text",
    strict: bool = False,
) -> PopeMetrics:
    """Load a question file and an answer file, join them by question id and score them."""
    questions = load_pope_questions(questions_path, strict=strict)
    answers = load_pope_answers(answers_path, answer_key=answer_key)
    try:
        joined = join_answers(questions, answers)
    except PopeFormatError as exc:
        raise PopeFormatError(f"{answers_path} against {questions_path}: {exc}") from None
    return score_pope(joined, mode)
