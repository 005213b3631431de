"""``python -m mmfast`` (also what ``accelerate launch -m mmfast`` runs)."""

import sys

from .cli import main

sys.exit(main())
