"""Base class for speculative drafters (the proposer side of draft-and-verify)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ..config import DecodingConfig
    from ..pipeline import Session


class Drafter:
    """Proposes draft tokens that the target verifies losslessly (see ``speculative/engine.py``)."""

    Config: ClassVar[type]
    supports_batch: ClassVar[bool] = False

    def __init__(self, config: Any, session: Session) -> None:
        self.config = config
        self.session = session

    def install(self) -> None:
        """Register hooks (called once when the session opens)."""

    @classmethod
    def check_decoder(cls, decoding: DecodingConfig) -> str | None:
        return None
