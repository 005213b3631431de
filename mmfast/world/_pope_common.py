"""What the world's POPE builders share: the split names and one question line."""

from __future__ import annotations

from dataclasses import asdict, dataclass

POPE_SPLITS: tuple[str, ...] = ("random", "popular", "adversarial")


@dataclass(frozen=True)
class PopeQuestion:
    """One POPE line (``to_json`` gives the dict written to the file)."""

    question_id: int
    image: str
    image_id: int
    text: str
    label: str

    def to_json(self) -> dict[str, object]:
        """The JSON object of this line."""
        return asdict(self)
