"""The scale question across studies (delft.experiments.scale): one recipe's difference from the reference at
several model sizes, from each study's study.json, as scale.json, summary.md and a plot in --out.

    python bench/study_scale.py results/study/scale_small results/study/scratch results/study/scale_large \\
        --recipe del_prob --out results/study/scale
"""

from __future__ import annotations

import argparse
from pathlib import Path

from delft.experiments.scale import write_scale_report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", nargs="+", type=Path)
    p.add_argument("--recipe", default="del_prob")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    write_scale_report(args.studies, args.recipe, args.out)


if __name__ == "__main__":
    main()
