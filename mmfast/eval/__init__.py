"""Evaluation (POPE, CHAIR and their data and records).

Submodules are imported explicitly (``from mmfast.eval.pope import score_pope``), so importing this
package loads neither NLTK nor any data.
"""
