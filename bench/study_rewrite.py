"""A stored study's seed-level analysis, verdicts and flipped answers recomputed from its study.json with this code
(delft.experiments.summary.rewrite), and study.json, summary.md and tables.txt's analysis block written again:

    python bench/study_rewrite.py results/study/arithmetic [MORE_STUDY_DIRS...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from delft.experiments.summary import rewrite

if __name__ == "__main__":
    for arg in sys.argv[1:]:
        rewrite(Path(arg))
