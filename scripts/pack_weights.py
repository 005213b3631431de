#!/usr/bin/env python
"""Pack a model directory's ``*.safetensors`` losslessly (``mmfast/weights_pack.py``): run after
retraining the embedded model or one of its parts, before committing.

    python scripts/pack_weights.py mmfast/assets/tiny-world
"""

from __future__ import annotations

import argparse
import logging
import sys

from mmfast.weights_pack import pack


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", nargs="?", default="mmfast/assets/tiny-world")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        pack(args.directory)
    except ValueError as exc:
        logging.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
